"""An unrolled Keras 3 RNN projects its whole sequence in one FULLY_CONNECTED
(trainconf/hoist.py), which adds the cell's bias too, instead of one per step: its
outputs still equal LiteRT's, and its gradients those of the per-step graph."""
from pathlib import Path

import numpy as np
import pytest

import trainconf.split
from microtrain.trainer import Trainer
from trainconf.split import split

from test_sequence_reads import litert

LOOPS = Path(__file__).parent / "fixtures" / "loops"
RNG = np.random.default_rng(7)


def _gradients(frozen: Path, x, t) -> dict:
    return Trainer(frozen, batch_size=len(x), optimizer="sgd").gradients([x], [t])[1]


# (fixture, projections, whether its cell adds a bias: the gru fixture's has none)
@pytest.mark.parametrize("name, projections, bias", [("lstm", 1, True), ("gru", 1, False),
                                                     ("bilstm", 2, True)])
def test_the_steps_input_projections_are_one_product(name, projections, bias, tmp_path,
                                                     monkeypatch):
    model = LOOPS / f"{name}.tflite"
    hoisted = Trainer(split(model, tmp_path / "hoisted", loss="mse").frozen, batch_size=4)
    g = hoisted.art.forward
    assert not [op for op in g.ops if op.type == "GATHER"]
    whole = [op for op in g.ops if op.type == "FULLY_CONNECTED"
             and len(g.tensors[op.inputs[0]].shape) == 3]
    assert len(whole) == projections
    assert [op.inputs[2] >= 0 for op in whole] == [bias] * projections  # the cell's bias
    x = RNG.normal(size=(4, 5, 3)).astype(np.float32)
    want = litert(model, x)
    assert np.abs(hoisted.predict([x])[0] - want).max() < 1e-5

    monkeypatch.setattr(trainconf.split, "hoist_input_projections", lambda model: 0)
    per_step = split(model, tmp_path / "per_step", loss="mse").frozen
    assert [op for op in Trainer(per_step).art.forward.ops if op.type == "GATHER"]
    t = RNG.normal(size=want.shape).astype(np.float32)
    grads, reference = _gradients(hoisted.art.frozen_path, x, t), _gradients(per_step, x, t)
    assert grads.keys() == reference.keys()
    for tensor, g in grads.items():
        assert np.abs(g - reference[tensor]).max() <= 1e-5 * max(np.abs(reference[tensor]).max(), 1e-6)


def test_a_weight_read_by_every_step_is_copied_transposed_and_follows_updates(tmp_path,
                                                                              monkeypatch):
    """The recurrent kernel, read by each step's FULLY_CONNECTED, is read through a
    transposed copy (microtrain/step/executor.py): training with it follows training
    without it, so the copy is refreshed after every update."""
    import microtrain.step.executor
    frozen = split(LOOPS / "lstm.tflite", tmp_path, loss="mse").frozen
    x = RNG.normal(size=(8, 5, 3)).astype(np.float32)
    t = RNG.normal(size=(8, 3)).astype(np.float32)

    def fit() -> list[float]:
        trainer = Trainer(frozen, batch_size=4, optimizer="adam", learning_rate=0.05)
        return [r["loss"] for r in trainer.fit([x], [t], epochs=4, shuffle=False)]

    trainer = Trainer(frozen, batch_size=4)
    trainer.predict([x])
    assert any(s.func is np.copyto for s in trainer.plan(4).forward[:1])
    copied = fit()
    monkeypatch.setattr(microtrain.step.executor, "_transposed_weights",
                        lambda g, arrays: (arrays, []))
    plain = fit()
    assert copied[-1] < 0.95 * copied[0]  # the weights moved (a stale copy drifts by ~1e-2)
    np.testing.assert_allclose(copied, plain, rtol=1e-6)
