"""Embedding tables that train: GATHER (table at input 0) and EMBEDDING_LOOKUP
(table at input 1) over token ids the model reads, forward against LiteRT, the
table's gradient (a row scatter-add) against PyTorch float64, and `--trainable`."""
import numpy as np
import pytest
import torch

from click.testing import CliRunner

from kernel_check import run
from microtrain.commands.cli import main
from microtrain.data import load_array
from microtrain.files.errors import UserError
from microtrain.files.graph import Graph
from microtrain.step.kernels import build
from microtrain.trainer import Trainer
from test_split_gradients import GraphMaker, check_gradients
from tflite_op import tflite_run
from trainconf.select import id_inputs
from trainconf.split import split

rng = np.random.default_rng(18)


def ids(vocab, shape, dtype=np.int32):
    return rng.integers(0, vocab, shape).astype(dtype)


@pytest.mark.parametrize("op", ["GATHER", "EMBEDDING_LOOKUP"])
def test_lookup_of_computed_ids_matches_litert(op):
    table, index = rng.normal(size=(7, 3)).astype(np.float32), ids(7, (2, 5))
    inputs = [table, index] if op == "GATHER" else [index.reshape(-1), table]
    shape = (2, 5, 3) if op == "GATHER" else (10, 3)
    want = tflite_run(op, inputs, [shape], constant=(0,) if op == "GATHER" else (1,))[0]
    np.testing.assert_array_equal(run(op, inputs, [shape], dtype=np.float32)[0], want)


def test_an_id_outside_the_table_is_refused_not_wrapped():
    with pytest.raises(UserError, match="index 9 outside the 7 rows of its table"):
        run("GATHER", [np.zeros((7, 3), np.float32), np.array([1, 9], np.int32)], [(2, 3)])


def test_ids_are_read_when_the_lookup_runs_not_when_it_is_prepared():
    """The arena may hold another tensor's bytes where the ids will be computed."""
    table, index = rng.normal(size=(7, 3)).astype(np.float32), np.array([99, -5], np.int32)
    out = np.empty((2, 3), np.float32)
    step = build("GATHER", [table, index], [out])
    index[:] = [6, 0]
    step()
    np.testing.assert_array_equal(out, table[[6, 0]])


@pytest.mark.parametrize("vocab, shape, padding", [(5, (3, 8), False), (10000, (32, 64), True),
                                                   (2000, (32, 32), False)])
def test_table_gradient_sums_repeated_ids_as_torch(vocab, shape, padding):
    """Many repeats (5 rows, 24 ids), the size the issue names (10k x 64, 32x64 ids) with a
    padding id, and the bench's ids (2000 rows, 32x32 ids: a few repeats each, summed in
    layers rather than by reduceat)."""
    index = ids(vocab, shape)
    if padding:
        index.reshape(-1)[:50] = 3  # a padding id, repeated many times
    dy = rng.normal(size=shape + (64,))
    (dx,) = run("GatherGrad", [dy, index], [(vocab, 64)], axis=0)
    table = torch.zeros((vocab, 64), dtype=torch.float64, requires_grad=True)
    table[torch.tensor(index, dtype=torch.long)].backward(torch.tensor(dy))
    np.testing.assert_allclose(dx, table.grad.numpy(), rtol=1e-12, atol=1e-12)


def classifier(m: GraphMaker, op: str, vocab=11, steps=6, dim=4):
    """GATHER: ids [B, T] -> table rows -> mean over T -> dense -> softmax;
    EMBEDDING_LOOKUP (PyTorch's form, 1-D ids): one id per sample -> dense -> softmax."""
    table = m.weight(vocab, dim)
    if op == "GATHER":
        x = m.tensor((-1, steps), dtype=np.int32)
        e = m.op("GATHER", [table, x], (-1, steps, dim), axis=0)
        pooled = m.op("MEAN", [e, m.tensor((1,), [1], np.int32)], (-1, dim))
    else:
        x = m.tensor((-1,), dtype=np.int32)
        pooled = m.op("EMBEDDING_LOOKUP", [x, table], (-1, dim))
    out = m.op("FULLY_CONNECTED", [pooled, m.weight(3, dim), m.weight(3)], (-1, 3))
    return x, m.op("SOFTMAX", [out], (-1, 3), beta=1.0), table


@pytest.mark.parametrize("op", ["GATHER", "EMBEDDING_LOOKUP"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_table_trains_with_torch_gradients(op, reduction, tmp_path):
    m = GraphMaker()
    x, y, table = classifier(m, op)
    path = m.save(tmp_path / "embed.circle", [x], [y])
    data = ids(11, (5, 6) if op == "GATHER" else (5,))
    data.reshape(-1)[:3] = data.reshape(-1)[3]  # a repeated id
    t = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 5)]
    got = check_gradients(path, tmp_path, data, t, "cce", reduction)
    assert table in got and np.count_nonzero(got[table].any(axis=1)) == len(np.unique(data))


def test_trainable_names_the_table(tmp_path):
    m = GraphMaker()
    x, y, table = classifier(m, "GATHER")
    path = m.save(tmp_path / "embed.circle", [x], [y])
    name = m.tensors[table].name
    assert Trainer(split(path, tmp_path, trainable=name).frozen).art.training.trainable == [table]
    everything = Trainer(split(path, tmp_path, force=True).frozen).art.training.trainable
    assert table in everything and len(everything) == 3
    last = Trainer(split(path, tmp_path, trainable="last:1", force=True).frozen)
    assert table not in last.art.training.trainable


# -- integer data ---------------------------------------------------------------------------------

def split_classifier(tmp_path, op="GATHER"):
    m = GraphMaker()
    x, y, _ = classifier(m, op)
    return split(m.save(tmp_path / "embed.circle", [x], [y]), tmp_path).frozen


def run_cli(frozen, x, t, tmp_path):
    np.save(tmp_path / "ids.npy", x)
    np.save(tmp_path / "t.npy", t)
    return CliRunner().invoke(main, ["run", str(frozen), "--input", str(tmp_path / "ids.npy"),
                                     "--target", str(tmp_path / "t.npy"), "--epochs", "2",
                                     "--batch-size", "4", "--json"])


def test_int64_ids_train_and_ids_outside_the_table_are_refused_in_one_line(tmp_path):
    frozen = split_classifier(tmp_path)
    x, t = ids(11, (12, 6), np.int64), np.eye(3, dtype=np.float32)[rng.integers(0, 3, 12)]
    result = run_cli(frozen, x, t, tmp_path)
    assert result.exit_code == 0, result.output
    x[7, 2] = 11
    result = run_cli(frozen, x, t, tmp_path)
    assert result.exit_code != 0 and result.output.strip().splitlines()[-1] == (
        f"Error: {tmp_path / 'ids.npy'}: sample 7 holds id 11, outside the 11 rows of the "
        "embedding table it indexes")
    x[7, 2] = -1  # Keras would wrap it to the last row: refused as well
    assert "sample 7 holds id -1" in run_cli(frozen, x, t, tmp_path).output


@pytest.mark.parametrize("data, problem", [
    (np.ones((12, 6), np.float32), "holds float32 data, but the model reads it into a int32 tensor"),
    (np.full((12, 6), 1 << 40, np.int64), "holds 1099511627776 (element 0), beyond the range of "
                                         "the int32 tensor")])
def test_ids_that_are_not_the_inputs_integers_are_refused(tmp_path, data, problem):
    frozen = split_classifier(tmp_path)
    result = run_cli(frozen, data, np.eye(3, dtype=np.float32)[[0] * 12], tmp_path)
    assert result.exit_code != 0 and problem in result.output.splitlines()[-1]


def test_bool_masks_are_read_as_bools_only(tmp_path):
    np.save(tmp_path / "mask.npy", np.array([[True, False]]))
    assert load_array(str(tmp_path / "mask.npy"), dtype=np.bool_).dtype == np.bool_
    np.save(tmp_path / "mask.npy", np.array([[1, 0]]))
    with pytest.raises(UserError, match="holds int64 data, but the model reads it into a bool"):
        load_array(str(tmp_path / "mask.npy"), dtype=np.bool_)


def test_the_ids_of_keras_wrapped_lookups_are_traced_to_the_input():
    """Keras 3's Embedding: SELECT(LESS(ids, 0), ADD(ids, n), ids) -> GATHER; two tables
    read one input: the smaller bounds its ids."""
    m = GraphMaker()
    x = m.tensor((-1, 6), dtype=np.int32)
    less = m.op("LESS", [x, m.tensor((), 0, np.int32)], (-1, 6))
    wrapped = m.op("ADD", [x, m.tensor((), 9, np.int32)], (-1, 6))
    picked = m.op("SELECT_V2", [less, wrapped, x], (-1, 6))
    a = m.op("GATHER", [m.weight(9, 4), picked], (-1, 6, 4), axis=0)
    b = m.op("EMBEDDING_LOOKUP", [m.op("RESHAPE", [x, m.tensor((1,), [-1], np.int32)], (-1,)),
                                  m.weight(7, 4)], (-1, 4))
    graph = Graph(m.tensors, m.ops, [x], [a, b])
    assert id_inputs(graph) == {x: 7}
