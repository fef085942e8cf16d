"""The device: a Flower ClientApp that fine-tunes the received trainable weights
with the Trainer of `microtrain run` on its own share of the data.

Each training message carries the global weights and the run's settings; the
device's share is `partition-id` of `num-partitions` (Flower's node config: the
simulation sets it, a SuperNode gets it from `--node-config`).  Optimizer and
loss-scale state stay with the device between rounds (Flower's per-node
`context.state`) unless the settings ask to reset them every round.
"""
import json
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from microtrain.files.contracts import LossScaleState
from microtrain.files.errors import UserError
from microtrain.shuffle import Shuffler
from microtrain.step.threads import limit_blas_threads
from microtrain.trainer import Trainer, TrainerState
from microtrain.commands.federated.data import training_part
from microtrain.commands.federated.partition import partition
from microtrain.commands.federated.settings import CONFIG_KEY, FederatedSettings
from microtrain.commands.federated.wire import ARRAYS_KEY, from_record, to_record

app = ClientApp()


@dataclass
class Device:
    trainer: Trainer
    inputs: list
    targets: list
    fresh: TrainerState   # before any step: each round's start unless the device keeps state


@lru_cache(maxsize=16)
def _device(settings_json: str, partition_id: int) -> Device:
    """The trainer and data of one device; kept per process, since a simulation
    runs many devices, round after round, in a few worker processes."""
    settings = FederatedSettings.from_json(settings_json)
    limit_blas_threads(settings.client_threads)
    if not 0 <= partition_id < settings.clients:
        raise UserError(None, f"partition-id {partition_id} is not one of the "
                              f"{settings.clients} clients")
    xs, ts = training_part(settings)
    mine = partition(settings.partition, ts[0], settings.clients, settings.seed)[partition_id]
    xs, ts = [x[mine] for x in xs], [t[mine] for t in ts]
    trainer = Trainer.from_config(settings.run)
    if trainer.batch_size > len(mine):   # a device with less data than one batch
        trainer = Trainer.from_config(replace(settings.run, batch_size=len(mine)))
    xs, ts = trainer.check_data(xs, ts, (settings.run.inputs, settings.run.targets))
    return Device(trainer, xs, ts, trainer.state())


def _start_round(device: Device, state: RecordDict, keep: bool, weights: np.ndarray) -> None:
    """The device's trainer at the start of a round: the global weights, with the
    optimizer and loss-scale state it kept from its last round (or fresh ones)."""
    start = device.fresh
    if keep and "optimizer" in state:
        saved = state["counters"]
        start = replace(start, optimizer_state={k: a.numpy() for k, a in state["optimizer"].items()},
                        iterations=int(saved["iterations"]),
                        loss_scale=LossScaleState.from_dict(json.loads(saved["loss_scale"]), None))
    device.trainer.restore(replace(start, params=weights, epoch=0, data_order=None))


def _keep(device: Device, state: RecordDict) -> None:
    kept = device.trainer.state()
    state["optimizer"] = ArrayRecord({k: Array(v) for k, v in kept.optimizer_state.items()})
    state["counters"] = ConfigRecord({"iterations": kept.iterations,
                                      "loss_scale": json.dumps(kept.loss_scale.to_dict())})


def _settings_and_device(msg: Message, context: Context) -> tuple[FederatedSettings, Device]:
    settings_json = msg.content["config"][CONFIG_KEY]
    return (FederatedSettings.from_json(settings_json),
            _device(settings_json, int(context.node_config["partition-id"])))


@app.train()
def train(msg: Message, context: Context) -> Message:
    settings, device = _settings_and_device(msg, context)
    trainer, received = device.trainer, msg.content[ARRAYS_KEY]
    start = from_record(received)
    _start_round(device, context.state, settings.keep_optimizer_state, start)
    trainer.proximal = (settings.proximal_mu, start) if settings.strategy == "fedprox" else None
    round_ = int(msg.content["config"]["server-round"])
    seed = (settings.seed * 1_000_003 + round_) * 1009 + int(context.node_config["partition-id"])
    history = trainer.fit(device.inputs, device.targets, epochs=settings.local_epochs,
                          shuffle=True, rng=Shuffler(seed))
    if settings.keep_optimizer_state:
        _keep(device, context.state)
    last = history[-1]
    metrics = MetricRecord({"num-examples": len(device.inputs[0]), "train_loss": last["loss"],
                            f"train_{trainer.metric}": last[trainer.metric]})
    wire_type = received["wof"].numpy().dtype   # reply in the type the server sent
    return Message(RecordDict({ARRAYS_KEY: to_record(trainer.memory.params, wire_type),
                               "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and metric of the received global weights on this device's data."""
    _, device = _settings_and_device(msg, context)
    trainer = device.trainer
    trainer.set_params(from_record(msg.content[ARRAYS_KEY]))
    result = trainer.evaluate(device.inputs, device.targets, checked=True)
    return Message(RecordDict({"metrics": MetricRecord({
        "num-examples": result["samples"], "device_loss": result["loss"],
        f"device_{trainer.metric}": result[trainer.metric]})}), reply_to=msg)
