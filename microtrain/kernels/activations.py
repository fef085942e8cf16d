"""Activation kernels and their gradients."""
import numpy as np

from . import kernel


def _identity(x):
    pass


def _relu(x):
    np.maximum(x, 0, out=x)


def _relu6(x):
    np.clip(x, 0, 6, out=x)


def _relu_n1_to_1(x):
    np.clip(x, -1, 1, out=x)


def _tanh(x):
    np.tanh(x, out=x)


# Circle's ActivationFunctionType: 0 NONE, 1 RELU, 2 RELU_N1_TO_1, 3 RELU6, 4 TANH.
FUSED = {0: _identity, 1: _relu, 2: _relu_n1_to_1, 3: _relu6, 4: _tanh}


def fused_activation(code: int):
    """The in-place function for a fused activation code."""
    if code not in FUSED:
        raise ValueError(f"unsupported fused activation {code}")
    return FUSED[code]
