"""Sparse update schemes (`--trainable biases`, `biases:last:K`, and their sums
with `last:N`): which tensors each names, that their gradients are those of
full training, and that they are refused clearly when out of range."""
from pathlib import Path

import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.trainer import Trainer
from test_memory_plan import data
from trainconf.select import layers, select_trainable, weighted_ops
from trainconf.split import load_prepared, resolve_precision, split

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def mobilenet():
    g = load_prepared(FIXTURES / "mobilenetv2.tflite", resolve_precision())[1]
    return g, layers(g, weighted_ops(g))


def test_schemes_name_biases_and_whole_layers(mobilenet):
    g, groups = mobilenet
    kernels = [u.kernel for layer in groups for u in layer]
    bias_of = [u.bias for layer in groups for u in layer]
    assert None not in bias_of  # a converted Keras MobileNetV2: BatchNorm folded into biases
    assert set(select_trainable(g, "biases")) == set(bias_of)
    assert set(select_trainable(g, "biases:last:3")) == set(bias_of[-3:])
    assert set(select_trainable(g, "biases,last:2")) == set(bias_of) | set(kernels[-2:])
    assert set(select_trainable(g, "biases:last:5, last:1")) == set(bias_of[-5:]) | {kernels[-1]}
    assert select_trainable(g, "last:2,biases:last:2") == select_trainable(g, "last:2")
    assert set(select_trainable(g, "biases,last:1", freeze_bias=True)) == \
        set(bias_of) | {kernels[-1]}


@pytest.mark.parametrize("spec,message", [
    ("biases:last:0", "biases:last:0: N must be between 1 and 53"),
    ("biases:last:x", "biases:last:x: N must be between 1 and 53"),
    ("biases,last:99", "last:99: N must be between 1 and 53"),
    ("biases:first:2", "no weighted op or weight named 'biases:first:2'"),
])
def test_bad_schemes(mobilenet, spec, message):
    with pytest.raises(UserError, match=message):
        select_trainable(mobilenet[0], spec)


def test_bias_gradients_are_those_of_full_training(tmp_path):
    """Training the biases alone backpropagates to every layer: each bias's
    gradient equals the one full training computes (float32, summed in another
    order by BLAS: a few ulps of the largest term)."""
    path = FIXTURES / "cnn.tflite"
    sparse = split(path, tmp_path / "sparse", trainable="biases,last:1")
    full = split(path, tmp_path / "full", trainable="all")
    x, t = data("cnn", 32)
    _, part = Trainer(sparse.frozen, batch_size=32).gradients([x], [t])
    _, whole = Trainer(full.frozen, batch_size=32).gradients([x], [t])
    assert len(part) < len(whole)
    for tensor, grad in part.items():
        np.testing.assert_allclose(grad, whole[tensor], rtol=0,
                                   atol=32 * np.finfo(np.float32).eps * np.abs(whole[tensor]).max())


@pytest.mark.parametrize("model,batch", [("mobilenetv2", 1), ("cnn", 32)])
def test_compact_scratch_is_smaller_and_bit_identical(model, batch, tmp_path):
    """--compact-scratch (no window index arrays, no clip bounds the size of an
    activation, convolutions a tile of output rows at a time): less kernel
    scratch, held as planned, the same losses and weights within float32
    rounding (a strided copy gathers what the index took; a clip against
    scalars equals one against full arrays; depthwise tiles sum in the same
    order; but BLAS rounds CONV_2D's products of a tile of window rows, and its
    weight gradient's sum of the tiles' products, differently from one product)."""
    runs = {}
    for compact in (False, True):
        result = split(FIXTURES / f"{model}.tflite", tmp_path / str(compact), trainable="all",
                       batch_size=batch, optimizer="sgd", compact_scratch=compact)
        trainer = Trainer(result.frozen, batch_size=batch, optimizer="sgd", learning_rate=0.01)
        x, t = data(model, 2 * batch)
        losses = [r["loss"] for r in trainer.fit([x], [t], epochs=2, shuffle=False)]
        held = trainer.memory_bytes()
        assert 0.98 * result.memory["ram"] <= held <= result.memory["ram"]
        runs[compact] = result.memory["kernel_scratch"], losses, trainer.weights()
    assert runs[True][0] < runs[False][0]
    np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-6)
    eps = np.finfo(np.float32).eps
    for t, w in runs[False][2].items():
        np.testing.assert_allclose(runs[True][2][t], w, rtol=0, atol=32 * eps * np.abs(w).max())
