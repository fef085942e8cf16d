"""Record the losses and final weights of the mixed-precision scenarios the tests
run, so that changes to how reduced-precision tensors are stored can be checked
to leave every number bit-identical (tests/test_mixed_precision_record.py).

    python scripts/record_mixed_precision.py [-o tests/fixtures/mixed_precision_record.json]

Each scenario trains from the split fixtures and records the per-epoch losses
(JSON keeps a float's exact value) and the SHA-256 of the final fp32 master
weights, plus, for the shrunk regression net, the first batch's gradients.

The numbers depend on the BLAS kernels numpy's OpenBLAS picks for the processor
(their summation order), so the record keeps one entry per kernel set
(threadpoolctl's `architecture`, e.g. Haswell or SkylakeX) and the script
writes the entry of the machine it runs on, keeping the others.
"""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from mixed_precision_table import small_gradient_model  # noqa: E402

from microtrain.step.loss_scale import make_loss_scale  # noqa: E402
from microtrain.trainer import Trainer  # noqa: E402
from trainconf.budget import Choice  # noqa: E402
from trainconf.select import layers, weighted_ops  # noqa: E402
from trainconf.split import (build, load_prepared, resolve_precision, split,  # noqa: E402
                             training_setup, write)

FIXTURES = ROOT / "tests" / "fixtures"
RECORD = FIXTURES / "mixed_precision_record.json"
IMAGES = ("digits_images", "digits_onehot")
DATA = {"mlp": ("digits_x", "digits_onehot"), "cnn": IMAGES, "depthwise": IMAGES,
        "regression": ("diabetes_x", "diabetes_y")}


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


def _load(model: str, n: int | None = None):
    x, t = (np.load(FIXTURES / f"{name}.npy") for name in DATA[model])
    return x[:n], t[:n]


def _result(trainer: Trainer, history: list[dict]) -> dict:
    return {"losses": [r["loss"] for r in history], "weights": _digest(trainer.memory.params)}


def shrunk_regression(folder: Path, precision: str, scale: str) -> dict:
    """docs/mixed_precision.md's underflow case (tests/test_mixed_precision.py): Adam, batch 32, 5 epochs."""
    frozen = small_gradient_model(folder, precision)
    x, y = _load("regression")
    first = Trainer(frozen, loss_scale=make_loss_scale(scale))
    _, grads = first.gradients([x[:32]], [y[:32]])
    trainer = Trainer(frozen, loss_scale=make_loss_scale(scale))
    result = _result(trainer, trainer.fit([x], [y], epochs=5, shuffle=False))
    result["first_gradients"] = {str(t): _digest(g) for t, g in grads.items()}
    return result


def partial_batches(folder: Path, model: str, precision: str, optimizer: str, batch: int) -> dict:
    """300 samples without shuffling: the last batch is partial (tests/test_memory_plan.py,
    tests/test_workspace.py)."""
    frozen = split(FIXTURES / f"{model}.tflite", folder, precision=precision).frozen
    x, t = _load(model, 300)
    trainer = Trainer(frozen, batch_size=batch, optimizer=optimizer)
    return _result(trainer, trainer.fit([x], [t], epochs=2, shuffle=False))


def shuffled_dynamic(folder: Path) -> dict:
    """The resume test's run: mlp fp16, dynamic scale growing every 20 steps, seed 3."""
    frozen = split(FIXTURES / "mlp.tflite", folder, precision="fp16").frozen
    x, t = _load("mlp")
    trainer = Trainer(frozen, loss_scale=make_loss_scale("dynamic", growth_interval=20))
    return _result(trainer, trainer.fit([x], [t], epochs=4, seed=3))


def some_rows(folder: Path) -> dict:
    """cnn fp16 training its last layer's bias and 3 output rows of its kernel, the
    set `--memory-budget` chose before it weighed the biases of more layers
    (tests/test_memory_budget.py)."""
    path, types = FIXTURES / "cnn.tflite", resolve_precision("fp16")
    g = load_prepared(path, types)[1]
    groups = layers(g, weighted_ops(g))
    setup = training_setup(path, None, None, None, None, None, None, {})
    built = build(path, lambda graph: Choice(0, 1, 3).choose(graph, groups), setup.loss,
                  setup.reduction, types, 32, setup.resolved.parameters)
    frozen = write(built, path, folder, setup, None).frozen
    x, t = _load("cnn", 64)
    trainer = Trainer(frozen, batch_size=32)
    return _result(trainer, trainer.fit([x], [t], epochs=1, shuffle=False))


def scenarios() -> dict:
    """Name -> a function of a fresh folder returning the record."""
    runs = {f"regression-shrunk-{p}-{s}": (lambda f, p=p, s=s: shrunk_regression(f, p, s))
            for p, s in [("fp32", "none"), ("fp16", "none"), ("fp16", "1024"),
                         ("fp16", "dynamic"), ("fp16", "adaptive")]}
    for model, optimizer, batch in [("mlp", "adam", 32), ("cnn", "adam", 32),
                                    ("depthwise", "adam", 32), ("depthwise", "sgd", 8)]:
        runs[f"{model}-fp16-{optimizer}-batch{batch}"] = \
            lambda f, m=model, o=optimizer, b=batch: partial_batches(f, m, "fp16", o, b)
    runs["mlp-fp16-dynamic-shuffled"] = shuffled_dynamic
    runs["cnn-fp16-some-rows"] = some_rows
    return runs


def blas_kernels() -> str:
    """The kernel set of the OpenBLAS numpy calls (threadpoolctl's architecture)."""
    from threadpoolctl import threadpool_info
    return next((i.get("architecture") or "unknown" for i in threadpool_info()
                 if i["user_api"] == "blas"), "none")


def run(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return scenarios()[name](Path(tmp))


@click.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=str(RECORD),
              show_default=True, help="Where to write the record (JSON).")
def main(output: str):
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        record = {name: run(name) for name in scenarios()}
    path = Path(output)
    records = json.loads(path.read_text()) if path.exists() else {}
    records[blas_kernels()] = record
    path.write_text(json.dumps(records, indent=1) + "\n")
    click.echo(f"{len(record)} scenarios for BLAS kernels {blas_kernels()} written to {output}")


if __name__ == "__main__":
    main()
