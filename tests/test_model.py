"""The model layer: round trips, operator codes, options, tensors, metadata,
speed, and precise errors on broken files."""
import re
from pathlib import Path

import numpy as np
import pytest
import tflite

from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (add_operator_code, buffer_array, get_metadata,
                                           load_model, model_from_bytes, model_to_bytes, op_name,
                                           options_dict, save_model, set_builtin_options,
                                           set_custom_options, set_metadata, tensor_dtype)
from model_patch import FIXTURES, MODELS, patch_field, patch_vector_item

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "circle.fbs"


def assert_same_tree(a, b, where="model"):
    """Deep equality of two object-API trees (arrays compared by value and dtype)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__"):
        assert type(a) is type(b) and vars(a).keys() == vars(b).keys(), where
        for k in vars(a):
            assert_same_tree(getattr(a, k), getattr(b, k), f"{where}.{k}")
    else:
        assert a == b, where


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_keeps_everything(name, tmp_path):
    original = load_model(FIXTURES / f"{name}.tflite")
    save_model(original, tmp_path / "m.circle")
    again = load_model(tmp_path / "m.circle")
    assert_same_tree(original, again)
    for b, (x, y) in enumerate(zip(original.buffers, again.buffers)):
        assert bytes(x.data if x.data is not None else b"") == \
            bytes(y.data if y.data is not None else b""), f"buffer {b}"
    assert model_to_bytes(again) == (tmp_path / "m.circle").read_bytes()  # stable
    assert original.signatureDefs and original.metadata  # the fixtures do carry both


def _tflite_data(raw_buffer) -> bytes:
    data = raw_buffer.DataAsNumpy()  # 0 when the buffer has no data
    return b"" if isinstance(data, int) else data.tobytes()


@pytest.mark.parametrize("name", MODELS)
def test_tflite_tensors_and_buffers_survive_as_tflite_reads_them(name):
    """Independent check: TensorFlow's tflite bindings read the saved file the same."""
    src = (FIXTURES / f"{name}.tflite").read_bytes()
    saved = model_to_bytes(model_from_bytes(src))
    a, b = tflite.Model.GetRootAs(src, 0), tflite.Model.GetRootAs(saved, 0)
    assert saved[4:8] == b"CIR0"
    for i in range(a.BuffersLength()):
        assert _tflite_data(a.Buffers(i)) == _tflite_data(b.Buffers(i))
    sa, sb = a.Subgraphs(0), b.Subgraphs(0)
    for t in range(sa.TensorsLength()):
        ta, tb = sa.Tensors(t), sb.Tensors(t)
        assert (ta.Name(), ta.Type(), ta.Buffer()) == (tb.Name(), tb.Type(), tb.Buffer())
        assert ta.ShapeAsNumpy().tolist() == tb.ShapeAsNumpy().tolist()


def test_buffer_data_is_16_byte_aligned():
    data = model_to_bytes(load_model(FIXTURES / "mobilenetv2.tflite"))
    m = circle.Model.GetRootAs(data, 0)
    starts = [m.Buffers(i)._tab.Vector(m.Buffers(i)._tab.Offset(4))
              for i in range(m.BuffersLength()) if m.Buffers(i).DataLength()]
    assert len(starts) > 100 and all(s % 16 == 0 for s in starts)


def _codes_file(*codes: tuple[int, int]) -> bytes:
    """A model whose operator codes hold these raw (deprecated, builtin) pairs,
    packed without the normalization model_to_bytes applies."""
    import flatbuffers
    model = circle.ModelT(subgraphs=[circle.SubGraphT()], operatorCodes=[
        circle.OperatorCodeT(deprecatedBuiltinCode=d, builtinCode=b) for d, b in codes])
    builder = flatbuffers.Builder(0)
    builder.Finish(model.Pack(builder), file_identifier=b"CIR0")
    return bytes(builder.Output())


@pytest.mark.parametrize("deprecated, builtin, code", [
    (4, 0, 4),          # an old file: only the byte field is set
    (9, 9, 9),
    (127, 150, 150),    # GELU does not fit in the byte field
    (3, 150, 3),        # builtin_code counts only when the byte field is 127
    (-2, -2, -2),       # circle's INSTANCE_NORM
    (-2, 0, -2),
])
def test_operator_code_read_rule(deprecated, builtin, code):
    assert model_from_bytes(_codes_file((deprecated, builtin))).operatorCodes[0].builtinCode == code


@pytest.mark.parametrize("name, deprecated, builtin", [
    ("FULLY_CONNECTED", 9, 9), ("ADD", 0, 0), ("BATCH_MATMUL", 126, 126),
    ("GELU", 127, 150), ("PLACEHOLDER_FOR_GREATER_OP_CODES", 127, 127),
    ("INSTANCE_NORM", -2, -2), ("MyGrad", 32, 32)])
def test_operator_code_write_rule(name, deprecated, builtin):
    model = circle.ModelT(subgraphs=[circle.SubGraphT()])
    index = add_operator_code(model, name)
    oc = circle.Model.GetRootAs(model_to_bytes(model), 0).OperatorCodes(index)
    assert (oc.DeprecatedBuiltinCode(), oc.BuiltinCode()) == (deprecated, builtin)


def test_add_operator_code_reuses_entries_and_op_name_reads_them():
    model = load_model(FIXTURES / "mlp.tflite")
    n = len(model.operatorCodes)
    fc = add_operator_code(model, "FULLY_CONNECTED")
    assert len(model.operatorCodes) == n and model.operatorCodes[fc].builtinCode == 9
    grad = add_operator_code(model, "FullyConnectedInputGrad")
    assert add_operator_code(model, "FullyConnectedInputGrad") == grad == n
    assert add_operator_code(model, "INSTANCE_NORM") == n + 1
    op = circle.OperatorT(opcodeIndex=grad)
    assert op_name(model, op) == "FullyConnectedInputGrad"
    op.opcodeIndex = n + 1
    assert op_name(model, op) == "INSTANCE_NORM"
    assert [op_name(model, o) for o in model.subgraphs[0].operators] == \
        ["FULLY_CONNECTED", "FULLY_CONNECTED", "SOFTMAX"]


# ---------------------------------------------------------------- options

def _schema_fields() -> dict[str, list[str]]:
    text = SCHEMA.read_text()
    return {table: re.findall(r"^\s*(\w+)\s*:(?![^;]*\(deprecated\))", body, re.M)
            for table, body in re.findall(r"^table (\w+) \{(.*?)\}", text, re.S | re.M)}


@pytest.mark.parametrize("table", [n for n in vars(circle.BuiltinOptions) if n.endswith("Options")]
                         + [n for n in vars(circle.BuiltinOptions2) if n.endswith("Options")])
def test_options_dict_uses_the_schema_field_names(table):
    op = circle.OperatorT()
    set_builtin_options(op, getattr(circle, table + "T")())
    assert list(options_dict(op)) == _schema_fields()[table]


def test_options_dict_of_fixture_ops():
    model = load_model(FIXTURES / "cnn.tflite")
    conv, pool = model.subgraphs[0].operators[:2]
    assert options_dict(conv) == {"padding": 0, "stride_w": 1, "stride_h": 1,
                                  "fused_activation_function": 1, "dilation_w_factor": 1,
                                  "dilation_h_factor": 1, "quantized_bias_type": 0}
    assert options_dict(pool)["filter_width"] == 2
    softmax = model.subgraphs[0].operators[-1]
    assert options_dict(softmax) == {"beta": 1.0}


def test_builtin_and_custom_options_round_trip():
    model = load_model(FIXTURES / "mlp.tflite")
    ops = model.subgraphs[0].operators
    custom = circle.OperatorT(opcodeIndex=add_operator_code(model, "Loss"), inputs=[0], outputs=[0])
    set_custom_options(custom, {"loss": "mse", "reduction": "mean", "axis": [1, 2], "beta": 0.5,
                                "keep_dims": True})
    reshape = circle.OperatorT(opcodeIndex=add_operator_code(model, "RESHAPE"), inputs=[0],
                               outputs=[0])
    set_builtin_options(reshape, circle.ReshapeOptionsT(newShape=[-1, 4]))
    ops += [custom, reshape]
    again = model_from_bytes(model_to_bytes(model)).subgraphs[0].operators
    assert options_dict(again[-2]) == {"loss": "mse", "reduction": "mean", "axis": [1, 2],
                                       "beta": 0.5, "keep_dims": True}
    assert again[-2].customOptionsFormat == circle.CustomOptionsFormat.FLEXBUFFERS
    assert options_dict(again[-1]) == {"new_shape": [-1, 4]}
    assert options_dict(circle.OperatorT()) == {}


# ---------------------------------------------------------------- tensors and metadata

def test_buffer_array_and_dtype_against_tflite_bindings():
    path = FIXTURES / "mlp.tflite"
    model, raw = load_model(path), tflite.Model.GetRootAs(path.read_bytes(), 0)
    weights = 0
    for t, tensor in enumerate(model.subgraphs[0].tensors):
        theirs = _tflite_data(raw.Buffers(raw.Subgraphs(0).Tensors(t).Buffer()))
        array = buffer_array(model, tensor)
        if array is None:
            assert theirs == b""
            continue
        weights += 1
        assert array.dtype == tensor_dtype(tensor) == np.float32
        assert list(array.shape) == tensor.shape.tolist()
        assert array.tobytes() == theirs
    assert weights == 4


def test_tensor_dtype_rejects_types_numpy_cannot_hold():
    with pytest.raises(UserError, match="tensor 'w' has type INT4"):
        tensor_dtype(circle.TensorT(name="w", type=circle.TensorType.INT4))


def test_buffer_array_checks_the_size():
    model = load_model(FIXTURES / "mlp.tflite")
    tensor = next(t for t in model.subgraphs[0].tensors if buffer_array(model, t) is not None)
    tensor.shape = np.array([3, 3], np.int32)
    with pytest.raises(UserError, match=r"shape \[3, 3\] of float32 needs 36"):
        buffer_array(model, tensor)


def test_metadata_get_and_set(tmp_path):
    model = load_model(FIXTURES / "mlp.tflite")
    assert get_metadata(model, "min_runtime_version").rstrip(b"\0")[:1].isdigit()
    assert get_metadata(model, "absent") is None
    set_metadata(model, "trainconf", b'{"a": 1}')
    set_metadata(model, "other", b"x")
    set_metadata(model, "trainconf", b'{"a": 2}')
    save_model(model, tmp_path / "m.circle")
    again = load_model(tmp_path / "m.circle")
    assert get_metadata(again, "trainconf") == b'{"a": 2}'
    assert get_metadata(again, "other") == b"x"
    assert [m.name for m in again.metadata].count("trainconf") == 1


# ---------------------------------------------------------------- broken files

@pytest.fixture(scope="module")
def cnn_bytes():
    return (FIXTURES / "cnn.tflite").read_bytes()


def test_every_truncation_is_a_user_error(cnn_bytes):
    for n in range(0, len(cnn_bytes), 7):
        with pytest.raises(UserError):
            model_from_bytes(cnn_bytes[:n], "cut.tflite")


def test_random_corruption_loads_or_fails_cleanly(cnn_bytes):
    """Flipped bytes either still decode (and save) or raise UserError, nothing else."""
    rng = np.random.default_rng(0)
    failures = 0
    for _ in range(300):
        data = np.frombuffer(cnn_bytes, np.uint8).copy()
        data[rng.integers(8, len(data), 4)] = rng.integers(0, 256, 4)
        try:
            model_to_bytes(model_from_bytes(data.tobytes(), "bad.tflite"))
        except UserError:
            failures += 1
    assert failures > 0


@pytest.mark.parametrize("data, message", [
    (b"", "0 bytes is too short"),
    (b"\x10\0\0\0CIR", "7 bytes is too short"),
    (b"\x10\0\0\0TFL2" + bytes(64), r"file identifier b'TFL2', expected b'CIR0' or b'TFL3'"),
    (b"\xff\0\0\0CIR0" + bytes(64), "truncated: the root table at byte 255 lies beyond the end"),
])
def test_bad_headers(data, message):
    with pytest.raises(UserError, match=message):
        model_from_bytes(data, "x.circle")


def test_unknown_options_type_is_rejected_not_dropped(cnn_bytes):
    data = bytearray(cnn_bytes)
    op = tflite.Model.GetRootAs(data, 0).Subgraphs(0).Operators(0)
    patch_field(data, op, 3, "B", 127)  # a type neither TFLite nor circle has (yet)
    with pytest.raises(UserError, match=r"^x.tflite: subgraph 0 operator 0 \(CONV_2D\) has builtin "
                                        r"options of type 127, which schemas/circle.fbs does not"):
        model_from_bytes(data, "x.tflite")


def test_dangling_tensor_index_is_rejected(cnn_bytes):
    data = bytearray(cnn_bytes)
    sg = tflite.Model.GetRootAs(data, 0).Subgraphs(0)
    patch_vector_item(data, sg.Operators(1), 1, 0, "i", 99)
    with pytest.raises(UserError, match="subgraph 0 operator 1 input refers to tensor 99, "
                                        "but there are only 19"):
        model_from_bytes(data, "x.tflite")


def test_custom_options_that_are_not_a_flexbuffer_map_are_kept_raw():
    """e.g. MediaPipe's Convolution2DTransposeBias keeps a C struct there."""
    op = circle.OperatorT(customOptions=np.frombuffer(b"\x01\x02\x03", np.uint8))
    assert options_dict(op) == {"custom_options": [1, 2, 3]}
