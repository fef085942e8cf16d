"""`trainconf export --int8`: full-integer models of the trained fixtures run in
LiteRT with the float model's accuracy (within 1 pp on the digits test set) and
outputs (within a few steps of the output scale); float input/output only adds
QUANTIZE/DEQUANTIZE at the edges; the scales agree with what TensorFlow's own
converter makes of the same float model and data; a model's quantization
record is used as calibration is; bad input is one line."""
import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.files.artifacts import sibling
from microtrain.files.contracts import Quantization
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (buffer_array, load_model, op_name, save_model,
                                           set_builtin_options, set_metadata)
from microtrain.files.format.wof import read_wof, write_wof
from microtrain.files.graph import Op
from microtrain.trainer import Trainer
from model_patch import FIXTURES
from test_hardening import _one_error
from test_landmark_refinement import _cache
from trainconf.cli import main
from trainconf.export import export
from trainconf.int8 import calibrate, record
from trainconf.operators import INT8
from trainconf.split import split
from trainconf.writer import circle_operator

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from int8_table import litert_invoked  # noqa: E402

DIGITS = {"mlp": "digits_x", "cnn": "digits_images", "depthwise": "digits_images"}
TRAIN = 1437  # the first 80% of the digits train and calibrate; the rest is the test set
TF_CALIBRATION = 256  # the samples scripts/make_int8_reference.py gave TensorFlow's converter
STEPS = 3  # how far (in its scale) an int8 tensor may lie from the float model's
SHAPE_OPS = {"SHAPE", "STRIDED_SLICE", "PACK"}  # TensorFlow's dynamic Flatten; split folds it


def _digits(name: str) -> tuple[np.ndarray, np.ndarray]:
    return np.load(FIXTURES / f"{DIGITS[name]}.npy"), np.load(FIXTURES / "digits_y.npy")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> (frozen path, calibration .npy) after a short training on the digits."""
    cache = {}

    def get(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            frozen = split(FIXTURES / f"{name}.tflite", out).frozen
            x, y = _digits(name)
            trainer = Trainer(frozen, batch_size=32, optimizer="adam", learning_rate=0.01)
            trainer.fit([x[:TRAIN]], [np.eye(10, dtype=np.float32)[y[:TRAIN]]], epochs=3,
                        seed=0)
            trainer.save_weights()
            np.save(out / "calibration.npy", x[:TRAIN])
            cache[name] = frozen, out / "calibration.npy"
        return cache[name]
    return get


def _export(frozen, path, *options) -> None:
    result = CliRunner().invoke(main, ["export", str(frozen), "-o", str(path), *map(str, options)])
    assert result.exit_code == 0, result.output + result.stderr


def _int8(trained, name: str, tmp_path, io: str = "int8"):
    frozen, calibration = trained(name)
    path = tmp_path / f"{name}_{io}.tflite"
    _export(frozen, path, "--int8", "--calibration", calibration, "--io", io)
    return path


def _value(interpreter, t: int, tensor) -> tuple[np.ndarray, float]:
    """Tensor t's float values (dequantized when int8) and its scale (0: float)."""
    y = interpreter.get_tensor(t)
    if y.dtype != np.int8:
        return y, 0.0
    q = tensor.quantization
    return (y.astype(np.float32) - q.zeroPoint[0]) * q.scale[0], float(q.scale[0])


def _litert(path, x: np.ndarray) -> tuple[np.ndarray, float]:
    """LiteRT's output on float samples x, dequantized, and its scale."""
    sg = load_model(path).subgraphs[0]
    return _value(litert_invoked(path, x), sg.outputs[0], sg.tensors[sg.outputs[0]])


def _logits(path, x: np.ndarray) -> tuple[np.ndarray, float]:
    """The values SOFTMAX reads (dequantized) and their scale."""
    model = load_model(path)
    sg = model.subgraphs[0]
    t = next(op for op in sg.operators if op_name(model, op) == "SOFTMAX").inputs[0]
    return _value(litert_invoked(path, x, experimental_preserve_all_tensors=True), t, sg.tensors[t])


def _float(trained, name: str, tmp_path):
    path = tmp_path / f"{name}_float.tflite"
    _export(trained(name)[0], path)
    return path


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_the_int8_model_has_the_float_models_accuracy(trained, name, tmp_path):
    x, y = _digits(name)
    accuracy = {kind: (_litert(path, x[TRAIN:])[0].argmax(1) == y[TRAIN:]).mean()
                for kind, path in (("float", _float(trained, name, tmp_path)),
                                   ("int8", _int8(trained, name, tmp_path)))}
    assert accuracy["float"] > 0.5  # it trained: the comparison means something
    assert abs(accuracy["int8"] - accuracy["float"]) <= 0.01, accuracy


@pytest.mark.parametrize("name", ["mlp", "cnn", "depthwise"])
@pytest.mark.filterwarnings("ignore:Warning. Enabling `experimental_preserve_all_tensors`")
def test_int8_outputs_lie_within_a_few_steps_of_the_float_ones(trained, name, tmp_path):
    """The logits (SOFTMAX's input) within a few of their steps; the
    probabilities as far as SOFTMAX, whose slope is at most 1/2, carries that,
    and within one of their steps on average."""
    x = _digits(name)[0][TRAIN:]
    float_model, int8_model = _float(trained, name, tmp_path), _int8(trained, name, tmp_path)
    z_float, z_int8 = _logits(float_model, x)[0], _logits(int8_model, x)
    assert np.abs(z_int8[0] - z_float).max() <= STEPS * z_int8[1]
    y_float = _litert(float_model, x)[0]
    y_int8, scale = _litert(int8_model, x)
    assert scale == 1 / 256  # SOFTMAX's fixed output scale
    assert np.abs(y_int8 - y_float).max() <= STEPS * z_int8[1] / 2 + scale
    assert np.abs(y_int8 - y_float).mean() <= scale


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_float_io_quantizes_at_the_edges_of_the_same_int8_model(trained, name, tmp_path):
    x = _digits(name)[0][TRAIN:]
    path = _int8(trained, name, tmp_path, io="float")
    model = load_model(path)
    sg = model.subgraphs[0]
    ops = [op_name(model, op) for op in sg.operators]
    assert ops[0] == "QUANTIZE" and ops[-1] == "DEQUANTIZE" and "QUANTIZE" not in ops[1:-1]
    assert {sg.tensors[t].type for t in [*sg.inputs, *sg.outputs]} == {circle.TensorType.FLOAT32}
    y, scale = _litert(path, x)
    assert scale == 0.0
    np.testing.assert_array_equal(y, _litert(_int8(trained, name, tmp_path), x)[0])


def _quantization(tensor) -> tuple[np.ndarray, np.ndarray]:
    q = tensor.quantization
    return np.asarray(q.scale, np.float64), np.asarray(q.zeroPoint)


def _computing_ops(model) -> list:
    return [op for op in model.subgraphs[0].operators if op_name(model, op) not in SHAPE_OPS]


@pytest.mark.parametrize("name", ["mlp", "cnn", "depthwise"])
def test_scales_agree_with_tensorflows_converter(name, tmp_path):
    """The untrained fixture holds the weights of the Keras model TensorFlow
    converted with the same representative data (scripts/make_int8_reference.py)."""
    frozen = split(FIXTURES / f"{name}.tflite", tmp_path).frozen
    x = _digits(name)[0]
    np.save(tmp_path / "calibration.npy", x[:TF_CALIBRATION])
    ours_path, theirs_path = tmp_path / "ours.tflite", FIXTURES / "int8" / f"{name}_tf.tflite"
    _export(frozen, ours_path, "--int8", "--calibration", tmp_path / "calibration.npy")
    ours, theirs = load_model(ours_path), load_model(theirs_path)
    pairs = list(zip(_computing_ops(ours), _computing_ops(theirs), strict=True))
    assert _op_versions(ours) == \
        [v for v in _op_versions(theirs) if v[0] not in SHAPE_OPS]
    for a, b in pairs:
        ta, tb = (m.subgraphs[0].tensors for m in (ours, theirs))
        if INT8[op_name(ours, a)].channels is not None:  # weights and biases: the same max|w|
            for i, j in zip(a.inputs[1:], b.inputs[1:]):
                np.testing.assert_allclose(_quantization(ta[i])[0], _quantization(tb[j])[0],
                                           rtol=1e-5)
        (sa, za), (sb, zb) = _quantization(ta[a.outputs[0]]), _quantization(tb[b.outputs[0]])
        np.testing.assert_allclose(sa, sb, rtol=1e-3)  # both calibrators take min and max
        assert np.abs(za - zb).max() <= 1
    y_ours, scale = _litert(ours_path, x[TRAIN:])
    y_theirs = _litert(theirs_path, x[TRAIN:])[0]  # batch 1: resized to the samples
    assert np.abs(y_ours - y_theirs).max() <= scale


def _op_versions(model) -> list[tuple[str, int]]:
    return [(op_name(model, op), model.operatorCodes[op.opcodeIndex].version)
            for op in model.subgraphs[0].operators]


def test_the_float_io_edges_are_tensorflows(trained, tmp_path):
    assert _op_versions(load_model(_int8(trained, "mlp", tmp_path, io="float"))) == \
        _op_versions(load_model(FIXTURES / "int8" / "mlp_tf_float_io.tflite"))


def _with_record(frozen, quantization: dict | Quantization, tmp_path):
    """A copy of the split set whose frozen model carries the record `quantization`."""
    model = load_model(frozen)
    if isinstance(quantization, dict):
        quantization = Quantization.from_dict(quantization, frozen)
    set_metadata(model, Quantization.NAME, quantization.to_json())
    copy = tmp_path / "recorded.frozen.circle"
    save_model(model, copy)
    (tmp_path / "recorded.wof").write_bytes(sibling(frozen, ".wof").read_bytes())
    return copy


def test_a_recorded_range_exports_as_calibration_does(trained, tmp_path):
    frozen, calibration = trained("mlp")
    calibrated = tmp_path / "calibrated.tflite"
    _export(frozen, calibrated, "--int8", "--calibration", calibration)
    export(frozen, tmp_path / "float.tflite")  # the float model the ranges are measured on
    exported = load_model(tmp_path / "float.tflite").subgraphs[0].tensors
    ranges = calibrate(load_model(tmp_path / "float.tflite"), [np.load(calibration)])
    index = {t.name: i for i, t in enumerate(load_model(frozen).subgraphs[0].tensors)}
    recorded = _with_record(frozen, record({index[exported[t].name]: r
                                            for t, r in ranges.items()}), tmp_path)
    _export(recorded, tmp_path / "recorded.tflite")  # int8 by default: the model records ranges
    assert (tmp_path / "recorded.tflite").read_bytes() == calibrated.read_bytes()
    _export(recorded, tmp_path / "as_float.tflite", "--float")
    assert (tmp_path / "as_float.tflite").read_bytes() == \
        (tmp_path / "float.tflite").read_bytes()


def test_recorded_scales_are_the_models(trained, tmp_path):
    frozen, _ = trained("mlp")
    g = load_model(frozen).subgraphs[0]
    first = g.operators[0]
    record = {"version": 1, "weights": {str(first.inputs[1]): {"scale": [0.01]}},
              "activations": {str(g.inputs[0]): {"scale": 1 / 255, "zero_point": -128},
                              str(first.outputs[0]): {"scale": 0.05, "zero_point": -100},
                              **{str(t): {"min": 0.0, "max": 8.0}
                                 for op in g.operators[1:] for t in op.outputs}}}
    out = tmp_path / "recorded.tflite"
    _export(_with_record(frozen, record, tmp_path), out)
    model = load_model(out)
    sg = model.subgraphs[0]
    first = sg.operators[0]
    assert _quantization(sg.tensors[first.outputs[0]])[0].tolist() == [np.float32(0.05)]
    assert _quantization(sg.tensors[first.outputs[0]])[1].tolist() == [-100]
    scales = _quantization(sg.tensors[first.inputs[1]])[0]
    assert np.all(scales == np.float32(0.01))  # every channel, from the one recorded scale
    bias_scales = _quantization(sg.tensors[first.inputs[2]])[0]
    np.testing.assert_allclose(bias_scales, np.float32(1 / 255) * 0.01, rtol=1e-6)


def test_a_fixed_scale_that_differs_is_refused(trained, tmp_path):
    frozen, _ = trained("mlp")
    g = load_model(frozen).subgraphs[0]
    ranges = {str(t): {"min": 0.0, "max": 1.0} for op in g.operators for t in op.inputs[:1]}
    record = {"version": 1, "activations": {
        **ranges, str(g.outputs[0]): {"scale": 0.5, "zero_point": 0}}}  # SOFTMAX's: 1/256
    line = _one_error(main, ["export", _with_record(frozen, record, tmp_path), "-o",
                             tmp_path / "x.tflite"])
    assert "TFLite's int8 spec gives them one scale and zero point" in line


@pytest.mark.parametrize("args, message", [
    ([], "give --calibration data"),
    (["--calibration", FIXTURES / "digits_images.npy"], "takes [64]"),
    (["--calibration", FIXTURES / "digits_x.npy", "--weights", "fp16"], "float exports"),
    (["--calibration", FIXTURES / "digits_x.npy"] * 2, "2 --calibration files"),
])
def test_bad_int8_exports_are_one_line(trained, tmp_path, args, message):
    frozen, _ = trained("mlp")
    line = _one_error(main, ["export", frozen, "-o", tmp_path / "x.tflite", "--int8", *args])
    assert message in line


@pytest.mark.parametrize("option", ["--calibration", "--io"])
def test_int8_options_without_int8_are_one_line(trained, tmp_path, option):
    frozen, calibration = trained("mlp")
    value = {"--calibration": calibration, "--io": "float"}[option]
    line = _one_error(main, ["export", frozen, "-o", tmp_path / "x.tflite", option, value])
    assert f"{option} is for an int8 export (--int8)" in line


def test_an_operator_without_an_int8_form_is_named(tmp_path):
    frozen = split(FIXTURES / "recurrent" / "lstm_classifier.tflite", tmp_path).frozen
    np.save(tmp_path / "x.npy", np.zeros((4, 1), np.float32))  # never read: operators first
    line = _one_error(main, ["export", frozen, "-o", tmp_path / "x.tflite", "--int8",
                             "--calibration", tmp_path / "x.npy"])
    assert "(SPLIT) has no int8 form" in line


WEIGHTED = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")


def _record_of(frozen_model, int8_model) -> dict:
    """A microtrain.quantization record holding the scales of `int8_model`, a
    full-integer conversion of the float model split into `frozen_model`
    (their operators in the same order)."""
    fs, qs = frozen_model.subgraphs[0], int8_model.subgraphs[0]

    def params(t):
        q = qs.tensors[t].quantization
        return {"scale": float(q.scale[0]), "zero_point": int(q.zeroPoint[0])}
    pairs = list(zip(_computing_ops(frozen_model), _computing_ops(int8_model), strict=True))
    activations = {str(f): params(q) for f, q in zip(fs.inputs, qs.inputs)}
    activations.update({str(f.outputs[0]): params(q.outputs[0]) for f, q in pairs})
    weights = {str(f.inputs[1]): {"scale": [float(s) for s in qs.tensors[q.inputs[1]]
                                            .quantization.scale]}
               for f, q in pairs if op_name(frozen_model, f) in WEIGHTED}
    return {"version": 1, "activations": activations, "weights": weights}


@pytest.mark.parametrize("name", ["mobilenet_v2", "small_cnn"])
def test_the_scales_of_a_converters_int8_model_give_that_model(name, tmp_path):
    """Recorded with the scales of the corpus's int8 model (TensorFlow's
    conversion of the same Keras model), the float one exports as that model:
    the same int8 weights but for rounding ties, outputs a few steps apart."""
    int8_path = _cache() / "keras" / f"{name}_int8.tflite"
    if not int8_path.is_file():
        pytest.skip(f"{int8_path} is not there (scripts/fetch_real_models.py makes it)")
    frozen = split(_cache() / "keras" / f"{name}.tflite", tmp_path).frozen
    theirs = load_model(int8_path)
    model = load_model(frozen)
    set_metadata(model, Quantization.NAME, json.dumps(_record_of(model, theirs)).encode())
    save_model(model, frozen)
    _export(frozen, tmp_path / "ours.tflite")
    ours = load_model(tmp_path / "ours.tflite")
    for a, b in zip(_computing_ops(ours), _computing_ops(theirs), strict=True):
        if op_name(ours, a) in WEIGHTED:
            wa, wb = (buffer_array(m, m.subgraphs[0].tensors[op.inputs[1]])
                      for m, op in ((ours, a), (theirs, b)))
            assert np.abs(wa.astype(int) - wb).max() <= 1 and np.mean(wa != wb) < 1e-4
    x = np.random.default_rng(0).uniform(0, 255, (16, 32, 32, 3)).astype(np.float32)
    y_ours, scale = _litert(tmp_path / "ours.tflite", x)
    y_theirs = _litert(int8_path, x)[0]
    assert np.abs(y_ours - y_theirs).max() <= 2 * STEPS * scale
    assert np.mean(y_ours == y_theirs) >= 0.9


@pytest.mark.parametrize("name", ["densenet121", "efficientnet_b0", "mobilenet_v3_small",
                                  "resnet50"])
def test_the_corpus_cnns_export_int8_and_run(name, tmp_path):
    """Every operator of the corpus's Keras CNNs (CONCATENATION, PAD, the pools,
    LOGISTIC, HARD_SWISH, MUL of activations, MEAN) gets parameters LiteRT
    accepts; their random weights make their outputs too sensitive to compare."""
    path = _cache() / "keras" / f"{name}.tflite"
    if not path.is_file():
        pytest.skip(f"{path} is not there (scripts/fetch_real_models.py makes it)")
    frozen = split(path, tmp_path).frozen
    x = np.random.default_rng(0).uniform(0, 255, (8, 32, 32, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    _export(frozen, tmp_path / "int8.tflite", "--int8", "--calibration", tmp_path / "x.npy")
    y, scale = _litert(tmp_path / "int8.tflite", x)
    np.testing.assert_allclose(y.sum(1), 1, atol=y.shape[1] * scale)  # SOFTMAX's rows


def _with_fake_quant(frozen, tmp_path, low: float, high: float):
    """A copy of the split set with a FAKE_QUANT [low, high] after the first operator."""
    model = load_model(frozen)
    sg = model.subgraphs[0]
    first = sg.operators[0]
    y = first.outputs[0]
    sg.tensors.append(copy.deepcopy(sg.tensors[y]))
    rounded = len(sg.tensors) - 1
    for op in sg.operators[1:]:
        op.inputs = [rounded if t == y else t for t in op.inputs]
    fake = circle_operator(model, Op(0, "FAKE_QUANT", [y], [rounded], {}))
    set_builtin_options(fake, circle.FakeQuantOptionsT(min=low, max=high, numBits=8))
    sg.operators.insert(1, fake)
    path = tmp_path / "fake.frozen.circle"
    save_model(model, path)
    write_wof(tmp_path / "fake.wof", len(sg.tensors), read_wof(sibling(frozen, ".wof"),
                                                               load_model(frozen)))
    return path


def test_fake_quant_operators_go_and_give_their_range(trained, tmp_path):
    frozen, _ = trained("mlp")
    g = load_model(frozen).subgraphs[0]
    others = {t: (0.0, 8.0) for op in g.operators[1:] for t in op.outputs}
    ranges = {g.inputs[0]: (0.0, 1.0), **others}
    fake = _with_fake_quant(frozen, tmp_path, -1.0, 6.0)
    _export(_with_record(fake, record(ranges), tmp_path), tmp_path / "fake.tflite")
    ranges[g.operators[0].outputs[0]] = (-1.0, 6.0)
    _export(_with_record(frozen, record(ranges), tmp_path), tmp_path / "plain.tflite")
    assert (tmp_path / "fake.tflite").read_bytes() == (tmp_path / "plain.tflite").read_bytes()
