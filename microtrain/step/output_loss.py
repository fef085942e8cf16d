"""The loss of a model no split wrote (a plain float or full-integer .tflite), for
`microtrain eval`: without a backprop graph, the model's outputs (dequantized when
integer, as LiteRT's DEQUANTIZE computes them) are judged against the targets by the
Loss kernel, as a split model's backprop graph judges probabilities, and by its
loss_registry.default_loss.  An OutputLoss stands where evaluation reads a Plan:
inputs, outputs, targets, loss, run_forward and run_loss."""
from functools import partial

import numpy as np

from microtrain.step.executor import Plan
from microtrain.files.graph import Graph
from microtrain.step.kernels import build
from microtrain.files.quantization import Quantization, dequantize

F32 = np.dtype(np.float32)


class OutputLoss:
    def __init__(self, plan: Plan, g: Graph, loss: str):
        """The loss `loss` (mean over the rows) of `plan`'s outputs, summed over
        the outputs as a backprop graph sums them; `g` is the plan's forward graph."""
        self.plan, self.inputs = plan, plan.inputs
        self.outputs, self.targets, self.loss = [], [], np.zeros(1, F32)
        self.steps, parts = [], []
        for y, t in zip(plan.outputs, g.outputs):
            real = y if y.dtype == F32 else np.empty(y.shape, F32)
            if real is not y:
                self.steps.append(partial(_real, real, y, g.tensors[t].quantization))
            target, part = np.empty(y.shape, F32), np.zeros(1, F32)
            self.steps.append(build("Loss", [real, target], [part, np.empty(y.shape, F32)],
                                    loss=loss))
            self.outputs.append(real)
            self.targets.append(target)
            parts.append(part)
        self.steps.append(partial(_total, self.loss, parts))

    def run_forward(self) -> None:
        self.plan.run_forward()

    def run_loss(self) -> None:
        for step in self.steps:
            step()


def _real(out: np.ndarray, y: np.ndarray, q: Quantization | None) -> None:
    """`out` = the real values of output y: dequantized if integer, else widened."""
    np.copyto(out, y if q is None or y.dtype.kind == "f" else dequantize(y, q))


def _total(out: np.ndarray, parts: list[np.ndarray]) -> None:
    out[0] = sum(part[0] for part in parts)
