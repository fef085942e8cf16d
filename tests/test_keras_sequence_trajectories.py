"""A Keras 3 LSTM text classifier (batch-1 build, trained here one sample at a time) and a
Keras 3 transformer encoder classifier (dynamic batch) train like Keras 3: per-epoch losses
of `fit(shuffle=False)` recorded by scripts/make_sequence_trajectories.py, within 1e-4 over
5 epochs (Adam with the Embedding frozen; SGD with momentum with it trained, since Keras on
TensorFlow gives Adam a table's gradient as IndexedSlices, see the script), every weight Keras trains trained here (LayerNorm gammas and betas, attention and
LSTM biases, the position table: the constants of ADD/MUL)."""
import json
from pathlib import Path

import numpy as np
import pytest

from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures" / "keras_sequence"
RECORD = json.loads((FIXTURES / "trajectories.json").read_text())
DATA = RECORD["data"]
TABLE = "embedding"  # the Embedding's table is the only constant whose name holds this
# weights Keras trains that the converter leaves as constants of ADD/MUL, by name
PARAMETERS = {"lstm": ["lstm_cell_1/BiasAdd_1/"],
              "transformer": ["position_1/add/", "key_1/Add/", "value_1/Add/", "norm1_1/Reshape",
                              "norm2_1/Reshape", "arith.constant1@op33", "arith.constant1@op67",
                              "ffn_in_1/BiasAdd/"]}  # gamma: one tensor of ones, untied
HYPERPARAMETERS = ("learning_rate", "momentum", "beta_1", "beta_2", "epsilon")


def _trainable(folder: Path, model: str, variant: str) -> str:
    """`all`, or every weight `all` trains but the Embedding's table (Keras: trainable=False)."""
    if variant == "all":
        return "all"
    names = [t["name"] for t in split(FIXTURES / f"{model}.tflite", folder, loss="cce").trainable]
    return ",".join(name for name in names if TABLE not in name)


def _run_id(run) -> str:
    return f"{run['model']}-{run['variant']}"


@pytest.mark.parametrize("run", RECORD["runs"], ids=_run_id)
def test_epoch_losses_match_keras(run, tmp_path):
    trainable = _trainable(tmp_path, run["model"], run["variant"])
    result = split(FIXTURES / f"{run['model']}.tflite", tmp_path, loss=DATA["loss"],
                   trainable=trainable)
    names = [t["name"] for t in result.trainable]
    assert all(any(part in n for n in names) for part in PARAMETERS[run["model"]])
    assert (run["variant"] == "all") == any(TABLE in n for n in names)
    config = run["optimizer_config"]
    trainer = Trainer(result.frozen, batch_size=DATA["batch_size"], optimizer=run["optimizer"],
                      **{k: config[k] for k in HYPERPARAMETERS if k in config})
    x, y = (np.load(FIXTURES / f"{DATA[k]}.npy") for k in ("inputs", "targets"))
    history = trainer.fit([x], [y], epochs=DATA["epochs"], shuffle=False)
    np.testing.assert_allclose([r["loss"] for r in history], run["epoch_loss"], rtol=0, atol=1e-4)
