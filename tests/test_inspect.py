"""`trainconf inspect`, checked against TensorFlow's tflite bindings."""
import json

import numpy as np
import pytest
import tflite
from click.testing import CliRunner
from tflite.utils import opcode2name

from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (add_operator_code, load_model, model_from_bytes,
                                           model_to_bytes, set_custom_options)
from model_patch import FIXTURES, MODELS
from trainconf.cli import main
from trainconf.inspect import describe, render_text


def _reference(path) -> dict:
    """Operator types, constant parameter count and bytes as the tflite package reads them."""
    m = tflite.Model.GetRootAs(path.read_bytes(), 0)
    sg = m.Subgraphs(0)
    codes = [max(m.OperatorCodes(i).BuiltinCode(), m.OperatorCodes(i).DeprecatedBuiltinCode())
             for i in range(m.OperatorCodesLength())]
    types = [opcode2name(codes[sg.Operators(k).OpcodeIndex()]) for k in range(sg.OperatorsLength())]
    params = nbytes = 0
    for t in range(sg.TensorsLength()):
        size = m.Buffers(sg.Tensors(t).Buffer()).DataLength()
        if size:
            params += int(np.prod(sg.Tensors(t).ShapeAsNumpy()))
            nbytes += size
    return {"types": types, "parameters": params, "bytes": nbytes}


@pytest.mark.parametrize("name", MODELS)
def test_describe_agrees_with_tflite(name):
    path = FIXTURES / f"{name}.tflite"
    desc, ref = describe(load_model(path)), _reference(path)
    sg = desc["subgraphs"][0]
    assert [op["type"] for op in sg["operators"]] == ref["types"]
    assert sg["totals"]["parameters"] == desc["totals"]["parameters"] == ref["parameters"]
    assert sg["totals"]["bytes"] == ref["bytes"]
    assert all(io["batch"] == "dynamic" and io["shape"][0] == -1
               for io in sg["inputs"] + sg["outputs"])
    assert "serving_default" in desc["signatures"]


def test_cnn_details():
    sg = describe(load_model(FIXTURES / "cnn.tflite"))["subgraphs"][0]
    assert sg["inputs"] == [{"index": 0, "name": "serving_default_x:0", "type": "FLOAT32",
                             "shape": [-1, 8, 8, 1], "batch": "dynamic"}]
    conv = sg["operators"][0]
    assert (conv["type"], conv["fused_activation"]) == ("CONV_2D", "RELU")
    assert [t["index"] for t in conv["inputs"]] == [0, 8, 9]
    assert conv["inputs"][1]["name"] == "cnn_1/conv1_1/convolution"
    assert {"SHAPE", "STRIDED_SLICE", "PACK", "RESHAPE"} <= {op["type"] for op in sg["operators"]}
    assert sg["operators"][3]["fused_activation"] is None  # SHAPE has no such option
    kernel = next(c for c in sg["constants"] if c["name"] == "cnn_1/conv1_1/convolution")
    assert kernel == {"index": 8, "name": "cnn_1/conv1_1/convolution", "type": "FLOAT32",
                      "shape": [8, 3, 3, 1], "parameters": 72, "bytes": 288, "readers": 1}


def test_fixed_batch_and_custom_ops():
    model = load_model(FIXTURES / "mlp.tflite")
    sg = model.subgraphs[0]
    for t in sg.tensors:
        t.shapeSignature = None
    op = circle.OperatorT(opcodeIndex=add_operator_code(model, "Loss"), inputs=[-1, 0],
                          outputs=[1])
    set_custom_options(op, {"loss": "mse"})
    sg.operators.append(op)
    desc = describe(model_from_bytes(model_to_bytes(model)))["subgraphs"][0]
    assert desc["inputs"][0]["batch"] == "fixed" and desc["inputs"][0]["shape"][0] == 1
    last = desc["operators"][-1]
    assert (last["type"], last["options"], last["inputs"][0]) == \
        ("Loss", {"loss": "mse"}, {"index": -1, "name": None})
    assert "(fixed batch)" in render_text(describe(model))


def test_cli_json_is_one_document_equal_to_describe():
    path = FIXTURES / "cnn.tflite"
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0 and result.stderr == ""
    assert json.loads(result.stdout) == describe(load_model(path))


def test_cli_text():
    result = CliRunner().invoke(main, ["inspect", str(FIXTURES / "cnn.tflite")])
    assert result.exit_code == 0
    out = result.output
    assert "#0 serving_default_x:0  FLOAT32 [-1, 8, 8, 1]  (dynamic batch)" in out
    assert "0: CONV_2D  activation RELU" in out
    assert "#8 cnn_1/conv1_1/convolution  FLOAT32 [8, 3, 3, 1]  72 parameters, 288 bytes" in out
    ref = _reference(FIXTURES / "cnn.tflite")
    assert out.rstrip().endswith(f"{ref['parameters']} parameters, {ref['bytes']} bytes")
