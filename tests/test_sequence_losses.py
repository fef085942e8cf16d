"""Per-token losses over a time axis (logits [B, T, V], targets [B, T] ids or
[B, T, V] one-hot) with an ignored class, against torch float64's
cross_entropy(ignore_index=...); a small causal language model trained on
next-token prediction, with token accuracy and perplexity."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from kernel_check import run
from microtrain.commands.cli import main
from microtrain.files.errors import UserError
from microtrain.trainer import Trainer
from test_split_gradients import GraphMaker
from trainconf.split import split

rng = np.random.default_rng(6)
B, T, V = 3, 5, 7


def token_ids(ignore):
    ids = rng.integers(0, V, (B, T))
    if ignore is not None:
        ids[0, -2:] = ids[2, 0] = ignore  # padding at an end and in the middle
    return ids


def torch_reference(z, ids, ignore, reduction, through):
    """Loss and gradient w.r.t. the kernel's input (logits z, or y = softmax(z))."""
    leaf = torch.tensor(z if through != "probabilities" else
                        torch.softmax(torch.tensor(z), -1).numpy(), requires_grad=True)
    logp = torch.log_softmax(leaf, -1) if through != "probabilities" else \
        torch.log(leaf / leaf.sum(-1, keepdim=True))
    loss = F.nll_loss(logp.reshape(-1, V), torch.tensor(ids).reshape(-1),
                      ignore_index=-100 if ignore is None else ignore, reduction=reduction)
    loss.backward()
    return loss.item(), leaf.grad.numpy()


@pytest.mark.parametrize("through", ["logits", "softmax output", "probabilities"])
@pytest.mark.parametrize("loss", ["sparse_cce", "cce"])
@pytest.mark.parametrize("ignore", [None, 0, -100])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_token_cross_entropy_ignores_as_torch(through, loss, ignore, reduction):
    if loss == "cce" and ignore == -100:
        pytest.skip("a one-hot target has no class -100")
    z = rng.normal(size=(B, T, V))
    ids = token_ids(ignore)
    y = torch.softmax(torch.tensor(z), -1).numpy()
    target = ids.astype(np.float64) if loss == "sparse_cce" else \
        (ids[..., None] == np.arange(V)).astype(np.float64)
    options = dict(loss=loss, reduction=reduction,
                   **({} if ignore is None else {"ignore_index": ignore}))
    if through == "probabilities":
        value, grad = run("Loss", [y, target], [(1,), (B, T, V)], **options)
    else:
        inputs = [z, target] + ([y] if through == "softmax output" else [])
        value, grad = run("LogitsLoss", inputs, [(1,), (B, T, V)], activation="softmax",
                          **options)
    want_value, want_grad = torch_reference(z, ids, ignore, reduction, through)
    assert value[0] == pytest.approx(want_value, rel=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-9)


def language_model(m: GraphMaker, steps=T, dim=4):
    """ids [B, T] -> token embedding -> dense to V logits per token (no softmax)."""
    x = m.tensor((-1, steps), dtype=np.int32)
    e = m.op("GATHER", [m.weight(V, dim), x], (-1, steps, dim), axis=0)
    h = m.op("FULLY_CONNECTED", [e, m.weight(8, dim), m.weight(8)], (-1, steps, 8),
             keep_num_dims=True, fused_activation_function=4)
    return x, m.op("FULLY_CONNECTED", [h, m.weight(V, 8), m.weight(V)], (-1, steps, V),
                   keep_num_dims=True)


def torch_lm_gradients(weights, x, ids, ignore):
    table, w1, b1, w2, b2 = (torch.tensor(np.asarray(w, np.float64), requires_grad=True)
                             for w in weights)
    logits = torch.tanh(table[torch.tensor(x, dtype=torch.long)] @ w1.T + b1) @ w2.T + b2
    loss = F.cross_entropy(logits.reshape(-1, V), torch.tensor(ids).reshape(-1),
                           ignore_index=ignore)
    loss.backward()
    return loss.item(), [p.grad.numpy() for p in (table, w1, b1, w2, b2)]


def test_a_language_model_gets_torch_gradients_with_an_ignored_padding_id(tmp_path):
    m = GraphMaker()
    x, logits = language_model(m)
    path = m.save(tmp_path / "lm.circle", [x], [logits])
    result = split(path, tmp_path, loss="sparse_cce", from_logits=True, ignore_index=0)
    trainer = Trainer(result.frozen, batch_size=B, optimizer="sgd")
    assert trainer.art.training.ignore_index == 0 and trainer.art.training.from_logits
    data, ids = rng.integers(1, V, (B, T)).astype(np.int32), token_ids(0)
    got_loss, got = trainer.gradients([data], [ids.astype(np.float32)])
    order = trainer.art.training.trainable
    want_loss, want = torch_lm_gradients([trainer.art.weights[t] for t in order], data, ids, 0)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for t, w in zip(order, want):
        np.testing.assert_allclose(got[t], w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("options, problem", [
    (dict(loss="mse", ignore_index=0), "--ignore-index applies to cce and sparse_cce, not mse"),
    (dict(loss="cce", from_logits=True, trainable="all"),
     "--from-logits: the model ends in SOFTMAX, so its outputs are probabilities")])
def test_loss_options_that_do_not_apply_are_refused(tmp_path, options, problem):
    m = GraphMaker()
    x, logits = language_model(m)
    out = m.op("SOFTMAX", [logits], (-1, T, V), beta=1.0)
    with pytest.raises(UserError, match=problem):
        split(m.save(tmp_path / "lm.circle", [x], [out]), tmp_path, **options)


def test_next_token_fine_tuning_reports_token_accuracy_and_perplexity(tmp_path):
    """A causal language model's data: the targets are the inputs shifted by one
    token, the last target padding (id 0, ignored)."""
    m = GraphMaker()
    x, logits = language_model(m)
    frozen = split(m.save(tmp_path / "lm.circle", [x], [logits]), tmp_path, loss="sparse_cce",
                   from_logits=True, ignore_index=0, learning_rate=0.05).frozen
    text = np.tile(np.arange(1, V), 20)
    starts = rng.integers(0, len(text) - T, 64)
    inputs = np.stack([text[s:s + T] for s in starts]).astype(np.int32)
    targets = np.concatenate([inputs[:, 1:], np.zeros((64, 1), np.int32)], 1)
    np.save(tmp_path / "x.npy", inputs)
    np.save(tmp_path / "t.npy", targets)
    result = CliRunner().invoke(main, ["run", str(frozen), "--input", str(tmp_path / "x.npy"),
                                       "--target", str(tmp_path / "t.npy"), "--epochs", "4",
                                       "--batch-size", "8", "--json", "--seed", "0"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    epochs, summary = records[:-1], records[-1]
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert all("perplexity" in r and "accuracy" in r for r in epochs)
    assert summary["final_perplexity"] < summary["initial_perplexity"]
    # eval: token accuracy and perplexity over the counted tokens (the ignored last one
    # of each sample left out), against torch on the model's own logits
    trainer = Trainer(frozen, batch_size=8)
    logits = trainer.predict([inputs])[0]
    evaluation = trainer.evaluate([inputs], [targets.astype(np.float32)])
    kept = targets != 0
    assert evaluation["accuracy"] == pytest.approx((logits.argmax(-1) == targets)[kept].mean())
    cross_entropy = F.cross_entropy(torch.tensor(logits, dtype=torch.float64).reshape(-1, V),
                                    torch.tensor(targets, dtype=torch.long).reshape(-1),
                                    ignore_index=0)
    assert evaluation["perplexity"] == pytest.approx(float(torch.exp(cross_entropy)), rel=1e-5)
