"""The server: a Flower ServerApp that starts from the .wof, runs the chosen
strategy over the trainable weights, evaluates the global weights on the
held-out set after every round, and writes the best of them to the .wof
(atomically, through Trainer.save_weights) only if they beat the starting weights.
"""
import json
import time
from logging import INFO
from pathlib import Path
from typing import Callable

from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx

from microtrain.files.errors import UserError
from microtrain.trainer import Trainer
from microtrain.commands.federated.data import held_out_part
from microtrain.commands.federated.settings import CONFIG_KEY, FederatedSettings
from microtrain.commands.federated.wire import WireGrid, from_record, to_record

OnRound = Callable[[dict], None]


def make_strategy(settings: FederatedSettings):
    """FedAvg, FedProx or FedAdam sampling `fraction` of the connected devices
    (at least `min_clients`) to train, and `evaluate_fraction` of them to evaluate
    the global weights on their own data (the server always evaluates them)."""
    common = dict(fraction_train=settings.fraction, fraction_evaluate=settings.evaluate_fraction,
                  min_train_nodes=settings.min_clients,
                  min_evaluate_nodes=settings.min_clients if settings.evaluate_fraction else 0,
                  min_available_nodes=settings.min_clients)
    if settings.strategy == "fedprox":
        return FedProx(**common, proximal_mu=settings.proximal_mu)
    if settings.strategy == "fedadam":
        return FedAdam(**common, eta=settings.server_learning_rate)
    return FedAvg(**common)


def serve(grid: Grid, settings: FederatedSettings, on_round: OnRound | None = None) -> dict:
    """Run the rounds; returns the summary (with every round's record)."""
    trainer = Trainer.from_config(settings.run)
    test = trainer.check_data(*held_out_part(settings))
    metric = trainer.metric
    wire = WireGrid(grid, settings.transmit)
    rounds: list[dict] = []
    best: dict = {}

    def evaluate(server_round: int, arrays) -> MetricRecord:
        params = from_record(arrays)
        trainer.set_params(params)
        result = trainer.evaluate(*test, checked=True)
        record = {"round": server_round, "clients": wire.replies, "failed": wire.failures,
                  **wire.means(), "test_loss": result["loss"], f"test_{metric}": result[metric],
                  "bytes_down": wire.bytes_down, "bytes_up": wire.bytes_up}
        wire.reset()
        rounds.append(record)
        if not best or trainer.improved(best["result"], result):
            best.update(result=result, params=params, round=server_round)
        if on_round:
            on_round(record)
        return MetricRecord({"loss": result["loss"], metric: result[metric]})

    _wait_for_devices(grid, settings.clients, settings.round_timeout)
    config = ConfigRecord({CONFIG_KEY: settings.to_json()})
    make_strategy(settings).start(grid=wire, initial_arrays=to_record(trainer.memory.params),
                                  num_rounds=settings.rounds, timeout=settings.round_timeout,
                                  train_config=config, evaluate_config=config,
                                  evaluate_fn=evaluate)
    return _finish(trainer, settings, rounds, best)


def _wait_for_devices(grid: Grid, count: int, timeout: float) -> None:
    """Wait until all `count` devices are connected (or `timeout` seconds): a strategy
    samples from the devices connected when a round starts, and the first round
    should not start while some are still connecting.  Later rounds go on with at
    least `min_clients` devices."""
    deadline = time.monotonic() + timeout
    while len(list(grid.get_node_ids())) < count and time.monotonic() < deadline:
        time.sleep(0.2)


def _finish(trainer, settings: FederatedSettings, rounds: list[dict], best: dict) -> dict:
    metric, start = trainer.metric, rounds[0]
    improved = best["round"] > 0
    target = Path(settings.run.output_wof or trainer.art.wof_path)
    if improved:
        trainer.set_params(best["params"])
        trainer.save_weights(target)
    verdict = (f"improved in round {best['round']}" if improved else "did not improve")
    message = (f"test {metric} {verdict}: {start[f'test_{metric}']:.4f} -> "
               f"{best['result'][metric]:.4f}; "
               + (f"weights written to {target}" if improved else "weights not written"))
    return {"event": "summary", "rounds": len(rounds) - 1, "metric": metric,
            f"initial_{metric}": start[f"test_{metric}"], f"best_{metric}": best["result"][metric],
            "best_round": best["round"], "improved": improved, "saved": improved,
            "wof": str(target) if improved else None,
            "bytes_down": sum(r["bytes_down"] for r in rounds),
            "bytes_up": sum(r["bytes_up"] for r in rounds), "message": message}


def make_server_app(settings: FederatedSettings | None = None, on_round: OnRound | None = None,
                    on_summary: OnRound | None = None,
                    on_error: Callable[[Exception], None] | None = None) -> ServerApp:
    """A ServerApp for `settings`, or (None) for the settings in the run config
    (key `microtrain`), as `flwr run` passes them.  Without callbacks the round
    records and the summary go to the ServerApp's log; `on_error` receives a
    UserError instead of Flower logging it as a crash."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            chosen = settings or FederatedSettings.from_json(context.run_config[CONFIG_KEY])
            summary = serve(grid, chosen, on_round or _log)
        except UserError as e:
            if on_error is None:
                raise
            on_error(e)
            return
        (on_summary or _log)(summary)

    return server


def _log(record: dict) -> None:
    log(INFO, "microtrain %s", json.dumps(record))


app = make_server_app()
