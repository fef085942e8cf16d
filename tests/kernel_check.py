"""Helpers for kernel tests: run one kernel, and check a gradient kernel
against central finite differences of its forward kernel in float64."""
import numpy as np

from microtrain.step.kernels import build


def run(name, inputs, out_shapes, dtype=np.float64, **options):
    """Run kernel `name` once on fresh output buffers and return them."""
    outputs = [np.zeros(s, dtype=dtype) for s in out_shapes]
    build(name, [None if a is None else np.ascontiguousarray(a) for a in inputs],
          outputs, **options)()
    return outputs


def numeric_grad(f, x, dy, eps=1e-6):
    """d(sum(f(x) * dy))/dx by central differences; f maps an array to an array."""
    x = x.astype(np.float64).copy()
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = np.sum(f(x) * dy)
        flat[i] = old - eps
        minus = np.sum(f(x) * dy)
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * eps)
    return g
