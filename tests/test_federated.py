"""Federated fine-tuning, the parts that need no Ray: partitions, settings, the
wire encoding and byte counts, the device's training handler (optimizer state
kept or reset, FedProx's term), the server's save rule, and the CLI without Flower."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.commands.federated.partition import class_labels, partition
from microtrain.commands.federated.settings import CONFIG_KEY, RUN_OPTIONS, FederatedSettings
from microtrain.run_config import RunConfig
from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
X, Y = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"
LABELS = np.load(Y)


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    return split(FIXTURES / "mlp.tflite", tmp_path_factory.mktemp("mlp")).frozen


def settings_for(frozen, **changes) -> FederatedSettings:
    """The settings of the mlp on the digits: `changes` to their run options, or to theirs."""
    run = {k: changes.pop(k) for k in list(changes) if k in RUN_OPTIONS}
    return FederatedSettings(RunConfig(**{"frozen": str(frozen), "inputs": (str(X),),
                                          "targets": (str(Y),), "validation_split": 0.2, **run}),
                             **changes)


# -- partitions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.5", "dirichlet:100"])
def test_partitions_cover_every_sample_once(spec):
    parts = partition(spec, LABELS, 10, seed=3)
    joined = np.concatenate(parts)
    assert len(parts) == 10 and len(joined) == len(LABELS)
    assert np.array_equal(np.sort(joined), np.arange(len(LABELS)))
    assert min(len(p) for p in parts) >= 10
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition(spec, LABELS, 10, seed=3)))


def test_iid_shares_are_equal_and_dirichlet_shares_are_skewed():
    labels = class_labels(LABELS)

    def spread(parts):   # mean over devices of the largest class share on the device
        return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])

    iid = partition("iid", LABELS, 10, seed=0)
    assert max(map(len, iid)) - min(map(len, iid)) <= 1
    assert spread(iid) < 0.2                                     # ~0.1 + sampling noise
    assert spread(partition("dirichlet:0.1", LABELS, 10, seed=0)) > 0.5


def test_partition_errors():
    with pytest.raises(UserError, match="dirichlet:ALPHA"):
        partition("dirichlet:-1", LABELS, 3, 0)
    with pytest.raises(UserError, match="class targets"):
        partition("dirichlet:0.5", np.linspace(0, 1, 50)[:, None], 3, 0)
    with pytest.raises(UserError, match="cannot be split"):
        partition("iid", LABELS[:2], 3, 0)


# -- settings -----------------------------------------------------------------------------------
def test_settings_round_trip_through_json(frozen):
    s = settings_for(frozen, input_shapes=((64,),), partition="dirichlet:0.5", transmit="fp16")
    assert FederatedSettings.from_json(s.to_json()) == s


@pytest.mark.parametrize("text, message", [
    ('{"run": {"frozen": "m.circle", "batch_size": 0}}', "--batch-size: 0 is not in the range"),
    ('{"run": {"frozen": "m.circle", "epoch": 3}}', "unknown federated settings: epoch"),
    ('{"run": {"inputs": ["x.npy"]}}', "the run names no frozen model")])
def test_settings_from_json_are_checked(text, message):
    with pytest.raises(UserError, match=message):
        FederatedSettings.from_json(text)


@pytest.mark.parametrize("change, message", [
    (dict(validation_split=None), "held-out set"), (dict(partition="skewed"), "--partition"),
    (dict(min_clients=11), "--min-clients"), (dict(fraction=0.0), "--fraction"),
    (dict(strategy="fedsgd"), "strategy")])
def test_settings_are_checked(frozen, change, message):
    with pytest.raises(UserError, match=message):
        settings_for(frozen, **change)


# -- the wire -----------------------------------------------------------------------------------
flwr = pytest.importorskip("flwr")
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from microtrain.commands.federated import client_app  # noqa: E402
from microtrain.commands.federated.server_app import _finish  # noqa: E402
from microtrain.commands.federated.wire import WireGrid, from_record, to_record  # noqa: E402


@pytest.fixture(autouse=True)
def task_identity():
    """Messages made outside Flower's runtime need a run and node identity."""
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class EchoGrid:
    """Replies to each message with its weights + 1, from 100 examples; node 2 fails."""

    def get_node_ids(self):
        return [1, 2, 3]

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for m in messages:
            if m.metadata.dst_node_id == 2:
                replies.append(Message(flwr.app.Error(code=0, reason="gone"), reply_to=m))
                continue
            weights = m.content["arrays"]["wof"].numpy()
            replies.append(Message(RecordDict({
                "arrays": to_record(weights + 1, weights.dtype),
                "metrics": MetricRecord({"num-examples": 100, "train_loss": 0.5})}), reply_to=m))
        return replies


@pytest.mark.parametrize("transmit, itemsize", [("fp32", 4), ("fp16", 2)])
def test_wire_grid_encodes_and_counts(transmit, itemsize):
    weights = np.linspace(-1, 1, 2410, dtype=np.float32)
    grid = WireGrid(EchoGrid(), transmit)
    content = RecordDict({"arrays": to_record(weights), "config": ConfigRecord()})
    messages = [Message(content, dst_node_id=n, message_type="train") for n in (1, 2, 3)]
    replies = grid.send_and_receive(messages)
    payload = 2410 * itemsize + 128              # the data plus numpy's .npy header
    assert grid.bytes_down == 3 * payload and grid.bytes_up == 2 * payload
    assert (grid.replies, grid.failures, grid.means()) == (2, 1, {"train_loss": 0.5})
    back = from_record(replies[0].content["arrays"])
    assert back.dtype == np.float32
    wire = np.float16 if transmit == "fp16" else np.float32
    np.testing.assert_array_equal(back, (weights.astype(wire) + wire(1)).astype(np.float32))


# -- the device ---------------------------------------------------------------------------------
def _train_message(settings, weights, server_round):
    return Message(RecordDict({"arrays": to_record(weights), "config": ConfigRecord(
        {CONFIG_KEY: settings.to_json(), "server-round": server_round})}),
        dst_node_id=1, message_type="train")


@pytest.mark.parametrize("keep", [True, False])
def test_device_keeps_or_resets_its_optimizer_state(frozen, keep):
    settings = settings_for(frozen, clients=4, keep_optimizer_state=keep, local_epochs=2)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 1, "num-partitions": 4},
                      state=RecordDict(), run_config={})
    start = Trainer(frozen).memory.params.copy()
    reply = client_app.train(_train_message(settings, start, 1), context)
    metrics = reply.content["metrics"]
    n = metrics["num-examples"]
    assert n == 359                        # 1437 training rows in 4 shares: 360, 359, 359, 359
    steps = 2 * -(-n // 32)
    trained = from_record(reply.content["arrays"])
    assert not np.array_equal(trained, start) and np.isfinite(metrics["train_loss"])
    client_app.train(_train_message(settings, trained, 2), context)
    device = client_app._device(settings.to_json(), 1)
    assert device.trainer.optimizer.iterations == (2 * steps if keep else steps)
    assert ("optimizer" in context.state) == keep


def test_device_evaluates_the_global_weights_on_its_share(frozen):
    from microtrain.data import validation_split
    settings = settings_for(frozen, clients=4, evaluate_fraction=0.5)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 2, "num-partitions": 4},
                      state=RecordDict(), run_config={})
    trainer = Trainer(frozen)
    weights = trainer.memory.params * np.float32(0.5)
    message = _train_message(settings, weights, 1)
    message.metadata.message_type = "evaluate"
    metrics = client_app.evaluate(message, context).content["metrics"]
    (x, y), _ = validation_split([np.load(X), np.load(Y)], 0.2)
    mine = partition("iid", y, 4, seed=0)[2]
    trainer.set_params(weights)
    expected = trainer.evaluate([x[mine]], [y[mine]])
    assert metrics["num-examples"] == len(mine)
    assert metrics["device_loss"] == pytest.approx(expected["loss"])
    assert metrics["device_accuracy"] == pytest.approx(expected["accuracy"])


def test_fedprox_adds_the_proximal_gradient(frozen):
    """One SGD step: the proximal term moves w by -lr * mu * (w - w_global)."""
    x, y = np.load(X)[:32], np.load(Y)[:32]
    trainers = [Trainer(frozen, optimizer="sgd", learning_rate=0.1) for _ in range(2)]
    anchor = trainers[1].memory.params + np.float32(0.5)
    trainers[1].proximal = (0.2, anchor)
    for t in trainers:
        t.fit([x], [y], epochs=1, shuffle=False)
    w0 = Trainer(frozen).memory.params
    np.testing.assert_allclose(trainers[1].memory.params - trainers[0].memory.params,
                               -0.1 * 0.2 * (w0 - anchor), atol=1e-6)


# -- the server's save rule ---------------------------------------------------------------------
@pytest.mark.parametrize("best_round", [0, 2])
def test_server_writes_the_best_weights_only_if_they_beat_the_start(frozen, tmp_path, best_round):
    out = tmp_path / "out.wof"
    settings = settings_for(frozen, output_wof=str(out))
    trainer = Trainer(frozen)
    best = trainer.memory.params * np.float32(0.5)
    rounds = [{"round": r, "test_accuracy": 0.1 * (r + 1), "bytes_down": 1, "bytes_up": 1}
              for r in range(3)]
    summary = _finish(trainer, settings, rounds,
                      {"round": best_round, "params": best, "result": {"accuracy": 0.3}})
    assert summary["saved"] == out.exists() == (best_round > 0)
    if best_round:
        np.testing.assert_array_equal(Trainer(frozen, wof=out).memory.params, best)


# -- the command line ---------------------------------------------------------------------------
def test_cli_imports_no_flower_and_explains_a_missing_extra(frozen):
    code = ("import sys; import microtrain.commands.cli; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray')]; "
            "sys.modules['flwr'] = None; "
            f"sys.argv = ['microtrain', 'federated', {str(frozen)!r}, '--input', {str(X)!r}, "
            f"'--target', {str(Y)!r}, '--validation-split', '0.2']; microtrain.commands.cli.main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "Error: microtrain federated needs Flower (flwr is missing): "
        "pip install 'trainconf-microtrain[federated]'"]


def test_write_app_gives_flwr_an_app_with_absolute_paths(frozen, tmp_path, monkeypatch):
    import tomli
    from click.testing import CliRunner
    from microtrain.commands.cli import main
    monkeypatch.chdir(X.parent)
    result = CliRunner().invoke(main, ["federated", str(frozen), "--input", X.name, "--target",
                                       Y.name, "--validation-split", "0.2", "--clients", "3",
                                       "--write-app", str(tmp_path / "app")])
    assert result.exit_code == 0, result.output
    doc = tomli.loads((tmp_path / "app" / "pyproject.toml").read_text())
    app = doc["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "microtrain.commands.federated.server_app:app",
                                 "clientapp": "microtrain.commands.federated.client_app:app"}
    settings = FederatedSettings.from_json(app["config"][CONFIG_KEY])
    assert settings.run.inputs == (str(X),) and settings.clients == 3
