"""The settings of a federated run: one typed record whose fields state the options
of `microtrain federated` (help, default, type: microtrain/run_config.py's `option`).

The record travels as JSON: in the Flower run config (key `microtrain`) to the
ServerApp, and in every training round's ConfigRecord to the ClientApps, so
both engines (simulation, deployment) configure the two apps the same way.
"""
import json
from dataclasses import asdict, dataclass, fields

import click

from microtrain.files.errors import UserError
from microtrain.run_config import HYPERPARAMETER, RunConfig, check_options, group, option

STRATEGIES = ("fedavg", "fedprox", "fedadam")
TRANSMIT = ("fp32", "fp16")
CONFIG_KEY = "microtrain"  # the run-config / ConfigRecord key holding the JSON


# The options of `microtrain run` that a federated run takes (its RunConfig's other
# fields keep their defaults): the model, the data and the devices' training.
RUN_OPTIONS = ("frozen", "wof", "backprop", "inputs", "input_shapes", "batch_size", "targets",
               "target_shapes", "test_inputs", "test_targets", "validation_split", "optimizer",
               *group(HYPERPARAMETER), "loss_scale", "output_wof")


@dataclass(frozen=True)
class FederatedSettings:
    """A federated run: `run` (the model, data and how each device trains, as
    `microtrain run`) and `microtrain federated`'s own options."""
    run: RunConfig
    clients: int = option("Simulated devices; the training data is split across them.", 10,
                          type=click.IntRange(1))
    rounds: int = option("Federated rounds.", 5, type=click.IntRange(1))
    partition: str = option(
        "How the data is split: iid (equal random shares) or dirichlet:ALPHA (class shares per "
        "device drawn from Dirichlet(ALPHA); smaller is more skewed).", "iid", type=str)
    fraction: float = option("Fraction of the devices that train in each round.", 1.0,
                             type=click.FloatRange(0, 1, min_open=True))
    min_clients: int = option("Devices a round needs at least (Flower's min_train_nodes and "
                              "min_available_nodes).", 2, type=click.IntRange(1))
    evaluate_fraction: float = option(
        "Fraction of the devices that also evaluate the global weights on their own data each "
        "round (device_loss, device_<metric>); the server always evaluates them on the "
        "held-out set.", 0.0, type=click.FloatRange(0, 1))
    local_epochs: int = option("Epochs each device trains per round.", 1, type=click.IntRange(1))
    strategy: str = option("Flower's aggregation strategy.", "fedavg",
                           type=click.Choice(STRATEGIES))
    proximal_mu: float = option("fedprox: weight of the proximal term mu/2 ||w - w_global||^2.",
                                0.01, type=float)
    server_learning_rate: float = option("fedadam: the server's step size (eta).", 0.01,
                                         type=float)
    transmit: str = option(
        "Type of the weights on the wire, both ways (fp16 halves the bytes; the server "
        "aggregates and devices train in fp32).", "fp32", type=click.Choice(TRANSMIT))
    keep_optimizer_state: bool = option(
        "Whether a device keeps its optimizer state between rounds.", True, type=bool,
        off="--reset-optimizer-state")
    client_threads: int = option("BLAS threads of each device's process.", 1,
                                 type=click.IntRange(1))
    seed: int = option("Seed of the partition and of every device's shuffling.", 0, type=int)
    round_timeout: float = option("Seconds the server waits for the devices' replies in a "
                                  "round.", 600.0, type=float)

    def __post_init__(self):
        check_options(self)
        if self.min_clients > self.clients:
            raise UserError(None, f"must not exceed --clients ({self.clients}), got "
                                  f"{self.min_clients}",
                            "--min-clients")
        if not (self.run.test_inputs or self.run.validation_split):
            raise UserError(None, "the server needs a held-out set: give --test-input/"
                                  "--test-target or --validation-split")
        parse_partition(self.partition)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FederatedSettings":
        record = _known(json.loads(text), fields(cls))
        run = _known(record.pop("run", {}), fields(RunConfig))  # its fields check their values
        if "frozen" not in run:
            raise UserError(None, "federated settings: the run names no frozen model")
        return cls(RunConfig(**run), **record)


def _known(record, known) -> dict:
    """`record` if it is a JSON object of `known` fields only."""
    if not isinstance(record, dict):
        raise UserError(None, f"federated settings: expected an object, got {record!r:.40}")
    unknown = set(record) - {f.name for f in known}
    if unknown:
        raise UserError(None, f"unknown federated settings: {', '.join(sorted(unknown))}")
    return record


def parse_partition(spec: str) -> tuple[str, float | None]:
    """'iid' -> ('iid', None); 'dirichlet:0.5' -> ('dirichlet', 0.5)."""
    kind, _, alpha = spec.partition(":")
    if kind == "iid" and not alpha:
        return "iid", None
    if kind == "dirichlet":
        try:
            value = float(alpha)
        except ValueError:
            value = 0.0
        if value > 0:
            return "dirichlet", value
    raise UserError(None, f"--partition must be iid or dirichlet:ALPHA with ALPHA > 0, got {spec!r}")
