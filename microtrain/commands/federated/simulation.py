"""Flower's simulation engine on this machine: N virtual devices in a few Ray
worker processes (one CPU each), the ServerApp in this process."""
import logging
import os

import ray  # noqa: F401  Flower's simulation engine; imported here so a missing extra shows early
from flwr.simulation import run_simulation

from microtrain.files.errors import UserError
from microtrain.commands.federated.client_app import app as client_app
from microtrain.commands.federated.server_app import OnRound, make_server_app
from microtrain.commands.federated.settings import FederatedSettings


def simulate(settings: FederatedSettings, on_round: OnRound | None = None,
             workers: int | None = None, verbose: bool = False) -> dict:
    """Run the federated rounds; returns the server's summary.  `workers`: Ray
    worker processes training side by side (default: the cores of this machine).
    Flower's own log shows only errors unless `verbose`."""
    logging.getLogger("flwr").setLevel(logging.INFO if verbose else logging.ERROR)
    outcome: dict = {}
    server = make_server_app(settings, on_round, lambda summary: outcome.update(summary=summary),
                             on_error=lambda error: outcome.update(error=error))
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0},
               "init_args": {"num_cpus": workers or os.cpu_count() or 1, "num_gpus": 0,
                             "include_dashboard": False}}
    run_simulation(server_app=server, client_app=client_app, num_supernodes=settings.clients,
                   backend_config=backend)
    if "error" in outcome:
        raise outcome["error"]
    if "summary" not in outcome:
        raise UserError(None, "the Flower simulation ended without a result (see its log)")
    return outcome["summary"]
