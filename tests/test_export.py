"""`trainconf export`: the trained model, written as .circle and .tflite, gives
`microtrain infer`'s outputs in onert and in LiteRT on every fixture; the batch
is the original's; fp16 weights go through DEQUANTIZE; a round trip through
split trains on; what a .tflite cannot hold is refused in one line."""
import json

import numpy as np
import onert.infer
import pytest
from ai_edge_litert.interpreter import Interpreter
from click.testing import CliRunner

from litert_reference import invoked
from microtrain.files.artifacts import TRAINING_META, load_artifacts, sibling
from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import get_metadata, load_model, save_model
from microtrain.files.format.wof import write_wof
from microtrain.files.graph import BATCH, graph_of
from microtrain.trainer import Trainer
from model_patch import FIXTURES, MODELS
from trainconf.cli import main
from trainconf.export import check_tflite, export
from trainconf.split import split

ROWS = 3  # the batch the exported models run at
TOLERANCE = 1e-5


def _random_data(art, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    g, rng = art.forward, np.random.default_rng(seed)
    x = rng.standard_normal((n,) + g.tensors[g.inputs[0]].shape[1:]).astype(np.float32)
    out = g.tensors[g.outputs[0]].shape[1:]
    if art.training.loss == "cce":
        y = np.eye(out[-1], dtype=np.float32)[rng.integers(0, out[-1], n)]
    else:
        y = rng.uniform(0, 1, (n,) + out).astype(np.float32)
    return x, y


def _train(frozen) -> Trainer:
    """A few Adam steps on random data, weights saved to the .wof."""
    trainer = Trainer(frozen, batch_size=8, optimizer="adam", learning_rate=0.01)
    x, y = _random_data(trainer.art, 16, seed=1)
    trainer.fit([x], [y], epochs=1, shuffle=False)
    trainer.save_weights()
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> (frozen path, a batch of inputs, microtrain's outputs on it)."""
    cache = {}

    def get(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            frozen = split(FIXTURES / f"{name}.tflite", out).frozen
            before = Trainer(frozen, with_backprop=False)
            x = _random_data(before.art, ROWS, seed=2)[0]
            untrained = before.predict([x])[0]
            trainer = _train(frozen)
            expected = Trainer(frozen, with_backprop=False).predict([x])[0]
            assert np.abs(expected - untrained).max() > 1e-4  # the weights did change
            assert np.array_equal(expected, trainer.predict([x])[0])
            cache[name] = frozen, x, expected
        return cache[name]
    return get


def run_litert(path, x: np.ndarray) -> np.ndarray:
    interpreter = invoked(Interpreter(model_path=str(path)), [x])
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def run_onert(path, x: np.ndarray) -> np.ndarray:
    return onert.infer.session(str(path)).infer([x])[0]


@pytest.mark.parametrize("name", MODELS)
def test_export_runs_in_onert_and_litert(name, trained, tmp_path):
    frozen, x, expected = trained(name)
    outputs = {}
    for suffix in (".circle", ".tflite"):
        path = tmp_path / f"{name}{suffix}"
        export(frozen, path)
        data = path.read_bytes()
        assert data[4:8] == {".circle": b"CIR0", ".tflite": b"TFL3"}[suffix]
        outputs[f"onert {suffix}"] = run_onert(path, x)
        if suffix == ".tflite":
            outputs["litert .tflite"] = run_litert(path, x)
    for where, got in outputs.items():
        assert got.shape == expected.shape, where
        assert np.abs(got - expected).max() <= TOLERANCE, where


@pytest.mark.parametrize("name", MODELS)
def test_exported_model_holds_only_what_inference_needs(name, trained, tmp_path):
    frozen, _, _ = trained(name)
    export(frozen, tmp_path / "m.circle")
    model, original = load_model(tmp_path / "m.circle"), load_model(FIXTURES / f"{name}.tflite")
    assert get_metadata(model, TRAINING_META) is None
    assert [m.name for m in model.metadata] == [m.name for m in original.metadata]
    g = graph_of(model)
    used = set(g.inputs) | set(g.outputs) | {t for op in g.ops for t in op.inputs + op.outputs}
    assert used == set(range(len(g.tensors)))  # no tensor left over from the split
    assert not {"SHAPE", "STRIDED_SLICE", "PACK"} & {op.type for op in g.ops}  # folded
    for t in g.inputs + g.outputs:  # the batch stays dynamic, as in the fixtures
        assert g.tensors[t].shape[0] == BATCH and g.tensors[t].dtype == np.float32
    sig, original_sig = model.signatureDefs[0], original.signatureDefs[0]
    assert [(m.name, g.tensors[m.tensorIndex].name) for m in sig.inputs + sig.outputs] == \
        [(m.name, original.subgraphs[0].tensors[m.tensorIndex].name)
         for m in original_sig.inputs + original_sig.outputs]


def test_every_float_constant_is_a_trained_weight(trained):
    """So the fp16 test below can round the reference's weights in the .wof alone."""
    for name in MODELS:
        art = load_artifacts(trained(name)[0], with_backprop=False)
        floats = {t.index for t in art.forward.tensors
                  if t.data is not None and t.dtype == np.float32}
        assert not floats, name


@pytest.mark.parametrize("name", MODELS)
def test_fp16_weights_through_dequantize_in_litert(name, trained, tmp_path):
    frozen, x, _ = trained(name)
    path = tmp_path / "m.tflite"
    export(frozen, path, weights="fp16")
    g = graph_of(load_model(path))
    art = load_artifacts(frozen, with_backprop=False)
    dequantized = [op for op in g.ops if op.type == "DEQUANTIZE"]
    assert len(dequantized) == len(art.weights)
    assert not [t for t in g.tensors if t.data is not None and t.dtype == np.float32]
    rounded = {t: w.astype(np.float16).astype(np.float32) for t, w in art.weights.items()}
    write_wof(tmp_path / "rounded.wof", len(art.forward.tensors), rounded)
    expected = Trainer(frozen, tmp_path / "rounded.wof", with_backprop=False).predict([x])[0]
    assert np.abs(run_litert(path, x) - expected).max() <= TOLERANCE


def test_onert_does_not_run_fp16_dequantize(trained, tmp_path):
    """Documents what --help says: when this fails, onert runs fp16 exports."""
    export(trained("mlp")[0], tmp_path / "m.tflite", weights="fp16")
    with pytest.raises(Exception):
        run_onert(tmp_path / "m.tflite", trained("mlp")[1])


def _fixed_batch_copy(name, tmp_path):
    """The fixture with every dynamic batch written as a fixed 1."""
    model = load_model(FIXTURES / f"{name}.tflite")
    for t in model.subgraphs[0].tensors:
        t.shapeSignature = None
    path = tmp_path / f"{name}_fixed.circle"
    save_model(model, path)
    return path


def test_a_fixed_batch_of_one_is_restored(tmp_path):
    frozen = split(_fixed_batch_copy("cnn", tmp_path), tmp_path).frozen
    _train(frozen)
    path = tmp_path / "fixed.tflite"
    assert export(frozen, path).batch == "1"
    model = load_model(path)
    sg = model.subgraphs[0]
    assert all(t.shapeSignature is None for t in sg.tensors)
    g = graph_of(model)
    (reshape,) = [op for op in g.ops if op.type == "RESHAPE"]
    assert g.tensors[reshape.inputs[1]].data.tolist() == list(g.tensors[reshape.outputs[0]].shape)
    assert g.tensors[reshape.outputs[0]].shape[0] == 1
    x = _random_data(load_artifacts(frozen, with_backprop=False), 1, seed=3)[0]
    expected = Trainer(frozen, with_backprop=False).predict([x])[0]
    for got in (run_litert(path, x), run_onert(path, x)):
        assert np.abs(got - expected).max() <= TOLERANCE


@pytest.mark.parametrize("name,suffix", [("cnn", ".tflite"), ("residual_mlp", ".circle")])
def test_round_trip_split_run_export_split_trains_on(name, suffix, trained, tmp_path):
    frozen, x, expected = trained(name)
    exported = tmp_path / f"{name}_trained{suffix}"
    export(frozen, exported)
    again = split(exported, tmp_path / "again").frozen
    first, second = (load_artifacts(f, with_backprop=False) for f in (frozen, again))
    names = [{a.forward.tensors[t].name: a.weights[t] for t in a.training.trainable}
             for a in (first, second)]
    assert list(names[0]) == list(names[1])
    for name, w in names[0].items():  # the trained weights, bit for bit
        assert np.array_equal(names[1][name], w)
    trainer = Trainer(again, batch_size=8, optimizer="adam", learning_rate=0.01)
    assert np.array_equal(trainer.predict([x])[0], expected)
    data = _random_data(trainer.art, 16, seed=4)
    before = trainer.evaluate([data[0]], [data[1]])["loss"]
    trainer.fit([data[0]], [data[1]], epochs=3, shuffle=False)
    assert trainer.evaluate([data[0]], [data[1]])["loss"] < before


def _with_circle_only_operator(frozen, tmp_path):
    model = load_model(frozen)
    softmax = model.subgraphs[0].operators[-1]
    model.operatorCodes[softmax.opcodeIndex].builtinCode = circle.BuiltinOperator.INSTANCE_NORM
    path = tmp_path / "norm.frozen.circle"
    save_model(model, path)
    return path


def test_tflite_refuses_a_circle_only_operator_in_one_line(trained, tmp_path):
    frozen = _with_circle_only_operator(trained("mlp")[0], tmp_path)
    wof = sibling(trained("mlp")[0], ".wof")
    out = tmp_path / "m.tflite"
    result = CliRunner().invoke(main, ["export", str(frozen), "--wof", str(wof), "-o", str(out)])
    assert result.exit_code == 1 and not out.exists()
    assert result.output == (f"Error: {frozen}: uses the circle-only operator INSTANCE_NORM, "
                             "which a .tflite cannot hold: export to .circle instead\n")
    export(frozen, tmp_path / "m.circle", wof=wof)  # circle holds it
    assert graph_of(load_model(tmp_path / "m.circle")).ops[-1].type == "INSTANCE_NORM"


def test_tflite_refuses_a_circle_only_tensor_type(trained):
    model = load_model(trained("mlp")[0])
    model.subgraphs[0].tensors[0].type = circle.TensorType.UINT4
    with pytest.raises(UserError, match="circle-only type UINT4"):
        check_tflite(model, "m")


def test_cli_json_and_text(trained, tmp_path):
    frozen = trained("mlp")[0]
    result = CliRunner().invoke(main, ["export", str(frozen), "-o", str(tmp_path / "m.tflite"),
                                       "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert (summary["format"], summary["weights"], summary["batch"], summary["trained_tensors"]) \
        == ("tflite", "fp32", "dynamic", 4)
    assert summary["bytes"] == (tmp_path / "m.tflite").stat().st_size
    result = CliRunner().invoke(main, ["export", str(frozen), "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 1
    assert result.output.strip().endswith("the output must end in .circle or .tflite")


def test_tflite_refuses_circle_only_options(trained):
    model = load_model(trained("mlp")[0])
    softmax = model.subgraphs[0].operators[-1]
    softmax.builtinOptionsType = circle.BuiltinOptions.InstanceNormOptions
    softmax.builtinOptions = circle.InstanceNormOptionsT()
    with pytest.raises(UserError, match="circle-only options InstanceNormOptions"):
        check_tflite(model, "m")
