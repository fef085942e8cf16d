"""A Keras 3 RNN converted at batch 1 reads its sequence time-major ([T, 1, D], a step
a GATHER on axis 0): trainconf/sequence_reads.py reads it batch-major instead, so the
split trains at any batch size.  At batch 4 its outputs equal LiteRT's on each sample,
and its gradients the mean of the samples' own."""
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

from microtrain.files.graph import symbolic_batch
from microtrain.trainer import Trainer
from trainconf.split import split

LOOPS = Path(__file__).parent / "fixtures" / "loops"
RNG = np.random.default_rng(5)


def litert(path: Path, x: np.ndarray) -> np.ndarray:
    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()
    rows = []
    for sample in x:
        interpreter.set_tensor(inp["index"], sample[None])
        interpreter.invoke()
        rows.append(interpreter.get_tensor(out["index"])[0])
    return np.array(rows)


@pytest.mark.parametrize("name", ["lstm", "gru", "bilstm"])
def test_a_batch_1_keras_rnn_trains_batched(name, tmp_path):
    model = LOOPS / f"{name}.tflite"
    result = split(model, tmp_path, loss="mse")
    trainer = Trainer(result.frozen, batch_size=4, optimizer="sgd")
    assert symbolic_batch(trainer.art.forward)
    x = RNG.normal(size=(4, 5, 3)).astype(np.float32)
    want = litert(model, x)
    assert np.abs(trainer.predict([x])[0] - want).max() < 1e-5
    t = RNG.normal(size=want.shape).astype(np.float32)
    _, grads = trainer.gradients([x], [t])
    single = Trainer(result.frozen, batch_size=1, optimizer="sgd")
    per_sample = [single.gradients([x[i:i + 1]], [t[i:i + 1]])[1] for i in range(4)]
    for tensor, g in grads.items():
        mean = np.mean([p[tensor] for p in per_sample], axis=0)
        assert np.abs(g - mean).max() <= 1e-5 * max(np.abs(mean).max(), 1e-6)


def test_a_stacked_rnn_that_stacks_its_steps_time_major_trains_a_sample_at_a_time(tmp_path):
    """The first layer's output sequence is built time-major (a CONCATENATION on axis 0):
    that stays, and the model keeps its batch of 1."""
    result = split(LOOPS / "stacked.tflite", tmp_path, loss="mse")
    assert not symbolic_batch(Trainer(result.frozen, batch_size=4).art.forward)
