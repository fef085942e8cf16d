"""microtrain trains every fixture like Keras 3: per-epoch losses of `fit(shuffle=False)`
recorded by scripts/make_fixtures.py, within 1e-4 over 5 epochs."""
import json
from pathlib import Path

import numpy as np
import pytest

from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
RECORD = json.loads((FIXTURES / "keras_trajectories.json").read_text())
DATA = RECORD["data"]


@pytest.fixture(scope="module")
def split_models(tmp_path_factory):
    out = tmp_path_factory.mktemp("split")
    made = {}

    def get(model: str, loss: str) -> Path:
        if (model, loss) not in made:
            folder = out / f"{model}-{loss}"
            folder.mkdir()
            made[model, loss] = split(FIXTURES / f"{model}.tflite", folder, loss=loss).frozen
        return made[model, loss]
    return get


def _data(run):
    n = DATA["n_train"]
    x = np.load(FIXTURES / f"{DATA['inputs'][run['model']]}.npy")[:n]
    y = np.load(FIXTURES / f"{DATA['targets'][run['loss']]}.npy")[:n]
    return x, y


def _hyperparameters(run) -> dict:
    config = run["optimizer_config"]
    keep = ("learning_rate", "momentum", "beta_1", "beta_2", "epsilon", "rho", "weight_decay")
    return {k: config[k] for k in keep if config.get(k) is not None and k in config}


@pytest.mark.parametrize("run", RECORD["runs"],
                         ids=[f"{r['model']}-{r['loss']}-{r['optimizer']}" for r in RECORD["runs"]])
def test_epoch_losses_match_keras(run, split_models):
    frozen = split_models(run["model"], run["loss"])
    trainer = Trainer(frozen, batch_size=DATA["batch_size"], optimizer=run["optimizer"],
                      **_hyperparameters(run))
    x, y = _data(run)
    history = trainer.fit([x], [y], epochs=DATA["epochs"], shuffle=False)
    losses = [r["loss"] for r in history]
    np.testing.assert_allclose(losses, run["epoch_loss"], rtol=0, atol=1e-4)
