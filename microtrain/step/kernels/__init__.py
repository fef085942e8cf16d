"""Kernel registry.

A kernel is a factory: given the op's preallocated input and output arrays and
its options (a dict with the schema's snake_case field names), it does all the
shape work once and returns a zero-argument closure that computes the outputs
in place.  The executor calls only those closures in the training step.

Keys are circle builtin operator names ("FULLY_CONNECTED") or the custom_code
of a gradient operator ("Conv2DInputGrad"); see schemas/backprop.md.  An
operator on quantized activations runs its integer kernel instead
(`@kernel(NAME, integer=True)`, quantized.py): its factory also gets the
OpQuantization of its tensors (microtrain/files/quantization.py).
Temporaries that need not survive between calls come from `scratch`
(workspace.py), so that the kernels of a step can share them.
"""
from typing import Callable

import numpy as np

from microtrain.step.kernels.workspace import begin_kernel

Step = Callable[[], None]
Factory = Callable[..., Step]

KERNELS: dict[str, Factory] = {}
INTEGER_KERNELS: dict[str, Factory] = {}  # the kernels of operators on quantized tensors
# The operator-code versions a kernel implements, for kernels that run only some
# (a custom op whose versions differ in meaning); the others run every version.
VERSIONS: dict[str, frozenset[int]] = {}

# How a kernel treats the rows of a leading batch axis (what lets microtrain/step/row_tiles.py
# run it on a batch a few rows at a time): "each": each row of the outputs depends only
# on the same row of the batch-shaped inputs; "sum": the (only) output is a sum over
# the rows of the batch-shaped inputs.  Kernels not listed are run whole.
ROWS: dict[str, str] = {}
# Kernels with nothing to do when their output shares its input's memory: the
# memory planner gives both the same bytes.
IN_PLACE: set[str] = set()
# Kernels whose output may share their first input's memory (each element is read
# before it is written): the planner gives the output the input's bytes when no later
# step reads the input.
OVERWRITES: set[str] = set()


def in_sequence(steps: list) -> Step:
    """One closure running the closures `steps` in order."""
    if len(steps) == 1:
        return steps[0]

    def step():
        for s in steps:
            s()
    return step


def kernel(name: str, versions: tuple[int, ...] = (), rows: str | None = None,
           in_place: bool = False, overwrites: bool = False,
           integer: bool = False) -> Callable[[Factory], Factory]:
    """Register a kernel factory under an operator name (for only the operator
    versions `versions`, when given), with how it treats batch rows, whether it
    runs in place and whether it may write over its first input (above);
    `integer`: its form on quantized tensors."""
    def register(factory: Factory) -> Factory:
        registry = INTEGER_KERNELS if integer else KERNELS
        if name in registry:
            raise ValueError(f"kernel {name} registered twice")
        registry[name] = factory
        if versions:
            VERSIONS[name] = frozenset(versions)
        if rows:
            ROWS[name] = rows
        if in_place:
            IN_PLACE.add(name)
        if overwrites:
            OVERWRITES.add(name)
        return factory
    return register


def version_problem(name: str, version: int) -> str | None:
    """Why the kernel of operator `name` cannot run that version of it (None: it can)."""
    if version in VERSIONS.get(name, (version,)):
        return None
    runs = ", ".join(str(v) for v in sorted(VERSIONS[name]))
    return f"is version {version}; microtrain runs version {runs} of it"


def build(name: str, inputs: list[np.ndarray | None], outputs: list[np.ndarray],
          **options) -> Step:
    """Prepare the kernel `name` over fixed buffers; returns the step closure."""
    begin_kernel()
    return prepare(name, inputs, outputs, **options)


def prepare(name: str, inputs: list[np.ndarray | None], outputs: list[np.ndarray],
            quantization=None, **options) -> Step:
    """build() within the scratch layout already begun (by a caller that takes
    scratch of its own around the kernel); with `quantization` (an
    OpQuantization), the integer kernel."""
    if quantization is not None:
        return INTEGER_KERNELS[name](inputs, outputs, quantization, **options)
    return KERNELS[name](inputs, outputs, **options)


def _load_all() -> None:
    # Importing the modules registers their kernels.
    from microtrain.step.kernels import (activations, conv, dense, elementwise,  # noqa: F401
                                         fake_quant, landmarks, logic, losses, quantized,
                                         reduce, resize, shape)


_load_all()
