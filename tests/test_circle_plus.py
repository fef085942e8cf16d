"""circle+ training parameters (schemas/circle_traininfo.fbs): what we write,
onert's low-level session reads back with the same values; what we read is
what we wrote; bad tables are refused in one line."""
import re

import numpy as np
import pytest
from onert.native import libnnfw_api_pybind as nnfw

from microtrain.errors import UserError
from microtrain.format.model import load_model, save_model, set_metadata
from model_patch import FIXTURES
from trainconf.circle_plus import (METADATA, CirclePlus, circle_plus_bytes, read_circle_plus,
                                   set_circle_plus, to_circle_plus)

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
    (("adam", {}, "bce"), "circle+ holds the losses sparse_cce, cce, mse, not bce"),
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
