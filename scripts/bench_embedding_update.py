"""ms/step and bytes of `--embedding-update dense` against `lazy` on a large table.

The model: token ids [B, T] -> GATHER from a V x D table -> mean over T -> dense
layer -> softmax, cce, every weight trained.  For each optimizer and update, a
fresh Trainer runs --warmup steps, then --steps timed steps (the median of
--rounds rounds is reported); the bytes are the planned peak (trainconf split)
and what the run holds (Trainer.memory_bytes), with the gradient and optimizer
parts of the plan.  Prints a Markdown table.

    python scripts/bench_embedding_update.py [--vocab 50000 --dim 64 --batch 32 --steps-per-sample 32]
"""
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from microtrain.files.format.model import save_model
from microtrain.files.graph import Graph, Op, Tensor
from microtrain.trainer import Trainer
from trainconf.split import split
from trainconf.writer import graph_to_model


def build(path: Path, vocab: int, dim: int, steps: int, classes: int = 10) -> Path:
    rng = np.random.default_rng(0)
    tensors, ops = [], []

    def tensor(shape, data=None, dtype=np.float32):
        array = None if data is None else np.asarray(data, dtype)
        tensors.append(Tensor(len(tensors), f"t{len(tensors)}", tuple(shape), np.dtype(dtype), array))
        return len(tensors) - 1

    def op(kind, inputs, shape, **options):
        out = tensor(shape)
        ops.append(Op(len(ops), kind, inputs, [out], options))
        return out
    ids = tensor((-1, steps), dtype=np.int32)
    table = tensor((vocab, dim), rng.normal(0, 0.05, (vocab, dim)))
    rows = op("GATHER", [table, ids], (-1, steps, dim), axis=0)
    pooled = op("MEAN", [rows, tensor((1,), [1], np.int32)], (-1, dim))
    logits = op("FULLY_CONNECTED", [pooled, tensor((classes, dim), rng.normal(0, 0.1, (classes, dim))),
                                    tensor((classes,), np.zeros(classes))], (-1, classes))
    probs = op("SOFTMAX", [logits], (-1, classes), beta=1.0)
    save_model(graph_to_model(Graph(tensors, ops, [ids], [probs]), "embedding_bench", {}), path)
    return path


def measure(frozen, optimizer, update, x, t, batch, warmup, steps, rounds):
    trainer = Trainer(frozen, batch_size=batch, optimizer=optimizer, embedding_update=update)
    xs, ts = trainer.check_data([x], [t])
    times = []
    for r in range(rounds):
        idx = [np.arange(i * batch, (i + 1) * batch) % len(x) for i in range(warmup + steps)]
        for i, part in enumerate(idx):
            if i == warmup:
                start = time.perf_counter()
            trainer.train_batch(xs, ts, part, _Totals())
        times.append(1000 * (time.perf_counter() - start) / steps)
    return statistics.median(times), trainer.memory_bytes()


class _Totals:
    def add(self, *args):
        pass


@click.command()
@click.option("--vocab", default=50000, show_default=True)
@click.option("--dim", default=64, show_default=True)
@click.option("--batch", default=32, show_default=True)
@click.option("--steps-per-sample", "seq", default=32, show_default=True, help="Ids per sample (T).")
@click.option("--optimizers", default="sgd,momentum,adam,rmsprop", show_default=True)
@click.option("--warmup", default=5, show_default=True)
@click.option("--steps", default=50, show_default=True)
@click.option("--rounds", default=3, show_default=True)
def main(vocab, dim, batch, seq, optimizers, warmup, steps, rounds):
    rng = np.random.default_rng(1)
    x = rng.integers(0, vocab, (batch * 8, seq)).astype(np.int32)
    t = np.eye(10, dtype=np.float32)[rng.integers(0, 10, len(x))]
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "embed.circle", vocab, dim, seq)
        print(f"table {vocab} x {dim}, batch {batch} x {seq} ids, every weight trained")
        print("| optimizer | update | ms/step | planned bytes | held bytes | gradients | optimizer state |")
        print("|---|---|---|---|---|---|---|")
        for optimizer in optimizers.split(","):
            for update in ("dense", "lazy"):
                result = split(model, Path(tmp) / update, optimizer=optimizer, batch_size=batch,
                               embedding_update=update, force=True)
                ms, held = measure(result.frozen, optimizer, update, x, t, batch, warmup, steps,
                                   rounds)
                m = result.memory
                print(f"| {optimizer} | {update} | {ms:.2f} | {m['ram']:,} | {held:,} | "
                      f"{m['gradients']:,} | {m['optimizer_state']:,} |")


if __name__ == "__main__":
    main()
