"""Loss and LogitsLoss against PyTorch implementations of Keras 3's definitions
(TF backend: clipping to [1e-7, 1 - 1e-7], cce renormalising y by its sum,
sparse cce as softmax cross-entropy of log(clip(y))), torch autograd, and
central finite differences in float64."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_check import numeric_grad, run
from microtrain.files.errors import OperatorError
from microtrain.step.kernels import build
from microtrain.files.loss_registry import LOSS_NAMES as LOSSES  # every loss is checked

rng = np.random.default_rng(23)
EPS = 1e-7


def sparse_xent(logits, labels):
    """Per-sample softmax cross-entropy with class ids, any leading dims."""
    classes = logits.shape[-1]
    flat = F.cross_entropy(logits.reshape(-1, classes), labels.reshape(-1).long(), reduction="none")
    return flat.reshape(logits.shape[:-1])


def keras_per_sample(loss, y, t):
    """Keras 3's per-sample loss (reduced over the last axis)."""
    if loss == "mse":
        return ((y - t) ** 2).mean(-1)
    if loss == "mae":
        return (y - t).abs().mean(-1)
    if loss == "bce":
        q = y.clamp(EPS, 1 - EPS)
        return -(t * q.log() + (1 - t) * (1 - q).log()).mean(-1)
    if loss == "cce":
        q = (y / y.sum(-1, keepdim=True)).clamp(EPS, 1 - EPS)
        return -(t * q.log()).sum(-1)
    return sparse_xent(y.clamp(EPS, 1 - EPS).log(), t)


def reduce(per_sample, reduction):
    """Keras' sum_over_batch_size ("mean") or "sum"."""
    total = per_sample.sum()
    return total / per_sample.numel() if reduction == "mean" else total


def targets(loss, shape):
    """Random targets for `loss` on predictions of `shape`."""
    if loss == "sparse_cce":
        return rng.integers(0, shape[-1], size=shape[:-1])
    if loss == "cce":
        return np.eye(shape[-1])[rng.integers(0, shape[-1], size=shape[:-1])]
    if loss == "bce":
        return rng.uniform(0, 1, size=shape)
    return rng.normal(size=shape)


def predictions(loss, shape):
    """Random predictions away from the clip bounds (probabilities for the
    cross-entropies, unclipped values otherwise)."""
    if loss in ("mse", "mae"):
        return rng.normal(size=shape)
    return rng.uniform(0.05, 0.95, size=shape)


def check_against_torch(kernel, y, t, reference, **options):
    """Our (loss, gradient) against the torch reference and its autograd."""
    loss, dy = run(kernel, [y, t], [(1,), y.shape], **options)
    yt = torch.tensor(y, requires_grad=True)
    expected = reference(yt, torch.tensor(t))
    expected.backward()
    np.testing.assert_allclose(loss, [expected.item()], rtol=1e-12)
    np.testing.assert_allclose(dy, yt.grad.numpy(), rtol=1e-10, atol=1e-15)
    return loss, dy


def check_against_differences(kernel, y, t, dy, **options):
    def loss(v):
        return run(kernel, [v, t], [(1,), v.shape], **options)[0]
    # Central differences of a loss ~10 with step 1e-6 carry ~1e-9 of rounding.
    np.testing.assert_allclose(dy, numeric_grad(loss, y, np.ones(1)), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(32, 5), (7, 5), (4, 3, 6)])  # a partial batch; rank 3
def test_loss(loss, reduction, shape):
    y, t = predictions(loss, shape), targets(loss, shape)
    _, dy = check_against_torch("Loss", y, t, lambda a, b: reduce(keras_per_sample(loss, a, b), reduction),
                                loss=loss, reduction=reduction)
    check_against_differences("Loss", y, t, dy, loss=loss, reduction=reduction)


def test_mean_divides_by_the_batch_it_gets():
    y, t = rng.normal(size=(7, 3)), rng.normal(size=(7, 3))
    (mean,), _ = run("Loss", [y, t], [(1,), y.shape], loss="mse", reduction="mean")
    (total,), _ = run("Loss", [y, t], [(1,), y.shape], loss="mse", reduction="sum")
    np.testing.assert_allclose(mean, total / 7, rtol=1e-14)
    np.testing.assert_allclose(mean, np.mean((y - t) ** 2), rtol=1e-14)


@pytest.mark.parametrize("loss", ["bce", "cce", "sparse_cce"])
def test_clipped_probabilities(loss):
    y = rng.uniform(0.05, 0.95, size=(6, 4))
    y[0, 0], y[1, 1], y[2, 2], y[3, 3], y[4, 0] = 0.0, 1.0, 1e-9, EPS, 1 - 1e-9
    y[5] = [1.0, 0.0, 0.0, 0.0]  # cce clips after renormalising: a whole extreme row
    labels = np.arange(6) % 4  # the targets sit on the clipped entries
    t = {"bce": rng.uniform(0, 1, size=y.shape), "cce": np.eye(4)[labels], "sparse_cce": labels}[loss]
    _, dy = check_against_torch("Loss", y, t, lambda a, b: reduce(keras_per_sample(loss, a, b), "mean"),
                                loss=loss, reduction="mean")
    if loss != "cce":  # (cce's renormalisation passes gradient around the clip)
        assert dy[0, 0] == dy[1, 1] == dy[2, 2] == 0 and dy[3, 3] != 0


@pytest.mark.parametrize("label_shape", ["flat", "column"])
@pytest.mark.parametrize("label_dtype", [np.int32, np.int64, np.float32])
@pytest.mark.parametrize("kernel", ["Loss", "LogitsLoss"])
def test_sparse_labels(kernel, label_shape, label_dtype):
    labels = rng.integers(0, 5, size=9)
    y = predictions("sparse_cce", (9, 5)) if kernel == "Loss" else rng.normal(size=(9, 5))
    t = labels.astype(label_dtype).reshape((9,) if label_shape == "flat" else (9, 1))
    if kernel == "Loss":
        def reference(a, _):
            return sparse_xent(a.clamp(EPS, 1 - EPS).log(), torch.tensor(labels)).mean()
    else:
        def reference(a, _):
            return F.cross_entropy(a, torch.tensor(labels))
    check_against_torch(kernel, y, t, reference, loss="sparse_cce", reduction="mean")


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_single_output_with_flat_targets(loss):
    y = predictions(loss, (8, 1))
    t = targets(loss, (8,))
    check_against_torch("Loss", y, t, lambda a, b: reduce(keras_per_sample(loss, a, b[:, None]), "mean"),
                        loss=loss, reduction="mean")


def softmax_reference(beta, sparse):
    def reference(z, t):
        logits = beta * z
        return sparse_xent(logits, t) if sparse else -(t * logits.log_softmax(-1)).sum(-1)
    return reference


def logits_targets(loss, shape, kind):
    """Targets for LogitsLoss: class ids, one-hot rows, soft distributions, or
    rows not summing to 1 (the gradient must stay exact)."""
    if loss == "sparse_cce" or kind == "one_hot":
        return targets(loss, shape)
    t = rng.uniform(0, 1, size=shape)
    return t if kind == "unnormalised" or loss == "bce" else t / t.sum(-1, keepdims=True)


@pytest.mark.parametrize("loss", ["cce", "sparse_cce"])
@pytest.mark.parametrize("beta", [1.0, 0.5, 2.5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["one_hot", "soft", "unnormalised"])
def test_softmax_logits_loss(loss, beta, reduction, kind):
    z = rng.normal(size=(7, 6)) * 2
    t = logits_targets(loss, z.shape, kind)
    per_sample = softmax_reference(beta, loss == "sparse_cce")
    _, dz = check_against_torch("LogitsLoss", z, t, lambda a, b: reduce(per_sample(a, b), reduction),
                                loss=loss, activation="softmax", beta=beta, reduction=reduction)
    check_against_differences("LogitsLoss", z, t, dz, loss=loss, activation="softmax", beta=beta,
                              reduction=reduction)


def test_softmax_logits_loss_matches_torch_cross_entropy():
    z, labels = rng.normal(size=(32, 10)), rng.integers(0, 10, size=32)
    zt = torch.tensor(z, requires_grad=True)
    expected = F.cross_entropy(zt, torch.tensor(labels))
    expected.backward()
    for loss, t in (("cce", np.eye(10)[labels]), ("cce", np.eye(10, dtype=np.int32)[labels]),
                    ("sparse_cce", labels)):
        value, dz = run("LogitsLoss", [z, t], [(1,), z.shape], loss=loss, activation="softmax")
        np.testing.assert_allclose(value, [expected.item()], rtol=1e-12)
        np.testing.assert_allclose(dz, zt.grad.numpy(), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(8, 1), (5, 3), (2, 3, 4)])
def test_logistic_logits_loss(reduction, shape):
    z, t = rng.normal(size=shape) * 2, logits_targets("bce", shape, "soft")

    def reference(a, b):
        per_element = F.binary_cross_entropy_with_logits(a, b, reduction="none")
        return reduce(per_element.mean(-1), reduction)
    _, dz = check_against_torch("LogitsLoss", z, t, reference, loss="bce", activation="logistic",
                                reduction=reduction)
    check_against_differences("LogitsLoss", z, t, dz, loss="bce", activation="logistic",
                              reduction=reduction)


@pytest.mark.parametrize("loss, activation", [("cce", "softmax"), ("bce", "logistic")])
def test_logits_loss_is_stable_for_huge_logits(loss, activation):
    z = rng.normal(size=(6, 4)) * 1e4
    t = logits_targets(loss, z.shape, "one_hot" if loss == "cce" else "soft")
    value, dz = run("LogitsLoss", [z, t], [(1,), z.shape], loss=loss, activation=activation)
    assert np.isfinite(value).all() and np.isfinite(dz).all()
    zt = torch.tensor(z)
    if loss == "cce":
        expected = F.cross_entropy(zt, torch.tensor(t))
    else:
        expected = F.binary_cross_entropy_with_logits(zt, torch.tensor(t))
    np.testing.assert_allclose(value, [expected.item()], rtol=1e-12)


@pytest.mark.parametrize("kernel, options", [
    ("Loss", {"loss": "hinge"}), ("Loss", {"loss": "mse", "reduction": "none"}),
    ("LogitsLoss", {"loss": "bce", "activation": "softmax"}),
    ("LogitsLoss", {"loss": "cce", "activation": "logistic"})])
def test_bad_options_raise(kernel, options):
    with pytest.raises(OperatorError):
        run(kernel, [np.ones((2, 3)), np.ones((2, 3))], [(1,), (2, 3)], **options)


@pytest.mark.parametrize("kernel, loss, options", [
    ("Loss", "mse", {}), ("Loss", "cce", {}), ("Loss", "sparse_cce", {}),
    ("LogitsLoss", "sparse_cce", {"activation": "softmax"}),
    ("LogitsLoss", "bce", {"activation": "logistic"})])
def test_float32_closure_reads_inputs_at_call_time(kernel, loss, options):
    y = np.zeros((8, 5), np.float32)
    t = np.zeros((8,) if loss == "sparse_cce" else (8, 5), np.float32)
    value, dy = np.zeros(1, np.float32), np.zeros_like(y)
    step = build(kernel, [y, t], [value, dy], loss=loss, **options)
    for _ in range(2):
        fresh = predictions(loss, y.shape) if kernel == "Loss" else rng.normal(size=y.shape)
        y[...], t[...] = fresh, targets(loss, y.shape)
        step()
        assert value.dtype == dy.dtype == np.float32
        expected_value, expected_dy = run(kernel, [y.astype(np.float64), t.astype(np.float64)],
                                          [(1,), y.shape], loss=loss, **options)
        np.testing.assert_allclose(value, expected_value, rtol=1e-5)
        np.testing.assert_allclose(dy, expected_dy, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["cce", "sparse_cce"])
@pytest.mark.parametrize("scale_logits", [1.0, 200.0])  # 200: softmax underflows to 0 somewhere
def test_logits_loss_reading_the_softmax_output(loss, scale_logits):
    """With the forward softmax output as a third input, LogitsLoss gives the same
    loss and gradient (float32) as from the logits alone, falling back to the
    logits where the output has underflowed at a target class."""
    z = (rng.standard_normal((9, 6)) * scale_logits).astype(np.float32)
    t = targets(loss, (9, 6)).astype(np.float32)
    y = run("SOFTMAX", [z], [z.shape], np.float32, beta=0.7)[0]
    options = dict(loss=loss, activation="softmax", beta=0.7, reduction="mean")
    want = run("LogitsLoss", [z, t], [(1,), z.shape], np.float32, **options)
    got = run("LogitsLoss", [z, t, y], [(1,), z.shape], np.float32, **options)
    assert np.isfinite(got[0][0])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-7)
