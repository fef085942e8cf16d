"""Where a user could lose work or be misled without an error: each case is refused
in one line or gets a helpful message; files are written as sets, synced, and
leave no temporaries; a kill -9 during saving leaves old or new weights."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import microtrain.files.atomic as atomic
from microtrain.files.artifacts import load_artifacts
from microtrain.commands.cli import main as microtrain
from microtrain.files.errors import TornSetError, UserError
from microtrain.files.format.wof import read_wof
from microtrain.files.format.model import load_model
from model_patch import FIXTURES
from trainconf.cli import main as trainconf
from trainconf.split import split

X, T = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"


@pytest.fixture
def mlp(tmp_path):
    return split(FIXTURES / "mlp.tflite", tmp_path)


def _one_error(cli, args) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def _ok(cli, args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output + result.stderr
    return result


def _run(frozen, *extra):
    return ["run", frozen, "--input", X, "--target", T, "--epochs", "1", "--seed", "3", *extra]


# -- outputs of another kind -------------------------------------------------------------------

def test_a_checkpoint_path_holding_weights_is_refused(mlp, tmp_path):
    weights = tmp_path / "other.wof"
    shutil.copy(mlp.wof, weights)
    line = _one_error(microtrain, _run(mlp.frozen, "--checkpoint", weights))
    assert line == (f"Error: {weights}: holds a .wof weights file; refusing to replace it with a "
                    "microtrain checkpoint (give --force to overwrite it)")
    assert weights.read_bytes() == mlp.wof.read_bytes()
    line = _one_error(microtrain, _run(mlp.frozen, "--checkpoint", mlp.wof, "--force"))
    assert line == (f"Error: {mlp.wof}: is also an input of this command (--wof); "
                    "give --checkpoint another file")


def test_outputs_over_files_of_another_kind_are_refused_unless_forced(mlp, tmp_path):
    frozen_bytes = mlp.frozen.read_bytes()
    model_copy = tmp_path / "copy.circle"
    shutil.copy(mlp.frozen, model_copy)
    line = _one_error(microtrain, _run(mlp.frozen, "--output-wof", model_copy))
    assert "holds a circle model; refusing to replace it with a .wof weights file" in line
    line = _one_error(microtrain, ["infer", mlp.frozen, "--input", X, "-o", mlp.wof])
    assert "the output must end in .npy (one output) or .npz (several)" in line
    wof_as_npy = tmp_path / "w.npy"
    shutil.copy(mlp.wof, wof_as_npy)
    line = _one_error(microtrain, ["infer", mlp.frozen, "--input", X, "-o", wof_as_npy])
    assert "holds a .wof weights file; refusing to replace it with a .npy array" in line
    assert model_copy.read_bytes() == frozen_bytes
    _ok(microtrain, ["infer", mlp.frozen, "--input", X, "-o", wof_as_npy, "--force"])
    assert np.load(wof_as_npy).shape == (1797, 10)


def test_infer_writes_only_npy_or_npz(mlp, tmp_path):
    line = _one_error(microtrain, ["infer", mlp.frozen, "--input", X, "-o", tmp_path / "out.txt"])
    assert line.endswith("out.txt: the output must end in .npy (one output) or .npz (several)")
    assert not (tmp_path / "out.txt").exists()


def test_import_does_not_write_over_the_tflite_model(tmp_path):
    model = tmp_path / "m.tflite"
    shutil.copy(FIXTURES / "mlp.tflite", model)
    line = _one_error(trainconf, ["import", model, "-o", model, "--force"])
    assert line.endswith("m.tflite: is also an input of this command (MODEL); give -o another file")
    other = tmp_path / "other.circle"
    shutil.copy(model, other)
    line = _one_error(trainconf, ["import", model, "-o", other])
    assert "holds a tflite model; refusing to replace it with a circle model" in line
    assert model.read_bytes() == other.read_bytes() == (FIXTURES / "mlp.tflite").read_bytes()


def test_split_does_not_write_over_files_of_another_kind(tmp_path):
    model = tmp_path / "mlp.tflite"
    shutil.copy(FIXTURES / "mlp.tflite", model)
    np.save(tmp_path / "mlp.wof", np.ones(3))
    (tmp_path / "mlp.wof.npy").rename(tmp_path / "mlp.wof")
    line = _one_error(trainconf, ["split", model])
    assert "mlp.wof: holds a .npy array; refusing to replace it with a .wof weights file" in line
    assert not (tmp_path / "mlp.frozen.circle").exists()
    _ok(trainconf, ["split", model, "--force"])
    assert load_artifacts(tmp_path / "mlp.frozen.circle").weights


# -- resuming ----------------------------------------------------------------------------------

@pytest.fixture
def checkpointed(mlp, tmp_path):
    ckpt = tmp_path / "run.ckpt"
    _ok(microtrain, _run(mlp.frozen, "--checkpoint", ckpt, "--validation-split", "0.2"))
    return mlp, ckpt


@pytest.mark.parametrize("change, message", [
    (["--batch-size", "16"], "was saved by a run with another --batch-size"),
    (["--input", FIXTURES / "digits_images.npy"], None),
    (["--validation-split", "0.3"], "was saved by a run with another training data"),
    (["--epochs", "1"], "has already done 1 epochs; --epochs 1 would train nothing"),
])
def test_a_resume_that_differs_is_refused(checkpointed, change, message):
    mlp, ckpt = checkpointed
    args = _run(mlp.frozen, "--checkpoint", ckpt, "--resume", "--epochs", "2",
                "--validation-split", "0.2") + change
    if message is None:  # other inputs: refused before resuming (they do not fit the model)
        _one_error(microtrain, args)
        return
    line = _one_error(microtrain, args)
    assert line.startswith(f"Error: {ckpt}: ") and message in line, line


def test_a_resume_with_another_test_set_is_refused(checkpointed):
    mlp, ckpt = checkpointed
    line = _one_error(microtrain, ["run", mlp.frozen, "--input", X, "--target", T, "--epochs", "2",
                                   "--checkpoint", ckpt, "--resume", "--test-input", X,
                                   "--test-target", T])
    assert "another training data" in line or "another test set" in line


def test_a_faithful_resume_trains_on(checkpointed):
    mlp, ckpt = checkpointed
    result = _ok(microtrain, _run(mlp.frozen, "--checkpoint", ckpt, "--resume", "--epochs", "2",
                                  "--validation-split", "0.2", "--json"))
    assert '"epoch": 2' in result.stdout


# -- weights and data that mislead ---------------------------------------------------------------

def _with_weight(mlp, value):
    model = load_model(mlp.frozen)
    weights = read_wof(mlp.wof, model)
    data = bytearray(mlp.wof.read_bytes())
    first = min(weights)
    offset = data.index(weights[first].tobytes())
    data[offset:offset + 4] = np.float32(value).tobytes()
    mlp.wof.write_bytes(bytes(data))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weights_are_refused_by_every_command(mlp, tmp_path, value):
    _with_weight(mlp, value)
    for args in (["eval", mlp.frozen, "--input", X, "--target", T],
                 ["infer", mlp.frozen, "--input", X, "-o", tmp_path / "o.npy"],
                 _run(mlp.frozen)):
        line = _one_error(microtrain, args)
        assert line.startswith(f"Error: {mlp.wof}: tensor ") and "NaN or inf values" in line
    assert not (tmp_path / "o.npy").exists()


def test_weights_that_overflow_are_refused_by_eval_and_infer(mlp, tmp_path):
    model = load_model(mlp.frozen)
    weights = read_wof(mlp.wof, model)
    data = bytearray(mlp.wof.read_bytes())
    for array in weights.values():  # every trainable value 3e38: the products overflow
        offset = data.index(array.tobytes())
        data[offset:offset + array.nbytes] = np.full(array.size, 3e38, np.float32).tobytes()
    mlp.wof.write_bytes(bytes(data))
    assert "they overflow float32" in _one_error(microtrain, ["eval", mlp.frozen, "--input", X,
                                                               "--target", T])
    assert "they overflow float32" in _one_error(microtrain, ["infer", mlp.frozen, "--input", X,
                                                               "-o", tmp_path / "o.npy"])
    assert not (tmp_path / "o.npy").exists()


def test_bytes_appended_to_a_wof_are_refused(mlp):
    mlp.wof.write_bytes(mlp.wof.read_bytes() + bytes(64))
    line = _one_error(microtrain, ["eval", mlp.frozen, "--input", X, "--target", T])
    assert "bytes were added or cut" in line


def test_test_target_needs_test_input(mlp):
    line = _one_error(microtrain, _run(mlp.frozen, "--test-target", T))
    assert line == "Error: give --test-input and --test-target together"


def test_an_empty_trainable_spec_is_one_error(tmp_path):
    line = _one_error(trainconf, ["split", FIXTURES / "mlp.tflite", "-o", tmp_path, "--trainable", ""])
    assert "--trainable: --trainable '' chooses nothing to train" in line


def test_class_ids_for_a_cce_model_get_a_hint(mlp):
    line = _one_error(microtrain, ["eval", mlp.frozen, "--input", X, "--target",
                                   FIXTURES / "digits_y.npy"])
    assert "they look like class ids: split the model with --loss sparse_cce" in line


@pytest.mark.parametrize("where", ["MODEL", "FROZEN", "--checkpoint"])
@pytest.mark.parametrize("what", ["folder", "fifo"])
def test_folders_and_fifos_as_inputs_are_one_line(mlp, tmp_path, where, what):
    odd = tmp_path / "odd.circle"
    odd.mkdir() if what == "folder" else os.mkfifo(odd)
    args = {"MODEL": (trainconf, ["split", odd]),
            "FROZEN": (microtrain, ["eval", odd, "--input", X, "--target", T]),
            "--checkpoint": (microtrain, _run(mlp.frozen, "--checkpoint", odd, "--resume"))}[where]
    line = _one_error(*args)
    assert line.startswith(f"Error: {odd}: ") or f"'{odd}'" in line, line


# -- writing: sets, syncing, temporaries -----------------------------------------------------------

def test_a_full_disk_during_split_leaves_the_previous_set(tmp_path, monkeypatch):
    model = tmp_path / "mlp.tflite"
    shutil.copy(FIXTURES / "mlp.tflite", model)
    first = split(model, trainable="last:1")
    before = {p: p.read_bytes() for p in (first.frozen, first.wof, first.backprop)}
    real_write = atomic._write_temporary
    calls = []

    def full_after_one(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise UserError(path, "cannot write it: No space left on device")
        return real_write(path, data)
    monkeypatch.setattr(atomic, "_write_temporary", full_after_one)
    with pytest.raises(UserError, match="No space left on device"):
        split(model)  # trains everything: all three files would change
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["mlp.tflite"] + [p.name for p in before])  # no temporaries, no marker
    load_artifacts(first.frozen)


def test_a_real_enospc_names_the_file(tmp_path, monkeypatch):
    def no_space(fd):  # where a full disk (or NFS) reports it at the latest
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(UserError) as info:
        atomic.atomic_write(tmp_path / "x.wof", b"1" * 100000)
    assert str(info.value) == f"{tmp_path / 'x.wof'}: cannot write it: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_set_interrupted_while_renaming_is_refused(mlp):
    marker = mlp.frozen.with_name("mlp" + atomic.PENDING)
    marker.write_bytes(b"mlp.wof\n")
    with pytest.raises(TornSetError, match="an interrupted `trainconf split` left a mix"):
        load_artifacts(mlp.frozen)


def test_the_folder_is_synced_after_each_rename(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(atomic, "_fsync_folder", synced.append)
    atomic.atomic_write(tmp_path / "a.bin", b"data")
    assert synced == [tmp_path]


def test_leftover_temporaries_of_dead_processes_are_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that no longer runs
    dead = tmp_path / f".w.wof.{child.pid}-0123abcd.partial"
    alive = tmp_path / f".w.wof.{os.getppid()}-0123abcd.partial"
    other = tmp_path / f".v.wof.{child.pid}-0123abcd.partial"
    for p in (dead, alive, other):
        p.write_bytes(b"x")
    atomic.atomic_write(tmp_path / "w.wof", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name, "w.wof"])


# -- kill -9 while saving ------------------------------------------------------------------------

KILL_TRIALS = int(os.environ.get("MICROTRAIN_KILL_TRIALS", "3"))


def test_kill_9_during_save_leaves_old_or_new_weights_and_no_temporaries(tmp_path):
    """Kill `microtrain run --save always --checkpoint` at spread-out moments: the .wof
    is always a complete set of weights (old or new) that loads, and the next run
    removes every temporary the killed one left."""
    model = tmp_path / "mlp.tflite"
    shutil.copy(FIXTURES / "mlp.tflite", model)
    files = split(model)
    command = [sys.executable, "-m", "microtrain.commands.cli", *map(str, _run(
        files.frozen, "--epochs", "3", "--save", "always", "--checkpoint", tmp_path / "run.ckpt"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    full = subprocess.run(command, env=env, capture_output=True, timeout=120)
    assert full.returncode == 0, full.stderr
    rng = np.random.default_rng(9)
    left = 0  # kills that left a temporary behind (reported, as the moment is chance)
    for trial in range(KILL_TRIALS):
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(float(rng.uniform(0.3, 2.5)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        art = load_artifacts(files.frozen)  # complete weights, old or new
        assert all(np.isfinite(w).all() for w in art.weights.values())
        left += any(p.name.endswith(atomic.SUFFIX) for p in tmp_path.iterdir())
    print(f"{KILL_TRIALS} kills, {left} left a temporary")
    _ok(microtrain, _run(files.frozen, "--save", "always", "--checkpoint", tmp_path / "run.ckpt"))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(atomic.SUFFIX)] == []
