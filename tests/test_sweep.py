"""`microtrain sweep`: best weights written only when they improve, resuming, parallel
trials, Optuna's TPE, successive halving, and the reproducing command line."""
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from microtrain.commands.cli import main, run
from microtrain.run_config import SWEEPABLE, RunConfig
from microtrain.commands.sweep import SweepSettings, Sweep, axis, swept, sweep as sweep_api
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
X, Y = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"
DATA = ["--input", X, "--target", Y, "--validation-split", 0.2]
GRID = "optimizer=sgd,adam learning-rate=0.001,0.01 epochs=2"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return split(FIXTURES / "mlp.tflite", tmp_path_factory.mktemp("mlp")).frozen


@pytest.fixture
def frozen(pristine, tmp_path) -> Path:
    """A private copy of the split mlp (the sweep may overwrite its .wof)."""
    folder = tmp_path / "model"
    shutil.copytree(pristine.parent, folder)
    return folder / pristine.name


def wof_of(frozen: Path) -> Path:
    return frozen.with_name("mlp.wof")


def sweep(frozen, *args):
    result = CliRunner().invoke(main, ["sweep", str(frozen), *map(str, DATA + list(args))])
    return result


def sweep_json(frozen, *args) -> tuple[list[dict], dict]:
    result = sweep(frozen, *args, "--json")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return lines[:-1], lines[-1]


def reproduce(command: str, start_wof: Path, out: Path) -> bytes:
    """Run the printed `microtrain run` command line from the starting weights."""
    args = shlex.split(command)
    assert args[:2] == ["microtrain", "run"]
    result = CliRunner().invoke(main, args[1:] + ["--wof", str(start_wof), "--output-wof",
                                                  str(out), "--save", "always"])
    assert result.exit_code == 0, result.output
    return out.read_bytes()


def ranked(summary: dict) -> list:
    return [(r["trial"], r["status"], r["value"]) for r in summary["ranking"]]


def test_grid_writes_the_best_weights_and_its_command_reproduces_them(frozen, tmp_path):
    start = tmp_path / "start.wof"
    shutil.copy(wof_of(frozen), start)
    trials, summary = sweep_json(frozen, "--grid", GRID)
    assert [t["trial"] for t in trials] == [0, 1, 2, 3]
    assert [t["params"] for t in trials][:2] == [
        {"optimizer": "sgd", "learning-rate": 0.001, "epochs": 2},
        {"optimizer": "sgd", "learning-rate": 0.01, "epochs": 2}]
    values = [r["value"] for r in summary["ranking"]]
    assert values == sorted(values, reverse=True) and len(set(values)) > 1
    best = summary["best"]
    assert best["value"] == values[0] > summary["initial"]
    assert summary["saved"] and summary["wof"] == str(wof_of(frozen))
    assert wof_of(frozen).read_bytes() != start.read_bytes()
    assert Path(summary["best_wof"]).read_bytes() == wof_of(frozen).read_bytes()
    assert "--learning-rate" in summary["command"] and "--seed 0" in summary["command"]
    assert reproduce(summary["command"], start, tmp_path / "again.wof") == \
        wof_of(frozen).read_bytes()
    assert not any(p.name.endswith((".tmp", ".trials")) for p in frozen.parent.iterdir())


def test_run_options_are_fixed_as_given_and_the_printed_command_works_as_printed(frozen):
    trials, summary = sweep_json(frozen, "--epochs", 2, "--no-shuffle",
                                 "--grid", "learning-rate=0.003,0.03")
    assert [t["params"] for t in trials] == [{"learning-rate": 0.003}, {"learning-rate": 0.03}]
    assert all(t["epochs"] == 2 and "--epochs 2" in t["command"] and "--no-shuffle" in
               t["command"] for t in trials)
    assert summary["saved"] and summary["start_wof"] in summary["command"]
    best = wof_of(frozen).read_bytes()
    assert best != Path(summary["start_wof"]).read_bytes()  # the copy still holds the start
    wof_of(frozen).unlink()
    result = CliRunner().invoke(main, shlex.split(summary["command"])[1:])  # as printed
    assert result.exit_code == 0, result.output
    assert wof_of(frozen).read_bytes() == best


def test_an_option_given_and_swept_is_refused(frozen):
    result = sweep(frozen, "--epochs", 3, "--grid", "epochs=1,2")
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "--epochs is given both as an option and in --grid" in result.output


def test_weights_that_do_not_improve_are_not_written(frozen):
    before = wof_of(frozen).read_bytes()
    trials, summary = sweep_json(frozen, "--grid", "optimizer=sgd learning-rate=1e-12,1e-13 "
                                                   "epochs=1")
    assert [t["status"] for t in trials] == ["ok", "ok"]
    assert summary["best"]["value"] == summary["initial"]
    assert summary["saved"] is False and summary["wof"] is None
    assert wof_of(frozen).read_bytes() == before


def test_random_sweep_samples_log_uniform_ranges_with_its_seed(frozen, tmp_path):
    grid = "optimizer=sgd,adam learning-rate=1e-4:1e-1 batch-size=8:64 epochs=1"
    trials, summary = sweep_json(frozen, "--grid", grid, "--random", 5, "--seed", 3)
    assert len(trials) == 5 and summary["trials"] == 5
    for t in trials:
        assert 1e-4 <= t["params"]["learning-rate"] <= 1e-1
        assert isinstance(t["params"]["batch-size"], int) and 8 <= t["params"]["batch-size"] <= 64
    assert len({t["params"]["learning-rate"] for t in trials}) == 5
    assert summary["saved"] is (summary["best"]["value"] > summary["initial"])
    other = tmp_path / "other.jsonl"
    again, _ = sweep_json(frozen, "--grid", grid, "--random", 5, "--seed", 3, "--log", other,
                          "--output-wof", tmp_path / "o.wof")
    assert [t["params"] for t in again] == [t["params"] for t in trials]


def _api_sweep(frozen, log: Path, grid=GRID, **settings) -> Sweep:
    fixed = {"frozen": str(frozen), "inputs": (str(X),), "targets": (str(Y),),
             "validation_split": 0.2}
    return Sweep(RunConfig(**fixed), [grid], SweepSettings(log=log, **settings))


def test_the_python_api_sweeps_as_the_command_does(frozen, tmp_path):
    summary = sweep_api([GRID], SweepSettings(log=tmp_path / "api.jsonl"), frozen=str(frozen),
                        inputs=(str(X),), targets=(str(Y),), validation_split=0.2,
                        output_wof=str(tmp_path / "api.wof"))
    _, by_command = sweep_json(frozen, "--grid", GRID, "--log", tmp_path / "cli.jsonl",
                               "--output-wof", tmp_path / "cli.wof")
    assert ranked(summary) == ranked(by_command)


def _comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("wof", "best_wof", "start_wof",
                                                          "command")}


def test_an_interrupted_sweep_resumes_to_the_same_result(frozen, pristine, tmp_path):
    straight = _api_sweep(pristine, tmp_path / "straight.jsonl",
                          grid=GRID.replace("epochs=2", "epochs=1")).run()
    log = tmp_path / "resumed.jsonl"
    finished = []

    def interrupt_after_two(record):
        finished.append(record["trial"])
        if len(finished) == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _api_sweep(frozen, log, grid=GRID.replace("epochs=2", "epochs=1")).run(interrupt_after_two)
    finished.clear()
    resumed = _api_sweep(frozen, log, grid=GRID.replace("epochs=2", "epochs=1")).run(
        lambda record: finished.append(record["trial"]))
    assert finished == [2, 3]  # only the trials the log did not hold
    assert _comparable(resumed) == _comparable(straight)
    assert wof_of(frozen).read_bytes() == Path(straight["best_wof"]).read_bytes()


def test_a_log_cut_short_and_lost_best_weights_are_recovered(frozen, tmp_path):
    """A kill while a record is written leaves half a line; a kill between a new best's
    weights and its record leaves the best-weights file out of step: both are repaired."""
    log = tmp_path / "s.jsonl"
    start = wof_of(frozen).read_bytes()
    grid = "optimizer=adam learning-rate=0.001,0.003,0.01 epochs=1"
    straight = _api_sweep(frozen, log, grid=grid).run()
    trained = wof_of(frozen).read_bytes()
    lines = log.read_text().splitlines(keepends=True)
    best = straight["best"]["trial"]
    others = [line for line in lines[1:-1] if json.loads(line)["trial"] != best]
    log.write_text(lines[0] + lines[1 + best] + others[0][:40])
    wof_of(frozen).write_bytes(start)
    Path(straight["best_wof"]).write_bytes(b"not the best")
    finished = []
    resumed = _api_sweep(frozen, log, grid=grid).run(lambda r: finished.append(r["trial"]))
    assert sorted(finished) == sorted(json.loads(line)["trial"] for line in others)
    assert _comparable(resumed) == _comparable(straight)
    assert straight["saved"] and trained != start
    assert Path(resumed["best_wof"]).read_bytes() == wof_of(frozen).read_bytes() == trained


def test_a_finished_sweep_run_again_reports_its_summary(frozen):
    _, first = sweep_json(frozen, "--grid", GRID)
    again = sweep(frozen, "--grid", GRID)
    assert again.exit_code == 0, again.output
    assert "rank" in again.stdout and f"best: trial {first['best']['trial']}" in again.stdout


def test_two_jobs_rank_as_one(frozen, pristine, tmp_path):
    grid = "optimizer=sgd,adam learning-rate=0.003,0.03 epochs=1"
    one = _api_sweep(pristine, tmp_path / "one.jsonl", grid=grid).run()
    two = _api_sweep(frozen, tmp_path / "two.jsonl", grid=grid, jobs=2).run()
    assert ranked(two) == ranked(one)


def test_failed_and_diverged_trials_are_recorded_and_the_sweep_goes_on(frozen):
    trials, summary = sweep_json(frozen, "--grid", "optimizer=sgd,adam momentum=0.5 "
                                                   "learning-rate=0.01,1e30 epochs=1")
    status = {(t["params"]["optimizer"], t["params"]["learning-rate"]): t for t in trials}
    assert status["sgd", 0.01]["status"] == "ok"
    assert status["sgd", 1e30]["status"] == "diverged"
    assert "diverged" in status["sgd", 1e30]["error"]
    assert status["adam", 0.01]["status"] == "failed"
    assert "optimizer adam has no momentum" in status["adam", 0.01]["error"]
    assert summary["best"]["trial"] == status["sgd", 0.01]["trial"]
    assert [r["status"] for r in summary["ranking"]][0] == "ok"
    assert (summary["ok"], summary["diverged"], summary["failed"]) == (1, 1, 2)


def test_tpe_search_runs_with_pruning_allowed(frozen):
    trials, summary = sweep_json(frozen, "--grid", "optimizer=adam,sgd learning-rate=1e-4:1e-1 "
                                                   "epochs=3", "--search", "tpe", "--trials", 6)
    assert len(trials) == 6
    assert {t["status"] for t in trials} <= {"ok", "pruned"}
    assert all(1e-4 <= t["params"]["learning-rate"] <= 1e-1 for t in trials)
    assert summary["search"] == "tpe" and summary["best"]["value"] > summary["initial"]


def test_tpe_without_optuna_says_how_to_install_it(frozen, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    result = sweep(frozen, "--grid", "learning-rate=1e-4:1e-1", "--search", "tpe")
    assert result.exit_code == 1
    assert result.output.strip() == ("Error: --search tpe needs Optuna: "
                                     "pip install 'trainconf-microtrain[search]'")


def test_halving_trains_the_better_half_on_and_reproduces(frozen, tmp_path):
    start = tmp_path / "start.wof"
    shutil.copy(wof_of(frozen), start)
    grid = "optimizer=adam learning-rate=0.0003,0.001,0.003,0.01 epochs=4"
    trials, summary = sweep_json(frozen, "--grid", grid, "--halving")
    assert [(t["rung"], t["epochs_total"]) for t in trials] == \
        [(0, 1)] * 4 + [(1, 2)] * 2 + [(2, 4)]
    rung0 = sorted(trials[:4], key=lambda t: -t["value"])
    assert sorted(t["trial"] for t in trials[4:6]) == sorted(t["trial"] for t in rung0[:2])
    assert summary["best"]["trial"] == trials[-1]["trial"]
    assert "--epochs 4" in summary["command"]
    assert [r["epochs_total"] for r in summary["ranking"]] == [4, 2, 1, 1]
    assert reproduce(summary["command"], start, tmp_path / "again.wof") == \
        wof_of(frozen).read_bytes()


@pytest.mark.parametrize("args,message", [
    (["--grid", "colour=red"], "'colour' is not an option of microtrain run that can be swept"),
    (["--grid", "learning-rate=1e-4:1e-1"], "is a range: sample it with --random N"),
    (["--grid", "learning-rate=0.1:0.01", "--random", 2], "needs 0 < LOW < HIGH"),
    (["--grid", "optimizer=sgd,nope"], "'nope' is not one of"),
    (["--grid", "epochs=1", "--input", "nope.npy"], "nope.npy"),
    (["--grid", "learning-rate=1e-3:1e-1", "--search", "tpe", "--jobs", 2],
     "leave out --jobs and --halving"),
    (["--grid", "learning-rate=0.01 epochs=1,2", "--halving"], "give one value of epochs"),
])
def test_bad_sweeps_are_one_error_line(frozen, args, message):
    result = sweep(frozen, *args)
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    assert not frozen.with_name("mlp.sweep.jsonl").exists()


def test_a_log_of_another_sweep_is_refused(frozen):
    sweep_json(frozen, "--grid", "learning-rate=0.001 epochs=1")
    result = sweep(frozen, "--grid", "learning-rate=0.002 epochs=1")
    assert result.exit_code == 1
    assert "was written by another sweep (different space)" in result.output


def test_halving_without_epochs_in_the_grid_ends_at_the_recorded_epochs(tmp_path):
    frozen = split(FIXTURES / "mlp.tflite", tmp_path, epochs=2).frozen
    trials, summary = sweep_json(frozen, "--grid", "learning-rate=0.001,0.01", "--halving")
    assert [(t["rung"], t["epochs_total"]) for t in trials] == [(0, 1), (0, 1), (1, 2)]
    assert "--epochs 2" in summary["command"]


def test_an_interrupted_tpe_search_resumes_from_its_log(frozen, tmp_path):
    grid = "optimizer=adam,sgd learning-rate=1e-4:1e-1 epochs=2"
    log, finished = tmp_path / "tpe.jsonl", []

    def interrupt_after_two(record):
        finished.append(record["trial"])
        if len(finished) == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _api_sweep(frozen, log, grid=grid, search="tpe", trials=4).run(interrupt_after_two)
    summary = _api_sweep(frozen, log, grid=grid, search="tpe", trials=4).run(
        lambda record: finished.append(record["trial"]))
    assert finished == [0, 1, 2, 3]
    assert summary["trials"] == 4 and summary["best"] is not None


def _a_value(param) -> str:
    """A valid value of a `run` option other than its default, from its click type."""
    import click
    if isinstance(param.type, click.Choice):
        return [c for c in param.type.choices if c != param.default][0]
    if isinstance(param.type, click.types.BoolParamType):
        return str(not param.default).lower()
    if isinstance(param.type, click.types.IntParamType):
        return "3"
    if isinstance(param.type, click.types.FloatParamType):
        return "0.25"
    return "dynamic"  # --loss-scale, the one free-text option


def test_every_option_of_run_is_swept_or_taken_by_the_sweep():
    from microtrain.run_config import SWEEP_FIXED, SWEEP_REPLACES
    names = [f.name for f in SWEEPABLE.values()]
    fields = set(RunConfig.__dataclass_fields__)
    assert set(names) | set(SWEEP_FIXED) | set(SWEEP_REPLACES) == fields
    assert fields < {p.name for p in run.params}
    base = RunConfig("model.circle", inputs=("x.npy",), targets=("y.npy",))
    params = {p.name: p for p in run.params}
    for key, f in SWEEPABLE.items():
        value = axis(f"{key}={_a_value(params[f.name])}").values[0]
        config = swept(base, {key: value})
        assert getattr(config, f.name) == value != f.default, key
        assert RunConfig.from_argv(config.argv()) == config, key
