"""An embedding table trains as Keras 3 trains it with a dense gradient (every row
gets Adam's, momentum's or RMSprop's step, untouched rows with a zero gradient):
epoch losses and the final table, recorded by scripts/make_embedding_fixtures.py.
Keras's own fit() equals that for momentum; for Adam and RMSprop its second
moment sums the squares of a repeated id's occurrences (TensorFlow's
IndexedSlices), which the recorded fit runs show apart."""
import json
from pathlib import Path

import numpy as np
import pytest

from microtrain.trainer import Trainer
from test_split_gradients import GraphMaker
from trainconf.split import split

RECORD = json.loads((Path(__file__).parent / "fixtures" / "keras_embedding.json").read_text())


def keras_classifier(tmp_path) -> Path:
    """Embedding -> GlobalAveragePooling1D -> Dense softmax, with Keras's initial weights."""
    table, kernel, bias = (np.array(w, np.float32) for w in RECORD["weights"])
    m = GraphMaker()
    steps = len(RECORD["ids"][0])
    x = m.tensor((-1, steps), dtype=np.int32)
    e = m.op("GATHER", [m.tensor(table.shape, table), x], (-1, steps, table.shape[1]), axis=0)
    pooled = m.op("MEAN", [e, m.tensor((1,), [1], np.int32)], (-1, table.shape[1]))
    logits = m.op("FULLY_CONNECTED", [pooled, m.tensor(kernel.T.shape, kernel.T),
                                      m.tensor(bias.shape, bias)], (-1, len(bias)))
    out = m.op("SOFTMAX", [logits], (-1, len(bias)), beta=1.0)
    return split(m.save(tmp_path / "keras_embedding.circle", [x], [out]), tmp_path,
                 loss="cce").frozen


def _runs(mode):
    return [r for r in RECORD["runs"] if r["mode"] == mode]


def _trained(run, tmp_path):
    trainer = Trainer(keras_classifier(tmp_path), batch_size=RECORD["batch_size"],
                      optimizer=run["optimizer"], **run["hyperparameters"])
    ids, targets = np.array(RECORD["ids"], np.int32), np.array(RECORD["targets"], np.float32)
    history = trainer.fit([ids], [targets], epochs=RECORD["epochs"], shuffle=False)
    return [r["loss"] for r in history], trainer.weights()[trainer.art.training.trainable[0]]


@pytest.mark.parametrize("run", _runs("dense"), ids=[r["optimizer"] for r in _runs("dense")])
def test_table_follows_keras_with_a_dense_gradient(run, tmp_path):
    losses, table = _trained(run, tmp_path)
    np.testing.assert_allclose(losses, run["epoch_loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(table, run["table"], rtol=0, atol=1e-5)
    # the ids of the first batch alone: their rows kept moving after it, as in Keras
    assert not np.allclose(run["table"][-4:], np.array(RECORD["weights"][0])[-4:], atol=1e-3)


def test_keras_fit_differs_only_where_it_squares_occurrences():
    fit = {r["optimizer"]: r["epoch_loss"] for r in _runs("fit")}
    dense = {r["optimizer"]: r["epoch_loss"] for r in _runs("dense")}
    np.testing.assert_allclose(fit["momentum"], dense["momentum"], rtol=0, atol=1e-6)
    for name in ("adam", "rmsprop"):
        assert np.abs(np.subtract(fit[name], dense[name])).max() > 1e-3
