"""Mixed-precision results for docs/mixed_precision.md: fp32 against fp16 with each loss-scale
kind and bf16 without one, on the regression fixture whose last layer is shrunk so that its
backpropagated gradients fall below fp16's range (diabetes data, Adam, batch 32).

    python scripts/mixed_precision_table.py [--epochs 5]
"""
import tempfile
from pathlib import Path

import click
import numpy as np

from microtrain.files.format.wof import write_wof
from microtrain.step.loss_scale import make_loss_scale
from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SHRINK = 3e-6  # the last layer's kernel is multiplied by this


def small_gradient_model(folder: Path, precision: str) -> Path:
    """Split the regression fixture at `precision`, last kernel shrunk by SHRINK."""
    result = split(FIXTURES / "regression.tflite", folder, precision=precision)
    trainer = Trainer(result.frozen)
    weights = {t: w.copy() for t, w in trainer.weights().items()}
    weights[result.trainable[-2]["index"]] *= SHRINK
    write_wof(result.wof, len(trainer.art.forward.tensors), weights)
    return result.frozen


def first_step(frozen: Path, scale: str, x, y) -> tuple[float, float]:
    """On the first batch: the share of the first layer's kernel gradient lost
    (exact zeros) and grad_underflow over all gradient stores."""
    trainer = Trainer(frozen, loss_scale=make_loss_scale(scale))
    grads = trainer.gradients([x[:32]], [y[:32]])[1][trainer.art.training.trainable[0]]
    lost = 1 - np.count_nonzero(grads) / grads.size
    return lost, trainer.underflow.take()["all"]


def _fmt_scale(scale) -> str:
    return f"{scale['min']:g}–{scale['max']:g}" if isinstance(scale, dict) else f"{scale:g}"


@click.command()
@click.option("--epochs", default=5, show_default=True, help="Epochs per run.")
@click.option("--optimizer", default="adam", show_default=True, help="Optimizer of every run.")
def main(epochs: int, optimizer: str):
    x, y = np.load(FIXTURES / "diabetes_x.npy"), np.load(FIXTURES / "diabetes_y.npy")
    rows = ["| types | --loss-scale | step 1: first-layer gradient lost | step 1: underflow, "
            "all gradient stores | epoch 1 grad_underflow_all | final loss | vs fp32 | "
            "loss scale at the end | skipped | ms/step |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        reference = None
        for precision, scale in [("fp32", "none"), ("fp16", "none"), ("fp16", "1024"),
                                 ("fp16", "dynamic"), ("fp16", "adaptive"), ("bf16", "none")]:
            frozen = small_gradient_model(Path(tmp) / f"{precision}-{scale}", precision)
            lost, underflow = first_step(frozen, scale, x, y)
            trainer = Trainer(frozen, optimizer=optimizer, loss_scale=make_loss_scale(scale))
            history = trainer.fit([x], [y], epochs=epochs, shuffle=False)
            final = history[-1]["loss"]
            reference = reference or final
            rows.append(f"| {precision} | {scale} | {lost:.1%} | {underflow:.1%} | "
                        f"{history[0]['grad_underflow_all']:.1%} | {final:.5f} | "
                        f"{final / reference - 1:+.2%} | "
                        f"{_fmt_scale(history[-1]['loss_scale'])} | "
                        f"{sum(r['skipped_steps'] for r in history)} | "
                        f"{np.median([r['ms_per_step'] for r in history]):.3f} |")
    click.echo("\n".join(rows))


if __name__ == "__main__":
    main()
