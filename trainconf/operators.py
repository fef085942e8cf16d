"""The operators trainconf knows: one entry per forward operator, with its
gradient rule, its shape folding and its properties.

Every question "what kind of operator is this?" is answered here and nowhere
else: which ops have a trainable weight (`--trainable`, the memory budget),
which weight gradients can be cut to rows, which ops are layers for adaptive
loss scaling, which ops fold into constants.  The forward kernels belong to the
runtime: an operator runs forward when microtrain registers a kernel under its
name (`microtrain.step.kernels.KERNELS`), a fact this module reads and never
restates.  docs/operators.md's table of supported operators is generated from
OPERATORS by scripts/operator_table.py.

How to add an operator
----------------------
1. Forward: a kernel `@kernel("NAME")` in microtrain/step/kernels/, tested in
   tests/test_kernels_*.py (against PyTorch or numpy references).
2. Backward (if it trains or passes gradients): a rule
   `rule(b, op, dy, needs) -> [grad | None per input]` in trainconf/gradients.py
   that emits gradient operators; a new gradient operator gets its kernel in
   microtrain/step/kernels and a row in schemas/backprop.md.  Its gradient is checked
   against PyTorch float64 in tests/test_split_gradients.py.
3. One entry in OPERATORS below, `Operator("NAME", gradients.rule, ...)` with
   its properties; then `python scripts/operator_table.py` to refresh the
   docs/operators.md's table (tests/test_docs.py fails while it is stale).
An op with a weight that trains sets `weight` (and `bias`) to their input
positions, or `weight=CONSTANT_OPERAND` for an elementwise op whose constant
operand is a per-feature parameter in some of its uses (a LayerNorm's gamma in a
MUL, a bias a converter adds after a bias-less matmul, an added position table:
see `parameter_operand`); `layer=True` if its input gradient (gradient of input 0) is emitted
as one operator whose inputs are [dY, W] (adaptive loss scaling scales there);
`row_grad` if its weight gradient is one operator whose output's leading axis is
the output channel, computed from [dY, X] (the memory budget may train a block
of rows); `ids` if its weight is a table whose rows it reads at the ids of that
input (an embedding lookup: the data loader checks them); `options` names its
builtin options table in the circle schema, which the writer gives it when a
backprop graph uses it.
"""
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from microtrain.files.graph import concrete_shape
from microtrain.step.kernels import KERNELS, VERSIONS

from . import fold, gradients


# `weight` of an op whose trainable input is whichever operand is a constant parameter
CONSTANT_OPERAND = "constant operand"


class Operand(NamedTuple):
    """What decides whether an input can train: its shape (-1 or a symbolic -k
    for the batch), whether it is floating point, whether it is a constant and
    whether that constant is all zeros."""
    shape: tuple
    floating: bool
    constant: bool
    zeros: bool = False


def parameter_operand(inputs: list[Operand | None], output: tuple, added: bool) -> int | None:
    """The position of the constant operand that is a per-feature parameter of
    an elementwise op (`added`: an ADD or SUB, else a MUL), None when there is
    none: one operand constant, the other computed; the constant floating point,
    with more than one value (not a scalar such as a LayerNorm's epsilon), and
    broadcast to the output (of a lower rank or a different shape than one
    sample's output).  A constant of one sample's shape is data (a recurrent
    layer's zero initial state, MediaPipe's constant matrix scales), but for a
    table added to the activations that is not all zeros (a position table)."""
    if len(inputs) != 2 or None in inputs or [x.constant for x in inputs].count(True) != 1:
        return None
    position = 0 if inputs[0].constant else 1
    c = inputs[position]
    if not c.floating or int(np.prod(c.shape)) <= 1 or len(c.shape) > len(output):
        return None
    if len(c.shape) == len(output) and tuple(c.shape) == concrete_shape(tuple(output), 1):
        return position if added and not c.zeros else None
    return position


@dataclass(frozen=True)
class Operator:
    name: str  # circle builtin operator name, or a custom op's custom_code
    gradient: Callable | None = None  # gradient rule (trainconf/gradients.py)
    fold: Callable | None = None  # value of its output from constant inputs (fold.py)
    weight: int | str | None = None  # input position of a trainable weight, or CONSTANT_OPERAND
    bias: int | None = None  # input position of the bias that trains with it
    layer: bool = False  # its input gradient is a layer for adaptive loss scaling
    row_grad: str | None = None  # the weight-gradient op whose rows are output channels
    ids: int | None = None  # an embedding lookup's input of row ids into its weight (the table)
    options: str | None = None  # its builtin options table, for the backprop graph's writer
    lowered: bool = False  # split rewrites it into operators that train (trainconf/recurrent.py)
    shape: int | None = None  # the input that is its output's shape (export restores its batch)
    # its multiply-adds run as numpy elementwise passes, not one BLAS product: on
    # microtrain ~10x slower each (MobileNetV2: depthwise convolutions, 15% of the
    # forward pass's multiply-adds, take 2/3 of its time); recomputation weighs them so
    elementwise: bool = False

    @property
    def forward(self) -> bool:
        """Whether the runtime has a kernel for it."""
        return self.name in KERNELS

    @property
    def versions(self) -> frozenset[int] | None:
        """The operator versions its kernel runs (None: every version)."""
        return VERSIONS.get(self.name)

    @property
    def weighted(self) -> bool:
        return self.weight is not None

    @property
    def kernel(self) -> bool:
        """Its weight sits at a fixed input (a matmul or convolution kernel, PRELU's alpha)."""
        return isinstance(self.weight, int)

    def weight_input(self, inputs: list[Operand | None], output: tuple) -> int | None:
        """The position of the input that trains in this use of the op, None
        when none can (absent, computed, or not a parameter)."""
        if self.weight == CONSTANT_OPERAND:
            return parameter_operand(inputs, output, self.name in ("ADD", "SUB"))
        if not self.kernel or self.weight >= len(inputs) or inputs[self.weight] is None \
                or not inputs[self.weight].constant:
            return None
        return self.weight


# The options tables of the activations declared below in bulk (the others have none).
_ACTIVATION_OPTIONS = {"LEAKY_RELU": "LeakyReluOptions", "EXP": "ExpOptions",
                       "HARD_SWISH": "HardSwishOptions", "GELU": "GeluOptions"}


def _camel(name: str) -> str:
    """LOGICAL_AND -> LogicalAnd, the stem of its options table's name."""
    return "".join(word.capitalize() for word in name.split("_"))


def _weighted(name, gradient, **props) -> Operator:
    return Operator(name, gradient, weight=1, bias=2, layer=True, **props)


_ENTRIES = [
    _weighted("FULLY_CONNECTED", gradients.fully_connected, row_grad="FullyConnectedWeightGrad",
              options="FullyConnectedOptions"),
    _weighted("CONV_2D", gradients.conv_2d, row_grad="Conv2DWeightGrad", options="Conv2DOptions"),
    _weighted("DEPTHWISE_CONV_2D", gradients.depthwise_conv_2d, options="DepthwiseConv2DOptions",
              elementwise=True),
    Operator("TRANSPOSE_CONV", gradients.transpose_conv, weight=1, bias=3, layer=True,
             options="TransposeConvOptions"),
    Operator("Convolution2DTransposeBias", gradients.transpose_conv, weight=1, bias=2, layer=True),
    Operator("MAX_POOL_2D", gradients.max_pool, options="Pool2DOptions"),
    Operator("AVERAGE_POOL_2D", gradients.average_pool, options="Pool2DOptions"),
    Operator("MEAN", gradients.mean_sum, options="ReducerOptions"),
    Operator("SUM", gradients.mean_sum, options="ReducerOptions"),
    Operator("REDUCE_MAX", gradients.reduce_max, options="ReducerOptions"),
    Operator("L2_NORMALIZATION", gradients.l2_normalization, options="L2NormOptions"),
    Operator("RESHAPE", gradients.reshape, options="ReshapeOptions"),
    Operator("SQUEEZE", gradients.reshape, options="SqueezeOptions"),
    Operator("EXPAND_DIMS", gradients.reshape, options="ExpandDimsOptions"),
    Operator("SOFTMAX", gradients.softmax, options="SoftmaxOptions"),
    *(Operator(name, gradients.activation, options=_ACTIVATION_OPTIONS.get(name))
      for name in gradients.ACTIVATION_OPS),
    *(Operator(name, gradients.input_activation, options=_ACTIVATION_OPTIONS.get(name))
      for name in gradients.INPUT_ACTIVATION_OPS),
    Operator("LOG_SOFTMAX", gradients.log_softmax, options="LogSoftmaxOptions"),
    Operator("PRELU", gradients.prelu, weight=1),  # its alpha trains
    Operator("ADD", gradients.add_sub, weight=CONSTANT_OPERAND, options="AddOptions"),
    Operator("SUB", gradients.add_sub, weight=CONSTANT_OPERAND, options="SubOptions"),
    Operator("MUL", gradients.mul, weight=CONSTANT_OPERAND, options="MulOptions"),
    Operator("DIV", gradients.div, options="DivOptions"),
    Operator("SQUARED_DIFFERENCE", gradients.squared_difference,
             options="SquaredDifferenceOptions"),
    Operator("MAXIMUM", gradients.pick, options="MaximumMinimumOptions"),
    Operator("MINIMUM", gradients.pick, options="MaximumMinimumOptions"),
    Operator("CONCATENATION", gradients.concatenation, fold=fold.concatenation,
             options="ConcatenationOptions"),
    Operator("PAD", gradients.pad, options="PadOptions"),
    Operator("PADV2", gradients.pad, options="PadV2Options"),
    Operator("MIRROR_PAD", gradients.mirror_pad, options="MirrorPadOptions"),
    Operator("DEPTH_TO_SPACE", gradients.depth_space, options="DepthToSpaceOptions"),
    Operator("SPACE_TO_DEPTH", gradients.depth_space, options="SpaceToDepthOptions"),
    Operator("STRIDED_SLICE", gradients.strided_slice, fold=fold.strided_slice,
             options="StridedSliceOptions"),
    Operator("SLICE", gradients.slice_, options="SliceOptions"),
    Operator("SPLIT", gradients.split, options="SplitOptions"),
    Operator("SPLIT_V", gradients.split, options="SplitVOptions"),
    # embedding tables: the weight is the table, whose gradient is a row scatter-add
    Operator("GATHER", gradients.gather, fold=fold.gather, weight=0, ids=1, options="GatherOptions"),
    Operator("EMBEDDING_LOOKUP", gradients.embedding_lookup, weight=1, ids=0),
    Operator("RESIZE_BILINEAR", gradients.resize_bilinear, options="ResizeBilinearOptions"),
    Operator("RESIZE_NEAREST_NEIGHBOR", gradients.resize_nearest_neighbor,
             options="ResizeNearestNeighborOptions"),
    Operator("TRANSPOSE", gradients.transpose, options="TransposeOptions"),
    Operator("BATCH_MATMUL", gradients.batch_matmul, options="BatchMatMulOptions"),
    # MediaPipe's landmark operators: forward only, but for the gradient of
    # TransformLandmarks' landmarks (its matrix input has none)
    Operator("Landmarks2TransformMatrix"),
    Operator("TransformTensorBilinear"),
    Operator("TransformLandmarks", gradients.transform_landmarks),
    # fake quantization of `split --quantize int8` and of int8 models (trainconf/quantize.py)
    Operator("FAKE_QUANT", gradients.fake_quant, options="FakeQuantOptions"),
    Operator("FakeQuantPerChannel", gradients.fake_quant_per_channel),
    # forward only (the backprop graphs use it too)
    Operator("ADD_N", options="AddNOptions"),
    # masks, ids and data movement of sequence models (issue 18)
    Operator("NEG", gradients.neg, options="NegOptions"),
    *(Operator(name, options=f"{_camel(name)}Options") for name in (
        "LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL",
        "LOGICAL_AND", "LOGICAL_OR", "LOGICAL_NOT")),  # bool outputs: no gradient
    Operator("SELECT", gradients.select, options="SelectOptions"),
    Operator("SELECT_V2", gradients.select, options="SelectV2Options"),
    Operator("CAST", gradients.reshape, options="CastOptions"),  # float to float: dY itself
    Operator("REVERSE_V2", gradients.reverse_v2, options="ReverseV2Options"),
    Operator("BROADCAST_TO", gradients.broadcast_to, options="BroadcastToOptions", shape=1),
    Operator("REDUCE_PROD", gradients.reduce_prod, fold=fold.reduce_prod, options="ReducerOptions"),
    Operator("TILE", gradients.tile, options="TileOptions"),
    Operator("CUMSUM", gradients.cumsum, options="CumsumOptions"),
    Operator("ONE_HOT", options="OneHotOptions"),
    Operator("ARG_MAX", options="ArgMaxOptions"),
    Operator("ARG_MIN", options="ArgMinOptions"),
    # fused recurrent layers: unrolled over time at split into the operators above
    Operator("UNIDIRECTIONAL_SEQUENCE_LSTM", lowered=True,
             options="UnidirectionalSequenceLSTMOptions"),
    Operator("BIDIRECTIONAL_SEQUENCE_LSTM", lowered=True,
             options="BidirectionalSequenceLSTMOptions"),
    Operator("UNIDIRECTIONAL_SEQUENCE_RNN", lowered=True, options="SequenceRNNOptions"),
    # shape computations, folded into constants at split
    Operator("SHAPE", fold=fold.shape, options="ShapeOptions"),
    Operator("PACK", fold=fold.pack, options="PackOptions"),
]

OPERATORS: dict[str, Operator] = {op.name: op for op in _ENTRIES}
assert len(OPERATORS) == len(_ENTRIES), "an operator is declared twice"


def spec(name: str) -> Operator:
    """The entry of an operator; an unknown one has no gradient, fold or kernel."""
    return OPERATORS.get(name) or Operator(name)


WITH_GRADIENT = sorted(name for name, op in OPERATORS.items() if op.gradient)
WEIGHTED = sorted(name for name, op in OPERATORS.items() if op.weighted)
FOLDS = {name: op.fold for name, op in OPERATORS.items() if op.fold}
ROW_GRADS = {op.row_grad for op in OPERATORS.values() if op.row_grad}


class Int8(NamedTuple):
    """How an operator computes in a full-integer int8 model, as TFLite's int8
    quantization spec constrains it (trainconf/int8.py writes such models)."""
    version: int  # its operator version over int8 tensors, as TensorFlow's converter writes it
    channels: int | None = None  # its weight's output-channel axis (per-channel scales)
    same_scale: bool = False  # output and (every) input share one scale and zero point
    output: tuple[float, int] | None = None  # its output's fixed (scale, zero point)


# The operators converters put in full-integer models; export --int8 refuses any other.
INT8: dict[str, Int8] = {
    "CONV_2D": Int8(3, channels=0),
    "DEPTHWISE_CONV_2D": Int8(3, channels=3),
    "FULLY_CONNECTED": Int8(4, channels=0),
    "ADD": Int8(2), "MUL": Int8(2), "MEAN": Int8(2), "HARD_SWISH": Int8(1),
    "RELU": Int8(2), "RELU6": Int8(2),
    "MAX_POOL_2D": Int8(2, same_scale=True), "AVERAGE_POOL_2D": Int8(2, same_scale=True),
    "RESHAPE": Int8(1, same_scale=True), "PAD": Int8(2, same_scale=True),
    "CONCATENATION": Int8(2, same_scale=True),
    "SOFTMAX": Int8(2, output=(1 / 256, -128)), "LOGISTIC": Int8(2, output=(1 / 256, -128)),
    "TANH": Int8(2, output=(1 / 128, 0)),
    # the edges of a model with float input and output
    "QUANTIZE": Int8(1), "DEQUANTIZE": Int8(2),
}
