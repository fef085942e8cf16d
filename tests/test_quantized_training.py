"""Training through int8 quantization: int8 models, dynamic-range models and
float models split with --quantize int8 (trainconf/quantize.py)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter
from click.testing import CliRunner

from microtrain.commands.cli import main as microtrain
from microtrain.files.artifacts import BACKPROP_META, UNSEALED, seal
from microtrain.files.errors import UserError
from microtrain.files.format.model import (get_metadata, load_model, model_to_bytes, op_name,
                                           set_metadata)
from microtrain.files.format.wof import read_wof
from microtrain.files.graph import concrete_shape, graph_of
from trainconf.cli import main as trainconf
from microtrain.trainer import Trainer
from test_export_int8 import litert_invoked
from test_memory_plan import assert_plan_is_held, budget_between
from test_split_gradients import relative_error
from torch_reference import reference_gradients
from trainconf.inspect import describe
from trainconf.quantize import QuantSpec, record_of
from trainconf.split import split

QUANTIZED = Path("tests/fixtures/quantized")
FIXTURES = Path("tests/fixtures")
CACHE = os.environ.get("TRAINCONF_REAL_MODELS")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """200 8x8 digit images, as the fixtures' 8x8x1 CNN reads them, and one-hot targets."""
    d = tmp_path_factory.mktemp("digits")
    x = np.load(FIXTURES / "digits_x.npy")[:200].reshape(-1, 8, 8, 1).astype(np.float32)
    t = np.load(FIXTURES / "digits_onehot.npy")[:200].astype(np.float32)
    np.save(d / "x.npy", x / x.max())
    np.save(d / "t.npy", t)
    return d / "x.npy", d / "t.npy"


def _ok(result):
    assert result.exit_code == 0, result.output + str(result.exception)
    return result.output


def _split(model, out, *options):
    _ok(CliRunner().invoke(trainconf, ["split", str(model), "-o", str(out), *options]))
    return out / f"{model.stem}.frozen.circle"


def _run(frozen, data, *options) -> list[dict]:
    x, t = data
    out = _ok(CliRunner().invoke(microtrain, ["run", str(frozen), "--input", str(x), "--target",
                                              str(t), "--epochs", "3", "--seed", "0", "--json",
                                              *options]))
    return [json.loads(line) for line in out.splitlines()]


def _op_names(frozen) -> list[str]:
    model = load_model(frozen)
    return [op_name(model, op) for op in model.subgraphs[0].operators]


def test_int8_model_trains_through_its_own_scales(digits, tmp_path):
    frozen = _split(QUANTIZED / "full_int8.tflite", tmp_path, "--optimizer", "sgd",
                    "--learning-rate", "0.05")
    names = _op_names(frozen)
    assert "FAKE_QUANT" in names and "FakeQuantPerChannel" in names
    record = record_of(load_model(frozen))
    int8 = load_model(QUANTIZED / "full_int8.tflite").subgraphs[0]
    inp = int8.tensors[int8.inputs[0]].quantization
    assert record.activations[int(int8.inputs[0])] == (pytest.approx(float(inp.scale[0])),
                                                       int(inp.zeroPoint[0]))
    summary = _run(frozen, digits)[-1]
    assert summary["final_loss"] < summary["initial_loss"]


def test_trained_weights_scales_track_them_unless_fixed(digits, tmp_path):
    """Tracked: a trained int8 weight's FakeQuantPerChannel has no scales input and the
    record leaves its scales to export (which takes max|w|/127 of the trained weight);
    training moves some weight past the model's grid, which `--weight-scales fixed`
    keeps (recorded, an input)."""
    for mode in ("track", "fixed"):
        frozen = _split(QUANTIZED / "full_int8.tflite", tmp_path / mode, "--optimizer", "sgd",
                        "--learning-rate", "0.05", "--weight-scales", mode)
        model = load_model(frozen)
        record = record_of(model)
        weights = [op.inputs[0] for op in graph_of(model).ops
                   if op.type == "FakeQuantPerChannel" and op.options["num_bits"] == 8]
        assert weights
        for op in graph_of(model).ops:
            if op.type == "FakeQuantPerChannel" and op.inputs[0] in weights:
                assert (len(op.inputs) == 1) == (mode == "track") == \
                    (op.inputs[0] not in record.weights)
        wof = frozen.with_name("full_int8.wof")
        before = {t: np.abs(a).max() for t, a in read_wof(wof, model).items()}
        _run(frozen, digits)
        after = {t: np.abs(a).max() for t, a in read_wof(wof, model).items()}
        assert any(after[t] > 1.001 * before[t] for t in weights)


@pytest.mark.parametrize("name", ["full_int8", "full_int8_float_io"])
def test_float_form_computes_what_litert_computes_on_the_int8_model(name, digits, tmp_path):
    """Within one step of the output's grid: float arithmetic rounds where the
    integer kernels' fixed-point multipliers do.  With float input and output
    the QUANTIZE becomes a FAKE_QUANT and the final DEQUANTIZE goes (the loss
    reads the SOFTMAX's logits)."""
    model = QUANTIZED / f"{name}.tflite"
    frozen = _split(model, tmp_path)
    assert _op_names(frozen)[-1] == "SOFTMAX"
    x = np.load(digits[0])[:32]
    out = tmp_path / "y.npy"
    _ok(CliRunner().invoke(microtrain, ["infer", str(frozen), "--input", str(digits[0]),
                                        "-o", str(out)]))
    ours = np.load(out)[:32]
    it = Interpreter(str(model))
    inp, outp = it.get_input_details()[0], it.get_output_details()[0]
    it.resize_tensor_input(inp["index"], x.shape)
    it.allocate_tensors()
    s, z = inp["quantization"]
    it.set_tensor(inp["index"], np.clip(np.round(x / s + z), -128, 127).astype(np.int8)
                  if inp["dtype"] == np.int8 else x)
    it.invoke()
    theirs = it.get_tensor(outp["index"]).astype(np.float32)
    if outp["dtype"] == np.int8:
        so, zo = outp["quantization"]
        theirs = (theirs - zo) * so
    # steps of the SOFTMAX's int8 grid, 1/256
    assert np.abs(np.round(ours * 256) - np.round(theirs * 256)).max() <= 1


def test_qas_off_trains_otherwise(digits, tmp_path):
    model = QUANTIZED / "full_int8.tflite"
    losses = {}
    for qas in ("on", "off"):
        frozen = _split(model, tmp_path / qas, "--qas", qas, "--optimizer", "sgd",
                        "--learning-rate", "0.05")
        losses[qas] = _run(frozen, digits)[-1]["final_loss"]
    assert losses["on"] != losses["off"]


def test_dynamic_range_weights_keep_their_grid_unless_dequantized(tmp_path):
    model = QUANTIZED / "dynamic_int8.tflite"
    kept = _op_names(_split(model, tmp_path / "keep"))
    dequantized = _op_names(_split(model, tmp_path / "float", "--int8-weights", "dequantize"))
    assert "FakeQuantPerChannel" in kept and "FAKE_QUANT" not in kept
    assert "FakeQuantPerChannel" not in dequantized


def test_float_model_trains_quantization_aware(digits, tmp_path):
    model = QUANTIZED / "shared_bias.tflite"
    frozen = _split(model, tmp_path, "--quantize", "int8", "--calibration", str(digits[0]))
    record = record_of(load_model(frozen))
    assert record.activations and any(bits == 32 for _, bits, _ in record.weights.values())
    summary = _run(frozen, digits)[-1]
    assert summary["final_loss"] < summary["initial_loss"]


def test_quantize_needs_calibration_and_a_float_model(digits, tmp_path):
    runner = CliRunner()
    for model, options in ((QUANTIZED / "shared_bias.tflite", ["--quantize", "int8"]),
                           (QUANTIZED / "full_int8.tflite",
                            ["--quantize", "int8", "--calibration", str(digits[0])])):
        result = runner.invoke(trainconf, ["split", str(model), "-o", str(tmp_path), *options])
        assert result.exit_code != 0 and result.exception is None or \
            isinstance(result.exception, SystemExit)
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("name,quantize", [("full_int8", None), ("dynamic_int8", None),
                                           ("shared_bias", "int8")])
def test_gradients_through_fake_quantization_match_torch(name, quantize, digits, tmp_path):
    """Against torch.fake_quantize_per_tensor_affine / per_channel_affine in float64."""
    x, t = np.load(digits[0])[:16], np.load(digits[1])[:16]
    result = split(QUANTIZED / f"{name}.tflite", tmp_path,
                   quant=QuantSpec(quantize, digits[0] if quantize else None))
    trainer = Trainer(result.frozen, batch_size=len(x), optimizer="sgd")
    got_loss, got = trainer.gradients([x], [t])
    want_loss, want = reference_gradients(trainer.art.forward, trainer.art.weights, [x], t, "cce")
    assert got_loss == pytest.approx(want_loss, rel=1e-4)
    assert set(got) == set(want)
    for tensor, g in got.items():
        assert relative_error(g, want[tensor]) < 1e-4, trainer.art.forward.tensors[tensor].name


def _litert_and_infer(exported: Path, frozen: Path, inputs: Path, out: Path):
    """(LiteRT's outputs of the exported model, `microtrain infer`'s of the split) on `inputs`."""
    _ok(CliRunner().invoke(microtrain, ["infer", str(frozen), "--input", str(inputs),
                                        "-o", str(out)]))
    it = litert_invoked(exported, np.load(inputs))
    return it.get_tensor(it.get_output_details()[0]["index"]), np.load(out)


def test_trained_fake_quantized_model_exports_as_litert_runs_it(digits, tmp_path):
    """The float export holds each weight rounded to its grid (FakeQuantPerChannel
    folded) and the activations' FAKE_QUANT builtins, which LiteRT runs."""
    frozen = _split(QUANTIZED / "full_int8_float_io.tflite", tmp_path, "--optimizer", "sgd",
                    "--learning-rate", "0.05")
    _run(frozen, digits)
    exported, out = tmp_path / "trained.tflite", tmp_path / "y.npy"
    _ok(CliRunner().invoke(trainconf, ["export", str(frozen), "-o", str(exported), "--float"]))
    assert "FakeQuantPerChannel" not in _op_names(exported)
    theirs, ours = _litert_and_infer(exported, frozen, digits[0], out)
    # LiteRT's float kernels round differently from numpy's, which can move an
    # activation on a rounding boundary by one step (0.5% of outputs by 9e-5 here)
    np.testing.assert_allclose(theirs, ours, atol=1e-3)
    assert np.array_equal(theirs.argmax(1), ours.argmax(1))


def test_a_trained_int8_model_exports_int8_and_litert_agrees_with_training(digits, tmp_path):
    """By default the export of a fake-quantized split is the full-integer model, with the
    split's own grids: LiteRT's int8 kernels compute what microtrain's float form trained."""
    frozen = _split(QUANTIZED / "full_int8_float_io.tflite", tmp_path, "--optimizer", "sgd",
                    "--learning-rate", "0.05")
    _run(frozen, digits)
    exported, out = tmp_path / "trained_int8.tflite", tmp_path / "y.npy"
    _ok(CliRunner().invoke(trainconf, ["export", str(frozen), "-o", str(exported),
                                       "--io", "float"]))
    assert any(d["dtype"] == np.int8 for d in Interpreter(str(exported)).get_tensor_details())
    theirs, ours = _litert_and_infer(exported, frozen, digits[0], out)
    # within one step of the int8 output's 1/256 grid (its rounding of the float form's
    # probabilities); classes are not compared: after a short training the probabilities
    # lie within about 0.014 of each other, so a half-step moves the largest one
    np.testing.assert_allclose(theirs, ours, atol=1 / 256)


def test_memory_budget_trains_some_rows_of_a_quantized_weight(digits, tmp_path):
    """A budget that trains part of a layer slices the rows' grids with the rows;
    their gradients are torch's rows."""
    x, t = np.load(digits[0])[:16], np.load(digits[1])[:16]
    path = QUANTIZED / "full_int8.tflite"
    result = split(path, tmp_path, memory_budget=budget_between(path, tmp_path, "last:1", "last:2"),
                   recompute="none")
    trainer = Trainer(result.frozen, batch_size=len(x), optimizer="sgd")
    rows = trainer.art.training.rows
    assert rows
    _, got = trainer.gradients([x], [t])
    _, want = reference_gradients(trainer.art.forward, trainer.art.weights, [x], t, "cce")
    for tensor, g in got.items():
        lo, hi = rows.get(tensor, (0, len(want[tensor])))
        assert relative_error(g, want[tensor][lo:hi]) < 1e-4


STORED = [("full_int8", None, {}), ("full_int8", None, {"recompute": "auto"}),
          ("full_int8", None, {"precision": "fp16"}), ("shared_bias", "int8", {})]
CACHED = [Path(CACHE) / "keras" / f"{name}.tflite" for name in ("small_cnn_int8",
                                                                "mobilenet_v2_int8")] \
    if CACHE else []


def _int8_and_float_storage(model: Path, calibration, tmp_path, monkeypatch, **options):
    """The model split as it is and with its FAKE_QUANT outputs stored in float32
    (as before int8 storage), and 48 random samples with one-hot targets."""
    spec = QuantSpec(calibration and "int8", calibration)
    splits = [split(model, tmp_path / "int8", quant=spec, **options)]
    with monkeypatch.context() as m:
        m.setattr("trainconf.split.store_levels", graph_of)
        splits.append(split(model, tmp_path / "float", quant=spec, **options))
    g = graph_of(load_model(splits[0].frozen))
    rng = np.random.default_rng(0)
    x = rng.random(concrete_shape(g.tensors[g.inputs[0]].shape, 48), dtype=np.float32)
    t = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 48)]
    return splits, x, t


@pytest.mark.parametrize("name,quantize_,options", STORED, ids=["int8", "recompute", "fp16", "qat"])
def test_int8_stored_activations_train_bit_identically(name, quantize_, options, digits, tmp_path,
                                                       monkeypatch):
    """FAKE_QUANT outputs stored as int8 levels: the same losses and weights, to the
    bit, as when they were stored in float32 (but with fp16 activations, which
    held them rounded to fp16), in fewer bytes, which the run holds as planned."""
    splits, x, t = _int8_and_float_storage(QUANTIZED / f"{name}.tflite",
                                           digits[0] if quantize_ else None, tmp_path,
                                           monkeypatch, batch_size=16, optimizer="momentum",
                                           **options)
    runs = []
    for result in splits:
        trainer = Trainer(result.frozen, batch_size=16, optimizer="momentum")
        history = trainer.fit([x], [t], epochs=2, shuffle=False)
        assert_plan_is_held(result.memory, trainer)
        stored = [u for u in trainer.art.forward.tensors if u.fake_quant]
        runs.append(([h["loss"] for h in history], trainer.memory.params.copy(), stored))
    (losses, weights, stored), (float_losses, float_weights, none) = runs
    assert stored and not none
    assert all(u.dtype == np.int8 for u in stored)
    assert splits[0].memory["arena"] < splits[1].memory["arena"]
    if options.get("precision") == "fp16":
        assert losses != float_losses
        np.testing.assert_allclose(losses, float_losses, rtol=1e-2)
    else:
        assert losses == float_losses
        np.testing.assert_array_equal(weights, float_weights)


@pytest.mark.parametrize("model", CACHED, ids=lambda p: p.stem)
def test_int8_stored_activations_of_real_models_are_held_as_planned(model, tmp_path,
                                                                    monkeypatch):
    """The cache's int8 Keras models (TRAINCONF_REAL_MODELS): planned RAM is held,
    and training is bit-identical to float32 storage."""
    splits, x, t = _int8_and_float_storage(model, None, tmp_path, monkeypatch, batch_size=16,
                                           optimizer="sgd")
    runs = []
    for result in splits:
        trainer = Trainer(result.frozen, batch_size=16, optimizer="sgd")
        losses = [h["loss"] for h in trainer.fit([x[:32]], [t[:32]], epochs=1, shuffle=False)]
        assert_plan_is_held(result.memory, trainer)
        runs.append((losses, trainer.memory.params.copy()))
    assert splits[0].memory["ram"] < splits[1].memory["ram"]
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_a_link_to_int8_levels_must_be_declared_alike(tmp_path):
    """The backprop graph's stand-in for a FAKE_QUANT's int8 output declares its
    type and grid; one that says float32 is refused in one line."""
    result = split(QUANTIZED / "full_int8.tflite", tmp_path)
    forward = Trainer(result.frozen).art.forward
    model = load_model(result.backprop)
    meta = json.loads(get_metadata(model, BACKPROP_META))
    b = next(b for b, f in meta["forward"] if forward.tensors[f].fake_quant)
    model.subgraphs[0].tensors[b].quantization = None
    meta["backprop_sha256"] = UNSEALED  # sealed again, as trainconf would
    set_metadata(model, BACKPROP_META, json.dumps(meta).encode())
    result.backprop.write_bytes(seal(model_to_bytes(model)))
    with pytest.raises(UserError, match=f"backprop tensor {b} stands for forward tensor .*"
                                        "int8 levels of a FAKE_QUANT"):
        Trainer(result.frozen)


def test_inspect_tells_int8_levels_from_quantized_activations(tmp_path):
    """The int8 model computes on quantized activations; its split stores float
    values as int8 levels, and its operators train as float ones."""
    model = QUANTIZED / "full_int8.tflite"
    frozen = split(model, tmp_path).frozen

    def labels(path):
        return {op["training"] for op in describe(load_model(path))["subgraphs"][0]["operators"]}
    assert "quantized" in labels(model)
    assert "quantized" not in labels(frozen)
