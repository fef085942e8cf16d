"""docs/federated.md's results: the digits MLP split across 10 simulated devices
(IID and Dirichlet(0.5)), the global test accuracy after every round next to
centralised training of the same model for the same total epochs.

    python scripts/federated_table.py [--rounds 30] [--learning-rate 0.01] [--clients 10]

Needs the [federated] extra.  Every run starts from the same split weights; the
held-out set is the last 20% of the digits data (as --validation-split 0.2).
"""
import shutil
import tempfile
from pathlib import Path

import click
import numpy as np

from microtrain.data import validation_split
from microtrain.commands.federated.settings import FederatedSettings
from microtrain.commands.federated.simulation import simulate
from microtrain.run_config import RunConfig
from microtrain.shuffle import Shuffler
from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
X, Y = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"
HOLD_OUT = 0.2


def centralised(frozen: Path, epochs: int, every: int, batch_size: int, learning_rate) -> list:
    """Test accuracy before training and after every `every` epochs."""
    (x, y), (tx, ty) = validation_split([np.load(X), np.load(Y)], HOLD_OUT)
    trainer = Trainer(frozen, batch_size=batch_size, optimizer="adam", learning_rate=learning_rate)
    accuracy = [trainer.evaluate([tx], [ty])["accuracy"]]
    history = trainer.fit([x], [y], epochs=epochs, shuffle=True, rng=Shuffler(0),
                          test=([tx], [ty]))
    accuracy += [r["test_accuracy"] for r in history[every - 1::every]]
    return accuracy


def federated(frozen: Path, batch_size: int, learning_rate: float, **options) -> list:
    run = RunConfig(str(frozen), inputs=(str(X),), targets=(str(Y),), validation_split=HOLD_OUT,
                    output_wof=str(frozen.with_suffix(".out.wof")), batch_size=batch_size,
                    optimizer="adam", learning_rate=learning_rate)
    settings = FederatedSettings(run, **options)
    rounds = []
    simulate(settings, on_round=rounds.append)
    return rounds


@click.command()
@click.option("--clients", default=10, show_default=True)
@click.option("--rounds", default=30, show_default=True)
@click.option("--local-epochs", default=1, show_default=True)
@click.option("--batch-size", default=32, show_default=True)
@click.option("--learning-rate", default=0.01, show_default=True, help="Adam's rate for every run.")
def main(clients, rounds, local_epochs, batch_size, learning_rate):
    work = Path(tempfile.mkdtemp())
    try:
        frozen = split(FIXTURES / "mlp.tflite", work).frozen
        common = dict(clients=clients, rounds=rounds, local_epochs=local_epochs,
                      batch_size=batch_size, learning_rate=learning_rate)
        runs = {"IID": federated(frozen, partition="iid", **common),
                "IID, fp16 on the wire": federated(frozen, partition="iid", transmit="fp16",
                                                   **common),
                "Dirichlet(0.5)": federated(frozen, partition="dirichlet:0.5", **common)}
        central = centralised(frozen, rounds * local_epochs, local_epochs, batch_size,
                              learning_rate)
    finally:
        shutil.rmtree(work)
    print(f"{clients} clients, {rounds} rounds x {local_epochs} local epoch(s), all clients "
          f"every round, FedAvg, Adam (lr {learning_rate}), batch {batch_size}; "
          f"centralised: one model, {rounds * local_epochs} epochs on all the training data.\n")
    names = list(runs)
    print("| round (= epochs / " + str(local_epochs) + ") | centralised | "
          + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in range(rounds + 1):
        cells = [f"{central[r]:.4f}"] + [f"{runs[n][r]['test_accuracy']:.4f}" for n in names]
        print(f"| {r} | " + " | ".join(cells) + " |")
    per_round = runs["IID"][1]
    fp16 = runs["IID, fp16 on the wire"][1]
    print(f"\nBytes per round, each way: fp32 {per_round['bytes_down']:,} / "
          f"{per_round['bytes_up']:,}; fp16 {fp16['bytes_down']:,} / {fp16['bytes_up']:,}.")
    final = {n: runs[n][-1]["test_accuracy"] for n in names}
    print(f"Final: centralised {central[-1]:.4f}; "
          + "; ".join(f"{n} {v:.4f} ({100 * (v - central[-1]):+.1f} pp)" for n, v in final.items()))


if __name__ == "__main__":
    main()
