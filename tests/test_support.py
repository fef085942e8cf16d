"""split refuses, in one line and before planning memory or writing a file, a
model with an operator microtrain cannot run or whose options the schema lacks."""
import shutil
import subprocess
from pathlib import Path

import pytest

from microtrain.files.format.model import add_operator_code, load_model, op_name, save_model
from trainconf import split as split_module
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
TRAINCONF = shutil.which("trainconf")


def _cnn_with(tmp_path, edit) -> Path:
    model = load_model(FIXTURES / "cnn.tflite")
    edit(model, model.subgraphs[0].operators)
    path = tmp_path / "model.circle"
    save_model(model, path)
    return path


def _as(name):
    def edit(model, ops):
        pool = next(op for op in ops if op_name(model, op) == "MAX_POOL_2D")
        pool.opcodeIndex = add_operator_code(model, name)
    return edit


def _option(key, value):
    def edit(model, ops):
        setattr(ops[0].builtinOptions, key, value)
    return edit


CASES = {
    "builtin without kernel": (_as("L2_POOL_2D"),
                               "operator 1 (L2_POOL_2D) has no forward kernel in microtrain"),
    "unknown custom op": (_as("MyCustomPool"),
                          "operator 1 (MyCustomPool) is a custom operator microtrain has no "
                          "kernel for"),
    "padding enum 2": (_option("padding", 2),
                       "operator 0 (CONV_2D) has padding 2, which is none of SAME, VALID"),
    "fused activation 9": (_option("fusedActivationFunction", 9),
                           "operator 0 (CONV_2D) has fused_activation_function 9, which is none "
                           "of NONE, RELU"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("trainable", ["last:1", "all"])
def test_refused_before_planning_or_writing(tmp_path, monkeypatch, case, trainable):
    edit, message = CASES[case]
    path = _cnn_with(tmp_path, edit)
    planned = []
    monkeypatch.setattr(split_module, "plan_memory", lambda *a: planned.append(1))
    with pytest.raises(Exception) as e:
        split(path, tmp_path / "out", trainable=trainable)
    assert type(e.value).__name__ == "UserError" and message in str(e.value)
    assert str(e.value).startswith(f"{path}: ")
    assert not planned and not (tmp_path / "out").exists()


@pytest.mark.skipif(TRAINCONF is None, reason="the package is not installed")
def test_command_line_prints_one_error_line(tmp_path):
    path = _cnn_with(tmp_path, _as("MyCustomPool"))
    result = subprocess.run([TRAINCONF, "split", str(path), "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: {path}: operator 1 (MyCustomPool) is a custom operator "
                           "microtrain has no kernel for")


def test_an_op_without_gradient_below_the_trained_layers_is_fine(tmp_path):
    """ADD_N has a forward kernel but no gradient rule: above it, training works."""
    model = load_model(FIXTURES / "regression.tflite")
    tanh = next(op for op in model.subgraphs[0].operators if op_name(model, op) == "TANH")
    tanh.opcodeIndex = add_operator_code(model, "ADD_N")  # of one input
    save_model(model, tmp_path / "add_n.circle")
    files = split(tmp_path / "add_n.circle", tmp_path / "out", trainable="last:1")
    assert files.frozen.exists() and len(files.trainable) == 2
    with pytest.raises(Exception, match=r"operator 1 \(ADD_N\) is on the gradient path but has "
                                        "no gradient rule"):
        split(tmp_path / "add_n.circle", tmp_path / "out2", trainable="all")
