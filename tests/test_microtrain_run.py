"""`microtrain run/eval/infer` end to end: output, saving rules, resume, bad input."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.commands.cli import main
from microtrain.files.format.model import load_model
from microtrain.files.format.wof import read_wof
from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
X, Y = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mlp")
    return split(FIXTURES / "mlp.tflite", out).frozen


@pytest.fixture
def frozen(pristine, tmp_path) -> Path:
    """A private copy of the split mlp, so tests may overwrite its .wof."""
    for f in pristine.parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    return tmp_path / pristine.name


def wof_of(frozen: Path) -> Path:
    return frozen.with_name("mlp.wof")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_run_json_reports_each_epoch_and_a_summary(frozen):
    result = invoke("run", frozen, "--input", X, "--target", Y, "--epochs", 3, "--json",
                    "--seed", 1, "--validation-split", 0.2)
    assert result.exit_code == 0, result.output
    records = json_lines(result.stdout)
    epochs, summary = records[:-1], records[-1]
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    for r in epochs:
        assert {"loss", "accuracy", "ms_per_step", "test_loss", "test_accuracy"} <= set(r)
        assert r["ms_per_step"] > 0
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    assert summary["event"] == "summary" and summary["judged_on"] == "test"
    assert summary["saved"] == summary["improved"] is True
    assert summary["final_accuracy"] > summary["initial_accuracy"]


def test_text_output_shows_one_line_per_epoch(frozen):
    result = invoke("run", frozen, "--input", X, "--target", Y, "--epochs", 2, "--save", "never")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Epoch 1/2") and "ms/step" in lines[0] and "loss:" in lines[0]
    assert "weights not written" in lines[-1]


@pytest.mark.parametrize("policy,lr,written", [("improved", 0.01, True), ("never", 0.01, False),
                                               ("always", 1e-12, True), ("improved", 1e-12, False)])
def test_save_policy(frozen, policy, lr, written):
    """A learning rate of 1e-12 leaves the accuracy as it was: not an improvement."""
    before = wof_of(frozen).read_bytes()
    inode = wof_of(frozen).stat().st_ino
    result = invoke("run", frozen, "--input", X, "--target", Y, "--epochs", 1, "--save", policy,
                    "--learning-rate", lr, "--optimizer", "sgd", "--json")
    assert result.exit_code == 0, result.output
    summary = json_lines(result.stdout)[-1]
    assert summary["saved"] is written
    assert (wof_of(frozen).stat().st_ino != inode) is written  # replaced by a rename
    if not written:
        assert wof_of(frozen).read_bytes() == before
    assert [p.name for p in frozen.parent.iterdir() if p.name.startswith(".")] == []  # no temporaries


def test_output_wof_leaves_the_input_wof_alone(frozen, tmp_path):
    before = wof_of(frozen).read_bytes()
    out = tmp_path / "trained.wof"
    assert invoke("run", frozen, "--input", X, "--target", Y, "--epochs", 1,
                  "--output-wof", out).exit_code == 0
    assert wof_of(frozen).read_bytes() == before
    trained = read_wof(out, load_model(frozen))
    assert set(trained) == set(read_wof(wof_of(frozen), load_model(frozen)))


def test_resume_gives_the_losses_of_an_uninterrupted_run(frozen, tmp_path):
    common = ["--input", X, "--target", Y, "--json", "--seed", 5, "--save", "always",
              "--optimizer", "adam", "--batch-size", 50]
    straight = tmp_path / "straight.wof"
    full = json_lines(invoke("run", frozen, *common, "--epochs", 4, "--output-wof", straight).stdout)
    ckpt, resumed_wof = tmp_path / "ckpt.npz", tmp_path / "resumed.wof"
    first = invoke("run", frozen, *common, "--epochs", 2, "--checkpoint", ckpt,
                   "--output-wof", tmp_path / "half.wof")
    assert first.exit_code == 0, first.output
    second = invoke("run", frozen, *common, "--epochs", 4, "--checkpoint", ckpt, "--resume",
                    "--output-wof", resumed_wof)
    assert second.exit_code == 0, second.output
    resumed = json_lines(first.stdout)[:-1] + json_lines(second.stdout)[:-1]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[:-1]]
    assert resumed_wof.read_bytes() == straight.read_bytes()


def test_eval_and_infer_agree_with_the_python_api(frozen, tmp_path):
    result = invoke("eval", frozen, "--input", X, "--target", Y, "--json")
    assert result.exit_code == 0, result.output
    trainer = Trainer(frozen)
    x, y = np.load(X), np.load(Y)
    assert json.loads(result.stdout)["loss"] == pytest.approx(trainer.evaluate([x], [y])["loss"])
    out = tmp_path / "out.npy"
    assert invoke("infer", frozen, "--input", X, "-o", out).exit_code == 0
    probs = np.load(out)
    np.testing.assert_array_equal(probs, trainer.predict([x])[0])
    np.testing.assert_allclose(probs.sum(axis=1), 1, rtol=1e-5)


def test_raw_bin_input_with_a_sample_shape(frozen, tmp_path):
    raw = tmp_path / "x.bin"
    np.load(X).astype("<f4").tofile(raw)
    result = invoke("eval", frozen, "--input", raw, "--input-shape", "64", "--target", Y, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["samples"] == 1797


def _bad_cases(frozen: Path, tmp: Path):
    nan = tmp / "nan.npy"
    x = np.load(X)
    x[3, 5] = np.nan
    np.save(nan, x)
    other = split(FIXTURES / "residual_mlp.tflite", tmp / "other")
    return {
        "wrong shape": (["--input", FIXTURES / "digits_images.npy"], "expected input samples of shape (64,)"),
        "two inputs": (["--input", X, "--input", X], "the model has 1 input(s), got 2"),
        "missing file": (["--input", tmp / "nope.npy"], "nope.npy"),
        "nan": (["--input", nan], "NaN"),
        "batch too big": (["--input", X, "--batch-size", 5000], "larger than the data set"),
        "foreign wof": (["--input", X, "--wof", other.wof], "buffers, but the model's subgraph has"),
        "foreign backprop": (["--input", X, "--backprop", other.backprop], "another model"),
        "diverges": (["--input", X, "--learning-rate", 1e30, "--optimizer", "sgd"], "diverged"),
    }


@pytest.mark.parametrize("case", ["wrong shape", "two inputs", "missing file", "nan",
                                  "batch too big", "foreign wof", "foreign backprop", "diverges"])
def test_bad_input_is_one_error_line_and_the_wof_is_untouched(frozen, tmp_path, case):
    args, expected = _bad_cases(frozen, tmp_path)[case]
    before = wof_of(frozen).read_bytes()
    result = subprocess.run([sys.executable, "-m", "microtrain.commands.cli", "run", str(frozen),
                             "--target", str(Y), *map(str, args), "--epochs", "1", "--save", "always"],
                            capture_output=True, text=True)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert wof_of(frozen).read_bytes() == before


def test_weights_with_nan_are_never_saved(frozen):
    trainer = Trainer(frozen)
    trainer.memory.params[0] = np.inf
    before = wof_of(frozen).read_bytes()
    with pytest.raises(Exception, match="NaN or inf"):
        trainer.save_weights()
    assert wof_of(frozen).read_bytes() == before
