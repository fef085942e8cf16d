"""The losses microtrain computes, and what every stage needs to know of each.

The file records (contracts), the metrics, trainconf's backprop builder, the
circle+ reader and the loss kernels all read this one table.
"""
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LossKind:
    name: str  # as `--loss` and the files name it
    metric: str  # the metric run and eval report by default
    logits_of: str | None  # a final activation whose logits the stable form reads
    per_class: bool  # targets are classes over the last axis: --ignore-index, perplexity
    circle_plus: str | None  # circle+'s name for it (its LossFn and options table)


LOSS_KINDS = {kind.name: kind for kind in (
    LossKind("cce", "accuracy", "SOFTMAX", True, "CategoricalCrossentropy"),
    LossKind("sparse_cce", "accuracy", "SOFTMAX", True, "SparseCategoricalCrossentropy"),
    LossKind("bce", "accuracy", "LOGISTIC", False, None),
    LossKind("mse", "mse", None, False, "MeanSquaredError"),
    LossKind("mae", "mae", None, False, None),
)}
LOSS_NAMES = tuple(LOSS_KINDS)
PER_CLASS = tuple(name for name, kind in LOSS_KINDS.items() if kind.per_class)
# The backprop graph's operators that compute a loss (from probabilities / from logits).
LOSS_OPS = ("Loss", "LogitsLoss")


def default_loss(g) -> str:
    """The loss a graph trains (`trainconf split`) or is judged (`microtrain eval` of a
    model no split wrote) by when none is named, from the operator that writes its
    first output, seen through a final DEQUANTIZE (a full-integer model with float
    outputs): cce after a SOFTMAX (probabilities), else mse."""
    producers = g.producers()
    last = producers.get(g.outputs[0])
    if last is not None and last.type == "DEQUANTIZE":
        last = producers.get(last.inputs[0])
    return "cce" if last is not None and last.type == "SOFTMAX" else "mse"


def circle_plus_enum(kind: LossKind) -> str:
    """circle+'s LossFn member for the loss: MeanSquaredError -> MEAN_SQUARED_ERROR."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind.circle_plus).upper()
