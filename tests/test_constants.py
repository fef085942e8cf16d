"""trainconf/constants.py: weights stored as fp16 or int8 (behind DEQUANTIZE or
read directly, dynamic-range) or sparse (behind DENSIFY) become the float32
values LiteRT computes from them; a full-integer model with int16 activations is
refused (int8 ones train: tests/test_quantized_training.py)."""
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from litert_reference import dequantized_in_front, invoked
from microtrain.files.artifacts import load_artifacts
from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (add_operator_code, buffer_array, load_model,
                                           model_to_bytes, op_name)
from microtrain.trainer import Trainer
from trainconf.constants import is_quantized, resolve_constants
from trainconf.inspect import describe
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
QUANTIZED = FIXTURES / "quantized"
REAL = FIXTURES / "real"


def _invoked(data: bytes, inputs: list[np.ndarray], **options) -> Interpreter:
    """A LiteRT interpreter (Interpreter's `options`) that has run `inputs`."""
    return invoked(Interpreter(model_content=data, **options), inputs)


def _litert(data: bytes, inputs: list[np.ndarray], **options) -> list[np.ndarray]:
    it = _invoked(data, inputs, **options)
    return [it.get_tensor(d["index"]) for d in it.get_output_details()]


def _tflite(model) -> bytes:
    return model_to_bytes(model, b"TFL3")


def _infer(path, x, tmp_path, trainable="last:1") -> np.ndarray:
    files = split(path, tmp_path, trainable=trainable)
    return Trainer(files.frozen, batch_size=len(x)).predict([x])[0]


X = np.random.default_rng(0).random((5, 8, 8, 1), dtype=np.float32)


@pytest.mark.parametrize("trainable", ["last:1", "all"])
def test_dynamic_range_int8_infers_what_litert_computes_from_the_dequantized_weights(
        tmp_path, trainable):
    (expected,) = _litert(dequantized_in_front(QUANTIZED / "dynamic_int8.tflite"), [X])
    got = _infer(QUANTIZED / "dynamic_int8.tflite", X, tmp_path, trainable)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def _round(v):
    """C's round(): halves away from zero (numpy rounds them to even)."""
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _int8_rounded(x: np.ndarray) -> np.ndarray:
    """x as a LiteRT hybrid kernel sees it: quantized to asymmetric int8 over the whole array
    (TFLite's AsymmetricQuantizeFloats: the range [min(x, 0), max(x, 0)] in 255 steps, the zero
    point nudged from the closer end; q = round(x / scale) + zero point), back in float64."""
    lo, hi = min(0.0, float(x.min())), max(0.0, float(x.max()))
    if lo == hi:
        return np.zeros(x.shape)
    scale = (hi - lo) / 255
    zero = -128 - lo / scale if 128 + abs(lo / scale) < 127 + abs(hi / scale) else 127 - hi / scale
    zero = np.clip(_round(zero), -128, 127)
    inverse = np.float32(1) / np.float32(scale)
    q = np.clip(_round(x.astype(np.float32) * inverse) + zero, -128, 127)
    return (q - zero) * float(np.float32(scale))


def _hybrid_op(model, op, x: np.ndarray, rounded: bool) -> np.ndarray:
    """A CONV_2D or FULLY_CONNECTED with int8 weights on float input x, in float64 with the
    weights dequantized; `rounded`: x first rounded to int8 as the hybrid kernel does, per
    sample (CONV_2D) or per row (FULLY_CONNECTED). Integer products are exact in float64, so
    this is the kernel's int8 accumulation rescaled."""
    import torch

    sg = model.subgraphs[0]
    weight = sg.tensors[op.inputs[1]]
    w = buffer_array(model, weight).astype(np.float64)
    w *= np.asarray(weight.quantization.scale, np.float32).reshape(-1, *[1] * (w.ndim - 1))
    b = buffer_array(model, sg.tensors[op.inputs[2]]).astype(np.float64)
    options = op.builtinOptions
    assert options.fusedActivationFunction in (circle.ActivationFunctionType.NONE,
                                               circle.ActivationFunctionType.RELU)
    if op_name(model, op) == "FULLY_CONNECTED":
        rows = x.reshape(-1, w.shape[1])
        y = np.stack([_int8_rounded(r) if rounded else r for r in rows]) @ w.T + b
    else:
        assert (options.strideH, options.strideW, options.dilationHFactor) == (1, 1, 1)
        xs = np.stack([_int8_rounded(s) if rounded else s for s in x]).astype(np.float64)
        y = torch.nn.functional.conv2d(
            torch.from_numpy(xs).permute(0, 3, 1, 2), torch.from_numpy(w).permute(0, 3, 1, 2),
            torch.from_numpy(b),
            padding="same" if options.padding == circle.Padding.SAME else "valid",
        ).permute(0, 2, 3, 1).numpy()
    if options.fusedActivationFunction == circle.ActivationFunctionType.RELU:
        y = np.maximum(y, 0)
    return y


def test_litert_hybrid_kernels_round_the_activations_to_int8(tmp_path):
    """Why `microtrain infer` on a dynamic-range model is not LiteRT's output on the same file:
    LiteRT runs CONV_2D/FULLY_CONNECTED with int8 weights as hybrid kernels that round their float
    input to int8 first (no interpreter option runs them in float: the reference kernels do it
    too). Each hybrid op's output equals that rounding emulated (within 1e-6 of its scale) and
    differs from the float computation on the dequantized weights, which is what microtrain
    computes (equal to LiteRT's with DEQUANTIZE in front of the weights, test above)."""
    path = QUANTIZED / "dynamic_int8.tflite"
    model = load_model(path)
    sg = model.subgraphs[0]
    hybrid = [op for op in sg.operators if op_name(model, op) in ("CONV_2D", "FULLY_CONNECTED")
              and is_quantized(sg.tensors[op.inputs[1]])]
    assert [op_name(model, op) for op in hybrid] == ["CONV_2D", "FULLY_CONNECTED",
                                                     "FULLY_CONNECTED"]
    it = _invoked(path.read_bytes(), [X], experimental_preserve_all_tensors=True,
                  experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    for op in hybrid:
        x, theirs = it.get_tensor(op.inputs[0]), it.get_tensor(op.outputs[0])
        scale = np.abs(theirs).max()
        assert np.abs(_hybrid_op(model, op, x, rounded=True) - theirs).max() <= 1e-6 * scale
        assert np.abs(_hybrid_op(model, op, x, rounded=False) - theirs).max() >= 1e-3 * scale
    # end to end the roundings add up to more than 1e-5 of the output, in every kernel set
    ours = _infer(path, X, tmp_path)
    for resolver in (OpResolverType.AUTO, OpResolverType.BUILTIN_REF):
        (theirs,) = _litert(path.read_bytes(), [X], experimental_op_resolver_type=resolver)
        assert np.abs(ours - theirs).max() > 1e-4 * np.abs(theirs).max()


def test_fp16_weights_behind_dequantize(tmp_path):
    (expected,) = _litert((QUANTIZED / "fp16.tflite").read_bytes(), [X])
    np.testing.assert_allclose(_infer(QUANTIZED / "fp16.tflite", X, tmp_path, "all"), expected,
                               rtol=1e-5, atol=1e-7)


def test_resolved_model_has_plain_float_weights():
    model = load_model(QUANTIZED / "fp16.tflite")
    resolve_constants(model)
    names = [op_name(model, op) for op in model.subgraphs[0].operators]
    assert "DEQUANTIZE" not in names and names[0] == "CONV_2D"
    read = {t for op in model.subgraphs[0].operators for t in op.inputs}
    for t in read:
        tensor = model.subgraphs[0].tensors[t]
        if buffer_array(model, tensor) is not None and tensor.type != circle.TensorType.INT32:
            assert tensor.type == circle.TensorType.FLOAT32 and tensor.quantization is None


def test_mediapipe_fp16_model_infers_as_litert(tmp_path):
    path = REAL / "face_detection_short_range.tflite"
    x = np.random.default_rng(1).random((1, 128, 128, 3), dtype=np.float32)
    expected = _litert(path.read_bytes(), [x])
    files = split(path, tmp_path, trainable="last:1")
    got = Trainer(files.frozen, batch_size=1).predict([x])
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * np.abs(e).max())


def _add_zero(model, t: int, zero: int) -> int:
    """Append y = t + zero (a [1] input) to the model; returns y."""
    sg = model.subgraphs[0]
    sg.tensors.append(circle.TensorT(shape=list(sg.tensors[t].shape), buffer=0, name=f"y{t}",
                                     type=circle.TensorType.FLOAT32))
    sg.operators.append(circle.OperatorT(
        opcodeIndex=add_operator_code(model, "ADD"), inputs=[t, zero],
        outputs=[len(sg.tensors) - 1],
        builtinOptionsType=circle.BuiltinOptions.AddOptions, builtinOptions=circle.AddOptionsT()))
    return len(sg.tensors) - 1


def test_densify_gives_the_values_litert_computes():
    """The sparse MediaPipe model: every DENSIFY → DEQUANTIZE chain's value, added
    to a zero input so that LiteRT reports it, equals the resolved constant."""
    path = REAL / "face_detection_full_range_sparse.tflite"
    model = load_model(path)
    sg = model.subgraphs[0]
    producers = {o: op for op in sg.operators for o in op.outputs}
    chains = [op.outputs[0] for op in sg.operators if op_name(model, op) == "DEQUANTIZE"
              and op.inputs[0] in producers
              and op_name(model, producers[op.inputs[0]]) == "DENSIFY"]
    assert len(chains) == 46
    sg.tensors.append(circle.TensorT(shape=[1], type=circle.TensorType.FLOAT32, buffer=0,
                                     name="zero"))
    zero = len(sg.tensors) - 1
    sg.inputs = list(sg.inputs) + [zero]
    sg.outputs = [_add_zero(model, t, zero) for t in chains]
    image = np.zeros((1, 192, 192, 3), np.float32)
    expected = _litert(_tflite(model), [image, np.zeros(1, np.float32)])
    resolved = load_model(path)
    resolve_constants(resolved)
    for t, e in zip(chains, expected):
        value = buffer_array(resolved, resolved.subgraphs[0].tensors[t])
        np.testing.assert_array_equal(value, e)


@pytest.mark.parametrize("dtype, scale, zero, axis", [
    (np.int8, [0.05], [0], 0),
    (np.uint8, [0.02], [128], 0),
    (np.int8, [0.01, 0.02, 0.04], [0, 0, 0], 0),
    (np.int8, [0.5, 0.25, 0.125, 1.0], [1, -2, 3, 0], 1),
])
def test_dequantize_matches_litert(dtype, scale, zero, axis):
    """A model ADD(x, DEQUANTIZE(c)) with x = 0 reports LiteRT's dequantized c."""
    values = np.random.default_rng(2).integers(np.iinfo(dtype).min, np.iinfo(dtype).max,
                                               (3, 4), dtype=dtype)
    model = circle.ModelT(version=3, buffers=[circle.BufferT(), circle.BufferT()])
    model.buffers[1].data = np.frombuffer(values.tobytes(), np.uint8)
    ttype = circle.TensorType.INT8 if dtype == np.int8 else circle.TensorType.UINT8
    q = circle.QuantizationParametersT(scale=scale, zeroPoint=zero, quantizedDimension=axis)
    tensors = [circle.TensorT(shape=[3, 4], type=ttype, buffer=1, name="c", quantization=q),
               circle.TensorT(shape=[3, 4], type=circle.TensorType.FLOAT32, buffer=0, name="w"),
               circle.TensorT(shape=[3, 4], type=circle.TensorType.FLOAT32, buffer=0, name="x"),
               circle.TensorT(shape=[3, 4], type=circle.TensorType.FLOAT32, buffer=0, name="y")]
    ops = [circle.OperatorT(opcodeIndex=add_operator_code(model, "DEQUANTIZE"), inputs=[0],
                            outputs=[1]),
           circle.OperatorT(opcodeIndex=add_operator_code(model, "ADD"), inputs=[2, 1],
                            outputs=[3], builtinOptionsType=circle.BuiltinOptions.AddOptions,
                            builtinOptions=circle.AddOptionsT())]
    model.subgraphs = [circle.SubGraphT(tensors=tensors, operators=ops, inputs=[2], outputs=[3])]
    (expected,) = _litert(_tflite(model), [np.zeros((3, 4), np.float32)])
    resolve_constants(model)
    assert [op_name(model, op) for op in model.subgraphs[0].operators] == ["ADD"]
    np.testing.assert_array_equal(buffer_array(model, model.subgraphs[0].tensors[1]), expected)


def test_int16_activations_are_refused_in_one_line(tmp_path):
    model = load_model(QUANTIZED / "full_int8.tflite")
    sg = model.subgraphs[0]
    sg.tensors[sg.inputs[0]].type = circle.TensorType.INT16
    path = tmp_path / "int16.tflite"
    path.write_bytes(model_to_bytes(model, b"TFL3"))
    with pytest.raises(UserError, match=r"int16.tflite: tensor 0 '.*' is INT16 with 1 scales: "
                                        r"only int8 activations with one scale can train"):
        split(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_inspect_marks_quantized_ops():
    ops = describe(load_model(QUANTIZED / "full_int8.tflite"))["subgraphs"][0]["operators"]
    assert {op["type"] for op in ops if op["training"] != "quantized"} == \
        {"STRIDED_SLICE", "PACK"}  # shape computations in int32, folded
    dynamic = describe(load_model(QUANTIZED / "dynamic_int8.tflite"))["subgraphs"][0]["operators"]
    assert {op["type"] for op in dynamic if op["training"] == "quantized weights"} == \
        {"CONV_2D", "FULLY_CONNECTED"}


def test_shared_biases_are_untied(tmp_path):
    """The converter keeps the three convolutions' zero biases as one tensor; each
    trained operator gets its own, so last:4 trains the depthwise convolution and
    the dense layers only, not the two convolutions that read the same bias."""
    sg = describe(load_model(QUANTIZED / "shared_bias.tflite"))["subgraphs"][0]
    shared = [c for c in sg["constants"] if c["readers"] > 1 and c["type"] == "FLOAT32"]
    assert [(c["shape"], c["readers"]) for c in shared] == [([16], 3)]
    assert sg["totals"]["shared_constants"] == 2  # and an int32 shape constant
    files = split(QUANTIZED / "shared_bias.tflite", tmp_path, trainable="last:4")
    names = [t["name"] for t in files.trainable]
    assert names[:2] == ["functional_1_1/depthwise_conv2d_1_1/depthwise",
                         f"{shared[0]['name']}@op3"]
    art = load_artifacts(files.frozen)
    ops = [op.type for op in art.backprop.ops]
    assert "Conv2DWeightGrad" not in ops and "Conv2DInputGrad" not in ops
    # the model computes what it computed before
    (expected,) = _litert((QUANTIZED / "shared_bias.tflite").read_bytes(), [X])
    got = Trainer(files.frozen, batch_size=len(X)).predict([X])[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def test_a_shared_weight_of_differing_values_stays_tied(tmp_path):
    """GPT-2 reads one matrix as its token embedding and its output layer: it trains as
    one weight, its gradient the sum of both uses' (torch float64)."""
    from test_split_gradients import RNG as GRNG, GraphMaker, check_gradients

    m = GraphMaker()
    x = m.tensor((-1, 4))
    tied = m.weight(4, 4)
    h = m.op("FULLY_CONNECTED", [x, tied], (-1, 4), fused_activation_function=4)
    y = m.op("FULLY_CONNECTED", [h, tied, m.weight(4)], (-1, 4))
    path = m.save(tmp_path / "tied.circle", [x], [y])
    grads = check_gradients(path, tmp_path / "split", GRNG.normal(size=(5, 4)).astype(np.float32),
                            GRNG.normal(size=(5, 4)).astype(np.float32), "mse")
    assert tied in grads and len(grads) == 2
