"""Updates as gradients complete, and weight gradients computed in tiles.

The memory plan may name, for a weight gradient, the backprop operator after
which it is complete (`updates`): its weight then updates right there, and the
gradient's memory is free for the next one (operator reordering).  It may also
fuse a weight gradient with its update (`fused`): the gradient is computed a
tile of rows at a time, each tile updating its rows as soon as it is done, so
that only a tile of the gradient is ever held (schemas/memory.md).
"""
from functools import partial

from microtrain.files.artifacts import Artifacts
from microtrain.files.errors import UserError
from microtrain.step.kernels import in_sequence, prepare
from microtrain.step.kernels.workspace import begin_kernel
from microtrain.step.precision import F32


class UpdateOrder:
    """The plan's `updates` and `fused` records, checked, and the closures they
    add to the backprop step.  `update`: update(weights, loss array) after the
    operator completing their gradients, or update((weight,), loss array, (lo, hi))
    after each tile of a fused one; None: every gradient is held whole until
    the step ends (fused gradients still computed in the same tiles)."""

    def __init__(self, art: Artifacts, update=None):
        self.update = update
        # backprop tensor of each weight gradient -> the forward (weight) tensor
        self.weight_grads = dict(art.links.gradients) if art.links else {}
        self.loss = art.links.loss if art.links else None
        plan = art.links.memory if art.links else None
        # gradient -> rows per tile of those computed (and applied) a tile at a time
        self.fused = dict(plan.fused) if plan else {}
        unknown = self.fused.keys() - self.weight_grads.keys()
        if unknown:
            raise UserError(art.backprop_path, f"memory plan: fused tensor {min(unknown)} is no "
                                               "weight gradient")
        self.updates: dict[int, list] = {}  # backprop operator -> the weights updated after it
        for g, i in plan.updates if update else ():
            if g not in self.weight_grads or not 0 <= i < len(art.backprop.ops):
                raise UserError(art.backprop_path, f"memory plan: the update of gradient {g} "
                                                   f"after operator {i} names no weight gradient "
                                                   "or operator")
            self.updates.setdefault(i, []).append(self.weight_grads[g])

    def fuses(self, op) -> bool:
        """Whether `op` computes a gradient the plan fuses (see fused)."""
        return op.outputs[0] in self.fused

    def after(self, op, arrays: list, fused: bool) -> list:
        """The update of the weights whose gradients `op` completes; a gradient
        it computes `fused` has updated tile by tile already."""
        tiled = self.weight_grads.get(op.outputs[0]) if fused else None
        weights = tuple(w for w in self.updates.get(op.index, ()) if w != tiled)
        return [partial(self.update, weights, arrays[self.loss])] if weights else []

    def fused_steps(self, g, op, arrays: list) -> list:
        """Weight gradient op.outputs[0] computed a tile of its rows (output
        channels: the last axis of its first input) at a time into its array,
        the whole gradient or, updating as gradients complete, a tile that each
        tile's update reads right away.  The unfused run computes the same
        tiles, so that the sums (and the weights) are bit-identical whichever
        way the BLAS blocks a product."""
        (dy, *rest), (out,) = [arrays[i] if i >= 0 else None for i in op.inputs], \
            [arrays[i] for i in op.outputs]
        n, rows = dy.shape[-1], self.fused[op.outputs[0]]
        if g.tensors[op.outputs[0]].shape[0] != n or \
                any(a is not None and a.dtype != F32 for a in (dy, *rest, out)):
            raise UserError(None, f"memory plan: fused gradient {op.outputs[0]} is not float32 "
                                  "with a row per channel of its operator's first input")
        whole = self.update is None
        steps = []
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            begin_kernel()  # the tiles run one after another: they share one scratch layout
            tile = out[lo:hi] if whole else out[:hi - lo]
            steps.append(prepare(op.type, [dy[..., lo:hi], *rest], [tile], **op.options))
            if not whole:
                steps.append(partial(self.update, (self.weight_grads[op.outputs[0]],),
                                     arrays[self.loss], (lo, hi)))
        return [in_sequence(steps)]
