"""Corrupted inputs for every command, and how a command's answer is judged.

A corpus is made once from splits of the mlp and cnn fixtures: the .tflite, the
three files of each split, a checkpoint, data files.  A case takes one input
kind, corrupts it (bytes, structure or metadata, another kind's bytes, a FIFO,
a folder, options) and runs one command in this process under an alarm.  The
answer is one of: "error" (exit 1, one `Error:` line on stderr), "accepted"
(exit 0), "traceback" (any other exception), "hang" (the alarm rang), or
"silent" (an edited backprop graph, or a .wof with bytes added, was accepted).
"""
import io
import json
import os
import shutil
import signal
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from hypothesis import strategies as st

from microtrain.files.artifacts import GraphLinks, UNSEALED, fingerprint, seal
from microtrain.commands.cli import main as microtrain
from microtrain.files.format.model import (get_metadata, model_from_bytes, model_to_bytes,
                                           set_metadata)
from microtrain.files.format import circle_generated as circle
from trainconf.cli import main as trainconf
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ("mlp", "cnn")
DATA = {"mlp": "digits_x", "cnn": "digits_images"}
SAMPLES = 48
TIMEOUT = 30  # seconds a command may take on 48 samples before it counts as a hang
KINDS = ("tflite", "frozen", "backprop", "wof", "checkpoint", "data", "options")


class Hang(BaseException):
    """The alarm rang: the command did not finish in TIMEOUT seconds."""


def make_corpus(folder: Path) -> dict:
    """The clean files every case starts from, by model."""
    corpus = {}
    for name in MODELS:
        src = folder / name / f"{name}.tflite"
        src.parent.mkdir()
        shutil.copy(FIXTURES / f"{name}.tflite", src)
        files = split(src)
        x = np.load(FIXTURES / f"{DATA[name]}.npy")[:SAMPLES]
        t = np.load(FIXTURES / "digits_onehot.npy")[:SAMPLES]
        np.save(src.parent / "x.npy", x)
        np.save(src.parent / "t.npy", t)
        np.savez(src.parent / "xt.npz", x=x, t=t)
        x.astype("<f4").tofile(src.parent / "x.bin")
        ckpt = src.parent / "run.ckpt"
        result = CliRunner().invoke(microtrain, _run_args(files.frozen, src.parent, "x.npy", "t.npy")
                                    + ["--checkpoint", str(ckpt), "--save", "never"])
        assert result.exit_code == 0, result.output
        corpus[name] = {"tflite": src.read_bytes(), "frozen": files.frozen.read_bytes(),
                        "backprop": files.backprop.read_bytes(), "wof": files.wof.read_bytes(),
                        "checkpoint": ckpt.read_bytes(),
                        "x.npy": (src.parent / "x.npy").read_bytes(),
                        "t.npy": (src.parent / "t.npy").read_bytes(),
                        "xt.npz": (src.parent / "xt.npz").read_bytes(),
                        "x.bin": (src.parent / "x.bin").read_bytes(),
                        "sample_shape": ",".join(str(d) for d in x.shape[1:])}
    return corpus


def _run_args(frozen: Path, folder: Path, x: str, t: str) -> list[str]:
    return ["run", str(frozen), "--input", str(folder / x), "--target", str(folder / t),
            "--epochs", "1", "--batch-size", "16", "--seed", "1"]


# -- corruption -----------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from(
        [0, -1, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 63, 10 ** 6]) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


def byte_mutation(draw, data: bytes, others: list[bytes]) -> bytes:
    """Truncate, flip, zero, append, insert or swap in another file's bytes."""
    how = draw(st.sampled_from(["truncate", "flip", "zero", "append", "insert", "swap", "empty"]))
    n = len(data)
    if how == "truncate":
        return data[:draw(st.integers(0, max(n - 1, 0)))]
    if how == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, n - 1))
            out[at] ^= draw(st.integers(1, 255))
        return bytes(out)
    if how == "zero":
        start = draw(st.integers(0, n - 1))
        length = draw(st.integers(1, 256))
        return data[:start] + bytes(min(length, n - start)) + data[start + length:]
    if how == "append":
        return data + draw(st.binary(min_size=1, max_size=128))
    if how == "insert":
        at = draw(st.integers(0, n))
        return data[:at] + draw(st.binary(min_size=1, max_size=64)) + data[at:]
    if how == "swap":
        return draw(st.sampled_from(others))
    return b""


def _edit_json(draw, meta):
    """Delete, replace or add one field somewhere in a JSON document."""
    node, key = meta, None
    path = []
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys or (path and draw(st.booleans())):
            break
        key = draw(st.sampled_from(keys))
        path.append((node, key))
        if not isinstance(node[key], (dict, list)):
            break
        node = node[key]
    if not path:
        return draw(JSON_VALUES)
    parent, key = path[-1]
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete" and isinstance(parent, dict):
        del parent[key]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=6))] = draw(JSON_VALUES)
    else:
        parent[key] = draw(JSON_VALUES)
    return meta


def _dumps(meta) -> bytes:
    return json.dumps(meta, allow_nan=True).encode()


def metadata_edit(draw, data: bytes, name: str) -> bytes:
    model = model_from_bytes(data)
    meta = json.loads(get_metadata(model, name))
    meta = _edit_json(draw, meta)
    set_metadata(model, name, _dumps(meta))
    return model_to_bytes(model)


SHAPE_DIMS = st.sampled_from([0, -1, -7, 1, 3, 2 ** 31 - 1, 2 ** 20, 65536]) | st.integers(-3, 100)
DTYPES = st.sampled_from([circle.TensorType.FLOAT32, circle.TensorType.FLOAT16,
                          circle.TensorType.INT32, circle.TensorType.INT8, circle.TensorType.STRING,
                          circle.TensorType.BOOL, circle.TensorType.COMPLEX64, 99])


def structure_edit(draw, data: bytes) -> bytes:
    """Change one tensor's shape or type, or one operator's inputs, in a model."""
    model = model_from_bytes(data)
    sg = model.subgraphs[0]
    what = draw(st.sampled_from(["shape", "dtype", "op-input", "io"]))
    if what == "op-input" and sg.operators:
        op = draw(st.sampled_from(sg.operators))
        inputs = list(op.inputs)
        if inputs:
            inputs[draw(st.integers(0, len(inputs) - 1))] = draw(st.integers(-2, len(sg.tensors) + 2))
            op.inputs = inputs
    elif what == "io":
        sg.outputs = draw(st.lists(st.integers(-1, len(sg.tensors)), min_size=0, max_size=3))
    else:
        t = draw(st.sampled_from(sg.tensors))
        if what == "shape":
            t.shape = draw(st.lists(SHAPE_DIMS, max_size=5))
            t.shapeSignature = t.shape if draw(st.booleans()) else t.shapeSignature
        else:
            t.type = draw(DTYPES)
    try:
        return model_to_bytes(model)
    except Exception:  # what the flatbuffer builder cannot pack, a user cannot make either
        return data


def reseal(backprop: bytes, frozen: bytes | None = None) -> bytes:
    """A backprop graph whose digests are made to fit again, as a forger would."""
    model = model_from_bytes(backprop)
    meta = json.loads(get_metadata(model, GraphLinks.NAME))
    if not isinstance(meta, dict):
        return backprop
    if frozen is not None:
        meta["frozen_sha256"] = fingerprint(frozen)
    meta["backprop_sha256"] = UNSEALED
    set_metadata(model, GraphLinks.NAME, _dumps(meta))
    data = model_to_bytes(model)
    return seal(data) if data.count(b'"backprop_sha256": "' + UNSEALED.encode() + b'"') == 1 else data


def npy_edit(draw, data: bytes) -> bytes:
    """Change the header of a .npy: its shape, dtype or order."""
    header_len = struct.unpack_from("<H", data, 8)[0]
    header = data[10:10 + header_len].decode("latin1")
    body = data[10 + header_len:]
    what = draw(st.sampled_from(["shape", "dtype", "fortran"]))
    if what == "shape":
        dims = draw(st.lists(SHAPE_DIMS | st.sampled_from([2 ** 40, 2 ** 62]), max_size=4))
        header = header.split("'shape':")[0] + f"'shape': ({', '.join(map(str, dims))}{',' if len(dims) == 1 else ''}), }}"
    elif what == "dtype":
        dt = draw(st.sampled_from(["'|O'", "'<U3'", "'<i8'", "'|b1'", "'<c8'", "'>f4'", "'<f2'", "'V4'"]))
        header = header.replace("'<f4'", dt)
    else:
        header = header.replace("False", "True")
    header = header.ljust(header_len - 1) + "\n" if len(header) < header_len else header + "\n"
    return data[:8] + struct.pack("<H", len(header)) + header.encode("latin1") + body


def checkpoint_edit(draw, data: bytes) -> bytes:
    """Rewrite a checkpoint with its meta.json edited or one .npy member's header changed."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    name = draw(st.sampled_from(sorted(members)))
    if name == "meta.json":
        members[name] = _dumps(_edit_json(draw, json.loads(members[name])))
    else:
        members[name] = npy_edit(draw, members[name])
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for n, content in members.items():
            archive.writestr(n, content)
    return out.getvalue()


# -- a case ---------------------------------------------------------------------------------------

@dataclass
class Case:
    kind: str
    command: str
    args: list[str]
    edited_backprop: bool = False  # the backprop graph differs from the one split wrote
    grown_wof: bool = False        # bytes were added to the .wof
    why: str = ""                  # a backprop case that may be accepted: unchanged, forged, infer


def _place(path: Path, content, draw) -> None:
    """Write a corrupted input, or make it a FIFO or a folder."""
    if path.exists() or path.is_symlink():
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if content == "fifo":
        os.mkfifo(path)
    elif content == "folder":
        path.mkdir()
    else:
        path.write_bytes(content)


def draw_case(draw, corpus: dict, folder: Path) -> Case:
    """Lay out one model's files in `folder` with one input corrupted; the command to run."""
    name = draw(st.sampled_from(MODELS))
    files = corpus[name]
    stem = folder / name
    paths = {"tflite": folder / f"{name}.tflite", "frozen": folder / f"{name}.frozen.circle",
             "backprop": folder / f"{name}.backprop.circle", "wof": folder / f"{name}.wof",
             "checkpoint": folder / "run.ckpt"}
    for key, path in paths.items():
        _place(path, files[key], draw)
    for data in ("x.npy", "t.npy", "xt.npz", "x.bin"):
        _place(folder / data, files[data], draw)
    kind = draw(st.sampled_from(KINDS))
    others = [files[k] for k in ("tflite", "frozen", "backprop", "wof", "checkpoint", "x.npy")]
    frozen, run = str(paths["frozen"]), _run_args(paths["frozen"], folder, "x.npy", "t.npy")
    evaluate = ["eval", frozen, "--input", str(folder / "x.npy"), "--target", str(folder / "t.npy")]
    infer = ["infer", frozen, "--input", str(folder / "x.npy"), "-o", str(folder / "out.npy")]
    case = Case(kind, "", [])
    if kind == "options":
        case.command, case.args = _options_case(draw, paths, folder, run, evaluate)
        return case
    special = draw(st.sampled_from(["bytes"] * 12 + ["fifo", "folder"]))
    if kind == "data":
        target = folder / draw(st.sampled_from(["x.npy", "t.npy", "xt.npz", "x.bin"]))
        original = files[target.name]
        if special != "bytes":
            content = special
        elif target.suffix == ".npy" and draw(st.booleans()):
            content = npy_edit(draw, original)
        else:
            content = byte_mutation(draw, original, others)
        _place(target, content, draw)
        spec = {"x.npy": ["--input", str(folder / "x.npy"), "--target", str(folder / "t.npy")],
                "t.npy": ["--input", str(folder / "x.npy"), "--target", str(folder / "t.npy")],
                "xt.npz": ["--input", f"{folder / 'xt.npz'}:x", "--target", f"{folder / 'xt.npz'}:t"],
                "x.bin": ["--input", str(folder / "x.bin"), "--input-shape", files["sample_shape"],
                          "--target", str(folder / "t.npy")]}[target.name]
        command = draw(st.sampled_from(["eval", "run", "infer"]))
        case.command = command
        case.args = [command, frozen] + (spec[:2] + spec[4:] + ["-o", str(folder / "out.npy")]
                                         if command == "infer" else spec)
        if command == "run":
            case.args += ["--epochs", "1", "--batch-size", "16"]
        return case
    path = paths[kind]
    original = files[kind]
    if special != "bytes":
        content = special
    else:
        how = draw(st.sampled_from(["bytes", "bytes", "structure", "metadata", "forged"]))
        if kind == "checkpoint":
            content = checkpoint_edit(draw, original) if how != "bytes" else \
                byte_mutation(draw, original, others)
        elif kind == "wof" or how == "bytes":
            content = byte_mutation(draw, original, others)
        elif how == "structure":
            content = structure_edit(draw, original)
        elif how == "metadata" and kind in ("frozen", "backprop"):
            content = metadata_edit(draw, original, "microtrain.training" if kind == "frozen"
                                    else "microtrain.backprop")
        else:
            content = structure_edit(draw, original)
        if how == "forged" and kind == "frozen" and isinstance(content, bytes):
            _place(paths["backprop"], reseal(files["backprop"], content), draw)
        elif how == "forged" and kind == "backprop" and isinstance(content, bytes):
            try:
                content = reseal(content)
            except Exception:
                pass
    _place(path, content, draw)
    forged = isinstance(content, bytes) and content != original and _sealed_by_us(content)
    case.edited_backprop = kind == "backprop" and content != original and not forged
    case.why = "unchanged" if content == original else "forged" if forged else ""
    case.grown_wof = kind == "wof" and isinstance(content, bytes) and len(content) > len(original)
    if kind == "tflite":
        command = draw(st.sampled_from(["import", "inspect", "split"]))
        case.command = command
        case.args = [command, str(paths["tflite"])] + (
            ["-o", str(folder / "imported.circle")] if command == "import" else
            ["-o", str(folder / "split")] if command == "split" else [])
        return case
    if kind == "checkpoint":
        case.command, case.args = "run", run + ["--checkpoint", str(paths["checkpoint"]), "--resume",
                                                "--epochs", "2", "--save", "never"]
        return case
    command = draw(st.sampled_from(["eval", "run", "infer", "inspect"]))
    case.command = command
    if kind == "backprop" and command == "infer" and not case.why:
        case.why = "infer"  # infer does not read the backprop graph
    case.args = {"eval": evaluate, "run": run, "infer": infer, "inspect": ["inspect", frozen]}[command]
    return case


def _sealed_by_us(content: bytes) -> bool:
    """Whether a forged backprop graph carries a digest that fits (then acceptance is
    a forgery's, not a silent acceptance of an edit)."""
    try:
        model = model_from_bytes(content)
        meta = json.loads(get_metadata(model, GraphLinks.NAME))
        digest = meta["backprop_sha256"]
        token = f'"backprop_sha256": "{digest}"'.encode()
        return fingerprint(content.replace(token, f'"backprop_sha256": "{UNSEALED}"'.encode())) == digest
    except Exception:
        return False


OPTION_VALUES = st.sampled_from(["0", "-1", "1", "1e308", "inf", "nan", "-inf", "", "abc", "2147483648",
                                 "0.5", "1.5", "1e-300", "3,3", "8,8,1", "64", "-0", "1e6"])


def _options_case(draw, paths, folder, run, evaluate):
    which = draw(st.sampled_from(["run", "eval", "split", "infer"]))
    value = draw(OPTION_VALUES | st.text(max_size=6))
    if which == "split":
        option = draw(st.sampled_from(["--trainable", "--memory-budget", "--batch-size", "--loss",
                                       "--precision", "--reduction"]))
        return "split", ["split", str(paths["tflite"]), "-o", str(folder / "split"), option, value]
    if which == "infer":
        option = draw(st.sampled_from(["--batch-size", "--input-shape", "-o"]))
        args = ["infer", str(paths["frozen"]), "--input", str(folder / "x.npy")]
        if option == "-o":
            return "infer", args + ["-o", str(folder / value) if value else ""]
        return "infer", args + ["-o", str(folder / "out.npy"), option, value]
    option = draw(st.sampled_from(["--batch-size", "--epochs", "--learning-rate", "--validation-split",
                                   "--loss-scale", "--metric", "--momentum", "--epsilon", "--seed",
                                   "--decay-steps", "--lr-schedule", "--accum-steps", "--input-shape",
                                   "--test-input", "--test-target", "--weight-decay", "--warmup-steps",
                                   "--growth-interval", "--loss-scale-init", "--alpha"]))
    base = run if which == "run" else evaluate
    if which == "eval" and option not in ("--batch-size", "--metric", "--input-shape"):
        base = run
    return base[0], base + [option, value]


def run_case(case: Case) -> tuple[str, str]:
    """(verdict, detail) of running the case's command in this process."""
    cli = trainconf if case.args[0] in ("import", "inspect", "split") else microtrain
    previous = signal.signal(signal.SIGALRM, _ring)
    signal.alarm(TIMEOUT)
    try:
        result = CliRunner().invoke(cli, case.args)
    except Hang:
        return "hang", " ".join(case.args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback
        return "traceback", "".join(traceback.format_exception(result.exception))[-1500:]
    if result.exit_code == 0:
        if (case.edited_backprop and case.args[0] != "infer") or case.grown_wof:
            return "silent", " ".join(case.args)
        return "accepted", ""
    lines = result.stderr.splitlines()
    if result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "):
        return "error", lines[0]
    return "traceback", f"exit {result.exit_code}: {result.stderr[-500:]}"


def _ring(signum, frame):
    raise Hang()
