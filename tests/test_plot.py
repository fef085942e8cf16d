"""`microtrain plot`: each kind of figure is written and decodes at the requested size;
a log it cannot read is one error line."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from microtrain.cli import main
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
    paths["sweep"] = out / "sweep.jsonl"
    result = invoke("sweep", mlp, *DIGITS, "--grid", "optimizer=sgd,adam learning-rate=1e-3:1e-1 "
                    "epochs=2", "--random", 4, "--log", paths["sweep"], "--json")
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

