"""Full-integer int8 models run by `microtrain infer` as they are: their outputs equal
those of LiteRT's reference kernels (OpResolverType.BUILTIN_REF) to the bit, on the
fixture and, when TRAINCONF_REAL_MODELS names the real-model cache, on every
full-integer model in it (scripts/fetch_real_models.py: Keras applications, text,
audio and transformer models); each of those also splits and trains an epoch.  What
microtrain cannot run as quantized is refused in one line naming it."""
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.commands.cli import main as microtrain
from microtrain.files.format.model import load_model, model_to_bytes
from microtrain.files.graph import Graph, Op, Tensor, graph_of
from microtrain.files.quantization import Quantization, dequantize, quantize
from microtrain.trainer import Trainer
from litert_reference import interpreter_outputs, invoked
from tflite_op import interpreter, tflite_run
from token_inputs import sample_inputs as token_inputs
from trainconf.cli import main as trainconf
from trainconf.inspect import describe
from trainconf.writer import graph_to_model

FIXTURES = Path(__file__).parent / "fixtures" / "quantized"
CACHE = os.environ.get("TRAINCONF_REAL_MODELS")
# full-integer models from public architectures (scripts/fetch_real_models.py): the small
# ones kept in tests/fixtures/int8_corpus, all of them in the cache
KEPT = sorted((FIXTURES.parent / "int8_corpus").glob("*.tflite"))
CORPUS = KEPT + sorted(
    p for p in Path(CACHE).glob("*/*_int8.tflite") if "dynamic" not in p.name
    and p.stem not in {k.stem for k in KEPT}) if CACHE else KEPT
# what microtrain refuses to run as it is, in one line naming it; `trainconf split` still
# trains both (it lowers the LSTM and folds the shape chains of a dynamic batch)
REFUSED = {
    "lstm_b1_int8": "operator 1 (UNIDIRECTIONAL_SEQUENCE_LSTM) computes on int16 activations",
    "transformer_int8": "has shape [-1, -1]: only the first dimension may be -1",
}
MODELS = [FIXTURES / "full_int8.tflite", FIXTURES / "ops_int8.tflite"] + [
    p for p in CORPUS if p.stem not in REFUSED]
SAMPLES = 8


def sample_inputs(path: Path, n: int) -> list[np.ndarray]:
    """n samples of each input: for a quantized one, quantized with its scale and zero
    point (as a model's QUANTIZE would) from real values over its range, crops of the
    cache's photographs for an image of 3 channels, else uniformly random values; ids
    within their embedding's rows for token ids (tests/token_inputs.py); for a float
    input (the model quantizes it), uniformly random values in [0, 1), as the fixtures
    were calibrated."""
    g = graph_of(load_model(path))
    others = token_inputs(path, n, np.random.default_rng(0))
    return [quantized_sample(g.tensors[i], n) if g.tensors[i].quantization else x
            for i, x in zip(g.inputs, others)]


def quantized_sample(t, n: int) -> np.ndarray:
    q = t.quantization
    lo = float(q.scale[0]) * (-128 - int(q.zero_point[0]))
    hi = float(q.scale[0]) * (127 - int(q.zero_point[0]))
    if CACHE and t.shape[-1] == 3:
        unit = fetch_script().photograph_crops(Path(CACHE) / "images", *t.shape[1:3],
                                               per_photograph=-(-n // 4))[:n]
    else:
        unit = np.random.default_rng(0).uniform(size=(n, *t.shape[1:]))
    return quantize((lo + unit * (hi - lo)).astype(np.float32), q)


def fetch_script():
    spec = importlib.util.spec_from_file_location(
        "fetch", Path(__file__).parents[1] / "scripts" / "fetch_real_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def litert(path: Path, xs: list[np.ndarray], reference: bool = True, keep: bool = False):
    """LiteRT's interpreter after running the inputs xs (`keep`: with every tensor kept)."""
    return invoked(interpreter(path, reference, experimental_preserve_all_tensors=keep), xs)


def output(run) -> np.ndarray:
    return run.get_tensor(run.get_output_details()[0]["index"])


def litert_output(path: Path, xs: list[np.ndarray], reference: bool = True) -> np.ndarray:
    """LiteRT's first output on the samples xs, as many at once as the model takes."""
    batch = batch_of(path, len(xs[0]))
    return np.concatenate([output(litert(path, [x[i:i + batch] for x in xs], reference))
                           for i in range(0, len(xs[0]), batch)])


def batch_of(path: Path, samples: int = SAMPLES) -> int:
    """The samples a run takes at once: all (a dynamic batch) or the model's fixed batch."""
    g = graph_of(load_model(path))
    fixed = g.tensors[g.inputs[0]].shape[0]
    return samples if fixed < 0 else fixed


def infer(model: Path, xs, tmp_path: Path):
    xs = xs if isinstance(xs, list) else [xs]
    args = []
    for k, x in enumerate(xs):
        np.save(tmp_path / f"x{k}.npy", x)
        args += ["--input", str(tmp_path / f"x{k}.npy")]
    result = CliRunner().invoke(microtrain, ["infer", str(model), *args, "-o",
                                             str(tmp_path / "y.npy")])
    return result, tmp_path / "y.npy"


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_infer_equals_litert_reference_kernels(model, tmp_path):
    xs = sample_inputs(model, SAMPLES)
    result, out = infer(model, xs, tmp_path)
    assert result.exit_code == 0, result.output
    got, want = np.load(out), litert_output(model, xs)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_inspect_gives_the_scales_of_quantized_inputs_and_outputs():
    """As LiteRT reads them."""
    sg = describe(load_model(FIXTURES / "full_int8.tflite"))["subgraphs"][0]
    run = interpreter(FIXTURES / "full_int8.tflite")
    for io, d in zip(sg["inputs"] + sg["outputs"],
                     run.get_input_details() + run.get_output_details()):
        q = d["quantization_parameters"]
        assert io["quantization"] == {"scale": q["scales"].tolist(),
                                      "zero_point": q["zero_points"].tolist()}


def test_float_data_for_an_int8_input_is_quantized_as_the_model_would(tmp_path):
    """Real values given for an int8 input: quantized with its scale and zero point as
    TFLite's QUANTIZE (the input of LiteRT's run below is quantized by LiteRT itself)."""
    model = FIXTURES / "full_int8.tflite"
    x = np.random.default_rng(1).uniform(size=(SAMPLES, 8, 8, 1)).astype(np.float32)
    x[0, 0, 0, 0] = 0.5 * 0.003913988824933767  # half a step: rounds away from zero
    result, out = infer(model, x, tmp_path)
    assert result.exit_code == 0, result.output
    g = graph_of(load_model(model))
    (quantized,) = tflite_run("QUANTIZE", [x], [x.shape], out_dtypes=[np.int8],
                              quantization=[None, g.tensors[g.inputs[0]].quantization],
                              reference=True)
    np.testing.assert_array_equal(np.load(out), output(litert(model, [quantized])))


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.stem)
def test_every_activation_equals_litert_reference_kernels(model):
    """Each operator's output, not only the model's (a saturated softmax hides much)."""
    batch = batch_of(model)
    xs = [x[:batch] for x in sample_inputs(model, SAMPLES)]
    trainer = Trainer(model, with_backprop=False, plain=True, batch_size=batch)
    trainer.predict(xs)
    run = litert(model, xs, keep=True)
    computed = [t for op in trainer.art.forward.ops for t in op.outputs]
    # int8 tensors of at most two values (random weights: BERT's uniform attention, MobileNetV3's
    # head), to tell a run that compared something
    degenerate = []
    for t in computed:
        want = run.get_tensor(t)
        if want.dtype == np.int8 and len(np.unique(want)) <= 2:
            degenerate.append(t)
        np.testing.assert_array_equal(trainer.memory.forward[t].reshape(want.shape), want,
                                      err_msg=f"tensor {t} '{trainer.art.forward.tensors[t].name}'")
    assert len(degenerate) < len(computed) // 3, f"degenerate tensors {degenerate}"


@pytest.mark.parametrize("model", [p for p in CORPUS if p.stem in REFUSED], ids=lambda p: p.stem)
def test_what_the_corpus_cannot_run_as_it_is_is_refused_in_one_line(model, tmp_path):
    result, _ = infer(model, sample_inputs(model, batch_of(model)), tmp_path)
    lines = result.output.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and REFUSED[model.stem] in lines[0], lines


@pytest.mark.parametrize("model", CORPUS, ids=lambda p: p.stem)
def test_corpus_model_splits_and_trains_an_epoch(model, tmp_path):
    """`trainconf split` then `microtrain run` of one epoch, every weight trained, on the
    samples above as real values (a split int8 model takes the data before quantization)
    with random one-hot targets: no traceback, a finite loss."""
    split = CliRunner().invoke(trainconf, ["split", str(model), "-o", str(tmp_path)])
    assert split.exit_code == 0, split.output
    g = graph_of(load_model(model))
    args = []
    for k, (i, x) in enumerate(zip(g.inputs, sample_inputs(model, SAMPLES))):
        q = g.tensors[i].quantization
        np.save(tmp_path / f"x{k}.npy", dequantize(x, q) if q else x)
        args += ["--input", str(tmp_path / f"x{k}.npy")]
    for k, o in enumerate(g.outputs):
        shape = g.tensors[o].shape
        labels = np.random.default_rng(k).integers(0, shape[-1], (SAMPLES, *shape[1:-1]))
        np.save(tmp_path / f"t{k}.npy", np.eye(shape[-1], dtype=np.float32)[labels])
        args += ["--target", str(tmp_path / f"t{k}.npy")]
    run = CliRunner().invoke(microtrain, [
        "run", str(tmp_path / f"{model.stem}.frozen.circle"), *args, "--epochs", "1",
        "--batch-size", str(min(batch_of(model), 4)), "--json"])
    assert run.exit_code == 0, run.output
    losses = [r["loss"] for r in map(json.loads, run.output.splitlines()) if "epoch" in r]
    assert losses and np.isfinite(losses).all(), run.output


def one_op_model(path: Path, op_type: str, dtype, scale=0.05, **options) -> Path:
    """A model of one quantized operator on [-1, 4] tensors of `dtype`."""
    q = Quantization(scale)
    g = Graph([Tensor(0, "x", (-1, 4), np.dtype(dtype), None, q),
               Tensor(1, "y", (-1, 4), np.dtype(dtype), None, q)],
              [Op(0, op_type, [0], [1], options)], [0], [1])
    path.write_bytes(model_to_bytes(graph_to_model(g, "one op", {}), b"TFL3"))
    return path


@pytest.mark.parametrize("make,problem", [
    (lambda p: one_op_model(p, "LOG", np.int8),
     "operator 0 (LOG) on int8 activations has no integer kernel in microtrain"),
    (lambda p: one_op_model(p, "RESHAPE", np.int16),
     "operator 0 (RESHAPE) computes on int16 activations (tensor 0 'x')"),
    (lambda p: one_op_model(p, "RESHAPE", np.int8, scale=0.0),
     "operator 0 (RESHAPE) reads tensor 0 'x' of scales [0.0] and zero points [0]: scales must "
     "be positive and finite"),
    (lambda p: FIXTURES / "dynamic_int8.tflite",
     "reads the quantized constant"),
    (lambda p: FIXTURES.parent / "real" / "face_detection_short_range.tflite",
     "operator 0 (DEQUANTIZE) is not supported by microtrain; `trainconf split` makes its "
     "constant plain float32"),
])
def test_what_cannot_run_is_refused_in_one_line(make, problem, tmp_path):
    model = make(tmp_path / "model.tflite")
    g = graph_of(load_model(model))
    x = np.zeros((2, *g.tensors[g.inputs[0]].shape[1:]), g.tensors[g.inputs[0]].dtype)
    result, _ = infer(model, x, tmp_path)
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and problem in lines[0], lines


@pytest.mark.parametrize("name", ["cnn", "mobilenetv2", "residual_mlp"])
def test_a_float_model_runs_as_it_is_too(name, tmp_path):
    """`infer` on a float model no split wrote (its converter's run-time shape chains
    included) gives LiteRT's outputs."""
    model = FIXTURES.parent / f"{name}.tflite"
    g = graph_of(load_model(model))
    x = np.random.default_rng(2).uniform(size=(3, *g.tensors[g.inputs[0]].shape[1:]))
    result, out = infer(model, x.astype(np.float32), tmp_path)
    assert result.exit_code == 0, result.output
    (want,) = interpreter_outputs(model, [x.astype(np.float32)])
    np.testing.assert_allclose(np.load(out), want, rtol=1e-5, atol=1e-6)
