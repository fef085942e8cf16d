"""`microtrain plot`: figures of training runs and sweeps from their JSON Lines logs.

Input: the output of `microtrain run --json` (one record per epoch, then a summary) or
a sweep log (schemas/sweep.md).  Runs: per-epoch loss and metric, train and test, of
every run on one figure, and for mixed-precision runs the loss scale (per layer for
adaptive scaling) and the fraction of gradient values lost to fp16 underflow.  A sweep:
the final metric against each swept option, and the curves of the best trials.

matplotlib is an optional extra (`[plot]`), imported only when a figure is drawn.
"""
import io
import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from microtrain.files.atomic import atomic_write
from microtrain.files.errors import UserError
from microtrain.metrics import HIGHER_IS_BETTER, METRICS

DPI = 72  # so a figure's size in pixels (PNG) and in points (SVG) are the same numbers
FORMATS = (".png", ".svg")
INSTALL_HINT = "pip install 'trainconf-microtrain[plot]'"
TOP_TRIALS = 5


@dataclass
class Run:
    name: str
    epochs: list[dict]
    metric: str
    subject: str  # the model and data, for the title


@dataclass
class SweepLog:
    path: Path
    header: dict
    trials: list[dict]


def _records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise UserError(path, "is not a text file of JSON lines") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(path, f"line {number} is not JSON") from None
        if not isinstance(record, dict):
            raise UserError(path, f"line {number} is not a JSON object")
        records.append(record)
    return records


def read_log(path) -> Run | SweepLog:
    """A run (`microtrain run --json`) or a sweep log, told apart by the first record."""
    path = Path(path)
    records = _records(path)
    if records and records[0].get("event") == "sweep":
        trials = [r for r in records if r.get("event") == "trial"]
        if not trials:
            raise UserError(path, "is a sweep log without a finished trial")
        return SweepLog(path, records[0], trials)
    epochs = [r for r in records if "epoch" in r and "loss" in r and "event" not in r]
    if not epochs:
        raise UserError(path, "holds no epoch records: expected the output of `microtrain run "
                              "--json` or a sweep log")
    summary = next((r for r in records if r.get("event") == "summary"), {})
    metric = summary.get("metric") or next((m for m in METRICS if m in epochs[0]), None)
    if metric is None or any(metric not in e for e in epochs):
        raise UserError(path, "its epoch records name no metric")
    return Run(path.stem, epochs, metric, _subject(summary.get("model"), summary.get("inputs")))


def _subject(model, inputs) -> str | None:
    """'mlp on digits_x.npy': the model's stem and the data files' names."""
    if not model:
        return None
    name = Path(model).name.removesuffix(".frozen.circle")
    return f"{name} on {', '.join(Path(i).name for i in inputs)}" if inputs else name


def _command_subject(command: str) -> str | None:
    """The subject of a `microtrain run FROZEN --input X ...` command line."""
    words = shlex.split(command)
    if words[:2] != ["microtrain", "run"] or len(words) < 3:
        return None
    inputs = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--input"]
    return _subject(words[2], inputs)


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(None, f"microtrain plot needs matplotlib: {INSTALL_HINT}") from None
    return Figure


def _mixed_precision(run: Run) -> bool:
    return any(e.get("loss_scale", 1.0) != 1.0 or e.get("grad_underflow_all") or
               e.get("skipped_steps") for e in run.epochs)


def _epoch_axes(ax, ylabel: str, legend="small") -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend)
    ax.grid(alpha=0.3)


def _curves(ax, runs: list[Run], key: str, label: str) -> None:
    """Train (solid) and test (dashed) values per epoch, a colour per run."""
    for i, run in enumerate(runs):
        metric_key = key.replace("<metric>", run.metric)
        x = [e["epoch"] for e in run.epochs]
        for prefix, style in (("", "-"), ("test_", "--")):
            if all(prefix + metric_key in e for e in run.epochs):
                ax.plot(x, [e[prefix + metric_key] for e in run.epochs], style, marker=".",
                        color=f"C{i}", label=f"{run.name} {prefix.rstrip('_') or 'train'}")
    _epoch_axes(ax, label)


def _loss_scales(ax, runs: list[Run]) -> None:
    for run in runs:
        x = [e["epoch"] for e in run.epochs]
        layers = sorted({name for e in run.epochs for name in e.get("loss_scale_by_tensor", {})})
        if layers:  # adaptive: a line per layer
            for name in layers:
                ax.plot(x, [e["loss_scale_by_tensor"].get(name, math.nan) for e in run.epochs],
                        marker=".", label=f"{run.name} {name}")
        elif isinstance(run.epochs[0].get("loss_scale"), dict):
            ax.fill_between(x, [e["loss_scale"]["min"] for e in run.epochs],
                            [e["loss_scale"]["max"] for e in run.epochs], alpha=0.3,
                            label=f"{run.name} min-max")
        else:
            ax.plot(x, [e.get("loss_scale", 1.0) for e in run.epochs], marker=".",
                    label=run.name)
    ax.set_yscale("log", base=2)
    _epoch_axes(ax, "loss scale", legend="x-small")


def _underflow(ax, runs: list[Run]) -> None:
    for i, run in enumerate(runs):
        x = [e["epoch"] for e in run.epochs]
        for key, style, what in (("grad_underflow", "-", "weight gradients"),
                                 ("grad_underflow_all", "--", "all gradients")):
            ax.plot(x, [100 * e.get(key, 0.0) for e in run.epochs], style, marker=".",
                    color=f"C{i}", label=f"{run.name} {what}")
    _epoch_axes(ax, "fp16 underflow (% of gradient values)")


def _draw_runs(fig, runs: list[Run]) -> str:
    mixed = any(_mixed_precision(r) for r in runs)
    axes = fig.subplots(2 if mixed else 1, 2, squeeze=False).ravel()
    _curves(axes[0], runs, "loss", "loss")
    metrics = sorted({r.metric for r in runs})
    _curves(axes[1], runs, "<metric>", " / ".join(metrics))
    if mixed:
        _loss_scales(axes[2], runs)
        _underflow(axes[3], runs)
    subjects = sorted({r.subject or r.name for r in runs})
    fig.suptitle(f"{'; '.join(subjects)}: loss and {' / '.join(metrics)} per epoch")
    return "mixed-precision runs" if mixed else "runs"


def _last_records(trials: list[dict]) -> list[dict]:
    """Each trial's last record (with halving, its last rung) that has a metric: finished
    ones, and pruned ones at the epoch they were stopped."""
    last = {}
    for r in trials:
        last[r["trial"]] = r
    return [r for r in last.values() if r["status"] == "ok" or
            (r["status"] == "pruned" and r.get("history"))]


def _value(record: dict, metric: str) -> float:
    if record["status"] == "ok":
        return record["value"]
    epoch = record["history"][-1]
    return epoch.get(f"test_{metric}", epoch.get(metric))


def _history(trials: list[dict], trial: int) -> list[dict]:
    """A trial's epochs over all its records (with halving, rung after rung)."""
    return [e for r in trials if r["trial"] == trial for e in r.get("history", [])]


def _epochs(record: dict) -> int:
    """Epochs a trial trained in all (with halving, over its rungs)."""
    return record.get("epochs_total") or record["epochs"]


def _group_label(status: str, epochs: int) -> str:
    trained = f"{epochs} epoch{'s' if epochs != 1 else ''}"
    return f"pruned after {trained}" if status == "pruned" else trained


def _panels(fig, count: int) -> list:
    """`count` axes on two columns, the last one spanning the last row when it is alone."""
    if count == 1:
        return [fig.add_subplot()]
    rows = math.ceil(count / 2)
    grid = fig.add_gridspec(rows, 2)
    axes = [fig.add_subplot(grid[i // 2, i % 2]) for i in range(count - 1)]
    last = grid[rows - 1, :] if count % 2 else grid[rows - 1, 1]
    return axes + [fig.add_subplot(last)]


def _option_panel(ax, log: SweepLog, key: str, records: list[dict]) -> None:
    """The metric against one swept option: a list of values is categorical, a LOW:HIGH
    range continuous; a marker per (status, epochs trained) group."""
    metric, values = log.header["metric"], log.header["space"][key]
    categories = [json.dumps(v) for v in values] if isinstance(values, list) else None
    groups = sorted({(r["status"], _epochs(r)) for r in records})
    for g, (status, epochs) in enumerate(groups):
        members = [r for r in records if (r["status"], _epochs(r)) == (status, epochs)]
        if categories:
            offset = (g - (len(groups) - 1) / 2) * 0.3 / max(len(groups), 1)
            x = [categories.index(json.dumps(r["params"][key])) + offset for r in members]
        else:
            x = [r["params"][key] for r in members]
        ax.scatter(x, [_value(r, metric) for r in members], color=f"C{g}",
                   marker="x" if status == "pruned" else "o", label=_group_label(status, epochs))
    if categories:
        ax.set_xticks(range(len(values)), [_short(v) for v in values])
        ax.set_xlim(-0.5, len(values) - 0.5)
    elif min(x := [r["params"][key] for r in records]) > 0 and max(x) / min(x) >= 10:
        ax.set_xscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(f"{log.header['judged_on']} {metric}")
    ax.axhline(log.header["baseline"], color="grey", linestyle=":", label="starting weights")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)


def _best_curves(ax, log: SweepLog, records: list[dict], swept: list[str]) -> None:
    metric = log.header["metric"]
    done = [r for r in records if r["status"] == "ok"]
    higher = HIGHER_IS_BETTER[metric]
    best = sorted(done, key=lambda r: -r["value"] if higher else r["value"])[:TOP_TRIALS]
    for r in best:
        history = _history(log.trials, r["trial"])
        values = [e.get(f"test_{metric}", e.get(metric)) for e in history]
        ax.plot(range(1, len(values) + 1), values, marker=".",
                label=f"trial {r['trial']}: " + ", ".join(f"{k}={_short(r['params'][k])}"
                                                          for k in swept))
    ax.set_title(f"best {len(best)} trials", fontsize="medium")
    _epoch_axes(ax, f"{log.header['judged_on']} {metric}", legend="x-small")


def _draw_sweep(fig, log: SweepLog) -> str:
    records = _last_records(log.trials)
    if not any(r["status"] == "ok" for r in records):
        raise UserError(log.path, "no trial of the sweep finished: nothing to plot")
    swept = [k for k in log.header["space"]
             if len({json.dumps(r["params"][k]) for r in records}) > 1]
    axes = _panels(fig, len(swept) + 1)
    for ax, key in zip(axes, swept):
        _option_panel(ax, log, key, records)
    _best_curves(axes[-1], log, records, swept)
    subject = _command_subject(log.header.get("command", "")) or log.path.stem
    search = f"{log.header['search']} sweep" + (" with halving" if log.header.get("halving")
                                                else "")
    fig.suptitle(f"{subject}: {log.header['judged_on']} {log.header['metric']} of "
                 f"{len(records)} trials ({search})")
    return "sweep"


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def draw(parsed: list, width: int, height: int):
    """The matplotlib Figure of read logs (one sweep, or runs), and its kind."""
    figure = _matplotlib()(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    sweeps = [p for p in parsed if isinstance(p, SweepLog)]
    return figure, _draw_sweep(figure, sweeps[0]) if sweeps else _draw_runs(figure, parsed)


def plot(logs, output, width: int = 960, height: int = 640) -> dict:
    """Draw the logs (several runs, or one sweep) into `output` (.png or .svg) of
    `width` x `height` pixels (points in an SVG); returns what was drawn."""
    output = Path(output)
    if output.suffix.lower() not in FORMATS:
        raise UserError(output, f"write the figure to a {' or '.join(FORMATS)} file")
    parsed = [read_log(p) for p in logs]
    sweeps = [p for p in parsed if isinstance(p, SweepLog)]
    if sweeps and len(parsed) > 1:
        raise UserError(sweeps[0].path, "a sweep log is plotted alone (give one sweep log, or "
                                        "any number of run logs)")
    figure, kind = draw(parsed, width, height)
    buf = io.BytesIO()
    figure.savefig(buf, format=output.suffix.lower()[1:], dpi=DPI)
    atomic_write(output, buf.getvalue())
    return {"output": str(output), "kind": kind, "width": width, "height": height,
            "logs": [str(p) for p in logs]}
