"""Where a microtrain training step's time goes, by operator type:

    python scripts/bench_profile.py FROZEN X.npy Y.npy [--batch 32] [--steps 8]

times every closure of the prepared step (microtrain/step/executor.py's Plan) one by one
over `steps` steps (after one warm-up step) and prints, for the forward and backprop
graphs, the operator types by total time: calls per step, ms per step, µs per call.
"Step overhead" is the rest of Trainer.train_batch (loading the batch, the update,
the metric).  Timing each closure adds ~0.1 µs a call: compare totals with the
bench's ms/step, not with each other's tenths.
"""
import time
from collections import defaultdict

import click
import numpy as np


def timed(steps: list, owners: list, totals: dict, graph: str) -> list:
    """The closures, each adding its time to totals[(graph, its operator's type)]."""
    def wrap(step, key):
        def run():
            start = time.perf_counter()
            step()
            totals[key][0] += time.perf_counter() - start
            totals[key][1] += 1
        return run
    return [wrap(s, (graph, op.type if op is not None else "(weight copies, rounding)"))
            for s, (_, op) in zip(steps, owners)]


def plain_ms(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - start))
    return float(min(times))


@click.command(help=__doc__)
@click.argument("frozen")
@click.argument("x")
@click.argument("y")
@click.option("--batch", default=32, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--optimizer", default="adam", show_default=True,
              help="The optimizer of the step (the bench's sequence rows use adam).")
@click.option("--top", default=15, show_default=True, help="Operator types shown per graph.")
def main(frozen, x, y, batch, steps, optimizer, top):
    from microtrain.commands.session import load_data
    from microtrain.trainer import Totals, Trainer
    trainer = Trainer(frozen, batch_size=batch, optimizer=optimizer)
    inputs, targets = trainer.data_types()
    xs, ts = trainer.check_data(load_data([x], dtypes=inputs), load_data([y], dtypes=targets))
    idx = np.arange(batch)
    trainer.train_batch(xs, ts, idx, Totals())  # warm-up, and builds the plans
    click.echo(f"{plain_ms(lambda: trainer.train_batch(xs, ts, idx, Totals()), steps):.2f} ms/step "
               f"uninstrumented (best of {steps})")
    totals = defaultdict(lambda: [0.0, 0])
    for plan in [trainer.plan(trainer.run_rows)]:  # the one train_batch runs on full batches
        plan.forward = timed(plan.forward, plan.owners["forward"], totals, "forward")
        plan.backward = timed(plan.backward, plan.owners["backward"], totals, "backprop")
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_batch(xs, ts, idx, Totals())
    wall = 1000 * (time.perf_counter() - start) / steps
    kernels = sum(t for t, _ in totals.values()) * 1000 / steps
    click.echo(f"{wall:.2f} ms/step instrumented: kernels {kernels:.2f}, step overhead {wall - kernels:.2f} "
               f"(run rows {trainer.run_rows})")
    for graph in ("forward", "backprop"):
        rows = sorted(((t, n, op) for (g, op), (t, n) in totals.items() if g == graph), reverse=True)
        total = 1000 * sum(t for t, _, _ in rows) / steps
        click.echo(f"\n{graph}: {total:.2f} ms/step, {sum(n for _, n, _ in rows) // steps} calls")
        for t, n, op in rows[:top]:
            click.echo(f"  {op:28s} {n // steps:6d} calls  {1000 * t / steps:8.3f} ms  "
                       f"{1e6 * t / n:7.1f} µs/call")


if __name__ == "__main__":
    main()
