"""`trainconf split`: the three files, what the backprop graph holds (and does not),
trainable selection, losses, and errors."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.files.artifacts import load_artifacts
from microtrain.files.format.model import load_model, save_model
from microtrain.files.format.wof import read_wof
from microtrain.files.graph import graph_of
from trainconf.cli import main
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["mlp", "residual_mlp", "cnn", "depthwise", "regression", "regression_small",
          "mlp_784", "mobilenetv2"]


def ops_of(path: Path) -> list[str]:
    return [op.type for op in graph_of(load_model(path)).ops]


@pytest.mark.parametrize("trainable", ["all", "last:1"])
@pytest.mark.parametrize("model", MODELS)
def test_split_every_fixture(model, trainable, tmp_path):
    result = split(FIXTURES / f"{model}.tflite", tmp_path, trainable=trainable)
    art = load_artifacts(result.frozen)
    assert [p.name for p in (result.frozen, result.wof, result.backprop)] == \
        [f"{model}.frozen.circle", f"{model}.wof", f"{model}.backprop.circle"]
    assert result.backprop.read_bytes()[4:8] == b"CIR0"
    frozen, original = load_model(result.frozen), load_model(FIXTURES / f"{model}.tflite")
    assert len(frozen.subgraphs[0].tensors) == len(original.subgraphs[0].tensors)
    for t in art.training.trainable:  # data cut out of the frozen model, kept in the .wof
        assert art.forward.tensors[t].data is None
        assert art.weights[t].shape == tuple(original.subgraphs[0].tensors[t].shape)
    assert set(read_wof(result.wof, frozen)) == set(art.training.trainable)
    outputs = art.backprop.outputs
    assert outputs[0] == art.links.loss and len(outputs) == 1 + len(art.training.trainable)
    if trainable == "last:1":
        assert len(art.training.trainable) == 2  # kernel and bias of the last weighted op


def test_dynamic_batch_flatten_is_folded(tmp_path):
    assert {"SHAPE", "STRIDED_SLICE", "PACK"} <= set(ops_of(FIXTURES / "cnn.tflite"))
    result = split(FIXTURES / "cnn.tflite", tmp_path)
    assert not {"SHAPE", "STRIDED_SLICE", "PACK"} & set(ops_of(result.frozen))
    frozen = graph_of(load_model(result.frozen))
    reshape = next(op for op in frozen.ops if op.type == "RESHAPE")
    assert frozen.tensors[reshape.inputs[1]].data.tolist() == [-1, 32]


def test_only_what_is_needed_is_generated(tmp_path):
    all_ops = ops_of(split(FIXTURES / "cnn.tflite", tmp_path / "all").backprop)
    # no input gradient for the first op: one Conv2DInputGrad (the second conv's), not two
    assert all_ops.count("Conv2DWeightGrad") == 2 and all_ops.count("Conv2DInputGrad") == 1
    last = ops_of(split(FIXTURES / "cnn.tflite", tmp_path / "last", trainable="last:1").backprop)
    # nothing below the lowest trainable weight, no frozen weight's gradient
    assert sorted(last) == sorted(["LogitsLoss", "FullyConnectedWeightGrad", "BiasGrad"])


def test_branches_are_summed(tmp_path):
    result = split(FIXTURES / "residual_mlp.tflite", tmp_path)
    g = graph_of(load_model(result.backprop))
    sums = [op for op in g.ops if op.type == "ADD_N"]
    assert len(sums) == 1 and len(sums[0].inputs) == 2  # the first dense feeds two ops
    assert g.tensors[sums[0].outputs[0]].name.startswith("accum/")


def test_softmax_with_cross_entropy_uses_the_stable_logits_loss(tmp_path):
    ops = ops_of(split(FIXTURES / "mlp.tflite", tmp_path / "cce").backprop)
    assert "LogitsLoss" in ops and "SoftmaxGrad" not in ops and "Loss" not in ops
    ops = ops_of(split(FIXTURES / "mlp.tflite", tmp_path / "mse", loss="mse").backprop)
    assert "Loss" in ops and "SoftmaxGrad" in ops


@pytest.mark.parametrize("model,expected", [("mlp", "cce"), ("regression", "mse")])
def test_default_loss_and_its_record_in_the_frozen_model(model, expected, tmp_path):
    result = split(FIXTURES / f"{model}.tflite", tmp_path)
    assert result.loss == expected
    assert load_artifacts(result.frozen, with_backprop=False).training.loss == expected


def test_trainable_by_name_and_freeze_bias(tmp_path):
    g = graph_of(load_model(FIXTURES / "mlp.tflite"))
    fc = [op for op in g.ops if op.type == "FULLY_CONNECTED"]
    kernel = g.tensors[fc[0].inputs[1]].name
    result = split(FIXTURES / "mlp.tflite", tmp_path, trainable=kernel)
    assert [t["name"] for t in result.trainable] == [kernel]
    result = split(FIXTURES / "mlp.tflite", tmp_path, trainable="all", freeze_bias=True)
    assert len(result.trainable) == 2 and "BiasGrad" not in ops_of(result.backprop)


def test_cli_json_summary_and_text(tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["split", str(FIXTURES / "cnn.tflite"), "-o", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    assert summary["trainable_parameters"] == 994 and summary["loss"] == "cce"
    assert {k: v["bytes"] for k, v in summary["files"].items()} == \
        {k: (tmp_path / f"cnn.{s}").stat().st_size
         for k, s in (("frozen", "frozen.circle"), ("wof", "wof"), ("backprop", "backprop.circle"))}
    text = runner.invoke(main, ["split", str(FIXTURES / "cnn.tflite"), "-o", str(tmp_path)])
    assert "994 parameters" in text.stdout and "backprop graph" in text.stdout


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainconf.cli", *map(str, args)],
                          capture_output=True, text=True)


def test_unsupported_operator_on_the_gradient_path(tmp_path):
    model = load_model(FIXTURES / "regression.tflite")
    from microtrain.files.format.model import add_operator_code
    tanh = next(op for op in model.subgraphs[0].operators
                if model.operatorCodes[op.opcodeIndex].builtinCode == 28)  # TANH
    # ADD_N (of one input here) runs forward (backprop graphs use it) but has no gradient rule
    tanh.opcodeIndex = add_operator_code(model, "ADD_N")
    save_model(model, tmp_path / "add_n.circle")
    result = _run("split", tmp_path / "add_n.circle", "-o", tmp_path / "out")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert line.startswith("Error: ") and "(ADD_N)" in line and "operator 1" in line
    assert "supported: " in line and "FULLY_CONNECTED" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("args,expected", [
    (["--trainable", "last:9"], "N must be between 1 and 2"),
    (["--trainable", "nope"], "no weighted op or weight named 'nope'"),
    (["--loss", "hinge"], "Invalid value for '--loss'"),
])
def test_bad_options(args, expected, tmp_path):
    result = _run("split", FIXTURES / "mlp.tflite", "-o", tmp_path, *args)
    assert result.returncode != 0 and expected in result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())


def test_split_artifacts_train_at_any_batch_size(tmp_path):
    from microtrain.trainer import Trainer
    result = split(FIXTURES / "cnn.tflite", tmp_path)
    x, y = np.load(FIXTURES / "digits_images.npy")[:40], np.load(FIXTURES / "digits_onehot.npy")[:40]
    for batch in (1, 7, 40):
        assert Trainer(result.frozen, batch_size=batch).fit([x], [y], epochs=1)[0]["loss"] > 0
