"""docs/memory.md's `--memory-budget` table: for each budget, what `trainconf split`
chooses on the shipped MLP, its planned peak RAM, and the RAM microtrain holds
after training one epoch of the digits data with it (batch 32, Adam).

    python scripts/budget_table.py [--budget 40KiB --budget ...]
"""
import tempfile
from pathlib import Path

import click
import numpy as np

from microtrain.files.errors import UserError
from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
BUDGETS = ("20KB", "24KB", "28KB", "32KB", "40KB", "60KiB", "100KB")


def row(budget: str, folder: Path, x, t) -> str:
    try:
        result = split(FIXTURES / "mlp.tflite", folder, memory_budget=budget)
    except UserError as e:
        return f"| mlp | {budget} | refused: {str(e).split('--memory-budget ')[-1]} | – | – |"
    trainer = Trainer(result.frozen, batch_size=32, optimizer="adam")
    trainer.fit([x], [t], epochs=1, shuffle=False)
    params = sum(p["parameters"] for p in result.trainable)
    return (f"| mlp | {budget} | {result.memory['budget']['text']} ({params:,} parameters) | "
            f"{result.memory['ram']:,} | {trainer.memory_bytes():,} |")


@click.command()
@click.option("--budget", "budgets", multiple=True, default=BUDGETS, show_default=True,
              help="Budgets to split the MLP with (repeat the option).")
def main(budgets):
    x, t = np.load(FIXTURES / "digits_x.npy"), np.load(FIXTURES / "digits_onehot.npy")
    lines = ["| model | budget | trains | planned | held |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        lines += [row(b, Path(tmp) / str(i), x, t) for i, b in enumerate(budgets)]
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
