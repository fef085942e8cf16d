"""`microtrain sweep`: train with many combinations of `microtrain run`'s options and
keep the best weights.

A trial is a RunConfig: the sweep's fixed options (model, data, metric), its seed
and the trial's values of the swept fields (dataclasses.replace).  Every option of
`run` can be swept, and the best trial is reproduced by its command line, which
the RunConfig writes from its fields (RunConfig.argv).
Every trial starts from the same weights and data order and is judged as `run`
judges: on the test set (the training set without one) by the metric.

The log is JSON Lines (schemas/sweep.md): a header naming the sweep, one record per
finished trial, then a summary.  A sweep started again with the same log skips the
trials it holds, so an interrupted sweep resumes where it stopped.
"""
import itertools
import json
import math
import os
import random
import shlex
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import click

from microtrain.commands import session
from microtrain.files.artifacts import fingerprint
from microtrain.files.atomic import atomic_write
from microtrain.step.threads import limit_blas_threads, require_threadpoolctl, share_of_cores
from microtrain.files.errors import UserError
from microtrain.files.opening import check_output
from microtrain.metrics import HIGHER_IS_BETTER
from microtrain.run_config import SWEEPABLE, RunConfig, SweepSettings, convert
from microtrain.trainer import TrainingDiverged

LOG_VERSION = 1
OPTUNA_HINT = "pip install 'trainconf-microtrain[search]'"


class Pruned(Exception):
    """Optuna judged a trial hopeless after an epoch; it stops there."""


@dataclass(frozen=True)
class Axis:
    """The values one option takes: a list, or a range low:high sampled log-uniformly."""
    key: str                     # the option's flag without dashes, e.g. learning-rate
    values: tuple = ()
    low: float | None = None
    high: float | None = None
    integer: bool = False

    @property
    def is_range(self) -> bool:
        return self.low is not None

    def sample(self, rng: random.Random):
        if not self.is_range:
            return self.values[rng.randrange(len(self.values))]
        value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return round(value) if self.integer else value

    def describe(self):
        return f"{self.low!r}:{self.high!r}" if self.is_range else list(self.values)


def axis(entry: str) -> Axis:
    """Parse NAME=V1,V2,... or NAME=LOW:HIGH (NAME: an option of run without its dashes)."""
    key, _, spec = entry.partition("=")
    if key not in SWEEPABLE:
        raise UserError(None, f"--grid {entry}: {key!r} is not an option of microtrain run "
                              f"that can be swept (choose from {', '.join(SWEEPABLE)})")
    if not spec:
        raise UserError(None, f"--grid {entry}: give values as {key}=V1,V2,... or "
                              f"{key}=LOW:HIGH")
    f = SWEEPABLE[key]
    kind = f.metadata["type"]
    integer = kind is int or isinstance(kind, click.IntRange)
    numeric = integer or kind is float or isinstance(kind, click.FloatRange)
    if ":" in spec and numeric:
        low, high = (_convert(f, entry, t) for t in spec.split(":", 1))
        if not 0 < low < high:
            raise UserError(None, f"--grid {entry}: a range LOW:HIGH is sampled "
                                  f"log-uniformly and needs 0 < LOW < HIGH")
        return Axis(key, low=low, high=high, integer=integer)
    values = tuple(_convert(f, entry, t) for t in spec.split(","))
    if len(set(values)) < len(values):
        raise UserError(None, f"--grid {entry}: a value is repeated")
    return Axis(key, values=values)


def _convert(f, entry: str, text: str):
    try:
        return convert(f, text.strip())
    except UserError as e:
        raise UserError(None, f"--grid {entry}: {e.problem}") from None


def swept(config: RunConfig, params: dict, epochs: int | None = None) -> RunConfig:
    """`config` with the values of a trial (keyed by grid name) and, if given, its epochs."""
    values = {SWEEPABLE[k].name: v for k, v in params.items()}
    if epochs is not None:
        values["epochs"] = epochs
    return replace(config, **values)


def grid(axes: Sequence[Axis]) -> list[dict]:
    ranges = [a.key for a in axes if a.is_range]
    if ranges:
        raise UserError(None, f"--grid {ranges[0]}=LOW:HIGH is a range: sample it with "
                              f"--random N or --search tpe")
    return [dict(zip([a.key for a in axes], combo))
            for combo in itertools.product(*(a.values for a in axes))]


def random_sample(axes: Sequence[Axis], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{a.key: a.sample(rng) for a in axes} for _ in range(n)]


def run_trial(config: RunConfig, report: Callable[[dict], None] | None = None) -> dict:
    """One `microtrain run` of `config`: its outcome as a log record's fields.
    A training that diverges or fails is recorded, not raised: the sweep goes on."""
    history, start = [], time.perf_counter()

    def on_epoch(record):
        history.append(record)
        if report:
            report(record)
    outcome = {"status": "ok", "error": None}
    try:
        summary = session.run(config, on_epoch=on_epoch)
    except Pruned:
        outcome["status"] = "pruned"
    except TrainingDiverged as e:
        outcome.update(status="diverged", error=str(e))
    except UserError as e:
        outcome.update(status="failed", error=str(e))
    except Exception as e:  # noqa: BLE001 -- a numerical or other failure of one trial
        outcome.update(status="failed", error=f"{type(e).__name__}: {e}")
    if outcome["status"] == "ok":
        metric = summary["metric"]
        outcome.update(value=summary[f"final_{metric}"], loss=summary["final_loss"],
                       improved=summary["improved"],
                       weights_sha256=fingerprint(Path(config.output_wof).read_bytes()))
    else:
        outcome.update(value=None, loss=None, improved=False, weights_sha256=None)
    return {**outcome, "epochs": len(history), "seconds": time.perf_counter() - start,
            "history": history}


def _parallel(jobs: int, configs: list[tuple[object, RunConfig]]):
    """Yield (tag, record) of run_trial for each (tag, config), in `jobs` worker processes
    (started fresh, each with its share of the cores for BLAS) as they finish."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    import multiprocessing
    require_threadpoolctl()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=limit_blas_threads,
                             initargs=(share_of_cores(jobs),)) as pool:
        futures = {pool.submit(run_trial, config): tag for tag, config in configs}
        try:
            for future in as_completed(futures):
                yield futures[future], future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def default_log(frozen) -> Path:
    """STEM.sweep.jsonl beside STEM.frozen.circle."""
    frozen = Path(frozen)
    return frozen.with_name(frozen.name.removesuffix(".circle").removesuffix(".frozen")
                            + ".sweep.jsonl")


class SweepLog:
    """The JSON Lines log: header, one record per finished trial, summary."""
    # header fields that change when a finished sweep saved its best weights
    SAVED_CHANGES = ("baseline", "wof_sha256")

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.trials: list[dict] = []
        self.summary: dict | None = None
        if path.exists() and path.stat().st_size:
            self._load(header)
        else:
            atomic_write(path, (json.dumps(header) + "\n").encode())

    def _load(self, header: dict) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a record cut short by an interruption: drop it
            with open(self.path, "r+b") as f:
                f.truncate(end)
        records = []
        for number, line in enumerate(data[:end].decode().splitlines(), 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(self.path, f"line {number} is not JSON") from None
        if not records or records[0].get("event") != "sweep":
            raise UserError(self.path, "is not a sweep log (its first line is not a sweep header)")
        self.trials = [r for r in records if r.get("event") == "trial"]
        self.summary = next((r for r in records if r.get("event") == "summary"), None)
        ignore = self.SAVED_CHANGES if self.summary and self.summary["saved"] and \
            self.summary["wof_sha256"] == header["wof_sha256"] else ()
        differ = [k for k in header if k not in ignore and records[0].get(k) != header[k]]
        if differ:
            raise UserError(self.path, f"was written by another sweep (different "
                                       f"{', '.join(differ)}): give another --log or remove it")

    def append(self, record: dict) -> None:
        if record["event"] == "trial":
            self.trials.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


@dataclass(frozen=True)
class Start:
    """The starting weights a trial's printed command reads, and the run options
    that command starts from."""
    path: Path
    config: RunConfig


class Sweep:
    """One sweep: its trials, log, best weights and summary.  `run()` does the work."""

    def __init__(self, config: RunConfig, grid_texts: Sequence[str], settings: SweepSettings):
        """`config`: the run options fixed for every trial (those left at their
        defaults may be swept)."""
        self.settings = settings
        self.axes = [axis(entry) for text in grid_texts for entry in text.split()]
        keys = [a.key for a in self.axes]
        if len(set(keys)) < len(keys):
            raise UserError(None, "--grid names an option twice")
        if not self.axes:
            raise UserError(None, "nothing to sweep: give --grid 'NAME=V1,V2 ...'")
        defaults = RunConfig(config.frozen)
        both = [k for k in keys if getattr(config, SWEEPABLE[k].name) !=
                getattr(defaults, SWEEPABLE[k].name)]
        if both:
            raise UserError(None, f"--{both[0]} is given both as an option and in --grid: give "
                                  "one value (fixed) or the values to sweep, not both")
        self.base = config if "seed" in keys else replace(config, seed=settings.seed)
        self.candidates = self._candidates()
        trainer, xs, ts, test = session.prepare(self.base)
        self.metric = trainer.metric
        self.epochs = trainer.resolved.parameters.epochs  # when the grid does not set them
        self.rungs = self._rungs() if settings.halving else None
        self.judged_on = "test" if test else "train"
        baseline = trainer.evaluate(*(test or (xs, ts)))[self.metric]
        self.target = Path(config.output_wof or trainer.art.wof_path)
        self.log_path = check_output(settings.log or default_log(config.frozen), None,
                                     option="--log")
        self.best_path = self._beside_log(".best.wof")
        self.work = self._beside_log(".trials")
        self.start = self._keep_start(Path(trainer.art.wof_path))
        header = {"event": "sweep", "version": LOG_VERSION, "search": settings.method,
                  "halving": settings.halving, "space": {a.key: a.describe() for a in self.axes},
                  "trials": self.count(), "seed": settings.seed,
                  "command": self.command({}), "metric": self.metric, "judged_on": self.judged_on,
                  "baseline": baseline,
                  "model_sha256": trainer.art.frozen_sha256,
                  "wof_sha256": fingerprint(Path(trainer.art.wof_path).read_bytes())}
        del trainer, xs, ts, test
        self.higher = HIGHER_IS_BETTER[self.metric]
        self.log = SweepLog(self.log_path, header)
        self.header = header
        self.best: dict | None = None
        for record in self.log.trials:
            self._consider(record)

    def _beside_log(self, suffix: str) -> Path:
        return self.log_path.with_name(self.log_path.name.removesuffix(".jsonl") + suffix)

    def _keep_start(self, wof: Path) -> "Start":
        """Where the starting weights stay readable after the sweep, and the `run` options
        that start from them: when the best weights go over the .wof the trials start from,
        a copy beside the log (made when the log is new, or its copy is gone), so that a
        trial's printed command reproduces it."""
        if not wof.resolve() == self.target.resolve():
            return Start(wof, self.base)
        copy = check_output(self._beside_log(".start.wof"), ("wof",), reads=[("--wof", wof)],
                            option="--log")
        if not (self.log_path.exists() and self.log_path.stat().st_size and copy.exists()):
            atomic_write(copy, wof.read_bytes())
        return Start(copy, replace(self.base, wof=str(copy), output_wof=str(self.target)))

    # -- trials -------------------------------------------------------------------------------
    def _candidates(self) -> list[dict] | None:
        s = self.settings
        if s.method == "grid":
            return grid(self.axes)
        if s.method == "random":
            return random_sample(self.axes, s.random, s.seed)
        return None  # tpe asks Optuna one trial at a time

    def count(self) -> int:
        return len(self.candidates) if self.candidates is not None else self.settings.trials

    def command(self, params: dict, epochs: int | None = None) -> str:
        """The `microtrain run` command line of a trial from the starting weights."""
        return shlex.join(["microtrain", "run"] + swept(self.start.config, params, epochs).argv())

    def _trial(self, trial: int, params: dict, epochs: int | None = None,
               checkpoint: Path | None = None) -> RunConfig:
        """The run options of a trial: written to its own .wof, always."""
        return replace(swept(self.base, params, epochs), save="always",
                       output_wof=str(self._trial_wof(trial)),
                       checkpoint=checkpoint and str(checkpoint),
                       resume=bool(checkpoint and checkpoint.exists()))

    def _trial_wof(self, trial: int) -> Path:
        return self.work / f"trial-{trial}.wof"

    def _key(self, record: dict) -> tuple:
        """Sort key: finished trials best first (ties: the lower trial number), then the rest."""
        if record["status"] != "ok":
            return (1, 0.0, record["trial"])
        return (0, -record["value"] if self.higher else record["value"], record["trial"])

    def _eligible(self, record: dict) -> bool:
        return record["status"] == "ok" and record.get("final", True)

    def _consider(self, record: dict) -> bool:
        """Make `record` the best if it beats the best so far; True if it did."""
        if self._eligible(record) and (self.best is None or
                                       self._key(record) < self._key(self.best)):
            self.best = record
            return True
        return False

    def _finish(self, trial: int, params: dict, outcome: dict, on_trial, **fields) -> dict:
        record = {"event": "trial", "trial": trial, "params": params, **fields, **outcome,
                  "command": self.command(params, fields.get("epochs_total"))}
        wof = self._trial_wof(trial)
        if self._consider(record):
            os.replace(wof, self.best_path)
        elif wof.exists():
            wof.unlink()
        self.log.append(record)
        if on_trial:
            on_trial(record)
        return record

    def _execute(self, jobs: list[tuple[object, RunConfig]]):
        """Yield (tag, outcome) for each (tag, config), in this process or in worker processes."""
        if self.settings.jobs == 1 or len(jobs) < 2:
            for tag, config in jobs:
                yield tag, run_trial(config)
        else:
            yield from _parallel(min(self.settings.jobs, len(jobs)), jobs)

    def _run_candidates(self, on_trial) -> None:
        done = {r["trial"] for r in self.log.trials}
        jobs = [(i, self._trial(i, p)) for i, p in enumerate(self.candidates) if i not in done]
        for trial, outcome in self._execute(jobs):
            self._finish(trial, self.candidates[trial], outcome, on_trial)

    def _run_halving(self, on_trial) -> None:
        """Successive halving: every candidate trains a few epochs, the better half
        trains on (resumed from its checkpoint) to twice as many, until the full epochs."""
        budgets = self.rungs
        rungs = len(budgets)
        done = {(r["trial"], r["rung"]): r for r in self.log.trials}
        survivors = list(range(len(self.candidates)))
        for rung, epochs in enumerate(budgets):
            final = rung == rungs - 1
            jobs = [(i, self._trial(i, self.candidates[i], epochs, self.work / f"trial-{i}.ckpt"))
                    for i in survivors if (i, rung) not in done]
            for trial, outcome in self._execute(jobs):
                done[trial, rung] = self._finish(trial, self.candidates[trial], outcome, on_trial,
                                                 rung=rung, epochs_total=epochs, final=final)
            ranked = sorted((done[i, rung] for i in survivors), key=self._key)
            survivors = sorted(r["trial"] for r in ranked[:math.ceil(len(ranked) / 2)]
                               if r["status"] == "ok")

    def _rungs(self) -> list[int]:
        """Successive halving's epochs per rung: the full epochs at the last rung, half as
        many at each rung before it (at least 1), one rung per halving of the candidates."""
        epochs = [a for a in self.axes if a.key == "epochs"]
        if epochs and (epochs[0].is_range or len(epochs[0].values) > 1):
            raise UserError(None, "--halving sets the epochs of each rung: give one value "
                                  "of epochs (the last rung's)")
        total = swept(self.base, self.candidates[0]).epochs or self.epochs
        rungs = math.ceil(math.log2(len(self.candidates))) + 1 if self.candidates else 1
        return [max(1, total >> (rungs - 1 - r)) for r in range(rungs)]

    def expected_records(self) -> int:
        """Log records the whole sweep writes (with halving, one per trial and rung)."""
        if not self.settings.halving:
            return self.count()
        n, total = len(self.candidates), 0
        for _ in self.rungs:
            total, n = total + n, math.ceil(n / 2)
        return total

    def _run_tpe(self, on_trial) -> None:
        try:
            import optuna
        except ImportError:
            raise UserError(None, f"--search tpe needs Optuna: {OPTUNA_HINT}") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            direction="maximize" if self.higher else "minimize",
            sampler=optuna.samplers.TPESampler(seed=self.settings.seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
        spaces = {a.key: _distribution(optuna, a) for a in self.axes}
        states = {"ok": "COMPLETE", "pruned": "PRUNED"}
        for r in self.log.trials:  # a resumed study learns from the logged trials
            study.add_trial(optuna.trial.create_trial(
                params=r["params"], distributions=spaces, value=r["value"],
                state=getattr(optuna.trial.TrialState, states.get(r["status"], "FAIL")),
                intermediate_values=dict(enumerate(_curve(r["history"], self.metric), 1))))
        for trial in range(len(self.log.trials), self.settings.trials):
            asked = study.ask(spaces)
            params = {a.key: asked.params[a.key] for a in self.axes}

            def report(epoch: dict, asked=asked) -> None:
                asked.report(_curve([epoch], self.metric)[0], epoch["epoch"])
                if asked.should_prune():
                    raise Pruned
            outcome = run_trial(self._trial(trial, params), report)
            if outcome["status"] == "ok":
                study.tell(asked, outcome["value"])
            else:
                study.tell(asked, state=getattr(optuna.trial.TrialState,
                                                states.get(outcome["status"], "FAIL")))
            self._finish(trial, params, outcome, on_trial)

    # -- the whole sweep ----------------------------------------------------------------------
    def run(self, on_trial: Callable[[dict], None] | None = None) -> dict:
        """Run the trials the log does not hold yet, keep the best weights, and return
        the summary (also appended to the log)."""
        if self.log.summary:
            return self.log.summary
        self.work.mkdir(exist_ok=True)
        if self.settings.method == "tpe":
            self._run_tpe(on_trial)
        elif self.settings.halving:
            self._run_halving(on_trial)
        else:
            self._run_candidates(on_trial)
        self._restore_best()
        summary = self._summary()
        if summary["saved"]:
            atomic_write(self.target, self.best_path.read_bytes())
        shutil.rmtree(self.work, ignore_errors=True)
        self.log.append(summary)
        return summary

    def _restore_best(self) -> None:
        """Make sure the best-weights file holds the best trial's weights: after an
        interruption it may hold a later trial's or none; the trial is then trained again."""
        best = self.best
        if best is None or (self.best_path.exists() and
                            fingerprint(self.best_path.read_bytes()) == best["weights_sha256"]):
            return
        params, epochs = best["params"], best.get("epochs_total")
        outcome = run_trial(self._trial(best["trial"], params, epochs))
        if outcome["weights_sha256"] != best["weights_sha256"]:
            raise UserError(self.log_path, f"trial {best['trial']} trained again gave other "
                                           "weights than logged: the training is not reproducible")
        os.replace(self._trial_wof(best["trial"]), self.best_path)

    def ranking(self) -> list[dict]:
        final = {}
        for r in self.log.trials:  # with halving, a trial's last rung stands for it
            final[r["trial"]] = r
        # trials that trained to the end first, then (halving) those that got further
        return sorted(final.values(), key=lambda r: (not self._eligible(r), -r.get("rung", 0))
                      + self._key(r))

    def _summary(self) -> dict:
        ranked = self.ranking()
        best = self.best
        saved = best is not None and best["improved"]
        counts = {s: sum(r["status"] == s for r in ranked) for s in ("ok", "pruned", "diverged",
                                                                     "failed")}
        return {"event": "summary", "search": self.settings.method, "metric": self.metric,
                "judged_on": self.judged_on, "initial": self.header["baseline"],
                "trials": len(ranked), **counts,
                "best": None if best is None else {k: best[k] for k in ("trial", "params",
                                                                        "value", "loss")},
                "command": best["command"] if best else None, "start_wof": str(self.start.path),
                "improved": saved,
                "saved": saved, "wof": str(self.target) if saved else None,
                "wof_sha256": best["weights_sha256"] if saved else None,
                "best_wof": str(self.best_path) if best else None,
                "ranking": [{k: r.get(k) for k in ("trial", "params", "status", "value", "loss",
                                                   "epochs", "epochs_total", "error")}
                            for r in ranked]}


def sweep(grid_texts: Sequence[str], settings: SweepSettings | None = None,
          on_trial: Callable[[dict], None] | None = None, **fixed) -> dict:
    """Sweep as `microtrain sweep` does and return the summary; `fixed`: the RunConfig
    fields fixed for every trial (frozen, inputs, targets, validation_split...)."""
    return Sweep(RunConfig(**fixed), grid_texts, settings or SweepSettings()).run(on_trial)


def _distribution(optuna, axis: Axis):
    if not axis.is_range:
        return optuna.distributions.CategoricalDistribution(list(axis.values))
    kind = optuna.distributions.IntDistribution if axis.integer else \
        optuna.distributions.FloatDistribution
    return kind(axis.low, axis.high, log=True)


def _curve(history: list[dict], metric: str) -> list[float]:
    """Per-epoch values of the metric trials are judged by: on the test set when there is one."""
    return [e.get(f"test_{metric}", e[metric]) for e in history]


def table(summary: dict, keys: Sequence[str]) -> str:
    """The ranked trials as a text table."""
    metric = summary["metric"]
    halving = any(r.get("epochs_total") for r in summary["ranking"])
    head = ["rank", "trial", *keys, *(["epochs trained"] if halving else []), metric, "loss",
            "status"]
    rows = [head]
    for rank, r in enumerate(summary["ranking"], 1):
        ok = r["status"] == "ok"
        rows.append([str(rank), str(r["trial"]), *(f"{r['params'][k]:.4g}" if isinstance(
                     r["params"][k], float) else str(r["params"][k]) for k in keys),
                     *([str(r["epochs_total"])] if halving else []),
                     f"{r['value']:.4f}" if ok else "-", f"{r['loss']:.4f}" if ok else "-",
                     r["status"] if ok or not r["error"] else f"{r['status']}: {r['error']}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]
                     for row in rows)
