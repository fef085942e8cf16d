"""The batch at split time (trainconf/batch.py): symbolic where the graph allows it,
with several rows a sample where a dense layer runs over a sequence ([B*T, D]); a
batch-1 graph that works across its batch axis keeps it and trains a sample at a
time.  Gradients are checked against PyTorch float64 at batch sizes above 1."""
import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.files.format.model import load_model
from microtrain.files.graph import graph_of, symbolic_batch
from microtrain.trainer import Trainer
from test_split_gradients import RNG, GraphMaker, check_gradients
from torch_reference import reference_gradients
from trainconf.split import split

T, D, U, CLASSES = 5, 4, 6, 3
INT = np.int32


def _dense_over_sequence(m: GraphMaker, x: int, target: int, flat_shape=(-1, D)) -> int:
    """RESHAPE [B, T, D] -> target, FULLY_CONNECTED, RESHAPE back to [B, T, U] (the
    converter's Tensordot), then a mean over time and a softmax head."""
    flat = m.op("RESHAPE", [x, target], flat_shape)
    dense = m.op("FULLY_CONNECTED", [flat, m.weight(U, D), m.weight(U)], (-1, U),
                 fused_activation_function=1)
    seq = m.op("RESHAPE", [dense, m.tensor((3,), [-1, T, U], INT)], (-1, T, U))
    pooled = m.op("MEAN", [seq, m.tensor((1,), [1], INT)], (-1, U))
    logits = m.op("FULLY_CONNECTED", [pooled, m.weight(CLASSES, U), m.weight(CLASSES)],
                  (-1, CLASSES))
    return m.op("SOFTMAX", [logits], (-1, CLASSES), beta=1.0)


def int_op(m: GraphMaker, type_: str, inputs, shape, **options) -> int:
    out = m.op(type_, inputs, shape, **options)
    m.tensors[out].dtype = np.dtype(INT)
    return out


def dynamic_tensordot(m: GraphMaker):
    """A dynamic-batch model whose reshape target is computed: SHAPE -> GATHER ->
    REDUCE_PROD -> PACK, so the file says [-1, -1] for the flattened sequence."""
    x = m.tensor((-1, T, D))
    shape = int_op(m, "SHAPE", [x], (3,))
    rows = int_op(m, "REDUCE_PROD", [int_op(m, "GATHER", [shape, m.tensor((2,), [0, 1], INT)],
                                            (2,), axis=0), m.tensor((1,), [0], INT)], (),
                  keep_dims=False)
    last = int_op(m, "GATHER", [shape, m.tensor((), 2, INT)], (), axis=0)
    target = int_op(m, "PACK", [rows, last], (2,), axis=0, values_count=2)
    return x, _dense_over_sequence(m, x, target, (-1, -1))


def data(n: int):
    return RNG.normal(0, 1, (n, T, D)).astype(np.float32), RNG.integers(0, CLASSES, n)


def test_a_computed_reshape_of_a_dynamic_batch_holds_the_sequence_rows(tmp_path):
    m = GraphMaker()
    x, y = dynamic_tensordot(m)
    path = m.save(tmp_path / "dynamic.circle", [x], [y])
    result = split(path, tmp_path, loss="sparse_cce")
    g = graph_of(load_model(result.frozen))
    assert [op.type for op in g.ops] == ["RESHAPE", "FULLY_CONNECTED", "RESHAPE", "MEAN",
                                         "FULLY_CONNECTED", "SOFTMAX"]
    assert g.tensors[g.ops[0].outputs[0]].shape == (-T, D)  # T rows a sample
    assert g.tensors[g.ops[1].outputs[0]].shape == (-T, U)
    assert list(g.tensors[g.ops[0].inputs[1]].data) == [-1, D]  # what LiteRT reads
    xs, ts = data(7)
    check_gradients(path, tmp_path / "grads", xs, ts, "sparse_cce")


def test_a_batch_1_sequence_reshape_becomes_symbolic(tmp_path):
    m = GraphMaker()
    x = m.tensor((1, T, D))
    static = m.tensor((2,), [T, D], INT)  # the converter's target at batch 1
    y = _dense_over_sequence(m, x, static)
    m.tensors[x].shape = (1, T, D)
    path = m.save(tmp_path / "batch1.circle", [x], [y])
    result = split(path, tmp_path, loss="sparse_cce")
    g = graph_of(load_model(result.frozen))
    assert symbolic_batch(g)
    assert g.tensors[g.ops[0].outputs[0]].shape == (-T, D)
    xs, ts = data(6)
    check_gradients(path, tmp_path / "grads", xs, ts, "sparse_cce")
    trainer = Trainer(result.frozen, batch_size=4, optimizer="adam", learning_rate=0.05)
    history = trainer.fit([xs], [ts], epochs=3, shuffle=False)
    assert history[-1]["loss"] < history[0]["loss"]


def time_major(m: GraphMaker) -> tuple[int, int]:
    """A batch-1 graph that reads its sequence time-major: RESHAPE [1, T, D] ->
    [T, 1, D], then a SLICE of each step on axis 0 (Keras 3's unrolled loops GATHER
    their steps, which trainconf/sequence_reads.py reads batch-major instead)."""
    x = m.tensor((1, T, D))
    seq = m.op("RESHAPE", [x, m.tensor((3,), [T, 1, D], INT)], (T, 1, D))
    w = m.weight(U, D)
    h = None
    for step in range(T):
        at = m.op("SLICE", [seq, m.tensor((3,), [step, 0, 0], INT),
                            m.tensor((3,), [1, 1, D], INT)], (1, 1, D))
        x_t = m.op("RESHAPE", [at, m.tensor((2,), [1, D], INT)], (1, D))
        z = m.op("FULLY_CONNECTED", [x_t, w], (1, U))
        h = z if h is None else m.op("ADD", [h, z], (1, U))
        h = m.op("TANH", [h], (1, U))
    logits = m.op("FULLY_CONNECTED", [h, m.weight(CLASSES, U), m.weight(CLASSES)], (1, CLASSES))
    return x, m.op("SOFTMAX", [logits], (1, CLASSES), beta=1.0)


def test_a_batch_1_graph_across_its_batch_axis_trains_a_sample_at_a_time(tmp_path):
    m = GraphMaker()
    x, y = time_major(m)
    path = m.save(tmp_path / "time_major.circle", [x], [y])
    result = split(path, tmp_path, loss="sparse_cce")
    trainer = Trainer(result.frozen, batch_size=4, optimizer="sgd")
    assert not symbolic_batch(trainer.art.forward)
    xs, ts = data(4)
    loss, grads = trainer.gradients([xs], [ts])
    # the batch's mean loss and gradients are the means over its samples' (torch, float64)
    per_sample = [reference_gradients(trainer.art.forward, trainer.art.weights, [xs[i:i + 1]],
                                      ts[i:i + 1], "sparse_cce", "mean") for i in range(4)]
    assert loss == pytest.approx(np.mean([p[0] for p in per_sample]), rel=1e-5)
    for t, g in grads.items():
        want = np.mean([p[1][t] for p in per_sample], axis=0)
        assert np.linalg.norm(g - want) <= 1e-5 * np.linalg.norm(want)
    history = Trainer(result.frozen, batch_size=4, optimizer="adam", learning_rate=0.05) \
        .fit([xs], [ts], epochs=3, shuffle=False)
    assert history[-1]["loss"] < history[0]["loss"]


def test_a_dynamic_batch_moved_off_the_first_axis_is_refused_in_one_line(tmp_path):
    m = GraphMaker()
    x = m.tensor((-1, T, D))
    moved = m.op("TRANSPOSE", [x, m.tensor((3,), [1, 0, 2], INT)], (T, -1, D))
    path = m.save(tmp_path / "moved.circle", [x], [m.op("TANH", [moved], (T, -1, D))])
    with pytest.raises(UserError, match=r"operator 0 \(TRANSPOSE\) moves the batch axis, which "
                                        "a model with a dynamic batch cannot do here"):
        split(path, tmp_path)


def test_a_sequence_reshape_exports_to_litert_at_batch_1(tmp_path):
    from ai_edge_litert.interpreter import Interpreter
    from trainconf.export import export

    m = GraphMaker()
    x = m.tensor((1, T, D))
    y = _dense_over_sequence(m, x, m.tensor((2,), [T, D], INT))
    path = m.save(tmp_path / "batch1.circle", [x], [y])
    result = split(path, tmp_path, loss="sparse_cce")
    exported = export(result.frozen, output=tmp_path / "out.tflite").path
    xs, _ = data(1)
    interpreter = Interpreter(model_path=str(exported))
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], xs)
    interpreter.invoke()
    got = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    want = Trainer(result.frozen, batch_size=1).predict([xs])[0]
    assert np.abs(got - want).max() < 1e-6
