"""The independent reference for models we did not build: the TFLite interpreter (LiteRT's
ai-edge-litert) running the original file (or, for int8 weights that float operators read
directly, the file with a DEQUANTIZE in front of each), and Keras's losses on its outputs."""
from pathlib import Path

import numpy as np
from ai_edge_litert.interpreter import Interpreter

from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (add_operator_code, buffer_array, load_model,
                                           model_to_bytes)
from trainconf.constants import is_quantized

CLIP = 1e-7  # keras.config.epsilon(), the probability clip of cross-entropy


def interpreter_outputs(model: Path | bytes, xs: list[np.ndarray]) -> list[np.ndarray]:
    """The interpreter's outputs for float inputs xs on a model file (or its bytes), one sample
    at a time (a fixed-batch model takes batch 1; a dynamic one is resized to it)."""
    interpreter = (Interpreter(model_content=model) if isinstance(model, bytes)
                   else Interpreter(model_path=str(model)))
    inputs = interpreter.get_input_details()
    for d, x in zip(inputs, xs):
        interpreter.resize_tensor_input(d["index"], [1, *x.shape[1:]])
    interpreter.allocate_tensors()
    outputs = interpreter.get_output_details()
    results = [[] for _ in outputs]
    for i in range(len(xs[0])):
        interpreter.reset_all_variables()  # each sample from the zero state (recurrent layers)
        for d, x in zip(inputs, xs):
            interpreter.set_tensor(d["index"], x[i:i + 1])
        interpreter.invoke()
        for r, d in zip(results, outputs):
            r.append(interpreter.get_tensor(d["index"]).copy())
    return [np.concatenate(r) for r in results]


def invoked(interpreter: Interpreter, xs: list[np.ndarray]) -> Interpreter:
    """`interpreter` after running the inputs xs at their own shapes, from the zero state."""
    inputs = interpreter.get_input_details()
    for d, x in zip(inputs, xs):
        interpreter.resize_tensor_input(d["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.reset_all_variables()  # a fused LSTM's state would carry over invoke()s
    for d, x in zip(inputs, xs):
        interpreter.set_tensor(d["index"], x)
    interpreter.invoke()
    return interpreter


def keras_loss(name: str, ys, ts) -> float:
    """Keras's loss (mse, mae or cce) with mean reduction, summed over the outputs as the
    backprop graph sums them, in float64."""
    total = 0.0
    for y, t in zip(ys, ts):
        y, t = y.astype(np.float64), t.astype(np.float64)
        if name == "mse":
            total += np.mean((y - t) ** 2)
        elif name == "mae":
            total += np.mean(np.abs(y - t))
        elif name == "cce":
            p = np.clip(y / y.sum(-1, keepdims=True), CLIP, 1 - CLIP)
            total += np.mean(-(t * np.log(p)).sum(-1))
        else:
            raise ValueError(f"no reference for loss {name!r}")
    return float(total)


def dequantized_in_front(path: Path) -> bytes | None:
    """The .tflite file with a DEQUANTIZE operator in front of every quantized constant an
    operator reads directly (a dynamic-range model's int8 weights), so that LiteRT itself
    computes the float weights and runs float kernels: the float model those weights stand for.
    (On the file, LiteRT's hybrid kernels also round their float inputs to int8.) None if no
    operator reads a quantized constant directly."""
    model = load_model(path)
    sg = model.subgraphs[0]
    front = []
    for t, tensor in enumerate(list(sg.tensors)):
        if not is_quantized(tensor) or buffer_array(model, tensor) is None:
            continue
        sg.tensors.append(circle.TensorT(shape=list(tensor.shape), type=circle.TensorType.FLOAT32,
                                         buffer=0, name=f"{tensor.name}/float"))
        new = len(sg.tensors) - 1
        for op in sg.operators:
            op.inputs = [new if i == t else i for i in op.inputs]
        front.append(t)
    if not front:
        return None
    code = add_operator_code(model, "DEQUANTIZE")
    sg.operators = [circle.OperatorT(opcodeIndex=code, inputs=[t], outputs=[new])
                    for t, new in zip(front, range(len(sg.tensors) - len(front), len(sg.tensors)))
                    ] + sg.operators
    return model_to_bytes(model, b"TFL3")
