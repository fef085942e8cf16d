"""`trainconf split --recompute`: the backward pass recomputes dropped forward
activations with copies of the forward operators.  Training is bit-identical
to keeping them (the same kernels on the same inputs), the planned peak is what
a run holds, no tensor is overwritten before its last read, and the chooser
finds the least arena (and the least work for it) that trying every choice
finds on graphs small enough to try them all."""
import itertools

import numpy as np
import pytest

from microtrain.files.artifacts import load_artifacts
from microtrain.files.graph import Graph, Op, Tensor
from microtrain.step.loss_scale import make_loss_scale
from microtrain.trainer import Trainer
from trainconf.backprop import LossSpec, build_backprop
from trainconf.inspect import planned_memory
from trainconf.recompute import Chooser, apply, candidates
from microtrain.files.format.model import load_model

from test_memory_plan import data, replay, splits  # noqa: F401  (splits: a fixture)

ALL_LAYERS = dict(optimizer="adam", batch_size=8)


def _train(frozen, model: str, batch: int, loss_scale: str = "none"):
    trainer = Trainer(frozen, batch_size=batch, optimizer="adam",
                      loss_scale=make_loss_scale(loss_scale))
    x, t = data(model, 3 * batch - 3)  # a partial last batch too
    history = trainer.fit([x], [t], epochs=2, shuffle=False)
    return [r["loss"] for r in history], trainer.memory.params.copy()


@pytest.mark.parametrize("model,precision,loss_scale", [
    ("mobilenetv2", "fp32", "none"), ("residual_mlp", "fp32", "none"), ("cnn", "fp32", "none"),
    ("mobilenetv2", "fp16", "dynamic"), ("mobilenetv2", "fp16", "adaptive"),
    ("mobilenetv2", "bf16", "none")])
def test_recomputing_trains_bit_identically(splits, model, precision, loss_scale):
    kept = splits(model, precision=precision, recompute="none", **ALL_LAYERS)
    again = splits(model, precision=precision, recompute="auto", **ALL_LAYERS)
    if model == "mobilenetv2":
        assert again.memory["recompute"]["extra_ops"] > 0
        assert again.memory["arena"] < kept.memory["arena"]
    losses, weights = _train(kept.frozen, model, 8, loss_scale)
    losses_again, weights_again = _train(again.frozen, model, 8, loss_scale)
    assert losses_again == losses
    np.testing.assert_array_equal(weights_again, weights)


def test_recomputed_activations_count_no_gradient_underflow(splits):
    again = splits("mobilenetv2", precision="fp16", recompute="auto", **ALL_LAYERS)
    recomputed = set(load_artifacts(again.frozen).links.recomputed)
    trainer = Trainer(again.frozen, batch_size=8, loss_scale=make_loss_scale("dynamic"))
    counted, take = set(), trainer.underflow.take

    def taking():  # the counts of each epoch, before the report resets them
        counted.update(trainer.underflow.counts)
        return take()
    trainer.underflow.take = taking
    trainer.fit(*[[a] for a in data("mobilenetv2", 16)], epochs=1)
    stores = {-1 - t for t in counted if t < 0}
    assert recomputed and stores and not stores & recomputed


@pytest.mark.parametrize("precision,batch", [("fp32", 8), ("fp16", 8), ("fp32", 32)])
def test_planned_peak_agrees_with_the_bytes_microtrain_holds(splits, precision, batch):
    result = splits("mobilenetv2", precision=precision, recompute="auto", optimizer="adam",
                    batch_size=batch)
    trainer = Trainer(result.frozen, batch_size=batch, optimizer="adam")
    x, t = data("mobilenetv2", 2 * batch)
    trainer.fit([x], [t], epochs=1)
    planned, held = result.memory["ram"], trainer.memory_bytes()
    assert 0.98 * planned <= held <= planned, (held, result.memory)


def test_no_tensor_is_overwritten_before_its_last_read(splits):
    art = load_artifacts(splits("mobilenetv2", recompute="auto", **ALL_LAYERS).frozen)
    copies = [op for op in art.backprop.ops if set(op.outputs) & set(art.links.recomputed)]
    assert copies and {op.type for op in copies} <= {op.type for op in art.forward.ops}
    for batch in (1, 8, 32):
        busiest = replay(art, batch)
        assert busiest <= art.links.memory.arena[0] * batch + art.links.memory.arena[1]


def test_none_is_todays_split_and_inspect_reports_the_extra_work(splits, tmp_path):
    default, none = splits("cnn"), splits("cnn", recompute="none")
    for name in ("frozen", "wof", "backprop"):
        assert getattr(default, name).read_bytes() == getattr(none, name).read_bytes()
    assert load_artifacts(none.frozen).links.recomputed is None
    again = splits("mobilenetv2", recompute="auto", **ALL_LAYERS)
    memory = planned_memory(again.frozen, load_model(again.frozen), None, None)
    assert memory["recompute"] == again.memory["recompute"]
    assert again.summary()["recompute"] == {"mode": "auto",
                                            "arena_without": splits("mobilenetv2", recompute="none",
                                                                    **ALL_LAYERS).memory["arena"]}
    assert 0 < memory["recompute"]["extra_fraction"] < 1


def test_under_a_budget_recomputing_comes_before_training_fewer_layers(splits):
    """A budget between the least planned peak with recomputation and the peak without."""
    options = dict(optimizer="adam", batch_size=32)
    kept = splits("mobilenetv2", recompute="none", **options).memory
    again = splits("mobilenetv2", recompute="auto", **options).memory
    budget = int(kept["ram"] - 0.8 * (kept["ram"] - again["ram"]))
    fitted = splits("mobilenetv2", memory_budget=budget, **options)
    fewer = splits("mobilenetv2", memory_budget=budget, recompute="none", **options)
    assert fitted.summary()["recompute"]["mode"] == "auto"
    assert fitted.memory["ram"] <= budget and fewer.memory["ram"] <= budget
    assert fitted.memory["recompute"]["extra_ops"] > 0 == fewer.memory["recompute"]["extra_ops"]
    trained = [sum(t["parameters"] for t in r.trainable) for r in (fitted, fewer)]
    assert trained[0] > trained[1]
    # only what the budget needs: no more work than the least arena takes
    assert fitted.memory["recompute"]["extra_work"] <= again["recompute"]["extra_work"]


# -- the chooser against trying every choice ------------------------------------------------------

def chain(widths: list[int], skips: dict[int, int]) -> Graph:
    """Fully connected layers (ReLU) of `widths`; skips {i: j}: layer i's output
    is added to layer j's (same width) before layer j+1 reads it."""
    rng = np.random.default_rng(0)
    tensors = [Tensor(0, "x", (-1, widths[0]), np.dtype(np.float32))]
    ops, outs = [], [0]

    def tensor(name, shape, data=None):
        tensors.append(Tensor(len(tensors), name, shape, np.dtype(np.float32), data))
        return len(tensors) - 1
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        w = tensor(f"w{i}", (b, a), rng.standard_normal((b, a), np.float32))
        bias = tensor(f"b{i}", (b,), np.zeros(b, np.float32))
        y = tensor(f"y{i}", (-1, b))
        ops.append(Op(len(ops), "FULLY_CONNECTED", [outs[-1], w, bias], [y],
                      {"fused_activation_function": 1}))
        for j in [j for j, k in skips.items() if k == i]:
            y2 = tensor(f"sum{i}", (-1, b))
            ops.append(Op(len(ops), "ADD", [y, outs[j + 1]], [y2], {"fused_activation_function": 0}))
            y = y2
        outs.append(y)
    return Graph(tensors, ops, [0], [outs[-1]])


@pytest.mark.parametrize("widths,skips,batch", [
    ([16, 256, 64, 256, 32, 128, 128, 16, 64, 8, 4], {}, 8),
    ([16, 192, 192, 64, 64, 256, 256, 32, 32, 8], {1: 2, 3: 4, 5: 6}, 4),
    ([8, 64, 512, 64, 512, 64, 256, 16, 4], {2: 4}, 1)])
def test_the_chooser_finds_the_best_of_every_choice(widths, skips, batch):
    g = chain(widths, skips)
    weights = [t.index for t in g.tensors if t.data is not None]
    bp = build_backprop(g, weights, LossSpec("mse"))
    for t in weights:
        g.tensors[t].data = None
    chooser = Chooser(g, bp, weights, batch)
    found = chooser.cost(chooser.choose(0))
    pool = candidates(g, bp)
    assert 8 <= len(pool) <= 12
    every = [chooser.cost(frozenset(c)) for n in range(len(pool) + 1)
             for c in itertools.combinations(pool, n)]
    least = min(a for a, _, _ in every)
    assert found[0] == least < chooser.cost(frozenset())[0]
    assert found[2] == min(w for a, _, w in every if a == least)
    apply(g, bp, chooser.choose(0))  # the choice builds
