"""Benchmark microtrain against Samsung ONE's onert (the `onert` wheel's
experimental training API): milliseconds per training step and whole-process
peak resident memory, at batch 32 with SGD (lr 0.01) and Adam (lr 0.001).

Every configuration (model x optimizer) runs in two fresh worker processes
(scripts/bench_worker.py), one per runtime, each importing only numpy and its own
runtime.  Both train the same model file on the same data, batches in order.
The parent alternates them (A B A B ...) so that machine drift hits both alike:
after one warm-up epoch each (discarded), every round runs --epochs epochs of
one, then of the other.  ms/step is the median epoch's wall time divided by its
steps; onert's epoch time (its EPOCH_TIMES) also spans binding each batch's
inputs, so the ratio uses microtrain's whole-epoch wall time too.  The compute
columns time forward + backward + update alone (microtrain's ms_per_step,
onert's session.train() call).  Memory is each worker's peak RSS (VmHWM) at
the end, and that peak minus the peak right after the imports.

When onert refuses a fixture, it gets the copy trainconf folds (symbolic batch,
shape chains as constants, weights kept) and microtrain trains that copy too.
The MLP-784 and MobileNetV2 rows train on seeded random data with one-hot targets.

The sequence rows (an LSTM text classifier, a 2-layer transformer encoder; built by
scripts/bench_sequence.py with the official converter) race microtrain against PyTorch
eager (the same architecture in torch.nn) and Keras 3 `fit` on the Keras model itself
(in --tf-python), Adam, the same batches, every runtime at --threads threads, the three
alternating as above; everything trains, the embedding tables too.
"""
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
WORKER = Path(__file__).resolve().parent / "bench_worker.py"
BATCH = 32
LEARNING_RATES = {"sgd": 0.01, "adam": 0.001}
RANDOM_SAMPLES = 1024
QUICK_SAMPLES = 256
# Pause before each switch of runtime: idle BLAS and thread-pool workers spin for
# a while after their last job, which would steal a core from the other runtime.
SETTLE_S = 0.2
TF_PYTHON = "/opt/venvs/tf/bin/python"
# sequence row -> (scripts/bench_sequence.py's .tflite, the architecture torch and keras
# train); rows race microtrain, torch and keras
SEQUENCE = {"lstm_text": ("lstm", "lstm"), "lstm_text_fused": ("lstm_fused", "lstm"),
            "transformer_encoder": ("transformer", "transformer")}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


@dataclass(frozen=True)
class Dataset:
    x: str  # a fixture .npy, or the shape of seeded random samples
    y: str | int  # a fixture .npy, or the number of classes of random one-hot targets

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(self.y, str):
            return np.load(FIXTURES / f"{self.x}.npy"), np.load(FIXTURES / f"{self.y}.npy")
        rng = np.random.default_rng(0)
        shape = tuple(int(d) for d in self.x.split("x"))
        x = rng.random((RANDOM_SAMPLES,) + shape, dtype=np.float32)
        return x, np.eye(self.y, dtype=np.float32)[rng.integers(0, self.y, RANDOM_SAMPLES)]


DIGITS = Dataset("digits_x", "digits_onehot")
DIGIT_IMAGES = Dataset("digits_images", "digits_onehot")
# model -> (data, loss); onert is given the same loss
MODELS = {
    "mlp": (DIGITS, "cce"),
    "residual_mlp": (DIGITS, "cce"),
    "cnn": (DIGIT_IMAGES, "cce"),
    "depthwise": (DIGIT_IMAGES, "cce"),
    "regression": (Dataset("diabetes_x", "diabetes_y"), "mse"),
    "mlp_784": (Dataset("784", 10), "cce"),
    "mobilenetv2": (Dataset("32x32x3", 10), "cce"),
}


# -- the machine ---------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _blas() -> str:
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return f"{blas['name']} {blas.get('version', '')}".strip()


def _commit() -> str | None:
    try:
        run = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True)
    except OSError:  # no git
        return None
    return run.stdout.strip() or None


def machine() -> dict:
    threads = {k: v for k, v in os.environ.items() if k.endswith("_NUM_THREADS")}
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__, "blas": _blas(),
            "onert": metadata.version("onert"), "thread_settings": threads, "commit": _commit()}


def describe(m: dict) -> str:
    threads = ", ".join(f"{k}={v}" for k, v in m["thread_settings"].items()) or "default threads"
    return (f"{m['cpu']}, {m['cores']} cores ({threads}); {m['system']}; Python {m['python']}, "
            f"numpy {m['numpy']} ({m['blas']}); onert {m['onert']}; commit {m['commit']}")


# -- workers -------------------------------------------------------------------------------
class Worker:
    """A bench_worker.py process: one runtime training one configuration."""

    def __init__(self, runtime: str, spec: dict, env: dict, python: str = sys.executable,
                 script: Path = WORKER):
        self.runtime = runtime
        self.proc = subprocess.Popen([python, str(script), runtime], text=True, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.hello = self.ask(spec)
        if self.refused:
            self.proc.wait()

    @property
    def refused(self) -> str | None:
        return self.hello["refused"]

    def ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise click.ClickException(f"the {self.runtime} worker died "
                                       f"(exit status {self.proc.wait()})")
        return json.loads(line)

    def finish(self) -> dict:
        reply = self.ask({"finish": True})
        self.proc.wait()
        return reply


def alternate(workers: dict[str, Worker], rounds: int, epochs: int) -> dict[str, list[dict]]:
    """A warm-up epoch each (discarded), then `rounds` times: `epochs` epochs of each in turn."""
    replies = {name: [] for name in workers}
    for name, worker in workers.items():
        worker.ask({"epochs": 1})
    for _ in range(rounds):
        for name, worker in workers.items():
            time.sleep(SETTLE_S)
            replies[name].append(worker.ask({"epochs": epochs}))
    return replies


# -- model files ---------------------------------------------------------------------------
def folded_copy(model: Path, out: Path) -> Path:
    """The model with a symbolic batch and its shape chains folded, as trainconf splits it."""
    from microtrain.files.format.model import save_model
    from trainconf.split import graph_of, load_model, make_batch_symbolic
    m = load_model(model)
    make_batch_symbolic(m, graph_of(m))
    save_model(m, out)
    return out


def bytecode_env(cache: Path) -> dict:
    """An environment in which the workers import compiled bytecode, as from an
    installed wheel: compiling microtrain's generated flatbuffers module from source
    on every import (PYTHONDONTWRITEBYTECODE) leaves ~15 MB of freed-but-held heap."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(cache)
    warm = [sys.executable, "-c", "import microtrain.trainer, onert.experimental.train"]
    subprocess.run(warm, env=env, check=True)
    return env


class Workspace:
    """A scratch folder holding each model's data (.npy, whole batches), its folded
    copy, microtrain's split of whichever file the runtimes train, and the workers'
    compiled bytecode."""

    def __init__(self, folder: Path, max_samples: int | None):
        self.folder, self.max_samples = folder, max_samples
        self.splits: dict[Path, Path] = {}
        self.env = bytecode_env(folder / "pycache")

    def worker(self, runtime: str, spec: dict, python: str = sys.executable,
               env: dict | None = None, script: Path = WORKER) -> Worker:
        return Worker(runtime, spec, {**self.env, **(env or {})}, python, script)

    def data(self, name: str) -> tuple[str, str, int]:
        """Paths of the inputs and targets, and the sample count.  Cut to whole batches:
        onert pads a partial last batch with repeated rows where microtrain runs a
        smaller one, so only whole batches give both the same work."""
        x_path, y_path = self.folder / f"{name}_x.npy", self.folder / f"{name}_y.npy"
        if not x_path.exists():
            x, y = MODELS[name][0].arrays()
            n = min(len(x), self.max_samples or len(x)) // BATCH * BATCH
            np.save(x_path, x[:n].astype(np.float32))
            np.save(y_path, y[:n].astype(np.float32))
        return str(x_path), str(y_path), len(np.load(x_path, mmap_mode="r"))

    def folded(self, name: str) -> Path:
        out = self.folder / f"{name}.folded.circle"
        return out if out.exists() else folded_copy(FIXTURES / f"{name}.tflite", out)

    def split(self, model: Path) -> Path:
        """microtrain's frozen file for `model`, split once."""
        from trainconf.split import split
        if model not in self.splits:
            name = model.name.split(".")[0]
            out = self.folder / f"split_{model.stem.replace('.', '_')}"
            self.splits[model] = split(model, out, loss=MODELS[name][1]).frozen
        return self.splits[model]


def start_onert(ws: Workspace, name: str, spec: dict) -> tuple[Worker | None, Path, dict]:
    """An onert worker on the fixture, or on its folded copy if onert refuses the
    fixture; (None, fixture) when it refuses both.  Also says what was tried."""
    fixture = FIXTURES / f"{name}.tflite"
    worker = ws.worker("onert", {**spec, "model": str(fixture)})
    if not worker.refused:
        return worker, fixture, {}
    tried = {"refused_fixture": worker.refused}
    folded = ws.folded(name)
    worker = ws.worker("onert", {**spec, "model": str(folded)})
    if not worker.refused:
        return worker, folded, tried
    return None, fixture, {**tried, "refused_folded": worker.refused}


# -- one configuration ---------------------------------------------------------------------
def runtime_result(hello: dict, replies: list[dict], final: dict, steps: int) -> dict:
    epoch_ms = [ms for r in replies for ms in r["epoch_ms"]]
    compute = [ms for r in replies for ms in r["compute_ms_per_step"]]
    return {"ms_per_step": statistics.median(epoch_ms) / steps, "epoch_ms": epoch_ms,
            "compute_ms_per_step": statistics.median(compute), "compute_ms_per_step_epochs": compute,
            "baseline_mib": hello["baseline_kib"] / 1024, "peak_mib": final["peak_kib"] / 1024,
            **_resident(final), "final_loss": final["final_loss"]}


def bench_config(ws: Workspace, name: str, optimizer: str, rounds: int, epochs: int) -> dict:
    x, y, samples = ws.data(name)
    spec = {"x": x, "y": y, "optimizer": optimizer, "learning_rate": LEARNING_RATES[optimizer],
            "batch": BATCH, "loss": MODELS[name][1]}
    onert, model, tried = start_onert(ws, name, spec)
    spec.update(model=str(model), frozen=str(ws.split(model)))
    workers = {"microtrain": ws.worker("microtrain", spec)}
    if onert:
        workers["onert"] = onert
    replies = alternate(workers, rounds, epochs)
    steps = samples // BATCH
    row = {"model": name, "optimizer": optimizer, "model_file": model.name, "samples": samples,
           "steps_per_epoch": steps, **tried}
    for runtime, worker in workers.items():
        row[runtime] = runtime_result(worker.hello, replies[runtime], worker.finish(), steps)
    if onert:
        for ratio, key in (("ratio", "ms_per_step"), ("compute_ratio", "compute_ms_per_step")):
            row[ratio] = row["microtrain"][key] / row["onert"][key]
    return row


def sequence_models(ws: Workspace, tf_python: str) -> Path:
    """scripts/bench_sequence.py's models and data, built once by `tf_python`."""
    out = ws.folder / "sequence"
    if not out.exists():
        script = Path(__file__).resolve().parent / "bench_sequence.py"
        env = {**ws.env, "TF_CPP_MIN_LOG_LEVEL": "3"}
        subprocess.run([tf_python, str(script), str(out)], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def bench_sequence(ws: Workspace, name: str, rounds: int, epochs: int, threads: int,
                   tf_python: str) -> dict:
    """microtrain, PyTorch eager and Keras fit training one sequence model, alternating."""
    from microtrain.files.errors import UserError
    from trainconf.split import split
    folder, (stem, arch) = sequence_models(ws, tf_python), SEQUENCE[name]
    try:
        result = split(folder / f"{stem}.tflite", ws.folder / f"split_{name}", loss="cce",
                       optimizer="adam")
    except UserError as e:  # an operator this branch cannot train yet
        return {"model": name, "model_file": f"{stem}.tflite",
                "refused": str(e).replace(f"{folder}/", "")}
    spec = {"x": str(folder / "tokens.npy"), "y": str(folder / "labels.npy"), "optimizer": "adam",
            "learning_rate": LEARNING_RATES["adam"], "batch": BATCH, "loss": "cce",
            "arch": arch, "threads": threads, "frozen": str(result.frozen),
            "model": str(folder / f"{arch}.keras")}
    env = {v: str(threads) for v in THREAD_VARIABLES}
    workers = {"microtrain": ws.worker("microtrain", spec, env=env),
               "torch": ws.worker("torch", spec, env=env),
               "keras": ws.worker("keras", spec, python=tf_python,
                                  env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"})}
    replies = alternate(workers, rounds, epochs)
    samples = len(np.load(spec["x"], mmap_mode="r"))
    steps = -(-samples // BATCH)
    row = {"model": name, "optimizer": "adam", "threads": threads, "samples": samples,
           "steps_per_epoch": steps, "model_file": f"{stem}.tflite",
           "trainable_parameters": {"microtrain": result.summary()["trainable_parameters"]}}
    for runtime, worker in workers.items():
        final = worker.finish()
        row[runtime] = runtime_result(worker.hello, replies[runtime], final, steps)
        if "trainable_parameters" in final:
            row["trainable_parameters"][runtime] = final["trainable_parameters"]
    for other in ("torch", "keras"):
        row[f"ratio_{other}"] = row["microtrain"]["ms_per_step"] / row[other]["ms_per_step"]
    return row


def sequence_markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Sequence models, Adam lr {LEARNING_RATES['adam']}, batch {BATCH}, "
             f"{s['threads']} thread(s) each; medians over {s['rounds']} rounds x {s['epochs']} "
             "epochs per runtime after a discarded warm-up epoch, the three runtimes "
             "alternating.  microtrain trains what `trainconf split --trainable all` makes "
             "trainable, PyTorch and Keras every parameter (embedding tables too):", "",
             "| model | microtrain ms/step | PyTorch eager ms/step | Keras fit ms/step | "
             "ratio microtrain/PyTorch | ratio microtrain/Keras | trainable parameters "
             "microtrain / PyTorch / Keras | peak MiB microtrain / PyTorch / Keras | "
             "final loss microtrain / PyTorch / Keras |", "|---|---|---|---|---|---|---|---|---|"]
    runtimes = ("microtrain", "torch", "keras")
    for row in report["sequence"]:
        if "refused" in row:
            lines.append(f"| {row['model']} | split refuses {row['model_file']}: "
                         f"{row['refused']} |" + " |" * 8)
            continue
        cells = [row["model"], *(_ms(row[r]["ms_per_step"]) for r in runtimes),
                 f"**{row['ratio_torch']:.2f}**", f"**{row['ratio_keras']:.2f}**",
                 " / ".join(f"{row['trainable_parameters'].get(r, '–'):,}" for r in runtimes),
                 " / ".join(f"{row[r]['peak_mib']:.0f}" for r in runtimes),
                 " / ".join(f"{row[r]['final_loss']:.4f}" for r in runtimes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def profile_epoch(ws: Workspace, row: dict) -> str:
    """cProfile of one microtrain epoch (after a warm-up epoch) as Markdown tables."""
    from microtrain.shuffle import Shuffler
    from microtrain.trainer import Trainer
    x, y, _ = ws.data(row["model"])
    model = FIXTURES / row["model_file"] if row["model_file"].endswith(".tflite") \
        else ws.folder / row["model_file"]
    trainer = Trainer(ws.split(model), batch_size=BATCH, optimizer=row["optimizer"],
                      learning_rate=LEARNING_RATES[row["optimizer"]])
    xs, ts = trainer.check_data([np.load(x)], [np.load(y)])
    rng = Shuffler(0)
    trainer.train_epoch(xs, ts, False, rng)
    profile = cProfile.Profile()
    profile.runcall(trainer.train_epoch, xs, ts, False, rng)
    stats = pstats.Stats(profile).stats
    return "\n\n".join(_top(stats, order, row["steps_per_epoch"])
                       for order in ("cumulative", "own"))


def _top(stats: dict, order: str, steps: int, lines: int = 10) -> str:
    """The `lines` functions with the most `order` time; pstats' own report rounds
    to whole milliseconds, too coarse for a step of a few microseconds."""
    key = 3 if order == "cumulative" else 2  # stats values: (calls, calls, own, cumulative, callers)
    top = sorted(stats.items(), key=lambda item: item[1][key], reverse=True)[:lines]
    rows = [f"| top {lines} by {order} time | calls | own ms | cumulative ms | "
            "cumulative µs/step |", "|---|---|---|---|---|"]
    for (file, line, function), (_, calls, own, cumulative, _) in top:
        where = f"{Path(file).name}:{line}({function})" if line else function
        rows.append(f"| `{where}` | {calls} | {1000 * own:.3f} | {1000 * cumulative:.3f} | "
                    f"{1e6 * cumulative / steps:.2f} |")
    return "\n".join(rows)


# -- output --------------------------------------------------------------------------------
def _ms(v: float) -> str:
    return f"{v:.3g}"


def _resident(final: dict) -> dict:
    """A worker's anonymous and file-backed resident MiB at the end of training."""
    return {"anon_mib": final["anon_kib"] / 1024, "file_mib": final["file_kib"] / 1024}


def _memory(r: dict) -> str:
    return (f"{r['peak_mib']:.1f} (+{r['peak_mib'] - r['baseline_mib']:.1f}; "
            f"anon {r['anon_mib']:.1f} / file {r['file_mib']:.1f})")


def _table_row(row: dict) -> str:
    mt, on = row["microtrain"], row.get("onert")
    if on is None:
        on = {"ms_per_step": f"refused ({row['refused_folded']})", "compute_ms_per_step": "–",
              "peak_mib": None, "final_loss": None}
    cells = [row["model"], row["optimizer"]]
    for key, ratio in (("ms_per_step", "ratio"), ("compute_ms_per_step", "compute_ratio")):
        cells += [_ms(mt[key]), _ms(on[key]) if ratio in row else on[key],
                  f"**{row[ratio]:.2f}**" if ratio in row else "–"]
    cells += [_memory(mt), _memory(on) if on["peak_mib"] is not None else "–",
              " / ".join(f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "–"
              for r in (mt, on))]
    return "| " + " | ".join(cells) + " |"


def _notes(rows: list[dict]) -> list[str]:
    notes = {}
    for row in rows:
        if "refused_folded" in row:
            notes[row["model"]] = (f"onert refuses {row['model']} and trainconf's folded copy "
                                   f"of it ({row['refused_folded']}); microtrain trained the fixture.")
        elif "refused_fixture" in row:
            notes[row["model"]] = (f"onert refuses the {row['model']} fixture "
                                   f"({row['refused_fixture']}); both runtimes trained "
                                   "trainconf's folded copy of it.")
    return [f"- {n}" for n in notes.values()]


def markdown(report: dict) -> str:
    s = report["settings"]
    load = report["load_average"]
    lines = [f"Machine: {describe(report['machine'])}; 1-minute load average {load['start']:.2f} "
             f"before the run, {load['end']:.2f} after.", "",
             f"Batch {BATCH}; SGD lr {LEARNING_RATES['sgd']}, Adam lr {LEARNING_RATES['adam']}; "
             f"medians over {s['rounds']} rounds x {s['epochs']} epochs per runtime after a "
             "discarded warm-up epoch, the two runtimes alternating.", "",
             "| model | optimizer | microtrain ms/step | onert ms/step | ratio microtrain/onert | "
             "microtrain compute ms/step | onert compute ms/step | compute ratio | "
             "microtrain peak MiB (+ over import; anon / file at the end) | onert peak MiB "
             "(+ over import; anon / file at the end) | "
             "final loss microtrain / onert |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_table_row(row) for row in report["rows"]]
    lines += ["", "ms/step = whole-epoch wall time / steps (onert's EPOCH_TIMES; for microtrain the "
                  "time of its train_epoch), so it includes copying each batch in; the ratio uses it.  "
                  "compute = forward + backward + update alone (microtrain's ms_per_step; onert's "
                  "time in session.train() per step).  Peak = whole-process peak RSS (VmHWM) of a "
                  "worker that imported only numpy and that runtime; + = peak minus the peak right "
                  "after those imports; anon / file = the resident anonymous and file-backed "
                  "MiB at the end of training (/proc/self/smaps_rollup: file-backed pages are "
                  "library code and files read in place, such as microtrain's mapped models, "
                  "which the system may drop and read again).  Final loss = mean loss over "
                  "the training data after all "
                  "epochs (the same data in the same order for both)."]
    return "\n".join(lines + _notes(report["rows"])) + "\n"


def _median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return float(np.median(times))


def tool_times(folder: Path) -> dict:
    """Host-side times on MobileNetV2 (1.6 MB, 65 ops): load + save, and split."""
    from microtrain.files.format.model import load_model, save_model
    from trainconf.split import split
    model = FIXTURES / "mobilenetv2.tflite"
    return {"load_save_ms": _median_ms(lambda: save_model(load_model(model), folder / "m.circle")),
            "split_ms": _median_ms(lambda: split(model, folder / "split"))}


# (types, --loss-scale) of the precision table: fp32, fp16 with every loss-scale kind, bf16
PRECISION_RUNS = [("fp32", "none"), ("fp16", "none"), ("fp16", "1024"), ("fp16", "dynamic"),
                  ("fp16", "adaptive"), ("bf16", "none")]
# the memory targets: fp16/fp32 planned and measured peak on MobileNetV2
MEMORY_TARGETS = [("adam", 32, 0.8), ("sgd", 32, 0.75), ("sgd", 128, 0.65)]
# issue 20's target: half the RAM MobileNetV2 (every layer, Adam, batch 32) planned before
# it (21,974,832 bytes at commit f718a80)
RECOMPUTE_BUDGET = "10.9MB"


def _split_worker(ws: Workspace, name: str, out: str, optimizer: str, batch: int,
                  scale: str = "none", **split_options):
    """A microtrain worker training `name` split with `split_options`, and the
    split's planned peak by part."""
    from trainconf.split import split
    result = split(FIXTURES / f"{name}.tflite", ws.folder / out, loss=MODELS[name][1],
                   optimizer=optimizer, batch_size=batch, loss_scale=scale, **split_options)
    return ws.worker("microtrain", _microtrain_spec(ws, name, result.frozen, optimizer, batch,
                                                    scale)), result.memory


def _precision_workers(ws: Workspace, name: str, runs, optimizer: str, batch: int) -> dict:
    """A microtrain worker per (types, loss scale), and each split's planned peak."""
    workers, planned = {}, {}
    for types, scale in runs:
        workers[types, scale], memory = _split_worker(
            ws, name, f"{name}-{types}-{optimizer}-{batch}", optimizer, batch, scale,
            precision=types)
        planned[types, scale] = memory["ram"]
    return {"workers": workers, "planned": planned}


def _microtrain_spec(ws: Workspace, name: str, frozen: Path, optimizer: str, batch: int,
                     scale: str = "none") -> dict:
    x, y, _ = ws.data(name)
    return {"x": x, "y": y, "optimizer": optimizer, "learning_rate": LEARNING_RATES[optimizer],
            "batch": batch, "loss": MODELS[name][1], "frozen": str(frozen), "loss_scale": scale}


def _baseline_worker(ws: Workspace, rev: str, name: str, optimizer: str, batch: int):
    """A microtrain worker of the source tree of commit `rev` (its own trainconf
    splits `name` with its defaults, its own bench_worker.py trains it), and that
    split's planned peak."""
    tree = ws.folder / f"baseline-{rev}"
    if not tree.exists():
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
        if archive.returncode:
            raise click.ClickException(f"--baseline-rev {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    env = {**ws.env, "PYTHONPATH": str(tree)}
    out = ws.folder / f"baseline-{rev}-split"
    run = subprocess.run([sys.executable, "-c", "from trainconf.cli import main; main()", "split",
                          str(FIXTURES / f"{name}.tflite"), "-o", str(out), "--optimizer",
                          optimizer, "--batch-size", str(batch), "--loss", MODELS[name][1],
                          "--json"], capture_output=True, text=True, env=env, cwd=tree)
    if run.returncode:
        raise click.ClickException(f"--baseline-rev {rev}: its split failed: {run.stderr.strip()}")
    frozen = next(out.glob("*.frozen.circle"))
    memory = json.loads(run.stdout)["memory"]
    return ws.worker("microtrain", _microtrain_spec(ws, name, frozen, optimizer, batch), env=env,
                     script=tree / "scripts" / "bench_worker.py"), memory


def recompute_row(ws: Workspace, rounds: int, epochs: int, budget: str,
                  baseline: str | None) -> dict:
    """MobileNetV2, every layer, Adam, batch 32: the default split against the split
    for `budget` (`--memory-budget`: recomputation, kernel scratch and tiles as the
    budget chooses) and, given `baseline` (a commit), that commit's default split
    trained by its own code, the workers alternating; compute ms/step, planned and
    measured peak."""
    started = {"default": _split_worker(ws, "mobilenetv2", "default", "adam", BATCH),
               "budget": _split_worker(ws, "mobilenetv2", "budget", "adam", BATCH,
                                       memory_budget=budget)}
    if baseline:
        started = {"baseline": _baseline_worker(ws, baseline, "mobilenetv2", "adam", BATCH),
                   **started}
    replies = alternate({mode: w for mode, (w, _) in started.items()}, rounds, epochs)
    row = {"budget": budget, "baseline_rev": baseline, "runs": {}}
    for mode, (worker, memory) in started.items():
        final = worker.finish()
        row["runs"][mode] = {"compute_ms_per_step": statistics.median(
                         ms for r in replies[mode] for ms in r["compute_ms_per_step"]),
                     "memory": memory, "peak_mib": final["peak_kib"] / 1024,
                     "held_mib": final["held_bytes"] / 2 ** 20, "final_loss": final["final_loss"]}
    return row


def precision_row(ws: Workspace, name: str, rounds: int, epochs: int) -> dict:
    """microtrain's compute ms/step (Adam, batch 32) and peak memory per type and
    loss scale, the runs alternating in fresh processes; ratios to fp32 within this run."""
    started = _precision_workers(ws, name, PRECISION_RUNS, "adam", BATCH)
    replies = alternate(started["workers"], rounds, epochs)
    row = {"model": name, "runs": {}}
    for key, worker in started["workers"].items():
        final = worker.finish()
        row["runs"][" ".join(key)] = {
            "compute_ms_per_step": statistics.median(
                ms for r in replies[key] for ms in r["compute_ms_per_step"]),
            "planned_bytes": started["planned"][key], "peak_mib": final["peak_kib"] / 1024,
            "added_mib": (final["peak_kib"] - worker.hello["baseline_kib"]) / 1024,
            **_resident(final), "final_loss": final["final_loss"]}
    return row


def memory_targets(ws: Workspace, rounds: int) -> list[dict]:
    """fp32 against fp16 (dynamic loss scale) on MobileNetV2 for each memory target."""
    rows = []
    for optimizer, batch, target in MEMORY_TARGETS:
        started = _precision_workers(ws, "mobilenetv2", [("fp32", "none"), ("fp16", "dynamic")],
                                     optimizer, batch)
        alternate(started["workers"], 1, 1)
        row = {"optimizer": optimizer, "batch": batch, "target": target}
        for key, worker in started["workers"].items():
            final = worker.finish()
            row[key[0]] = {"planned_bytes": started["planned"][key],
                           "peak_mib": final["peak_kib"] / 1024,
                           "baseline_mib": worker.hello["baseline_kib"] / 1024,
                           "added_mib": (final["peak_kib"] - worker.hello["baseline_kib"]) / 1024,
                           "data_mib": final["data_bytes"] / 2 ** 20,
                           "held_mib": final["held_bytes"] / 2 ** 20,
                           "mapped_mib": final["mapped_bytes"] / 2 ** 20, **_resident(final)}
        rows.append(row)
    return rows


def _ratio_cell(value: float, target: float) -> str:
    return f"**{value:.2f}**" + ("" if value <= target else " (misses)")


def extra_markdown(report: dict) -> str:
    lines = []
    if "tools" in report:
        tools = report["tools"]
        lines += ["", f"Host side, MobileNetV2 (1.6 MB, 65 ops): load + save "
                      f"{tools['load_save_ms']:.0f} ms, `trainconf split` {tools['split_ms']:.0f} ms "
                      "(medians of 5)."]
    names = [" ".join(k) for k in PRECISION_RUNS]
    lines += ["", "Mixed precision, Adam, batch 32: compute ms/step (forward + backward + update; "
                  "ratio to fp32 in brackets, target 1.5) and planned RAM / measured peak (MiB; "
                  "measured = whole-process peak RSS, + = above the worker's peak after its "
                  "imports):", "",
              "| model | " + " | ".join(names) + " | planned fp32 / fp16 / bf16 | measured fp32 / "
              "fp16 / bf16 |", "|---|" + "---|" * (len(names) + 2)]
    for row in report["precision"]:
        runs, base = row["runs"], row["runs"]["fp32 none"]["compute_ms_per_step"]
        cells = [f"{_ms(runs[n]['compute_ms_per_step'])} "
                 f"({_ratio_cell(runs[n]['compute_ms_per_step'] / base, 1.5)})" for n in names]
        mib = lambda b: f"{b / 2 ** 20:.2f}"  # noqa: E731
        planned = " / ".join(mib(runs[n]["planned_bytes"]) for n in ("fp32 none", "fp16 dynamic",
                                                                     "bf16 none"))
        measured = " / ".join(f"{runs[n]['peak_mib']:.1f} (+{runs[n]['added_mib']:.1f})"
                              for n in ("fp32 none", "fp16 dynamic", "bf16 none"))
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {planned} | {measured} |")
    if report.get("memory_targets"):
        lines += ["", "Memory targets, MobileNetV2 (α 0.35, 32×32): fp16 (dynamic loss scale) "
                      "against fp32 from the same run, MiB.  Planned = `trainconf split`'s "
                      "planned peak RAM (`ram`; the files it reads in place apart).  "
                      "Measured = the worker's peak RSS above its peak right "
                      "after importing numpy and microtrain, split into the data it loaded, "
                      "the RAM the trainer's arrays hold (`memory_bytes`, = planned) and the rest "
                      "(Python objects of the prepared step, allocator slack, BLAS buffers, "
                      "library code paged in).  Whole = the whole-process peak RSS (VmHWM), "
                      "the import baseline included.  Anon / file = resident anonymous and "
                      "file-backed MiB at the end of training (/proc/self/smaps_rollup; mapped "
                      "= the split's files microtrain reads in place, `mapped_bytes`):", "",
                  "| optimizer | batch | planned fp32 / fp16 | planned ratio | measured fp32 / "
                  "fp16 (data + held + rest) | measured ratio | whole fp32 / fp16 (baseline) | "
                  "whole ratio | anon / file / mapped fp32 | anon / file / mapped fp16 | target |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["memory_targets"]:
            a, b = r["fp32"], r["fp16"]
            parts = " / ".join(
                f"{m['added_mib']:.1f} ({m['data_mib']:.1f} + {m['held_mib']:.1f} + "
                f"{m['added_mib'] - m['data_mib'] - m['held_mib']:.1f})" for m in (a, b))
            lines.append(
                f"| {r['optimizer']} | {r['batch']} | {a['planned_bytes'] / 2 ** 20:.2f} / "
                f"{b['planned_bytes'] / 2 ** 20:.2f} | "
                f"{_ratio_cell(b['planned_bytes'] / a['planned_bytes'], r['target'])} | "
                f"{parts} | {_ratio_cell(b['added_mib'] / a['added_mib'], r['target'])} | "
                f"{a['peak_mib']:.1f} / {b['peak_mib']:.1f} ({a['baseline_mib']:.1f} / "
                f"{b['baseline_mib']:.1f}) | {_ratio_cell(b['peak_mib'] / a['peak_mib'], r['target'])} "
                + "".join(f"| {m['anon_mib']:.1f} / {m['file_mib']:.1f} / {m['mapped_mib']:.2f} "
                          for m in (a, b)) + f"| {r['target']} |")
    return "\n".join(lines) + "\n"


def _recompute_cells(name: str, r: dict, runs: dict) -> list[str]:
    memory = r["memory"]
    extra, budget = memory.get("recompute", {}), memory.get("budget")
    ratios = [f"**{r['compute_ms_per_step'] / runs[to]['compute_ms_per_step']:.2f}**"
              for to in ("baseline", "default") if to in runs]
    return [name, f"{r['compute_ms_per_step']:.1f}", *ratios,
            f"{memory.get('ram', memory['total']) / 2 ** 20:.2f}", f"{r['held_mib']:.2f}",
            f"{r['peak_mib']:.1f}", budget["text"] if budget else "all",
            (f"{extra['extra_ops']} ops, {extra['extra_fraction']:.0%} of the forward's "
             "multiply-adds") if extra.get("extra_ops") else "–",
            f"{budget['scratch_tile']:,}" if budget and budget["scratch_tile"] else "–",
            f"{r['final_loss']:.6f}"]


def recompute_markdown(row: dict) -> str:
    runs, rev = row["runs"], row["baseline_rev"]
    names = {"baseline": f"commit {rev}, default", "default": "default",
             "budget": f"`--memory-budget {row['budget']}`"}
    ratios = [f"ratio to {to}" for to in ("baseline", "default") if to in runs]
    head = ["split", "compute ms/step", *ratios, "planned RAM MiB", "held MiB", "peak RSS MiB",
            "trains", "recomputed", "scratch tile (bytes)", "final loss"]
    return "\n".join([
        "", "MobileNetV2 (α 0.35, 32×32), Adam, batch 32, fp32: the default split (every layer) "
            f"against `trainconf split --memory-budget {row['budget']}`"
            + (f" and commit {rev}'s default split trained by its own code" if rev else "")
            + ", alternating in fresh processes; compute ms/step (forward + backward + update), "
              "the planned RAM (for the baseline its planned total, which counted the model "
              "files as RAM), the trainer's held arrays (= planned) and the whole-process peak RSS; the budget's "
              "scratch tile is its compact kernels' (– : the fastest layouts):", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        + ["| " + " | ".join(_recompute_cells(names[m], runs[m], runs)) + " |"
           for m in names if m in runs]) + "\n"


def _write(path: Path | None, text: str) -> None:
    if path is not None:
        from microtrain.files.atomic import atomic_write
        atomic_write(path, text.encode())


def _check_output(ctx, param, path: Path | None) -> Path | None:
    """Refuse a missing folder now, not after minutes of benchmarking."""
    if path is not None and not path.resolve().parent.is_dir():
        raise click.BadParameter(f"{path}: no such folder {path.parent}")
    return path


def _check_models(ctx, param, value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS and n not in SEQUENCE]
    if unknown or not names:
        raise click.BadParameter(f"unknown model(s) {', '.join(unknown) or '(none given)'}; "
                                 f"choose from {', '.join([*MODELS, *SEQUENCE])}")
    return names


@click.command(help=__doc__)
@click.option("--models", default=",".join([*MODELS, *SEQUENCE]), show_default=True,
              callback=_check_models, help="Comma-separated models to benchmark.")
@click.option("--rounds", type=click.IntRange(1), default=None,
              help="Alternations of the two runtimes per configuration [default: 5; 1 with --quick].")
@click.option("--epochs", type=click.IntRange(1), default=None,
              help="Timed epochs of each runtime per round [default: 3; 2 with --quick].")
@click.option("--quick", is_flag=True,
              help=f"Smoke run: fewer rounds and epochs, at most {QUICK_SAMPLES} samples per model.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path),
              callback=_check_output, help="Also write the Markdown table to this file (it is always printed).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              callback=_check_output, help="Write every measurement (per-epoch times too) as JSON to this file.")
@click.option("--precision-only", is_flag=True,
              help="Only the mixed-precision tables (fp32/fp16/bf16 speed and memory, the "
                   "MobileNetV2 memory targets), not the comparison with onert.")
@click.option("--recompute-only", is_flag=True,
              help="Only the recomputation table (MobileNetV2, every layer, Adam, batch 32: "
                   "the default split against one for --budget).")
@click.option("--budget", default=RECOMPUTE_BUDGET, show_default=True,
              help="The recomputation table's --memory-budget.")
@click.option("--baseline-rev", default=None,
              help="Also train, in the recomputation table's alternation, the default split "
                   "of this commit's trainconf with this commit's microtrain (a source tree "
                   "of it from git archive), so that both ratios come from one run.")
@click.option("--profile", is_flag=True,
              help="After the table, print a cProfile of one microtrain epoch (top 10 by "
                   "cumulative and by own time) for every row where microtrain is slower "
                   "than onert.")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
              help="Threads of every runtime in the sequence rows (BLAS, torch, TensorFlow).")
@click.option("--tf-python", default=TF_PYTHON, show_default=True,
              help="Interpreter with TensorFlow and Keras 3, for the sequence rows.")
def main(models, rounds, epochs, quick, markdown_path, json_path, precision_only, profile,
         threads, tf_python, recompute_only, budget, baseline_rev):
    rounds = rounds or (1 if quick else 5)
    epochs = epochs or (2 if quick else 3)
    start = time.perf_counter()
    report = {"machine": machine(), "settings": {"batch": BATCH, "learning_rates": LEARNING_RATES,
                                                 "rounds": rounds, "epochs": epochs,
                                                 "threads": threads},
              "rows": [], "sequence": [], "load_average": {"start": os.getloadavg()[0]}}
    sequence = [] if precision_only or recompute_only else [n for n in models if n in SEQUENCE]
    models = [] if recompute_only else [n for n in models if n in MODELS]
    with tempfile.TemporaryDirectory() as tmp:
        ws = Workspace(Path(tmp), QUICK_SAMPLES if quick else None)
        for name in sequence:
            report["sequence"].append(bench_sequence(ws, name, rounds, epochs, threads, tf_python))
            click.echo(f"sequence: {name} done", err=True)
        for name in [] if precision_only else models:
            for optimizer in LEARNING_RATES:
                row = bench_config(ws, name, optimizer, rounds, epochs)
                click.echo(_table_row(row), err=True)
                if profile and row.get("ratio", 0) > 1:
                    row["profile"] = profile_epoch(ws, row)
                report["rows"].append(row)
        if report["rows"]:
            report["tools"] = tool_times(Path(tmp))
        report["precision"] = []
        for name in models:
            report["precision"].append(precision_row(ws, name, rounds, epochs))
            click.echo(f"precision: {name} done", err=True)
        if "mobilenetv2" in models:
            report["memory_targets"] = memory_targets(ws, rounds)
        if recompute_only:
            report["recompute"] = recompute_row(ws, rounds, epochs, budget, baseline_rev)
    report["elapsed_s"] = time.perf_counter() - start
    report["load_average"]["end"] = os.getloadavg()[0]  # other work on the machine skews times
    load = report["load_average"]
    text = (markdown(report) if report["rows"] else
            f"Machine: {describe(report['machine'])}; 1-minute load average {load['start']:.2f} "
            f"before the run, {load['end']:.2f} after; medians over {rounds} rounds x {epochs} "
            "epochs per configuration after a discarded warm-up epoch, the configurations "
            "alternating in fresh processes.\n")
    text += extra_markdown(report) if models else ""
    text += "\n" + sequence_markdown(report) if report["sequence"] else ""
    text += recompute_markdown(report["recompute"]) if "recompute" in report else ""
    click.echo(text)
    for row in report["rows"]:
        if "profile" in row:
            click.echo(f"Profile of one microtrain epoch ({row['steps_per_epoch']} steps, under "
                       f"cProfile), {row['model']} {row['optimizer']}:\n\n{row['profile']}\n")
    click.echo(f"({report['elapsed_s']:.0f} s)", err=True)
    _write(markdown_path, text)
    _write(json_path, json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
