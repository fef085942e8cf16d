"""The operators trainconf knows: one entry per forward operator, with its
gradient rule, its shape folding and its properties.

Every question "what kind of operator is this?" is answered here and nowhere
else: which ops have a trainable weight (`--trainable`, the memory budget),
which weight gradients can be cut to rows, which ops are layers for adaptive
loss scaling, which ops fold into constants.  The forward kernels belong to the
runtime: an operator runs forward when microtrain registers a kernel under its
name (`microtrain.kernels.KERNELS`), a fact this module reads and never
restates.  The README's table of supported operators is generated from
OPERATORS by scripts/operator_table.py.

How to add an operator
----------------------
1. Forward: a kernel `@kernel("NAME")` in microtrain/kernels/, tested in
   tests/test_kernels_*.py (against PyTorch or numpy references).
2. Backward (if it trains or passes gradients): a rule
   `rule(b, op, dy, needs) -> [grad | None per input]` in trainconf/gradients.py
   that emits gradient operators; a new gradient operator gets its kernel in
   microtrain/kernels and a row in schemas/backprop.md.  Its gradient is checked
   against PyTorch float64 in tests/test_split_gradients.py.
3. One entry in OPERATORS below, `Operator("NAME", gradients.rule, ...)` with
   its properties; then `python scripts/operator_table.py` to refresh the
   README's table (tests/test_operators.py fails while it is stale).
An op with a weight that trains sets `weight` (and `bias`) to their input
positions; `layer=True` if its input gradient (gradient of input 0) is emitted
as one operator whose inputs are [dY, W] (adaptive loss scaling scales there);
`row_grad` if its weight gradient is one operator whose output's leading axis is
the output channel, computed from [dY, X] (the memory budget may train a block
of rows).
"""
from dataclasses import dataclass
from typing import Callable

from microtrain.kernels import KERNELS

from . import fold, gradients


@dataclass(frozen=True)
class Operator:
    name: str  # circle builtin operator name, or a custom op's custom_code
    gradient: Callable | None = None  # gradient rule (trainconf/gradients.py)
    fold: Callable | None = None  # value of its output from constant inputs (fold.py)
    weight: int | None = None  # input position of a weight that can train
    bias: int | None = None  # input position of the bias that trains with it
    layer: bool = False  # its input gradient is a layer for adaptive loss scaling
    row_grad: str | None = None  # the weight-gradient op whose rows are output channels

    @property
    def forward(self) -> bool:
        """Whether the runtime has a kernel for it."""
        return self.name in KERNELS

    @property
    def weighted(self) -> bool:
        return self.weight is not None


def _weighted(name, gradient, **props) -> Operator:
    return Operator(name, gradient, weight=1, bias=2, layer=True, **props)


_ENTRIES = [
    _weighted("FULLY_CONNECTED", gradients.fully_connected, row_grad="FullyConnectedWeightGrad"),
    _weighted("CONV_2D", gradients.conv_2d, row_grad="Conv2DWeightGrad"),
    _weighted("DEPTHWISE_CONV_2D", gradients.depthwise_conv_2d),
    Operator("TRANSPOSE_CONV", gradients.transpose_conv, weight=1, bias=3, layer=True),
    Operator("Convolution2DTransposeBias", gradients.transpose_conv, weight=1, bias=2, layer=True),
    Operator("MAX_POOL_2D", gradients.max_pool),
    Operator("AVERAGE_POOL_2D", gradients.average_pool),
    Operator("MEAN", gradients.mean_sum),
    Operator("SUM", gradients.mean_sum),
    Operator("REDUCE_MAX", gradients.reduce_max),
    Operator("L2_NORMALIZATION", gradients.l2_normalization),
    Operator("RESHAPE", gradients.reshape),
    Operator("SQUEEZE", gradients.reshape),
    Operator("EXPAND_DIMS", gradients.reshape),
    Operator("SOFTMAX", gradients.softmax),
    *(Operator(name, gradients.activation) for name in gradients.ACTIVATION_OPS),
    *(Operator(name, gradients.input_activation) for name in gradients.INPUT_ACTIVATION_OPS),
    Operator("LOG_SOFTMAX", gradients.log_softmax),
    Operator("PRELU", gradients.prelu, weight=1),  # its alpha trains
    Operator("ADD", gradients.add_sub),
    Operator("SUB", gradients.add_sub),
    Operator("MUL", gradients.mul),
    Operator("DIV", gradients.div),
    Operator("SQUARED_DIFFERENCE", gradients.squared_difference),
    Operator("MAXIMUM", gradients.pick),
    Operator("MINIMUM", gradients.pick),
    Operator("CONCATENATION", gradients.concatenation, fold=fold.concatenation),
    Operator("PAD", gradients.pad),
    Operator("PADV2", gradients.pad),
    Operator("MIRROR_PAD", gradients.mirror_pad),
    Operator("DEPTH_TO_SPACE", gradients.depth_space),
    Operator("SPACE_TO_DEPTH", gradients.depth_space),
    Operator("STRIDED_SLICE", gradients.strided_slice, fold=fold.strided_slice),
    Operator("SLICE", gradients.slice_),
    Operator("SPLIT", gradients.split),
    Operator("SPLIT_V", gradients.split),
    Operator("GATHER", gradients.gather),
    Operator("RESIZE_BILINEAR", gradients.resize_bilinear),
    Operator("RESIZE_NEAREST_NEIGHBOR", gradients.resize_nearest_neighbor),
    Operator("TRANSPOSE", gradients.transpose),
    Operator("BATCH_MATMUL", gradients.batch_matmul),
    # forward only (the backprop graphs use them too)
    Operator("ADD_N"),
    Operator("NEG"),
    # shape computations, folded into constants at split
    Operator("SHAPE", fold=fold.shape),
    Operator("PACK", fold=fold.pack),
]

OPERATORS: dict[str, Operator] = {op.name: op for op in _ENTRIES}
assert len(OPERATORS) == len(_ENTRIES), "an operator is declared twice"


def spec(name: str) -> Operator:
    """The entry of an operator; an unknown one has no gradient, fold or kernel."""
    return OPERATORS.get(name) or Operator(name)


WITH_GRADIENT = sorted(name for name, op in OPERATORS.items() if op.gradient)
WEIGHTED = sorted(name for name, op in OPERATORS.items() if op.weighted)
FOLDS = {name: op.fold for name, op in OPERATORS.items() if op.fold}
ROW_GRADS = {op.row_grad for op in OPERATORS.values() if op.row_grad}
