"""Sequence models (issue 18) exported after training: the unrolled .tflite and .circle give
`microtrain infer`'s outputs in LiteRT and onert, for the committed fixtures and (when the
cache is there) the whole sequence corpus; the operators written for onert keep the
original's meaning (Keras's wrap of negative ids, a broadcast whose shape holds the batch)."""
import numpy as np
import onert.infer
import pytest
from ai_edge_litert.interpreter import Interpreter

from microtrain.files.format.model import load_model, model_to_bytes
from microtrain.files.graph import BATCH, Graph, Op, Tensor, graph_of
from litert_reference import invoked
from microtrain.trainer import Trainer
from test_real_models import CACHED, FIXTURE_PARAMS
from token_inputs import one_hot_targets, sample_inputs
from trainconf.export import export
from trainconf.importer import import_tflite
from trainconf.portable import make_portable
from trainconf.split import split
from trainconf.writer import graph_to_model

ROWS = 3
TOLERANCE = 1e-5


def run_litert(path, xs: list) -> np.ndarray:
    interpreter = invoked(Interpreter(model_path=str(path)), xs)
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def run_onert(path, xs: list) -> np.ndarray:
    return onert.infer.session(str(path)).infer(xs)[0]


RUNTIMES = {".tflite": {"litert": run_litert, "onert": run_onert}, ".circle": {"onert": run_onert}}


def run(runtime, path, xs: list, dynamic: bool) -> np.ndarray:
    """The model's outputs on the batch xs; a batch-1 model runs a sample at a time."""
    if dynamic:
        return runtime(path, xs)
    return np.concatenate([runtime(path, [x[i:i + 1] for x in xs]) for i in range(len(xs[0]))])


def trained_export(tflite, tmp_path):
    """(exported paths by suffix, inputs, microtrain's outputs, dynamic batch) of the model
    split with --trainable all and trained a few Adam steps."""
    circle = tmp_path / f"{tflite.stem}.circle"
    import_tflite(tflite, circle)
    frozen = split(circle, tmp_path, trainable="all").frozen
    rng = np.random.default_rng(0)
    xs, ts = sample_inputs(tflite, ROWS, rng), one_hot_targets(tflite, ROWS, rng)
    untrained = Trainer(frozen, with_backprop=False).predict(xs)[0]
    trainer = Trainer(frozen, batch_size=ROWS, optimizer="adam", learning_rate=0.01)
    trainer.fit(xs, ts, epochs=2, shuffle=False)
    trainer.save_weights()
    expected = Trainer(frozen, with_backprop=False).predict(xs)[0]
    assert np.abs(expected - untrained).max() > 1e-6  # the export carries trained weights
    paths = {suffix: tmp_path / f"exported{suffix}" for suffix in RUNTIMES}
    for path in paths.values():
        export(frozen, path)
    dynamic = graph_of(load_model(paths[".tflite"])).tensors[0].shape[0] == BATCH
    return paths, xs, expected, dynamic


def check_runs_everywhere(tflite, tmp_path):
    paths, xs, expected, dynamic = trained_export(tflite, tmp_path)
    for suffix, runtimes in RUNTIMES.items():
        for name, runtime in runtimes.items():
            got = run(runtime, paths[suffix], xs, dynamic)
            assert got.shape == expected.shape, (suffix, name)
            assert np.abs(got - expected).max() <= TOLERANCE, (suffix, name)


@pytest.mark.parametrize("tflite", FIXTURE_PARAMS)
def test_fixture_export_runs_in_litert_and_onert(tflite, tmp_path):
    check_runs_everywhere(tflite, tmp_path)


@pytest.mark.parametrize("tflite", CACHED)
def test_corpus_export_runs_in_litert_and_onert(tflite, tmp_path):
    if not tflite.is_file():
        pytest.skip(f"{tflite} is not there (scripts/fetch_real_models.py makes it)")
    check_runs_everywhere(tflite, tmp_path)


@pytest.mark.parametrize("tflite", FIXTURE_PARAMS)
def test_onert_gets_only_what_it_runs(tflite, tmp_path):
    """No EMBEDDING_LOOKUP, no SELECT on integers, no FULLY_CONNECTED keeping rank > 2 dims."""
    paths = trained_export(tflite, tmp_path)[0]
    g = graph_of(load_model(paths[".circle"]))
    for op in g.ops:
        assert op.type != "EMBEDDING_LOOKUP"
        if op.type in ("SELECT", "SELECT_V2"):
            assert g.tensors[op.outputs[0]].dtype == np.float32
        if op.type == "FULLY_CONNECTED":
            assert len(g.tensors[op.outputs[0]].shape) == 2


def test_negative_ids_still_wrap(tmp_path):
    """Keras's Embedding reads id -k as row n-k; the integer SELECT written for onert does too."""
    tflite = next(p.values[0] for p in FIXTURE_PARAMS if p.id == "keras_transformer")
    paths, xs, _, _ = trained_export(tflite, tmp_path)
    ids = xs[0]
    negative = np.where(np.arange(ids.size).reshape(ids.shape) % 2 == 0, ids - 200, ids)
    assert (negative < 0).any()
    for suffix, runtimes in RUNTIMES.items():
        for name, runtime in runtimes.items():
            wrapped = runtime(paths[suffix], [ids])
            assert np.array_equal(runtime(paths[suffix], [negative.astype(np.int32)]), wrapped), \
                (suffix, name)


def _broadcast_model(tmp_path, batch: int):
    """x [-1, 4] + y, y = BROADCAST_TO(c, [-1, 4]) also an output (so it cannot be dropped):
    the folded shape as split writes it, made portable for `batch`."""
    c = np.arange(4, dtype=np.float32)
    tensors = [Tensor(0, "x", (-1, 4), np.dtype(np.float32), None),
               Tensor(1, "c", (4,), np.dtype(np.float32), c),
               Tensor(2, "shape", (2,), np.dtype(np.int32), np.int32([BATCH, 4])),
               Tensor(3, "y", (-1, 4), np.dtype(np.float32), None),
               Tensor(4, "z", (-1, 4), np.dtype(np.float32), None)]
    ops = [Op(0, "BROADCAST_TO", [1, 2], [3], {}, 2),  # LiteRT registers it from version 2
           Op(1, "ADD", [0, 3], [4], {})]
    model = graph_to_model(Graph(tensors, ops, [0], [3, 4]), "broadcast", {})
    if batch != BATCH:
        model.subgraphs[0].tensors[0].shapeSignature = None
        for t in (3, 4):
            model.subgraphs[0].tensors[t].shapeSignature = None
    make_portable(model, batch)
    path = tmp_path / f"broadcast{batch}.tflite"
    path.write_bytes(model_to_bytes(model, b"TFL3"))
    return path, c


@pytest.mark.parametrize("rows", [1, 3])
def test_a_shape_holding_the_batch_is_computed_at_run_time(rows, tmp_path):
    path, c = _broadcast_model(tmp_path, BATCH)
    assert "SHAPE" in {op.type for op in graph_of(load_model(path)).ops}
    x = np.ones((rows, 4), np.float32)
    interpreter = Interpreter(model_path=str(path))
    interpreter.resize_tensor_input(interpreter.get_input_details()[0]["index"], [rows, 4])
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    y, z = (interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details())
    assert np.array_equal(y, np.broadcast_to(c, (rows, 4)))
    assert np.array_equal(z, x + c)


def test_a_shape_holding_the_batch_gets_its_row_at_batch_one(tmp_path):
    path, c = _broadcast_model(tmp_path, 1)
    g = graph_of(load_model(path))
    assert [op.type for op in g.ops] == ["BROADCAST_TO", "ADD"]
    assert g.tensors[g.ops[0].inputs[1]].data.tolist() == [1, 4]
    y = run_litert(path, [np.ones((1, 4), np.float32)])
    assert np.array_equal(y, c[None])
