"""Run the whole toolchain on every model of the real-model cache and tabulate what happens.

    python scripts/real_models_report.py --cache DIR [--models GLOB] [--code REPO]

For each DIR/<source>/<name>.tflite (see scripts/fetch_real_models.py), as a new user would, each
command in a fresh process: `trainconf import`, `trainconf inspect`, then for each --trainable
spec (`all`, `last:1`, `last:2`) `trainconf split`, `microtrain infer` and `microtrain run`
(2 epochs of one batch, Adam at the first --learning-rate: the second epoch's loss is below the
first's if the first step went downhill, which a small enough rate guarantees when the gradients
are right; where the loss does not visibly fall, as a user would, at the next larger rate: a
summed loss of 8e4 changes in float32 steps of 8e-3, more than two steps at 1e-4 move it when
only the last layers train).
The batch is what a user would feed: the 4 photographs in DIR/images (fetch_real_models.py puts
them there) resized to each image input, in its layout (NHWC, or NCHW for the PyTorch
conversions), values in [0, 1]; an integer input (token ids) random ids within the rows of the
embedding table it indexes (ones if it indexes none: a padding mask; tests/token_inputs.py);
another input uniform noise in [0, 1). The
targets (see `target`): a mask for a segmentation output, one-hot rows (labels) for the others.
Random inputs are a poor stand-in: on noise MediaPipe's selfie segmentation
answers 0 (sigmoid saturated, gradients ~1e-10) everywhere. Each command ends
`ok`, in a one-line `Error:` (quoted) or in a traceback (its last line quoted). The TFLite
interpreter (ai-edge-litert) runs the original model on the same inputs: the table gives the
largest difference of `microtrain infer` from it and the loss of its outputs against the
starting loss microtrain reports, and whether training kept the loss finite and lowered it.
Writes REPORT.md and report.json into DIR (or --output). --code runs another checkout's trainconf/microtrain.
Reading and resizing the photographs needs Pillow (matplotlib's dependency).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SPECS = ("all", "last:1", "last:2")
SAMPLES, EPOCHS, SEED = 4, 2, 0
TIMEOUT = 900
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from litert_reference import dequantized_in_front, interpreter_outputs, keras_loss  # noqa: E402
from token_inputs import one_hot, sample_inputs  # noqa: E402


@dataclass
class Outcome:
    """How one command ended: status is ok, error, traceback or timeout."""
    status: str
    message: str = ""
    seconds: float = 0.0

    @property
    def cell(self) -> str:
        return "ok" if self.status == "ok" else f"{self.status}: `{self.message}`"


@dataclass
class SpecResult:
    split: Outcome
    infer: Outcome | None = None
    run: Outcome | None = None
    loss: str = ""                 # the split's loss function
    max_diff: float | None = None  # |microtrain infer - TFLite|, largest
    hybrid_diff: float | None = None  # the same against LiteRT's hybrid kernels (dynamic range)
    reference_loss: float | None = None
    initial_loss: float | None = None
    history: list = field(default_factory=list)
    final_loss: float | None = None
    learning_rate: float | None = None  # the rate of the run shown (the first that trained)

    @property
    def matches(self) -> bool | None:
        """The starting loss equals the loss of the interpreter's outputs (relative 1e-4)."""
        if self.initial_loss is None or self.reference_loss is None:
            return None
        return abs(self.initial_loss - self.reference_loss) <= 1e-4 * max(1.0, abs(self.reference_loss))

    @property
    def trains(self) -> bool:
        """Finite losses throughout; the last epoch's loss below the first's and the loss after
        training below the one before."""
        losses = [self.initial_loss, self.final_loss, *self.history]
        return (self.run is not None and self.run.status == "ok"
                and all(v is not None and math.isfinite(v) for v in losses)
                and self.history[-1] < self.history[0] and self.final_loss < self.initial_loss)


@dataclass
class ModelResult:
    name: str
    bytes: int
    import_: Outcome
    inspect: Outcome
    specs: dict = field(default_factory=dict)
    reference: str = ""  # why there is no TFLite reference, if there is none


# ---------------------------------------------------------------- running commands


def command(args, env, cwd, json_out=False) -> tuple[Outcome, object]:
    """Run `python -m <args>` in cwd (so messages name files relative to it); classify how it
    ended and parse its JSON (last line)."""
    start = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True,
                           text=True, env=env, cwd=cwd, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return Outcome("timeout", f"over {TIMEOUT} s", TIMEOUT), None
    seconds = time.perf_counter() - start
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    if "Traceback (most recent call last)" in p.stderr:
        return Outcome("traceback", lines[-1], seconds), None
    if p.returncode:
        errors = [l for l in lines if l.startswith("Error:")]
        return Outcome("error", (errors or lines or [f"exit {p.returncode}"])[-1], seconds), None
    data = None
    if json_out:
        data = json.loads(p.stdout.strip().splitlines()[-1])
    return Outcome("ok", "", seconds), data


# ---------------------------------------------------------------- one model


def model_io(model: Path):
    """(input shapes, input dtypes, output shapes, output producers' operator names) with the
    batch dimension dropped."""
    import tflite

    names = {v: k for k, v in vars(tflite.BuiltinOperator).items() if not k.startswith("_")}
    m = tflite.Model.GetRootAsModel(model.read_bytes(), 0)
    g = m.Subgraphs(0)
    producers = {}
    for i in range(g.OperatorsLength()):
        op = g.Operators(i)
        code = m.OperatorCodes(op.OpcodeIndex())
        for t in op.OutputsAsNumpy():
            producers[int(t)] = names.get(max(code.BuiltinCode(), code.DeprecatedBuiltinCode()), "")
    ins = [g.Tensors(i) for i in g.InputsAsNumpy()]
    outs = [g.Tensors(i) for i in g.OutputsAsNumpy()]
    return ([t.ShapeAsNumpy().tolist()[1:] for t in ins], [t.Type() for t in ins],
            [t.ShapeAsNumpy().tolist()[1:] for t in outs],
            [producers.get(int(i), "") for i in g.OutputsAsNumpy()])


def photographs(images: Path, shape: list[int]) -> np.ndarray | None:
    """The photographs in `images` resized to an image input of `shape` (HWC or CHW, 3
    channels), in [0, 1]; None if the input is not an image."""
    from PIL import Image

    if len(shape) != 3 or 3 not in (shape[0], shape[-1]):
        return None
    channels_first = shape[-1] != 3
    h, w = shape[1:] if channels_first else shape[:2]
    files = sorted(images.glob("*.png"))[:SAMPLES]
    batch = np.stack([np.asarray(Image.open(f).convert("RGB").resize((w, h), Image.BILINEAR),
                                 np.float32) / 255 for f in files])
    return batch.transpose(0, 3, 1, 2).copy() if channels_first else batch


def target(shape: list[int], producer: str, rng) -> np.ndarray:
    """A target for SAMPLES rows of an output: a centred ellipse mask for an image-sized
    LOGISTIC output (a segmentation), else one-hot rows (a label per sample, or per position;
    they suit every loss). For a regression (landmarks, boxes) targets near the model's own
    predictions would be likelier data, but from there Adam's first step at 1e-4 on all layers
    of a trained MediaPipe model overshoots (prediction + 1: losses 2-5 become 2.3-8562), and
    on pose_landmark_full even at 1e-6; far targets show whether the gradients are right."""
    if producer == "LOGISTIC" and len(shape) == 3 and shape[-1] == 1 and min(shape[:2]) > 1:
        h, w = shape[:2]
        y, x = np.mgrid[0:h, 0:w]
        mask = (((y + 0.5) / h - 0.5) / 0.4) ** 2 + (((x + 0.5) / w - 0.5) / 0.3) ** 2 <= 1
        return np.broadcast_to(mask[..., None], (SAMPLES, *shape)).astype(np.float32)
    return one_hot((SAMPLES, *shape), rng)


def save(arrays, work: Path, kind: str) -> list[Path]:
    """Each array to work/<kind><i>.npy; the paths."""
    paths = []
    for i, a in enumerate(arrays):
        paths.append(work / f"{kind}{i}.npy")
        np.save(paths[-1], a)
    return paths


def run_model(model: Path, name: str, work: Path, env, learning_rates: list[float],
              images: Path) -> ModelResult:
    import tflite

    unquantized = (tflite.TensorType.FLOAT32, tflite.TensorType.INT32, tflite.TensorType.INT64)

    circle = work / (model.stem + ".circle")  # commands run in work: relative names
    imported, _ = command(["trainconf.cli", "import", model, "-o", circle.name], env, work)
    source = circle.name if imported.status == "ok" else model
    inspected, _ = command(["trainconf.cli", "inspect", source, "--json"], env, work, json_out=True)
    result = ModelResult(name, model.stat().st_size, imported, inspected)
    in_shapes, in_types, out_shapes, producers = model_io(model)
    rng = np.random.default_rng(SEED)
    xs = [a if (a := photographs(images, s)) is not None else other
          for s, other in zip(in_shapes, sample_inputs(model, SAMPLES, rng))]
    ts = [target(s, p, rng) for s, p in zip(out_shapes, producers)]
    data = {"x": save(xs, work, "x"), "t": save(ts, work, "t")}
    ys = hybrid = None
    if all(t in unquantized for t in in_types):
        try:
            float_model = dequantized_in_front(model)
            ys = interpreter_outputs(float_model or model, xs)
            hybrid = float_model and interpreter_outputs(model, xs)
        except RuntimeError as e:  # e.g. a custom op the interpreter lacks
            result.reference = f"interpreter: {str(e).splitlines()[0]}"
    else:
        result.reference = "the model's inputs are quantized"
    for spec in SPECS:
        out = spec.replace(":", "")
        split, info = command(["trainconf.cli", "split", source, "-o", out, "--trainable", spec,
                               "--json"], env, work, json_out=True)
        r = result.specs[spec] = SpecResult(split)
        if split.status != "ok":
            continue
        frozen = Path(out, model.stem + ".frozen.circle")
        r.loss = info.get("loss", "") if isinstance(info, dict) else ""
        inputs = [a for p in data["x"] for a in ("--input", p)]
        targets = [a for p in data["t"] for a in ("--target", p)]
        predicted = work / "y.npz"
        if any(s.infer for s in result.specs.values()):
            pass  # the forward pass is the same for every spec: infer once
        else:
            r.infer, _ = command(["microtrain.commands.cli", "infer", frozen, *inputs, "-o", predicted],
                                 env, work)
        if r.infer and r.infer.status == "ok" and ys is not None:
            with np.load(predicted) as z:
                mine = [z[k] for k in z.files]
            r.max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(mine, ys))
            if hybrid:
                r.hybrid_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(mine, hybrid))
        for rate in learning_rates:  # as a user searches: the next rate if this one did not train
            train(r, [frozen, *inputs, *targets], rate, env, work)
            if r.trains:
                break
        if ys is not None and r.loss in ("mse", "mae", "cce"):
            r.reference_loss = keras_loss(r.loss, ys, ts)
    return result


def train(r: SpecResult, arguments: list, rate: float, env, work: Path) -> None:
    """Two epochs of `microtrain run` at learning rate `rate`, recorded in r."""
    r.learning_rate = rate
    r.run, summary = command(["microtrain.commands.cli", "run", *arguments, "--epochs", EPOCHS,
                              "--batch-size", SAMPLES, "--no-shuffle", "--learning-rate", rate,
                              "--save", "never", "--json"], env, work, json_out=True)
    r.initial_loss = r.final_loss = None
    r.history = []
    if summary:
        r.loss = summary["loss"]
        r.initial_loss, r.final_loss = summary["initial_loss"], summary["final_loss"]
        r.history = summary["history"]


# ---------------------------------------------------------------- the report


def fmt(v, digits=4) -> str:
    return "–" if v is None else f"{v:.{digits}g}"


def spec_cell(r: SpecResult | None) -> str:
    if r is None:
        return "–"
    if r.split.status != "ok":
        return f"split {r.split.cell}"
    if r.run is None or r.run.status != "ok":
        return f"run {r.run.cell}" if r.run else "–"
    verdict = "**trains**" if r.trains else "does not train"
    verdict += f" at lr {r.learning_rate:g}" if r.learning_rate is not None else ""
    change = (r.final_loss - r.initial_loss if r.final_loss is not None and r.initial_loss is not None
              else None)
    return (f"{verdict}: epochs {' → '.join(fmt(v) for v in r.history)} "
            f"(evaluated {fmt(r.initial_loss)} before, {fmt(r.final_loss)} after: {fmt(change, 2)})")


def write_report(results: list[ModelResult], out: Path, argv: str, code: Path,
                 learning_rates: list[float]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    trained = [r.name for r in results
               if all(r.specs.get(s) and r.specs[s].trains for s in ("all", "last:2"))]
    lines = [
        "# Real-model corpus report", "",
        f"Command: `{argv}`  ", f"Code: {code} at {git_head(code)}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        f"One batch of {SAMPLES} photographs (resized to each image input, in [0, 1]; noise for "
        "other float inputs; for integer inputs, random ids within the rows of the embedding "
        "table each indexes, ones for a mask); targets: a centred ellipse mask for a segmentation output, one-hot rows "
        "for the others; "
        f"{EPOCHS} epochs, Adam at learning rate "
        f"{', then '.join(f'{v:g}' for v in learning_rates)} (the next rate only where the one "
        "before did not train; a cell names the rate it shows), the split's default loss. "
        "Trains = finite losses, the second epoch's loss below the first's and the loss "
        "evaluated after training below the one before.  "
        "Δ infer = largest |microtrain infer − TFLite interpreter| (on the `all` split, else the "
        "first split that worked; for int8 weights read by float operators, the interpreter runs "
        "the file with a DEQUANTIZE in front of each, the float model they stand for, and the "
        "difference from its hybrid kernels on the file, which round activations to int8, "
        "follows in brackets); loss vs TFLite = microtrain's starting loss / the same loss "
        "computed from the interpreter's outputs.", "",
        f"**Train end to end with `all` and `last:2`: {len(trained)} of {len(results)}**: "
        + (", ".join(trained) or "none"), "",
        "| model | bytes | import | inspect | Δ infer | loss vs TFLite | all | last:1 | last:2 |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        first = next((s for s in r.specs.values() if s.max_diff is not None or s.initial_loss), None)
        diff = fmt(first.max_diff, 3) if first else "–"
        if first and first.hybrid_diff is not None:
            diff += f" (LiteRT's hybrid kernels: {fmt(first.hybrid_diff, 3)})"
        ref = (f"{fmt(first.initial_loss, 6)} / {fmt(first.reference_loss, 6)}"
               + {True: " (=)", False: " (**differs**)", None: ""}[first.matches]
               if first and first.initial_loss is not None else r.reference or "–")
        lines.append(f"| {r.name} | {r.bytes:,} | {r.import_.cell} | {r.inspect.cell} | {diff} | "
                     f"{ref} | " + " | ".join(spec_cell(r.specs.get(s)) for s in SPECS) + " |")
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")


def git_head(code: Path) -> str:
    p = subprocess.run(["git", "-C", str(code), "log", "-1", "--format=%h %s"],
                       capture_output=True, text=True)
    return p.stdout.strip()[:80] or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True,
                        help="the directory scripts/fetch_real_models.py filled")
    parser.add_argument("--models", nargs="+", default=["*/*.tflite"],
                        help="globs of models under the cache (default: %(default)s)")
    parser.add_argument("--output", type=Path,
                        help="directory for REPORT.md and report.json (default: the cache)")
    parser.add_argument("--learning-rate", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2],
                        help="Adam's learning rates for the 2 training steps, tried in order "
                             "until one trains (default: %(default)s)")
    parser.add_argument("--code", type=Path, default=REPO,
                        help="checkout whose trainconf/microtrain run (default: this one)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="models measured at once (default: %(default)s)")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="REPORT_JSON",
                        help="run nothing: write one report from these report.json files "
                             "(a model in several: the last file's)")
    args = parser.parse_args()
    argv = " ".join(["python", *sys.argv])
    out = args.output or args.cache
    if args.merge:
        latest = {d["name"]: d for f in args.merge for d in json.loads(f.read_text())}  # later wins
        write_report([load_result(latest[k]) for k in sorted(latest)], out, argv, args.code,
                     args.learning_rate)
        return
    env = dict(os.environ, PYTHONPATH=str(args.code.resolve()))
    images = args.cache.resolve() / "images"
    if len(list(images.glob("*.png"))) < SAMPLES:
        parser.error(f"{images}: needs {SAMPLES} photographs (.png): "
                     "run scripts/fetch_real_models.py --sources images")

    def measure(model: Path) -> ModelResult:
        name = f"{model.parent.name}/{model.stem}"
        with tempfile.TemporaryDirectory() as tmp:
            r = run_model(model, name, Path(tmp), env, args.learning_rate, images)
        print(name, r.import_.status, r.inspect.status,
              *(f"{s}:{spec_cell(r.specs.get(s))}" for s in SPECS), flush=True)
        return r

    results = []
    with ThreadPoolExecutor(args.jobs) as pool:  # the work is in subprocesses
        for r in pool.map(measure, sorted({m for g in args.models for m in args.cache.glob(g)})):
            results.append(r)
            write_report(results, out, argv, args.code, args.learning_rate)


def load_result(d: dict) -> ModelResult:
    """A ModelResult back from its report.json form."""
    def outcome(o):
        return o and Outcome(**o)
    specs = {k: SpecResult(**{**v, "split": outcome(v["split"]), "infer": outcome(v["infer"]),
                              "run": outcome(v["run"])}) for k, v in d["specs"].items()}
    return ModelResult(**{**d, "import_": outcome(d["import_"]), "inspect": outcome(d["inspect"]),
                          "specs": specs})


if __name__ == "__main__":
    main()
