"""Nothing a user gives is lost or silently overwritten (issue 23): an output is
never a file the same call reads, a trained .wof is not reset by a new split
unless forced, concurrent runs on one set are refused (or wait), every output
is checked before any work, errors name their file and option, a closed stdout
ends quietly, and a file's shapes never size an allocation beyond this
machine's memory."""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.files.artifacts import sibling
from microtrain.commands.cli import main as microtrain
from microtrain.files.format.model import get_metadata, model_from_bytes, model_to_bytes
from microtrain.files.lock import lock_file
from model_patch import FIXTURES
from test_hardening import _ok, _one_error, mlp  # noqa: F401  (mlp: a fixture)
from trainconf.cli import main as trainconf
from trainconf.split import split

X, T = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"
ROOT = Path(__file__).parent.parent


def _run(frozen, *extra):
    return ["run", frozen, "--input", X, "--target", T, "--epochs", "1", "--seed", "3", *extra]


def _cli(*args, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", "import sys; "
                             "from microtrain.commands.cli import main; "
                             "from trainconf.cli import main as tc; "
                             "(tc if sys.argv[1] == 'trainconf' else main)(sys.argv[2:])",
                             *map(str, args)], env=env, cwd=ROOT, **popen)


# -- 1. no output is an input of the same call ----------------------------------------------------

def test_infer_refuses_to_write_over_its_input(mlp, tmp_path):
    data = tmp_path / "data.npy"
    shutil.copy(X, data)
    line = _one_error(microtrain, ["infer", mlp.frozen, "--input", data, "-o", data])
    assert line == (f"Error: {data}: is also an input of this command (--input); "
                    "give -o another file")
    assert data.read_bytes() == X.read_bytes()


def test_an_output_reached_through_a_link_is_the_input(mlp, tmp_path):
    link = tmp_path / "link.npy"
    data = tmp_path / "data.npy"
    shutil.copy(X, data)
    link.symlink_to(data)
    line = _one_error(microtrain, ["infer", mlp.frozen, "--input", data, "-o", link])
    assert "is also an input of this command (--input)" in line
    assert data.read_bytes() == X.read_bytes()


def test_export_refuses_to_write_over_the_frozen_model(mlp):
    before = mlp.frozen.read_bytes()
    line = _one_error(trainconf, ["export", mlp.frozen, "-o", mlp.frozen])
    assert line == (f"Error: {mlp.frozen}: is also an input of this command (FROZEN); "
                    "give -o another file")
    assert mlp.frozen.read_bytes() == before


def test_run_refuses_a_checkpoint_or_output_that_is_its_data(mlp, tmp_path):
    data = tmp_path / "x.npy"
    shutil.copy(X, data)
    line = _one_error(microtrain, ["run", mlp.frozen, "--input", data, "--target", T,
                                   "--checkpoint", data, "--force"])
    assert "is also an input of this command (--input)" in line
    line = _one_error(microtrain, _run(mlp.frozen, "--output-wof", mlp.backprop, "--force"))
    assert "is also an input of this command (--backprop)" in line
    assert data.read_bytes() == X.read_bytes()


def test_split_over_trained_weights_is_refused_unless_forced(tmp_path):
    model = tmp_path / "mlp.tflite"
    shutil.copy(FIXTURES / "mlp.tflite", model)
    files = split(model)
    _ok(trainconf, ["split", model])  # the same weights again: nothing is lost
    _ok(microtrain, _run(files.frozen, "--save", "always"))
    trained = files.wof.read_bytes()
    line = _one_error(trainconf, ["split", model])
    assert line == (f"Error: {files.wof}: holds weights that differ from {model.name}'s (trained "
                    "by microtrain run?); give --force to replace them, or -o another folder")
    assert files.wof.read_bytes() == trained
    _ok(trainconf, ["split", model, "--force"])
    assert files.wof.read_bytes() != trained


def test_split_over_trained_weights_is_refused_before_its_work(tmp_path, monkeypatch):
    import trainconf.split as split_module
    files = split(FIXTURES / "mlp.tflite", tmp_path)
    _ok(microtrain, _run(files.frozen, "--save", "always"))
    built = []
    monkeypatch.setattr(split_module, "build", lambda *a, **kw: built.append(a))
    line = _one_error(trainconf, ["split", FIXTURES / "mlp.tflite", "-o", tmp_path,
                                  "--memory-budget", "60KiB"])
    assert "holds weights that differ" in line and built == []


# -- 2. one run at a time on a set ----------------------------------------------------------------

def _holding(frozen, tmp_path, *extra) -> subprocess.Popen:
    """A run in another process that holds the set's lock for a while; its output
    goes to tmp_path/holder.out (a pipe nobody reads would stop it)."""
    with open(tmp_path / "holder.out", "w") as out:
        proc = _cli("microtrain", *_run(frozen, "--epochs", "1000000", "--save", "always", *extra),
                    stdout=out, stderr=subprocess.STDOUT, text=True)
    # the set's lock, then its .wof's: both held before a test runs another command
    locks = [lock_file(frozen), lock_file(sibling(frozen, ".wof"))]
    for _ in range(600):
        if all(lock.exists() and lock.read_text().strip() == str(proc.pid) for lock in locks):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    raise AssertionError("the run never took its lock: " + (tmp_path / "holder.out").read_text())


def test_a_second_run_on_the_same_set_is_refused(mlp, tmp_path):
    first = _holding(mlp.frozen, tmp_path)
    try:
        line = _one_error(microtrain, _run(mlp.frozen, "--save", "always"))
        assert line == (f"Error: {mlp.frozen}: in use by process {first.pid} (another run or "
                        "split of these files); give --wait to wait for it")
    finally:
        first.kill()
        first.communicate()


def test_a_run_writing_the_same_wof_from_another_set_is_refused(mlp, tmp_path):
    other = split(FIXTURES / "mlp.tflite", tmp_path / "other")
    first = _holding(mlp.frozen, tmp_path)
    try:
        line = _one_error(microtrain, _run(other.frozen, "--output-wof", mlp.wof))
        assert f"Error: {mlp.wof}: in use by process {first.pid}" in line
    finally:
        first.kill()
        first.communicate()


def test_wait_waits_for_the_holder_and_only_one_writes_at_a_time(mlp, tmp_path):
    first = _holding(mlp.frozen, tmp_path, "--epochs", "300", "--json")
    second = _ok(microtrain, _run(mlp.frozen, "--save", "always", "--wait", "--json"))
    first.communicate()
    first_summary = json.loads((tmp_path / "holder.out").read_text().splitlines()[-1])
    second_summary = json.loads(second.output.splitlines()[-1])
    assert first_summary["saved"] and second_summary["saved"]
    # the second started from the weights the first wrote: it waited for them
    assert second_summary["initial_loss"] == first_summary["final_loss"]


def test_a_lock_left_by_a_killed_process_does_not_block(mlp, tmp_path):
    first = _holding(mlp.frozen, tmp_path)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    _ok(microtrain, _run(mlp.frozen, "--save", "always"))


def test_split_is_refused_while_a_run_trains_the_set(tmp_path):
    model = tmp_path / "mlp.tflite"
    shutil.copy(FIXTURES / "mlp.tflite", model)
    files = split(model)
    first = _holding(files.frozen, tmp_path)
    try:
        line = _one_error(trainconf, ["split", model, "--force"])
        assert f"in use by process {first.pid}" in line
    finally:
        first.kill()
        first.communicate()


def test_split_into_a_new_folder_holds_the_lock_there(tmp_path, monkeypatch):
    """The folder is made before the work, so the set's lock is taken in it; a refused
    split leaves no folder behind."""
    import trainconf.cli as trainconf_cli
    out = tmp_path / "new" / "set"
    held = []

    def split_holding(model, outdir, **kw):
        held.append(lock_file(Path(outdir) / "mlp.frozen.circle").read_text().strip())
        return split(model, outdir, **kw)
    monkeypatch.setattr(trainconf_cli, "split", split_holding)
    _ok(trainconf, ["split", FIXTURES / "mlp.tflite", "-o", out])
    assert held == [str(os.getpid())]  # the lock file holds our process id: it is held
    line = _one_error(trainconf, ["split", FIXTURES / "mlp.tflite", "-o", tmp_path / "other",
                                  "--memory-budget", "1KB"])
    assert "even the smallest trainable set" in line
    assert not (tmp_path / "other").exists()


# -- 3. outputs checked before any work ----------------------------------------------------------

@pytest.mark.parametrize("command", ["run-wof", "run-checkpoint", "infer", "export", "plot",
                                     "sweep", "import"])
def test_an_output_in_a_missing_folder_is_refused_before_any_work(mlp, tmp_path, command):
    out = tmp_path / "missing" / "out"
    args = {"run-wof": _run(mlp.frozen, "--output-wof", out.with_suffix(".wof")),
            "run-checkpoint": _run(mlp.frozen, "--checkpoint", out.with_suffix(".ckpt")),
            "infer": ["infer", mlp.frozen, "--input", X, "-o", out.with_suffix(".npy")],
            "export": ["export", mlp.frozen, "-o", out.with_suffix(".tflite")],
            "plot": ["plot", mlp.frozen, "-o", out.with_suffix(".png")],
            "sweep": ["sweep", mlp.frozen, "--input", X, "--target", T, "--grid",
                      "learning-rate=0.1", "--log", out.with_suffix(".jsonl")],
            "import": ["import", FIXTURES / "mlp.tflite", "-o", out.with_suffix(".circle")]}
    cli = trainconf if command in ("export", "import") else microtrain
    result = CliRunner().invoke(cli, [str(a) for a in args[command]])
    assert result.exit_code == 1 and "Epoch" not in result.output, result.output
    assert result.stderr.strip() == (f"Error: {out.with_suffix(Path(args[command][-1]).suffix)}: "
                                     f"cannot write it: no folder {out.parent}")


# -- 4. errors name their file and option ---------------------------------------------------------

def test_sample_counts_that_differ_name_both_files(mlp, tmp_path):
    few = tmp_path / "t100.npy"
    np.save(few, np.load(T)[:100])
    line = _one_error(microtrain, ["run", mlp.frozen, "--input", X, "--target", few])
    assert line == f"Error: {few}: holds 100 samples but the input {X} holds 1797"


def test_a_bad_hyperparameter_names_its_option(mlp):
    line = _one_error(microtrain, _run(mlp.frozen, "--learning-rate", "-0.01"))
    assert line == "Error: --learning-rate: must be a number > 0, got -0.01"
    line = _one_error(microtrain, _run(mlp.frozen, "--lr-schedule", "linear-warmup",
                                       "--warmup-start", "-1"))
    assert line == "Error: --warmup-start: must be a number >= 0, got -1.0"


def test_a_hyperparameter_the_optimizer_lacks_is_named_as_options(mlp, tmp_path):
    line = _one_error(microtrain, _run(mlp.frozen, "--optimizer", "sgd", "--beta1", "0.8"))
    assert line == ("Error: optimizer sgd has no --beta1 (it takes --learning-rate, --momentum, "
                    "--weight-decay)")
    line = _one_error(trainconf, ["split", FIXTURES / "mlp.tflite", "-o", tmp_path,
                                  "--optimizer", "rmsprop", "--beta2", "0.9"])
    assert "has no --beta2 (it takes --learning-rate, --rho," in line and "_" not in line


def test_divergence_names_the_model(mlp):
    line = _one_error(microtrain, _run(mlp.frozen, "--learning-rate", "1e30"))
    assert line.startswith(f"Error: {mlp.frozen}: training diverged in epoch 1: ")
    assert "--learning-rate" in line


def test_the_backprop_graph_or_the_wof_as_the_model_say_what_to_give(mlp):
    for wrong in (mlp.backprop, mlp.wof):
        line = _one_error(microtrain, _run(wrong))
        assert line.startswith(f"Error: {wrong}: ") and line.endswith(
            f"give the model {mlp.frozen.name} instead"), line
    line = _one_error(microtrain, _run(FIXTURES / "mlp.tflite"))
    assert "split it first (trainconf split" in line


# -- 5. manners ----------------------------------------------------------------------------------

def test_a_closed_stdout_ends_quietly_with_the_files_written(tmp_path):
    model = tmp_path / "mlp.tflite"
    shutil.copy(FIXTURES / "mlp.tflite", model)
    proc = _cli("trainconf", "split", model, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    _, err = proc.communicate()
    assert proc.returncode == 0 and err == b""
    assert (tmp_path / "mlp.frozen.circle").exists() and (tmp_path / "mlp.wof").exists()


def test_a_closed_stdout_does_not_stop_training(mlp):
    proc = _cli("microtrain", *_run(mlp.frozen, "--epochs", "2", "--save", "always"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    before = mlp.wof.read_bytes()
    proc.stdout.close()
    _, err = proc.communicate()
    assert proc.returncode == 0 and err == b""
    assert mlp.wof.read_bytes() != before


def test_library_warnings_are_shown_only_with_verbose(mlp, monkeypatch, recwarn):
    import warnings
    from microtrain.commands import session

    def warn_then_evaluate(config):
        warnings.warn("a library's deprecation", FutureWarning)
        return {"loss_function": "cce", "loss": 1.0}
    monkeypatch.setattr(session, "evaluate", warn_then_evaluate)
    args = ["eval", mlp.frozen, "--input", X, "--target", T]
    assert _ok(microtrain, args).stderr == "" and not recwarn.list
    assert os.environ.get("PYTHONWARNINGS") != "ignore"  # restored after the command
    _ok(microtrain, args + ["--verbose"])
    assert [str(w.message) for w in recwarn.list] == ["a library's deprecation"]


def test_parsing_run_options_from_python_leaves_warnings_alone(monkeypatch):
    """The sweep API reads its trials' options with `run`'s parser: that hides no warnings
    of the caller's process (only a command, which restores them, does)."""
    import warnings
    from microtrain.commands.cli import run
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    with warnings.catch_warnings():
        before = list(warnings.filters)
        run.make_context("run", ["frozen.circle", "--input", "x.npy", "--target", "y.npy"])
        assert warnings.filters == before
    assert "PYTHONWARNINGS" not in os.environ


# -- 8. sizes from files --------------------------------------------------------------------------

def _limited(gib: int):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))
    return limit


def test_a_huge_shape_signature_is_one_line_under_a_memory_limit(tmp_path):
    model = model_from_bytes((FIXTURES / "mlp.tflite").read_bytes())
    sg = model.subgraphs[0]
    sg.tensors[sg.inputs[0]].shapeSignature = [-1, 2 ** 31 - 1]
    path = tmp_path / "huge.tflite"
    path.write_bytes(model_to_bytes(model))
    proc = _cli("trainconf", "split", path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, preexec_fn=_limited(3))
    _, err = proc.communicate()
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith(f"Error: {path}: "), err


# findings of the fuzz campaign (tests/test_fuzz.py at 10,000 cases over seeds 1-4)

def _forged(files, edit) -> None:
    """The backprop graph of `files` with `edit(model)` applied, resealed as a forger would."""
    from fuzz_cases import reseal
    model = model_from_bytes(files.backprop.read_bytes())
    edit(model, json.loads(get_metadata(model, "microtrain.backprop")))
    files.backprop.write_bytes(reseal(model_to_bytes(model)))


@pytest.mark.parametrize("shape", [[3], [1, 1], []])
def test_a_loss_tensor_of_another_shape_is_one_line(mlp, shape):
    def edit(model, links):
        model.subgraphs[0].tensors[links["loss"]].shape = shape
    _forged(mlp, edit)
    line = _one_error(microtrain, ["eval", mlp.frozen, "--input", X, "--target", T])
    assert line.endswith(f"has shape {shape}; a loss is one value, shape [1]")


def test_a_planned_shape_whose_size_overflows_int64_is_one_line(mlp):
    def edit(model, links):
        linked = {links["loss"], *links["targets"]}
        planned = next(t for t, *_ in links["memory"]["backprop"] if t not in linked)
        t = model.subgraphs[0].tensors[planned]
        t.shape = t.shapeSignature = [-1] + [2 ** 31 - 1] * 4
    _forged(mlp, edit)
    line = _one_error(microtrain, _run(mlp.frozen))
    assert line.startswith(f"Error: {mlp.backprop}: memory plan: backprop tensor ")


@pytest.mark.parametrize("tail", [[], [2 ** 31 - 1, 2 ** 31 - 1]])
def test_a_trainable_tensor_with_no_elements_is_one_line(mlp, tmp_path, tail):
    model = model_from_bytes(mlp.frozen.read_bytes())
    trainable = json.loads(get_metadata(model, "microtrain.training"))["trainable"]
    tensor = model.subgraphs[0].tensors[trainable[0]]
    tensor.shape = [tensor.shape[0], 0] + list(tensor.shape[1:]) + tail
    mlp.frozen.write_bytes(model_to_bytes(model))
    line = _one_error(microtrain, ["infer", mlp.frozen, "--input", X, "-o", tmp_path / "o.npy"])
    assert line.endswith("with no elements")


def test_epochs_beyond_what_circle_plus_records_are_refused(mlp):
    line = _one_error(microtrain, _run(mlp.frozen, "--epochs", str(2 ** 31)))
    assert "--epochs" in line and "2147483648" in line


def test_an_argument_holding_a_nul_is_one_line(mlp, tmp_path):
    line = _one_error(microtrain, ["infer", mlp.frozen, "--input", X, "-o", f"{tmp_path}/a\0b"])
    assert line.endswith("an argument cannot hold a NUL character")


def test_shapes_whose_plan_overflows_int64_are_one_line(tmp_path):
    # cnn.tflite with one tensor's shape corrupted (fuzz seed 8, case 208)
    model = tmp_path / "cnn.tflite"
    shutil.copy(FIXTURES / "fuzz" / "planning_overflow.tflite", model)
    line = _one_error(trainconf, ["split", model, "-o", tmp_path / "split"])
    assert line.startswith(f"Error: {model}: the tensors of a training step need up to ")
