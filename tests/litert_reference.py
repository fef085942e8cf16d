"""The independent reference for models we did not build: the TFLite interpreter (LiteRT's
ai-edge-litert) running the original file, and Keras's losses on its outputs."""
from pathlib import Path

import numpy as np
from ai_edge_litert.interpreter import Interpreter

CLIP = 1e-7  # keras.config.epsilon(), the probability clip of cross-entropy


def interpreter_outputs(path: Path, xs: list[np.ndarray]) -> list[np.ndarray]:
    """The interpreter's outputs for float inputs xs, one sample at a time (a fixed-batch model
    takes batch 1; a dynamic one is resized to it)."""
    interpreter = Interpreter(model_path=str(path))
    inputs = interpreter.get_input_details()
    for d, x in zip(inputs, xs):
        interpreter.resize_tensor_input(d["index"], [1, *x.shape[1:]])
    interpreter.allocate_tensors()
    outputs = interpreter.get_output_details()
    results = [[] for _ in outputs]
    for i in range(len(xs[0])):
        for d, x in zip(inputs, xs):
            interpreter.set_tensor(d["index"], x[i:i + 1])
        interpreter.invoke()
        for r, d in zip(results, outputs):
            r.append(interpreter.get_tensor(d["index"]).copy())
    return [np.concatenate(r) for r in results]


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
