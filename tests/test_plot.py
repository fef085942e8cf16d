"""`microtrain plot`: each kind of figure is written and decodes at the requested size;
a log it cannot read is one error line."""
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from microtrain.commands import plot
from microtrain.commands.cli import main
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
DIGITS = ["--input", FIXTURES / "digits_x.npy", "--target", FIXTURES / "digits_onehot.npy",
          "--validation-split", 0.2]
DIABETES = ["--input", FIXTURES / "diabetes_x.npy", "--target", FIXTURES / "diabetes_y.npy",
            "--validation-split", 0.2]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, Path]:
    """Run logs (fp32 with two optimizers; fp16 with adaptive and dynamic loss scaling)
    and a sweep log."""
    out = tmp_path_factory.mktemp("logs")
    mlp = split(FIXTURES / "mlp.tflite", out / "mlp").frozen
    fp16 = split(FIXTURES / "regression.tflite", out / "fp16", precision="fp16").frozen
    runs = {"adam": (mlp, DIGITS, []), "sgd": (mlp, DIGITS, ["--optimizer", "sgd"]),
            "adaptive": (fp16, DIABETES, ["--loss-scale", "adaptive", "--adaptive-interval", 3]),
            "dynamic": (fp16, DIABETES, ["--loss-scale", "dynamic"])}
    paths = {}
    for name, (frozen, data, extra) in runs.items():
        result = invoke("run", frozen, *data, *extra, "--epochs", 3, "--seed", 1, "--json",
                        "--save", "never")
        assert result.exit_code == 0, result.output
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text(result.stdout)
    sweeps = {"sweep": ["optimizer=sgd,adam learning-rate=1e-3:1e-1 epochs=2", "--random", 4],
              "tpe": ["optimizer=sgd,adam learning-rate=1e-3:1e-1 batch-size=16,32 epochs=4",
                      "--search", "tpe", "--trials", 8],
              "halving": ["optimizer=sgd,adam batch-size=16,32 epochs=4", "--halving"]}
    for name, (grid, *how) in sweeps.items():
        paths[name] = out / f"{name}.jsonl"
        result = invoke("sweep", mlp, *DIGITS, "--grid", grid, *how, "--seed", 0,
                        "--log", paths[name], "--output-wof", out / f"{name}.wof", "--json")
        assert result.exit_code == 0, result.output
    return paths


def draw(out: Path, *logs, size=(640, 400), kind: str):
    result = invoke("plot", *logs, "-o", out, "--width", size[0], "--height", size[1])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {kind} ({size[0]}x{size[1]})")


@pytest.mark.parametrize("names,kind", [(["adam", "sgd"], "runs"),
                                        (["adaptive", "dynamic"], "mixed-precision runs"),
                                        (["sweep"], "sweep")])
def test_each_figure_decodes_as_a_png_of_the_requested_size(logs, tmp_path, names, kind):
    out = tmp_path / "figure.png"
    draw(out, *(logs[n] for n in names), size=(700, 450), kind=kind)
    pixels = imread(out)
    assert pixels.shape[:2] == (450, 700)
    assert pixels.std() > 0.05  # something is drawn, not a blank canvas


def test_svg_is_xml_of_the_requested_size(logs, tmp_path):
    out = tmp_path / "sweep.svg"
    draw(out, logs["sweep"], size=(800, 500), kind="sweep")
    root = ET.parse(out).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert (root.get("width"), root.get("height")) == ("800pt", "500pt")


def test_adaptive_runs_report_a_scale_per_layer(logs):
    import json
    epochs = [json.loads(line) for line in logs["adaptive"].read_text().splitlines()][:-1]
    assert all(len(e["loss_scale_by_tensor"]) > 1 for e in epochs)
    assert all(min(e["loss_scale_by_tensor"].values()) == e["loss_scale"]["min"] for e in epochs)


def _bad_logs(tmp_path: Path, logs) -> dict:
    def write(name, text):
        (tmp_path / name).write_text(text)
        return [tmp_path / name]
    return {
        "not json": (write("a.jsonl", "{\"epoch\": 1\n"), "a.jsonl: line 1 is not JSON"),
        "empty": (write("b.jsonl", ""), "b.jsonl: holds no epoch records"),
        "no epochs": (write("c.jsonl", '{"event": "summary"}\n'), "holds no epoch records"),
        "missing": ([tmp_path / "nope.jsonl"], "nope.jsonl"),
        "sweep and run": ([logs["sweep"], logs["adam"]], "a sweep log is plotted alone"),
    }


@pytest.mark.parametrize("case", ["not json", "empty", "no epochs", "missing", "sweep and run"])
def test_a_log_it_cannot_read_is_one_error_line(logs, tmp_path, case):
    paths, message = _bad_logs(tmp_path, logs)[case]
    out = tmp_path / "figure.png"
    result = invoke("plot", *paths, "-o", out)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
    assert not out.exists()


def test_other_formats_are_refused(logs, tmp_path):
    result = invoke("plot", logs["adam"], "-o", tmp_path / "figure.jpg")
    assert result.exit_code == 1
    assert result.output.strip().endswith("figure.jpg: write the figure to a .png or .svg file")


def test_without_matplotlib_it_says_how_to_install(logs, tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    result = invoke("plot", logs["adam"], "-o", tmp_path / "figure.png")
    assert result.exit_code == 1
    assert result.output.strip() == ("Error: microtrain plot needs matplotlib: "
                                     "pip install 'trainconf-microtrain[plot]'")



def figure(*paths):
    """The matplotlib figure `microtrain plot` draws for these logs."""
    return plot.draw([plot.read_log(p) for p in paths], 800, 500)[0]


def _trials(log: Path) -> dict[int, dict]:
    """Each trial's last record in a sweep log."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["trial"]: r for r in records if r.get("event") == "trial"}


def _points(ax) -> dict[str, int]:
    """Scatter points per legend label."""
    return {c.get_label(): len(c.get_offsets()) for c in ax.collections}


def test_titles_name_the_model_data_and_metric(logs):
    runs = figure(logs["adam"], logs["sgd"]).get_suptitle()
    assert "mlp on digits_x.npy" in runs and "accuracy" in runs
    sweep = figure(logs["sweep"]).get_suptitle()
    assert "mlp on digits_x.npy" in sweep and "test accuracy" in sweep


@pytest.mark.parametrize("name", ["sweep", "tpe", "halving"])
def test_every_sweep_panel_has_a_legend_and_none_is_empty(logs, name):
    fig = figure(logs[name])
    assert all(ax.get_visible() and ax.has_data() for ax in fig.axes)
    assert all(ax.get_legend() is not None for ax in fig.axes)
    for ax in fig.axes[:-1]:  # every option's panel shows the starting weights
        assert "starting weights" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_three_panel_sweep_has_three_axes(logs):
    fig = figure(logs["sweep"])  # optimizer, learning rate, and the best trials' curves
    assert [ax.get_xlabel() for ax in fig.axes] == ["optimizer", "learning-rate", "epoch"]


def test_listed_options_are_categorical_and_ranges_continuous(logs):
    optimizer, batch, _ = figure(logs["halving"]).axes
    assert [t.get_text() for t in optimizer.get_xticklabels()] == ["sgd", "adam"]
    assert [t.get_text() for t in batch.get_xticklabels()] == ["16", "32"]
    learning_rate = figure(logs["sweep"]).axes[1]
    assert learning_rate.get_xscale() == "log"


def test_pruned_trials_are_drawn_and_marked(logs):
    trials = _trials(logs["tpe"])
    pruned = {r["epochs"] for r in trials.values() if r["status"] == "pruned"}
    assert pruned, "the seeded TPE sweep prunes some trials"
    for ax in figure(logs["tpe"]).axes[:-1]:
        points = _points(ax)
        assert sum(points.values()) == len(trials)
        assert {label for label in points if label.startswith("pruned after")} == \
            {f"pruned after {e} epoch{'s' if e != 1 else ''}" for e in pruned}


def test_halving_trials_are_marked_with_their_epochs(logs):
    trials = _trials(logs["halving"]).values()
    expected = {}
    for r in trials:
        label = f"{r['epochs_total']} epoch{'s' if r['epochs_total'] != 1 else ''}"
        expected[label] = expected.get(label, 0) + 1
    assert len(expected) > 1  # rungs of 1, 2 and 4 epochs
    for ax in figure(logs["halving"]).axes[:-1]:
        assert _points(ax) == expected
