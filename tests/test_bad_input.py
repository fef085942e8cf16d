"""Bad input through the real command line: one `Error: <file>: ...` line on
stderr, exit status 1, no traceback, no output file left behind."""
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from microtrain.files.format.model import load_model
from microtrain.files.format.wof import wof_to_bytes
from model_patch import FIXTURES

TRAINCONF = shutil.which("trainconf")


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


def assert_one_error_line(result, path, fragment: str) -> None:
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), result.stderr
    assert fragment in lines[0]


MLP = (FIXTURES / "mlp.tflite").read_bytes()
BAD_MODELS = {
    "truncated": (MLP[:len(MLP) // 2], "truncated or corrupt model"),
    "garbage": (bytes(range(256)) * 8, "file identifier b'\\x04\\x05\\x06\\x07'"),
    "wrong identifier": (MLP[:4] + b"XYZ0" + MLP[8:], "file identifier b'XYZ0'"),
    "empty": (b"", "0 bytes is too short"),
}


@pytest.fixture(scope="module")
def trainconf():
    assert TRAINCONF, "the package is not installed: pip install -e ."
    return TRAINCONF


@pytest.mark.parametrize("case", BAD_MODELS)
@pytest.mark.parametrize("command", ["import", "inspect"])
def test_bad_model_file(trainconf, tmp_path, command, case):
    data, fragment = BAD_MODELS[case]
    path = tmp_path / "bad.tflite"
    path.write_bytes(data)
    result = _run(trainconf, command, str(path))
    assert_one_error_line(result, path, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tflite"]


def test_missing_file(trainconf, tmp_path):
    path = tmp_path / "absent.tflite"
    assert_one_error_line(_run(trainconf, "import", str(path)), path, "no such model")


# No trainconf command reads a .wof; these go through the command group that
# both command lines share, reading the .wof as microtrain does.
WOF_PROGRAM = """
import sys, click
from microtrain.commands.cli_common import CommandGroup
from microtrain.files.format.model import load_model
from microtrain.files.format.wof import read_wof

@click.group(cls=CommandGroup)
def main():
    pass

@main.command()
@click.argument("model")
@click.argument("wof")
def check(model, wof):
    click.echo(len(read_wof(wof, load_model(model))))

main()
"""


def _wof_edits(n: int) -> dict:
    return {
        "magic": (lambda d: struct.pack_into("<H", d, 0, 0x4F57), "magic number 20311"),
        "version": (lambda d: struct.pack_into("<B", d, 2, 9), ".wof version 9"),
        "count": (lambda d: struct.pack_into("<I", d, 4, n + 1), f"holds {n + 1} buffers"),
        "offset": (lambda d: struct.pack_into("<I", d, 8, 1 << 20), "but the file ends at byte"),
    }


@pytest.mark.parametrize("case", ["magic", "version", "count", "offset"])
def test_bad_wof(tmp_path, case):
    model = load_model(FIXTURES / "mlp.tflite")
    n = len(model.subgraphs[0].tensors)
    edit, fragment = _wof_edits(n)[case]
    data = bytearray(wof_to_bytes(n, {0: np.zeros((1, 64), np.float32)}))
    edit(data)
    path = tmp_path / "w.wof"
    path.write_bytes(data)
    result = _run(sys.executable, "-c", WOF_PROGRAM, "check", str(FIXTURES / "mlp.tflite"),
                  str(path))
    assert_one_error_line(result, path, fragment)
