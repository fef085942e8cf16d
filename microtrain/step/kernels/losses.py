"""Loss kernels: Keras 3 losses (TensorFlow backend) with their exact gradients.

Outputs are the reduced loss (shape [1]) and its gradient w.r.t. the model
output.  Per-sample losses reduce the last axis; reduction "mean" divides
their sum by their count, prod(y.shape[:-1]) (the batch size for [B, C]
outputs, as Keras' sum_over_batch_size), "sum" does not divide.
"""
from functools import partial
from math import prod

import numpy as np

from microtrain.files.errors import OperatorError
from microtrain.files.loss_registry import LOSS_KINDS, PER_CLASS
from microtrain.step.kernels import kernel
from microtrain.step.kernels.activations import filled, full, row_exp, row_sums, rows
from microtrain.step.kernels.workspace import scratch

EPSILON = 1e-7  # keras.config.epsilon(), the probability clip


def _temp(like):
    """Scratch shaped like `like`, for values computed anew in every call."""
    return scratch(like.shape, like.dtype)


def _per_rows(like, value):
    """A factor that depends on the row count (a mean's 1/rows), as a scalar of
    `like`'s type: a constant array would differ between the steps of full and
    partial batches."""
    return like.dtype.type(value)


def _scale(y, reduction):
    if reduction == "mean":
        return 1 / prod(y.shape[:-1])
    if reduction == "sum":
        return 1.0
    raise OperatorError(None, f"unsupported loss reduction {reduction!r}")


def _one_hot(t, y2):
    """(closure filling target = one_hot(t) at call time, target): t holds
    class ids (any numeric dtype) for the rows of y2, shaped [rows] or [rows, 1]."""
    labels = t.reshape(y2.shape[0], 1)
    classes = np.arange(y2.shape[1]).astype(t.dtype)
    target = _temp(y2)
    return partial(np.equal, labels, classes, out=target), target


def _clip(p, q, inside):
    """A closure writing q = clip(p, EPSILON, 1 - EPSILON) and inside = where
    the clip passes the gradient: EPSILON <= p <= 1 - EPSILON, as TF (built
    from minimum/maximum, whose gradients go to x on ties)."""
    lo, hi = full(p, EPSILON), full(p, 1 - EPSILON)
    below = scratch(p.shape, bool)

    def step():
        np.greater_equal(p, lo, out=inside)
        np.less_equal(p, hi, out=below)
        np.logical_and(inside, below, out=inside)
        np.maximum(p, lo, out=q)
        np.minimum(q, hi, out=q)
    return step


def _mse(y, t, out, dy, scale):
    """L = scale * sum((y-t)²) / C;  dy = 2 * scale * (y-t) / C."""
    k = scale / y.shape[-1]
    t, diff, twice_k = t.reshape(y.shape), dy.reshape(-1), _per_rows(dy, 2 * k)

    def step():
        np.subtract(y, t, out=dy)
        out[0] = np.dot(diff, diff) * k
        np.multiply(dy, twice_k, out=dy)
    return step


def _mae(y, t, out, dy, scale):
    """L = scale * sum(|y-t|) / C;  dy = scale * sign(y-t) / C."""
    k = scale / y.shape[-1]
    t, diff = t.reshape(y.shape), _temp(y)

    def step():
        np.subtract(y, t, out=diff)
        np.sign(diff, out=dy)
        out[0] = np.vdot(diff, dy) * k
        np.multiply(dy, k, out=dy)
    return step


def _bce(y, t, out, dy, scale):
    """q = clip(y);  L = -scale/C * sum(t*log(q) + (1-t)*log(1-q));
    dy = scale/C * inside * (q-t) / (q*(1-q))."""
    k = scale / y.shape[-1]
    t = t.reshape(y.shape)
    q, rest, log_q = _temp(y), _temp(y), _temp(y)
    inside = scratch(y.shape, bool)
    clip, one = _clip(y, q, inside), full(y, 1)

    def step():
        clip()
        np.subtract(one, q, out=rest)
        np.log(q, out=log_q)
        np.log(rest, out=dy)  # dy holds log(1-q) until the gradient
        # sum(t*log(q) + (1-t)*log(1-q)) = sum(log(1-q)) + t·(log(q) - log(1-q))
        log_sum = np.add.reduce(dy, axis=None)
        np.subtract(log_q, dy, out=log_q)
        out[0] = -k * (log_sum + np.vdot(t, log_q))
        np.subtract(q, t, out=dy)
        np.multiply(q, rest, out=rest)
        np.divide(dy, rest, out=dy)
        np.multiply(dy, inside, out=dy)
        np.multiply(dy, k, out=dy)
    return step


def _cce(y, t, out, dy, scale):
    """p = y / sum(y), q = clip(p);  L = -scale * sum(t*log(q));  with
    g = t*inside/q (= -dL/dp per sample): dy = scale * (sum_c g*p - g) / sum(y)."""
    y2, t2, dy2 = rows(y), rows(t.reshape(y.shape)), rows(dy)
    sums, dots = scratch((y2.shape[0], 1), y.dtype), scratch((y2.shape[0], 1), y.dtype)
    p, q, g = _temp(y2), _temp(y2), _temp(y2)
    inside = scratch(y2.shape, bool)
    clip, total, dot = _clip(p, q, inside), row_sums(y2, sums), row_sums(dy2, dots)

    def step():
        total()
        np.divide(y2, sums, out=p)
        clip()
        np.log(q, out=g)
        out[0] = -scale * np.vdot(t2, g)
        np.divide(t2, q, out=g)
        np.multiply(g, inside, out=g)
        np.multiply(g, p, out=dy2)
        dot()
        np.subtract(dots, g, out=dy2)
        np.divide(dy2, sums, out=dy2)
        np.multiply(dy2, scale, out=dy2)
    return step


def _sparse_cce(y, t, out, dy, scale):
    """Keras (TF backend) takes softmax cross-entropy of log(clip(y)): with
    q = clip(y), S = sum(q):  L = scale * sum(log(S) - log(q[label]));
    dy = scale * inside * (1/S - one_hot/q)."""
    y2, dy2 = rows(y), rows(dy)
    fill, target = _one_hot(t, y2)
    q, log_q = _temp(y2), _temp(y2)
    sums, log_sums = scratch((y2.shape[0], 1), y.dtype), scratch((y2.shape[0], 1), y.dtype)
    inside = scratch(y2.shape, bool)
    clip, total = _clip(y2, q, inside), row_sums(q, sums)

    def step():
        fill()
        clip()
        total()
        np.log(sums, out=log_sums)
        np.log(q, out=log_q)
        out[0] = scale * (np.add.reduce(log_sums, axis=None) - np.vdot(target, log_q))
        np.divide(target, q, out=dy2)
        np.reciprocal(sums, out=sums)
        np.subtract(sums, dy2, out=dy2)
        np.multiply(dy2, inside, out=dy2)
        np.multiply(dy2, scale, out=dy2)
    return step


# Every loss of the registry has its kernel above, named _<loss>.
_PROBABILITY_LOSSES = {name: globals()[f"_{name}"] for name in LOSS_KINDS}


def _kept_tokens(t, y2, ignore, sparse):
    """(closure, target, kept) for a loss that ignores the tokens of class
    `ignore` (ids equal to it; one-hot rows of it): target [rows, C] is the
    one-hot or given target with those rows zero, kept [rows, 1] 1 or 0."""
    kept = scratch((y2.shape[0], 1), y2.dtype)
    if sparse:
        fill, target = _one_hot(t, y2)
        labels = t.reshape(kept.shape)
        keep = partial(np.not_equal, labels, labels.dtype.type(ignore), out=kept)
    else:
        given, target = rows(t.reshape(y2.shape)), _temp(y2)
        fill = partial(np.copyto, target, given)
        keep = partial(np.equal, given[:, ignore:ignore + 1], 0, out=kept)

    def step():
        fill()
        keep()
        np.multiply(target, kept, out=target)
    return step, target, kept


def _ignoring(make, y, t, out, dy, reduction, ignore, sparse):
    """Loss `make(target, scale)` over the kept tokens only: ignored ones add
    nothing to the loss, the gradient or a mean's count (torch's ignore_index,
    Keras's ignore_class).  `make` gets the dense target with ignored rows zero
    and computes the sum; a mean then divides by the kept tokens of the step."""
    if not sparse and not 0 <= ignore < y.shape[-1]:
        raise OperatorError(None, f"ignore_index {ignore} is not a class of the "
                                  f"{y.shape[-1]}-class output")
    prepare, target, kept = _kept_tokens(t, rows(y), ignore, sparse)
    inner = make(target, 1.0)
    mean = reduction == "mean"
    _scale(y, reduction)  # refuses an unknown reduction

    def step():
        prepare()
        inner()
        if mean:
            count = max(float(np.add.reduce(kept, axis=None)), 1.0)
            out[0] /= count
            np.multiply(dy, dy.dtype.type(1 / count), out=dy)
    return step


@kernel("Loss")
def loss(inputs, outputs, loss="mse", reduction="mean", ignore_index=None, **_):
    """Keras loss `loss` of predictions y against targets t (see each
    _<loss> for the math); the gradient is zero where Keras clips.
    `ignore_index` (cce, sparse_cce): tokens of that class are left out."""
    (y, t), (out, dy) = inputs, outputs
    if loss not in _PROBABILITY_LOSSES:
        raise OperatorError(None, f"Loss: unsupported loss {loss!r}")
    if ignore_index is not None and loss in PER_CLASS:
        return _ignoring(lambda target, scale: _cce(y, target, out, dy, scale),
                         y, t, out, dy, reduction, ignore_index, loss == "sparse_cce")
    return _PROBABILITY_LOSSES[loss](y, t, out, dy, _scale(y, reduction))


def _softmax_xent(z, t, out, dz, scale, beta, sparse):
    """With a = beta*z, T = sum(t) per row:  L = scale * sum(T*logsumexp(a) - t·a);
    dz = beta * scale * (softmax(a)*T - t)  (softmax(a) - t for distributions t)."""
    z2, dz2 = rows(z), rows(dz)
    shape = (z2.shape[0], 1)
    if sparse:  # one class per row: T = 1
        prepare, target = _one_hot(t, z2)
        totals = filled(shape, z.dtype, 1)
    else:
        target, totals = rows(t.reshape(z.shape)), scratch(shape, z.dtype)
        prepare = row_sums(target, totals)
    sums, log_sums, weights = (scratch(shape, z.dtype) for _ in range(3))
    shifted = _temp(z2)
    exps = row_exp(z2, beta, shifted, dz2, sums)  # logsumexp(a) = log(sums) + max(a)
    k = _per_rows(dz2, beta * scale)

    def step():
        prepare()
        exps()
        np.log(sums, out=log_sums)
        out[0] = scale * (np.vdot(totals, log_sums) - np.vdot(target, shifted))
        np.divide(totals, sums, out=weights)
        np.multiply(dz2, weights, out=dz2)
        np.subtract(dz2, target, out=dz2)
        np.multiply(dz2, k, out=dz2)
    return step


def _sigmoid_xent(z, t, out, dz, scale):
    """Per element softplus(z) - t*z (= bce of sigmoid(z) without clipping):
    L = scale/C * sum(softplus(z) - t*z);  dz = scale/C * (sigmoid(z) - t), with
    sigmoid(z) = exp(z - softplus(z)), both free of overflow."""
    k = scale / z.shape[-1]
    t, softplus, zero = t.reshape(z.shape), _temp(z), full(z, 0)

    def step():
        np.logaddexp(zero, z, out=softplus)
        out[0] = k * (np.add.reduce(softplus, axis=None) - np.vdot(t, z))
        np.subtract(z, softplus, out=dz)
        np.exp(dz, out=dz)
        np.subtract(dz, t, out=dz)
        np.multiply(dz, k, out=dz)
    return step


def _softmax_xent_from_output(z, t, y, out, dz, scale, beta, sparse):
    """The same loss and gradient read off y = softmax(beta*z), which the forward
    pass has computed already:  L = -scale * sum(t * log y);
    dz = beta * scale * (y*T - t).  Where y has underflowed to 0 at a target
    class, log y is -inf: that step takes the logits path instead."""
    y2, dz2, logs = rows(y), rows(dz), _temp(rows(y))
    if sparse:
        prepare, target = _one_hot(t, y2)
        totals = None
    else:
        target, totals = rows(t.reshape(y.shape)), scratch((y2.shape[0], 1), y.dtype)
        prepare = row_sums(target, totals)
    k = _per_rows(dz2, beta * scale)
    from_logits = _softmax_xent(z, t, out, dz, scale, beta, sparse)

    def step():
        prepare()
        with np.errstate(divide="ignore"):
            np.log(y2, out=logs)
        value = -scale * np.vdot(target, logs)
        if not np.isfinite(value):
            from_logits()
            return
        out[0] = value
        if totals is None:
            np.subtract(y2, target, out=dz2)
        else:
            np.multiply(y2, totals, out=dz2)
            np.subtract(dz2, target, out=dz2)
        np.multiply(dz2, k, out=dz2)
    return step


@kernel("LogitsLoss")
def logits_loss(inputs, outputs, loss="cce", activation="softmax", beta=1.0,
                reduction="mean", ignore_index=None, **_):
    """Loss of act(z) for a model whose final op is `activation` (or whose
    output is logits: `--from-logits`), computed from the logits z (Keras'
    from_logits path): cce/sparse_cce on softmax(beta*z), bce on sigmoid(z).
    A third input, the forward softmax output, lets cce/sparse_cce skip
    recomputing the softmax.  `ignore_index`: as in Loss."""
    (z, t, *y), (out, dz) = inputs, outputs
    scale = _scale(z, reduction)
    if loss not in LOSS_KINDS or LOSS_KINDS[loss].logits_of != activation.upper():
        raise OperatorError(None, f"LogitsLoss: unsupported {loss!r} after {activation!r}")
    if activation == "logistic":
        return _sigmoid_xent(z, t, out, dz, scale)

    def xent(target, scale, sparse=loss == "sparse_cce"):
        if y and y[0] is not None:
            return _softmax_xent_from_output(z, target, y[0], out, dz, scale, beta, sparse)
        return _softmax_xent(z, target, out, dz, scale, beta, sparse)
    if ignore_index is not None:
        return _ignoring(partial(xent, sparse=False), z, t, out, dz, reduction,
                         ignore_index, loss == "sparse_cce")
    return xent(t, scale)
