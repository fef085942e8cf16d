"""circle+ training parameters (schemas/circle_traininfo.fbs): what we write,
onert's low-level session reads back with the same values; what we read is
what we wrote; bad tables are refused in one line."""
import json
import re

import flatbuffers
import numpy as np
import pytest
from click.testing import CliRunner
from onert.native import libnnfw_api_pybind as nnfw

from microtrain.files.artifacts import load_artifacts
from microtrain.commands.cli import main as microtrain_main
from microtrain.files.errors import UserError
from microtrain.files.format import circle_traininfo_generated as ct
from microtrain.files.format.model import (get_metadata, load_model, op_name, save_model,
                                           set_metadata)
from model_patch import FIXTURES
from trainconf.circle_plus import (METADATA, CirclePlus, circle_plus_bytes, read_circle_plus,
                                   set_circle_plus, to_circle_plus)
from trainconf.cli import main as trainconf_main
from trainconf.export import export
from trainconf.split import split

ONERT_OPTIMIZERS = {"sgd": nnfw.optimizer.SGD, "adam": nnfw.optimizer.ADAM}
ONERT_LOSSES = {"cce": nnfw.loss.CATEGORICAL_CROSSENTROPY, "mse": nnfw.loss.MEAN_SQUARED_ERROR}
ONERT_REDUCTIONS = {"mean": nnfw.loss_reduction.SUM_OVER_BATCH_SIZE, "sum": nnfw.loss_reduction.SUM}


def onert_traininfo(path):
    """What onert's training session reads from the model's CIRCLE_TRAINING."""
    return nnfw.experimental.nnfw_session(str(path), "train").train_get_traininfo()


def with_circle_plus(tmp_path, c: CirclePlus):
    model = load_model(FIXTURES / "mlp.tflite")  # FULLY_CONNECTED x2, SOFTMAX
    set_circle_plus(model, c)
    path = tmp_path / "plus.circle"
    save_model(model, path)
    return path


@pytest.mark.parametrize("optimizer,given,loss,reduction,ops,onert_ops", [
    ("adam", {"learning_rate": 0.005}, "cce", "sum", [0, 1, 2], -1),   # -1: all operators
    ("sgd", {}, "mse", "mean", [1, 2], 2),                               # the last two
    ("adam", {"beta_1": 0.8, "epsilon": 1e-5}, "mse", "mean", [], 0),    # none
])
def test_onert_reads_back_what_we_write(optimizer, given, loss, reduction, ops, onert_ops,
                                        tmp_path):
    c = to_circle_plus(optimizer, given, loss, reduction, epochs=7, batch_size=16,
                       trainable_ops=ops)
    path = with_circle_plus(tmp_path, c)
    info = onert_traininfo(path)
    assert info.opt == ONERT_OPTIMIZERS[optimizer]
    assert info.learning_rate == np.float32(c.hyperparameters["learning_rate"])
    assert (info.batch_size, info.loss_info.loss, info.loss_info.reduction_type) == \
        (16, ONERT_LOSSES[loss], ONERT_REDUCTIONS[reduction])
    assert info.num_of_trainable_ops == onert_ops
    back = read_circle_plus(load_model(path), path)
    assert back == c  # values are float32, read back as their shortest decimal
    assert back.hyperparameters["learning_rate"] == given.get("learning_rate", c.hyperparameters["learning_rate"])


def test_adam_arguments_are_written_in_full():
    c = to_circle_plus("adam", {"beta_2": 0.99}, "sparse_cce", "mean", 1, 32, None)
    assert c.hyperparameters == {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.99,
                                 "epsilon": 1e-7}


@pytest.mark.parametrize("args,problem", [
    (("rmsprop", {}, "cce"), "circle+ holds the optimizers sgd and adam, not rmsprop"),
    (("sgd", {"momentum": 0.9}, "cce"), "circle+ cannot hold sgd's momentum"),
    (("adam", {"weight_decay": 0.01}, "cce"), "circle+ cannot hold adam's weight_decay"),
    (("adam", {}, "bce"), "circle+ holds the losses cce, sparse_cce, mse, not bce"),
])
def test_what_circle_plus_cannot_hold_is_refused(args, problem):
    with pytest.raises(UserError, match=re.escape(problem)):
        to_circle_plus(*args, "mean", 1, 32, None)


def test_bad_tables_are_refused(tmp_path):
    model = load_model(FIXTURES / "mlp.tflite")
    assert read_circle_plus(model, "m") is None
    set_metadata(model, METADATA, b"\x08\x00\x00\x00XXXX\x00\x00")
    with pytest.raises(UserError, match="not a circle\\+ ModelTraining table"):
        read_circle_plus(model, "m")
    good = circle_plus_bytes(to_circle_plus("sgd", {}, "cce", "mean", 1, 32, None))
    set_metadata(model, METADATA, good[:12])
    with pytest.raises(UserError, match="truncated or corrupt"):
        read_circle_plus(model, "m")


# -- the life cycle: circle+ in, recorded parameters, microtrain run's defaults, circle+ out ----

def _run_json(*args) -> dict:
    result = CliRunner().invoke(microtrain_main, ["run", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.splitlines()[-1])


DATA = ["--input", FIXTURES / "digits_x.npy", "--target", FIXTURES / "digits_onehot.npy"]
CIRCLE_PLUS_SETUP = to_circle_plus("adam", {"learning_rate": 0.005}, "mse", "sum", epochs=3,
                                   batch_size=16, trainable_ops=[1, 2])


def test_split_takes_its_defaults_from_circle_plus_and_records_them(tmp_path):
    result = split(with_circle_plus(tmp_path, CIRCLE_PLUS_SETUP), tmp_path / "out")
    frozen = load_model(result.frozen)
    assert get_metadata(frozen, METADATA) is None  # absorbed into our record
    art = load_artifacts(result.frozen, with_backprop=False)
    g = art.forward
    last_fc = [op for op in g.ops if op.type == "FULLY_CONNECTED"][-1]
    assert (art.training.loss, art.training.reduction) == ("mse", "sum")
    assert art.training.trainable == last_fc.inputs[1:3]  # operator 1 and its bias
    p = art.training.parameters
    assert (p.optimizer, p.batch_size, p.epochs) == ("adam", 16, 3)
    assert p.hyperparameters == {"learning_rate": 0.005, "beta_1": 0.9, "beta_2": 0.999,
                                 "epsilon": 1e-7}
    report = result.summary()["parameters"]
    assert {k: v["source"] for k, v in report.items()} == {
        "optimizer": METADATA, "learning_rate": METADATA, "beta_1": METADATA,
        "beta_2": METADATA, "epsilon": METADATA, "amsgrad": "default",
        "weight_decay": "default", "batch_size": METADATA, "epochs": METADATA}


def test_split_options_override_circle_plus(tmp_path):
    result = split(with_circle_plus(tmp_path, CIRCLE_PLUS_SETUP), tmp_path / "out",
                   trainable="all", loss="cce", reduction="mean", batch_size=8,
                   optimizer="sgd", momentum=0.5)
    art = load_artifacts(result.frozen, with_backprop=False)
    assert (art.training.loss, art.training.reduction, len(art.training.trainable)) == \
        ("cce", "mean", 4)
    p = art.training.parameters
    # adam's recorded arguments do not carry over to sgd
    assert (p.optimizer, p.hyperparameters, p.batch_size, p.epochs) == \
        ("sgd", {"momentum": 0.5}, 8, 3)
    sources = {k: v["source"] for k, v in result.summary()["parameters"].items()}
    assert sources["learning_rate"] == "default" and sources["momentum"] == "command line"
    assert sources["epochs"] == METADATA and sources["batch_size"] == "command line"


def test_microtrain_run_takes_its_defaults_from_the_frozen_model(tmp_path):
    plus = split(with_circle_plus(tmp_path, CIRCLE_PLUS_SETUP), tmp_path / "plus").frozen
    summary = _run_json(plus, *DATA, "--no-shuffle", "--save", "never")
    params = summary["parameters"]
    assert {k: (v["value"], v["source"]) for k, v in params.items()
            if k in ("optimizer", "learning_rate", "batch_size", "epochs")} == {
        "optimizer": ("adam", "frozen model"), "learning_rate": (0.005, "frozen model"),
        "batch_size": (16, "frozen model"), "epochs": (3, "frozen model")}
    assert params["amsgrad"] == {"value": False, "source": "default"}
    # the same run with everything given, on a model split without circle+
    plain = split(FIXTURES / "mlp.tflite", tmp_path / "plain", trainable="last:1", loss="mse",
                  reduction="sum").frozen
    given = _run_json(plain, *DATA, "--no-shuffle", "--save", "never", "--optimizer", "adam",
                      "--learning-rate", 0.005, "--batch-size", 16, "--epochs", 3)
    assert given["history"] == summary["history"] and len(summary["history"]) == 3
    assert all(v["source"] in ("command line", "default") for v in given["parameters"].values())
    # options override the record
    over = _run_json(plus, *DATA, "--no-shuffle", "--save", "never", "--epochs", 1,
                     "--optimizer", "sgd")
    assert len(over["history"]) == 1
    assert over["parameters"]["learning_rate"] == {"value": 0.01, "source": "default"}
    assert over["parameters"]["batch_size"] == {"value": 16, "source": "frozen model"}


@pytest.mark.parametrize("trainable,onert_ops", [("all", -1), ("last:1", 2)])
def test_export_traininfo_is_read_back_by_onert(trainable, onert_ops, tmp_path):
    frozen = split(FIXTURES / "mlp.tflite", tmp_path, trainable=trainable, reduction="sum",
                   optimizer="sgd", learning_rate=0.05, batch_size=20, epochs=4).frozen
    out = tmp_path / "plus.circle"
    assert export(frozen, out, traininfo=True).traininfo
    info = onert_traininfo(out)
    assert (info.opt, info.learning_rate, info.batch_size) == \
        (nnfw.optimizer.SGD, np.float32(0.05), 20)
    assert (info.loss_info.loss, info.loss_info.reduction_type, info.num_of_trainable_ops) == \
        (nnfw.loss.CATEGORICAL_CROSSENTROPY, nnfw.loss_reduction.SUM, onert_ops)
    back = read_circle_plus(load_model(out), out)
    assert (back.optimizer, back.hyperparameters, back.epochs, back.loss) == \
        ("sgd", {"learning_rate": 0.05}, 4, "cce")
    # and split takes it all back
    again = load_artifacts(split(out, tmp_path / "again").frozen, with_backprop=False)
    first = load_artifacts(frozen, with_backprop=False)
    assert again.training.parameters == first.training.parameters
    assert (again.training.trainable, again.training.reduction) == \
        (first.training.trainable, "sum")


@pytest.mark.parametrize("options,problem", [
    ({"optimizer": "rmsprop"}, "circle+ holds the optimizers sgd and adam, not rmsprop"),
    ({"loss": "bce"}, "circle+ holds the losses cce, sparse_cce, mse, not bce"),
])
def test_export_traininfo_refuses_what_circle_plus_cannot_hold(options, problem, tmp_path):
    frozen = split(FIXTURES / "regression.tflite", tmp_path, **options).frozen
    result = CliRunner().invoke(trainconf_main, ["export", str(frozen), "--traininfo",
                                                 "-o", str(tmp_path / "m.circle")])
    assert result.exit_code == 1 and not (tmp_path / "m.circle").exists()
    assert result.output == f"Error: {frozen}: {problem}\n"


def test_split_refuses_cross_entropy_from_logits(tmp_path):
    c = to_circle_plus("sgd", {}, "cce", "mean", 1, 32, None)
    data = bytearray(circle_plus_bytes(c))
    model = load_model(FIXTURES / "mlp.tflite")
    table = ct.ModelTrainingT.InitFromPackedBuf(data, 0)
    table.lossfnOpt.fromLogits = True
    builder = flatbuffers.Builder(0)
    builder.Finish(table.Pack(builder), file_identifier=b"CTR0")
    set_metadata(model, METADATA, bytes(builder.Output()))
    save_model(model, tmp_path / "logits.circle")
    result = CliRunner().invoke(trainconf_main, ["split", str(tmp_path / "logits.circle")])
    assert result.exit_code == 1 and len(result.output.splitlines()) == 1
    assert "asks for cce from logits" in result.output


def test_inspect_estimates_for_the_recorded_parameters(tmp_path):
    frozen = split(FIXTURES / "mlp.tflite", tmp_path, optimizer="sgd", batch_size=8).frozen
    for args, expected in (([], (8, "sgd")), (["--batch-size", "4", "--optimizer", "adam"],
                                              (4, "adam"))):
        result = CliRunner().invoke(trainconf_main, ["inspect", str(frozen), "--json", *args])
        assert result.exit_code == 0, result.output
        memory = json.loads(result.output)["memory"]
        assert (memory["batch_size"], memory["optimizer"]) == expected


def test_traininfo_of_an_fp16_export_counts_the_dequantize_operators(tmp_path):
    frozen = split(FIXTURES / "mlp.tflite", tmp_path, trainable="last:1").frozen
    export(frozen, tmp_path / "m.circle", weights="fp16", traininfo=True)
    model = load_model(tmp_path / "m.circle")
    ops = [op_name(model, op) for op in model.subgraphs[0].operators]
    assert ops.count("DEQUANTIZE") == 4 and ops[:4] == ["DEQUANTIZE"] * 4  # one per weight
    assert read_circle_plus(model, "m").trainable_ops == [5, 6]  # the last FC and SOFTMAX
