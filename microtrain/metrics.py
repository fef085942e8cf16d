"""Metrics as Keras computes them, accumulated over batches as (total, count),
over every output of the model together (each output has a target).

Like kernels, a metric is a factory: bound once to a plan's output and target
arrays, it returns a closure that measures the batch they hold."""
from functools import partial
from math import prod

import numpy as np

from microtrain.step.kernels.workspace import kept
from microtrain.files.loss_registry import LOSS_KINDS, PER_CLASS

HIGHER_IS_BETTER = {"accuracy": True, "mae": False, "mse": False, "loss": False}


def _buffer(slot: str, shape, dtype) -> np.ndarray:
    """A temporary of a metric, one per slot name; bound inside a workspace
    (`sharing`), the metric of a partial batch takes the leading rows of the
    full batch's."""
    return kept(("metric", slot), shape, dtype, lambda s: np.empty(s, dtype))


def _counted(y: np.ndarray, t: np.ndarray, loss: str, ignore: int | None):
    """(closure, counted): counted [rows] marks the predictions that count, those
    whose target is not the ignored class (`trainconf split --ignore-index`);
    (None, None) when every prediction counts."""
    if ignore is None:
        return None, None
    rows = y.shape[:-1]
    counted = _buffer("counted", rows, bool)
    if loss == "sparse_cce":
        return partial(np.not_equal, t.reshape(rows), ignore, out=counted), counted
    return partial(np.equal, t.reshape(y.shape)[..., ignore], 0, out=counted), counted


def accuracy(y: np.ndarray, t: np.ndarray, loss: str, ignore: int | None = None):
    """A closure counting the correct predictions of a batch: (hits, predictions);
    per token for outputs [B, T, C], ignored tokens left out."""
    rows = y.shape[:-1]
    hits = _buffer("hits", rows if loss != "bce" and y.shape[-1] > 1 else y.shape, bool)
    if loss == "bce" or y.shape[-1] == 1:  # one probability per output
        t2, above = t.reshape(y.shape), _buffer("above", y.shape, bool)

        def compare():
            np.greater(y, 0.5, out=hits)
            np.greater(t2, 0.5, out=above)
            np.equal(hits, above, out=hits)
    else:
        predicted = _buffer("predicted", rows, np.intp)
        if loss == "sparse_cce":
            wanted = t.reshape(rows)

            def compare():
                np.argmax(y, axis=-1, out=predicted)
                np.equal(predicted, wanted, out=hits)
        else:
            wanted = _buffer("wanted", rows, np.intp)

            def compare():
                np.argmax(y, axis=-1, out=predicted)
                np.argmax(t, axis=-1, out=wanted)
                np.equal(predicted, wanted, out=hits)
    mark, counted = _counted(y, t, loss, ignore)

    def step() -> tuple[float, int]:
        compare()
        if counted is None:
            return int(np.count_nonzero(hits)), hits.size
        mark()
        np.logical_and(hits, counted, out=hits)
        return int(np.count_nonzero(hits)), int(np.count_nonzero(counted))
    return step


def tokens(outputs, targets, loss: str, ignore: int | None):
    """A closure counting the tokens a batch's loss averages over (those not ignored)."""
    marks = [_counted(y, t, loss, ignore) for y, t in zip(outputs, targets)]
    every = sum(prod(y.shape[:-1]) for y in outputs)

    def count() -> int:
        if ignore is None:
            return every
        total = 0
        for mark, counted in marks:  # one at a time: the outputs share the buffer
            mark()
            total += int(np.count_nonzero(counted))
        return total
    return count


def _error(power: int):
    def metric(y: np.ndarray, t: np.ndarray, loss: str, ignore: int | None = None):
        """A closure summing |y - t|**power over a batch: (sum, elements)."""
        t2, d = t.reshape(y.shape), _buffer("error", y.shape, np.float32)
        ufunc = np.abs if power == 1 else np.square

        def step() -> tuple[float, int]:
            np.subtract(y, t2, out=d)
            ufunc(d, out=d)
            return float(np.add.reduce(d, axis=None)), d.size
        return step
    return metric


mae, mse = _error(1), _error(2)
METRICS = {"accuracy": accuracy, "mae": mae, "mse": mse}


def meter(name: str, outputs, targets, loss: str, ignore: int | None = None):
    """The closure measuring metric `name` over every (output, target) pair: the
    totals and counts of all outputs summed, so a model with several heads is
    judged on all of them (Keras would report one metric per output)."""
    steps = [METRICS[name](y, t, loss, ignore) for y, t in zip(outputs, targets)]
    if len(steps) == 1:
        return steps[0]

    def step() -> tuple[float, int]:
        parts = [measure() for measure in steps]
        return sum(total for total, _ in parts), sum(count for _, count in parts)
    return step


def language_model(loss: str, outputs) -> bool:
    """Whether the loss is a per-token cross-entropy (outputs [B, T, V]), whose
    runs report perplexity: exp of the mean cross-entropy per counted token."""
    return loss in PER_CLASS and any(y.ndim >= 3 for y in outputs)


def bind(name: str, outputs, targets, training):
    """(metric closure, token counter or None) over a plan's arrays, for the
    training metadata `training` (its loss and ignored class)."""
    measure = meter(name, outputs, targets, training.loss, training.ignore_index)
    counter = tokens(outputs, targets, training.loss, training.ignore_index) \
        if language_model(training.loss, outputs) else None
    return measure, counter


def default_metric(loss: str) -> str:
    return LOSS_KINDS[loss].metric
