"""The lazy update of embedding tables (`--embedding-update lazy`): the touched-rows
gradient against PyTorch's sparse gradient, trajectories against independent
references (torch.optim.SparseAdam for Adam, the rules written out in float64 for
SGD, momentum and RMSprop, over torch float64 gradients), untouched rows never
change, accumulation, refusals and the memory plan."""
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kernel_check import run
from microtrain.commands.cli import main
from microtrain.files.errors import UserError
from microtrain.step.loss_scale import make_loss_scale
from microtrain.trainer import Trainer
from test_embedding import classifier
from test_split_gradients import GraphMaker
from torch_reference import reference_gradients
from trainconf.split import split

rng = np.random.default_rng(183)
VOCAB, STEPS, BATCH = 40, 3, 4


def test_touched_rows_gradient_is_torchs_sparse_gradient():
    index = rng.integers(0, 500, (8, 16)).astype(np.int32)
    index[0, :10] = 7  # a repeated id
    dy = rng.normal(size=(8, 16, 5))
    cap = index.size
    ids, values, count = run("GatherRowsGrad", [dy, index], [(cap,), (cap, 5), (1,)], rows=500)
    emb = torch.nn.Embedding(500, 5, sparse=True).double()
    emb(torch.tensor(index, dtype=torch.long)).backward(torch.tensor(dy))
    want = emb.weight.grad.coalesce()
    k = int(count[0])
    np.testing.assert_array_equal(ids[:k], want.indices()[0].numpy())
    np.testing.assert_allclose(values[:k], want.values().numpy(), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lazy")
    m = GraphMaker()
    x, y, table = classifier(m, "GATHER", vocab=VOCAB, steps=STEPS)
    return m.save(tmp / "embed.circle", [x], [y]), m.tensors[table].name, table


def batches(n=4):
    """Batches whose ids leave most rows untouched and touch some rows in one step only."""
    xs = [rng.integers(0, VOCAB // 2, (BATCH, STEPS)).astype(np.int32) for _ in range(n)]
    ts = [np.eye(3, dtype=np.float32)[rng.integers(0, 3, BATCH)] for _ in range(n)]
    return xs, ts


def trainer(model, tmp_path, optimizer, update="lazy", **kw):
    path, name, _ = model
    frozen = split(path, tmp_path, trainable=name, force=True).frozen
    return Trainer(frozen, batch_size=BATCH, optimizer=optimizer, embedding_update=update, **kw)


def reference_rule(optimizer):
    """The lazy rule on touched rows in float64, per Keras's formulas (docs/semantics.md)."""
    lr = {"sgd": 0.01, "momentum": 0.01, "rmsprop": 0.001}[optimizer]
    state = {}

    def step(w, g, rows):
        g = g[rows]
        if optimizer == "sgd":
            w[rows] -= lr * g
        elif optimizer == "momentum":
            v = state.setdefault("v", np.zeros_like(w))
            v[rows] = 0.9 * v[rows] - lr * g
            w[rows] += v[rows]
        else:
            v = state.setdefault("v", np.zeros_like(w))
            v[rows] = 0.9 * v[rows] + 0.1 * g ** 2
            w[rows] -= lr * g / np.sqrt(v[rows] + 1e-7)
    return step


def sparse_adam():
    """torch.optim.SparseAdam with Keras's defaults (its formula: see docs/semantics.md)."""
    holder = {}

    def step(w, g, rows):
        if "opt" not in holder:
            holder["p"] = torch.nn.Parameter(torch.tensor(w))
            holder["opt"] = torch.optim.SparseAdam([holder["p"]], lr=0.001, betas=(0.9, 0.999),
                                                   eps=1e-7)
        p = holder["p"]
        p.grad = torch.sparse_coo_tensor(torch.tensor(rows[None]), torch.tensor(g[rows]), w.shape,
                                         check_invariants=True)
        holder["opt"].step()
        w[...] = p.detach().numpy()
    return step


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "rmsprop"])
def test_lazy_trajectory_matches_the_reference_and_untouched_rows_stay(model, tmp_path, optimizer):
    t = trainer(model, tmp_path, optimizer)
    table = model[2]
    w = t.memory.param_views[table].astype(np.float64)
    start = w.copy()
    rule = sparse_adam() if optimizer == "adam" else reference_rule(optimizer)
    xs, ts = batches()
    for x, target in zip(xs, ts):
        before = t.memory.param_views[table].copy()
        _, g = reference_gradients(t.art.forward, {table: w.astype(np.float32)}, [x], target, "cce")
        rule(w, g[table], np.unique(x))
        t.fit([x], [target], epochs=t.epoch + 1, shuffle=False)
        after = t.memory.param_views[table]
        untouched = np.setdiff1d(np.arange(VOCAB), x)
        np.testing.assert_array_equal(after[untouched], before[untouched])
        np.testing.assert_allclose(after, w, rtol=1e-4, atol=1e-6)
    never = np.setdiff1d(np.arange(VOCAB), np.concatenate(xs))
    assert never.size and np.array_equal(t.memory.param_views[table][never], start[never])


def test_dense_momentum_moves_rows_the_step_did_not_touch(model, tmp_path):
    """The contrast: Keras's dense update keeps moving a row by its velocity."""
    t = trainer(model, tmp_path, "momentum", update="dense")
    xs, ts = batches(2)
    for x, target in zip(xs, ts):
        before = t.memory.param_views[model[2]].copy()
        t.fit([x], [target], epochs=t.epoch + 1, shuffle=False)
    moved = np.setdiff1d(xs[0], xs[1])
    assert moved.size and not np.array_equal(t.memory.param_views[model[2]][moved], before[moved])


@pytest.mark.parametrize("optimizer", ["adam", "nadam"])
def test_accumulated_batches_update_the_union_of_their_rows(model, tmp_path, optimizer):
    """Two accumulated batches of 4 equal one batch of 8 (mean loss)."""
    xs, ts = batches(4)
    x, target = np.concatenate(xs), np.concatenate(ts)
    path, name, table = model
    frozen = split(path, tmp_path, trainable=name, force=True).frozen
    whole = Trainer(frozen, batch_size=8, optimizer=optimizer, embedding_update="lazy")
    halves = Trainer(frozen, batch_size=4, optimizer=optimizer, embedding_update="lazy",
                     accum_steps=2)
    whole.fit([x], [target], epochs=2, shuffle=False)
    halves.fit([x], [target], epochs=2, shuffle=False)
    np.testing.assert_allclose(halves.memory.param_views[table], whole.memory.param_views[table],
                               rtol=1e-5, atol=1e-7)


def test_only_tables_go_lazy_and_what_lazy_cannot_do_is_refused(model, tmp_path):
    path, _, table = model
    frozen = split(path, tmp_path, force=True).frozen
    t = Trainer(frozen, batch_size=BATCH, embedding_update="lazy")
    assert list(t.memory.lazy) == [table] and len(t.memory.grad_offsets) == 2  # the dense layer
    with pytest.raises(UserError, match="lazy trains in fp32 without loss scaling"):
        Trainer(frozen, batch_size=BATCH, embedding_update="lazy",
                loss_scale=make_loss_scale("dynamic"))
    half = split(path, tmp_path / "fp16", precision="fp16").frozen
    with pytest.raises(UserError, match="lazy needs fp32 weights"):
        Trainer(half, batch_size=BATCH, embedding_update="lazy")
    x, target = batches(1)
    np.save(tmp_path / "x.npy", x[0])
    np.save(tmp_path / "t.npy", target[0])
    result = CliRunner().invoke(main, ["run", str(half), "--input", str(tmp_path / "x.npy"),
                                       "--target", str(tmp_path / "t.npy"),
                                       "--embedding-update", "lazy"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "lazy needs fp32" in result.output


@pytest.mark.parametrize("accum_steps", [1, 3])
def test_planned_peak_is_what_a_lazy_run_holds_and_less_than_dense(tmp_path, accum_steps):
    from microtrain.commands import session
    from microtrain.run_config import RunConfig
    m = GraphMaker()
    x, y, _ = classifier(m, "GATHER", vocab=5000, steps=STEPS, dim=16)
    path = m.save(tmp_path / "big.circle", [x], [y])
    ids, t = rng.integers(0, 5000, (40, STEPS)).astype(np.int32), \
        np.eye(3, dtype=np.float32)[rng.integers(0, 3, 40)]
    np.save(tmp_path / "x.npy", ids)
    np.save(tmp_path / "t.npy", t)
    planned = {}
    for update in ("dense", "lazy"):
        result = split(path, tmp_path / update, batch_size=8, accum_steps=accum_steps,
                       embedding_update=update)
        config = RunConfig(frozen=str(result.frozen), inputs=[str(tmp_path / "x.npy")],
                           targets=[str(tmp_path / "t.npy")], epochs=1, save="never",
                           accum_steps=accum_steps, embedding_update=update)
        summary = session.run(config)
        planned[update] = result.memory
        held = summary["memory_bytes"]
        assert 0.98 * result.memory["ram"] <= held <= result.memory["ram"], (held, result.memory)
    assert planned["lazy"]["gradients"] < planned["dense"]["gradients"] / 10
    assert planned["lazy"]["ram"] < planned["dense"]["ram"]
