"""Comparisons and logic, with boolean outputs (a WHILE loop's condition, which
trainconf split evaluates with these kernels when it unrolls the loop)."""
from functools import partial

import numpy as np

from . import kernel


def _binary(ufunc):
    def factory(inputs, outputs, **_):
        (a, b), (y,) = inputs[:2], outputs
        return partial(ufunc, a, b, out=y)
    return factory


# y = a op b, a and b broadcast against each other to y's shape.
for _name, _ufunc in (("LESS", np.less), ("LOGICAL_AND", np.logical_and)):
    kernel(_name)(_binary(_ufunc))
