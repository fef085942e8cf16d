"""fp16 training with loss scaling, on a regression net whose last layer starts
tiny, so that its backpropagated gradients fall below fp16's range."""
import sys
from pathlib import Path

import numpy as np
import pytest

from microtrain.step.executor import Plan
from microtrain.files.format.model import load_model, model_to_bytes, op_name
from microtrain.step.loss_scale import make_loss_scale
from microtrain.trainer import Trainer
from trainconf.split import split

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from mixed_precision_table import small_gradient_model  # noqa: E402  (docs/mixed_precision.md's scenario)

FIXTURES = Path(__file__).parent / "fixtures"
X, Y = np.load(FIXTURES / "diabetes_x.npy"), np.load(FIXTURES / "diabetes_y.npy")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {p: small_gradient_model(tmp_path_factory.mktemp(p), p) for p in ("fp32", "fp16")}


def trainer(models, precision="fp16", scale="none", **kw) -> Trainer:
    return Trainer(models[precision], batch_size=32, optimizer="adam",
                   loss_scale=make_loss_scale(scale), **kw)


def first_kernel(t: Trainer) -> int:
    return t.art.training.trainable[0]


def test_fp16_without_scaling_loses_most_first_layer_gradients(models):
    exact = trainer(models, "fp32").gradients([X[:32]], [Y[:32]])[1]
    t = trainer(models)
    fp16 = t.gradients([X[:32]], [Y[:32]])[1]
    k = first_kernel(t)
    assert np.count_nonzero(exact[k]) == exact[k].size
    assert np.count_nonzero(fp16[k]) / fp16[k].size < 0.25  # most elements lost
    record = trainer(models).fit([X[:32]], [Y[:32]], epochs=1, shuffle=False)[0]
    assert record["grad_underflow_all"] > 0.1


@pytest.mark.parametrize("scale", ["1024", "dynamic", "adaptive"])
def test_loss_scaling_prevents_underflow_and_matches_fp32(models, scale):
    t = trainer(models, scale=scale)
    k = first_kernel(t)
    assert np.count_nonzero(t.gradients([X[:32]], [Y[:32]])[1][k]) == t.memory.grad_views[k].size
    history = t.fit([X], [Y], epochs=5, shuffle=False)
    reference = trainer(models, "fp32").fit([X], [Y], epochs=5, shuffle=False)
    for record in history:
        assert record["grad_underflow"] < 0.01 and record["grad_underflow_all"] < 0.01
    assert history[-1]["loss"] == pytest.approx(reference[-1]["loss"], rel=0.01)


def test_adaptive_scales_differ_between_layers(models):
    t = trainer(models, scale="adaptive")
    record = t.fit([X], [Y], epochs=1, shuffle=False)[0]
    assert record["loss_scale"]["max"] >= 1024 * record["loss_scale"]["min"]
    assert len(set(t.scaler.layer_scales().values())) > 1


def test_injected_overflow_skips_exactly_that_step_and_backs_off(models, monkeypatch):
    t = trainer(models, scale="dynamic")
    run = Plan.run_backward
    calls = {"n": 0}
    state = {}

    def overflow_on_third_step(plan):
        run(plan)
        calls["n"] += 1
        if calls["n"] == 3:
            t.memory.grads[0] = np.inf
            state.update(params=t.memory.params.copy(), opt=t.optimizer.state(),
                         iterations=t.optimizer.iterations, scale=t.scaler.scale)
        elif calls["n"] == 4:  # the skipped step left everything as it was
            np.testing.assert_array_equal(t.memory.params, state["params"])
            for name, value in t.optimizer.state().items():
                np.testing.assert_array_equal(value, state["opt"][name])
            assert t.optimizer.iterations == state["iterations"]
            assert t.scaler.scale == state["scale"] / 2 and t.scaler.good_steps == 0
    monkeypatch.setattr(Plan, "run_backward", overflow_on_third_step)
    record = t.fit([X], [Y], epochs=1, shuffle=False)[0]
    assert record["skipped_steps"] == 1
    assert t.optimizer.iterations == calls["n"] - 1
    assert record["loss_scale"] == 2.0 ** 14


def test_dynamic_scale_grows_after_the_interval(models):
    t = trainer(models, scale="dynamic")
    t.scaler.growth_interval = 5
    t.fit([X[:160]], [Y[:160]], epochs=1, shuffle=False)
    assert t.scaler.scale == 2.0 ** 16


def test_fp16_tensors_hold_float16_values(models):
    t = trainer(models)
    t.gradients([X[:32]], [Y[:32]])  # a forward and backward pass, no update
    for graph, arrays in ((t.art.forward, t.memory.forward), (t.art.backprop, t.memory.backprop)):
        for tensor, a in zip(graph.tensors, arrays):
            if tensor.dtype == np.float16:
                np.testing.assert_array_equal(a, a.astype(np.float16).astype(np.float32))
    assert not np.array_equal(t.memory.params, t.memory.working)  # master stays fp32


def test_power_of_two_static_scale_is_exact_in_fp32(tmp_path):
    frozen = split(FIXTURES / "mlp.tflite", tmp_path).frozen
    x, y = np.load(FIXTURES / "digits_x.npy")[:300], np.load(FIXTURES / "digits_onehot.npy")[:300]
    runs = []
    for scale in ("none", "1024"):
        t = Trainer(frozen, optimizer="adam", loss_scale=make_loss_scale(scale))
        runs.append(([r["loss"] for r in t.fit([x], [y], epochs=3, shuffle=False)],
                     t.memory.params.copy()))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulating_k_batches_equals_one_k_times_larger_batch(tmp_path, optimizer):
    frozen = split(FIXTURES / "cnn.tflite", tmp_path).frozen
    x, y = np.load(FIXTURES / "digits_images.npy")[:256], np.load(FIXTURES / "digits_onehot.npy")[:256]
    big = Trainer(frozen, batch_size=64, optimizer=optimizer)
    small = Trainer(frozen, batch_size=16, optimizer=optimizer, accum_steps=4)
    losses = [[r["loss"] for r in t.fit([x], [y], epochs=2, shuffle=False)] for t in (big, small)]
    np.testing.assert_allclose(small.memory.params, big.memory.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert big.optimizer.iterations == small.optimizer.iterations == 8


def test_fp16_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path):
    """The checkpoint carries the loss-scale state, and resuming refreshes the fp16
    working copy of the weights."""
    import json
    from click.testing import CliRunner
    from microtrain.commands.cli import main
    frozen = split(FIXTURES / "mlp.tflite", tmp_path, precision="fp16").frozen
    common = ["run", str(frozen), "--input", str(FIXTURES / "digits_x.npy"), "--target",
              str(FIXTURES / "digits_onehot.npy"), "--json", "--seed", "3", "--save", "never",
              "--loss-scale", "dynamic", "--growth-interval", "20"]

    def losses(*args) -> list[float]:
        result = CliRunner().invoke(main, common + list(args))
        assert result.exit_code == 0, result.output
        return [json.loads(line)["loss"] for line in result.stdout.splitlines()[:-1]]
    straight = losses("--epochs", "4")
    ckpt = str(tmp_path / "ckpt.npz")
    resumed = losses("--epochs", "2", "--checkpoint", ckpt) + \
        losses("--epochs", "4", "--checkpoint", ckpt, "--resume")
    assert resumed == straight


def _without_dense_bias(tmp_path) -> Path:
    """The cnn with its FULLY_CONNECTED's bias absent (input -1), as TensorFlow's
    converter writes a Dense layer whose bias is all zeros."""
    model = load_model(FIXTURES / "cnn.tflite")
    (dense,) = [op for op in model.subgraphs[0].operators if op_name(model, op) == "FULLY_CONNECTED"]
    dense.inputs = [*dense.inputs[:2], -1]
    path = tmp_path / "cnn_no_bias.tflite"
    path.write_bytes(model_to_bytes(model, b"TFL3"))
    return path


@pytest.mark.parametrize("model", ["cnn", "cnn without the dense bias"])
def test_tiled_fp16_ops_train_as_whole_ones(tmp_path, monkeypatch, model):
    """Ops on large fp16 batches run a few rows at a time (bounded float32 copies):
    forced here on the cnn with tiny tiles, the losses match whole-batch runs up
    to float32 summation order, and the tiles hold less scratch; an absent optional
    input (a bias) stays absent in every tile."""
    import microtrain.step.executor as executor
    import microtrain.step.row_tiles as row_tiles
    source = FIXTURES / "cnn.tflite" if model == "cnn" else _without_dense_bias(tmp_path)
    frozen = split(source, tmp_path, precision="fp16").frozen
    x, y = np.load(FIXTURES / "digits_images.npy")[:300], np.load(FIXTURES / "digits_onehot.npy")[:300]

    def run():
        t = Trainer(frozen, batch_size=32, optimizer="adam", loss_scale=make_loss_scale("dynamic"))
        losses = [r["loss"] for r in t.fit([x], [y], epochs=2, shuffle=False)]
        return losses, t.memory.workspace.buffer.nbytes
    whole, whole_scratch = run()
    tiled_ops = []
    monkeypatch.setattr(row_tiles, "TILE", 256)
    monkeypatch.setattr(executor, "tiled", lambda g, op, *a, _t=executor.tiled:
                        tiled_ops.append(op.type) or _t(g, op, *a))
    tiled, tiled_scratch = run()
    assert {"CONV_2D", "Conv2DInputGrad", "Conv2DWeightGrad", "FULLY_CONNECTED"} <= set(tiled_ops)
    np.testing.assert_allclose(tiled, whole, rtol=1e-4)
    assert tiled_scratch < whole_scratch / 2
