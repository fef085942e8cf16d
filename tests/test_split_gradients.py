"""The gradients that the frozen + backprop graphs compute equal PyTorch autograd's
(float64) on the same network: on every fixture and on small graphs built here to
exercise every gradient rule."""
from pathlib import Path

import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.files.format.model import save_model
from microtrain.files.graph import Graph, Op, Tensor
from microtrain.trainer import Trainer
from torch_reference import reference_gradients
from trainconf.split import split
from trainconf.writer import graph_to_model

FIXTURES = Path(__file__).parent / "fixtures"
RNG = np.random.default_rng(7)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check_gradients(model_path: Path, out: Path, x: np.ndarray, t: np.ndarray, loss: str,
                    reduction: str = "mean", trainable: str = "all") -> dict:
    result = split(model_path, out, loss=loss, reduction=reduction, trainable=trainable)
    trainer = Trainer(result.frozen, batch_size=len(x), optimizer="sgd")
    got_loss, got = trainer.gradients([x], [t])
    want_loss, want = reference_gradients(trainer.art.forward, trainer.art.weights, [x], t,
                                          loss, reduction)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert set(got) == set(want)
    for tensor, g in got.items():
        assert relative_error(g, want[tensor]) < 1e-5, trainer.art.forward.tensors[tensor].name
    return got


FIXTURE_CASES = [("mlp", "digits_x", "digits_onehot", "cce"),
                 ("mlp", "digits_x", "digits_y", "sparse_cce"),
                 ("residual_mlp", "digits_x", "digits_onehot", "cce"),
                 ("cnn", "digits_images", "digits_onehot", "cce"),
                 ("depthwise", "digits_images", "digits_onehot", "cce"),
                 ("regression", "diabetes_x", "diabetes_y", "mse"),
                 ("regression", "diabetes_x", "diabetes_y", "mae"),
                 ("regression", "diabetes_x", "diabetes_y", "bce"),
                 ("mobilenetv2", None, None, "cce")]


@pytest.mark.parametrize("model,inputs,targets,loss", FIXTURE_CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in FIXTURE_CASES])
def test_fixture_gradients_match_torch(model, inputs, targets, loss, tmp_path):
    if inputs is None:  # random images for the network without a data set of its own
        x = RNG.random((4, 32, 32, 3), dtype=np.float32)
        t = np.eye(10, dtype=np.float32)[RNG.integers(0, 10, 4)]
    else:
        x, t = np.load(FIXTURES / f"{inputs}.npy")[:16], np.load(FIXTURES / f"{targets}.npy")[:16]
    check_gradients(FIXTURES / f"{model}.tflite", tmp_path, x, t, loss)


# -- small graphs covering the rules the fixtures do not reach -----------------------------------

class GraphMaker:
    def __init__(self):
        self.tensors, self.ops = [], []

    def tensor(self, shape, data=None, dtype=np.float32) -> int:
        array = None if data is None else np.asarray(data, dtype)
        self.tensors.append(Tensor(len(self.tensors), f"t{len(self.tensors)}", tuple(shape),
                                   np.dtype(dtype), array))
        return len(self.tensors) - 1

    def weight(self, *shape) -> int:
        return self.tensor(shape, RNG.normal(0, 0.5, shape))

    def op(self, type_, inputs, shape, dtype=np.float32, **options) -> int:
        out = self.tensor(shape, dtype=dtype)
        self.ops.append(Op(len(self.ops), type_, list(inputs), [out], options))
        return out

    def save(self, path: Path, inputs, outputs) -> Path:
        save_model(graph_to_model(Graph(self.tensors, self.ops, inputs, outputs), "test", {}), path)
        return path


CONV = dict(padding=0, stride_w=2, stride_h=2, dilation_w_factor=1, dilation_h_factor=1)


def conv_block(m: GraphMaker):
    """conv (stride 2, SAME, relu6) -> depthwise (x2, dilation 2, tanh) -> avg pool SAME ->
    max pool VALID with overlapping windows -> mean keep_dims -> squeeze -> fc -> softmax"""
    x = m.tensor((-1, 6, 6, 2))
    a = m.op("CONV_2D", [x, m.weight(4, 3, 3, 2), m.weight(4)], (-1, 3, 3, 4),
             fused_activation_function=3, **CONV)
    b = m.op("DEPTHWISE_CONV_2D", [a, m.weight(1, 3, 3, 8), m.weight(8)], (-1, 3, 3, 8),
             fused_activation_function=4, depth_multiplier=2,
             **dict(CONV, stride_w=1, stride_h=1, dilation_w_factor=2, dilation_h_factor=2))
    c = m.op("AVERAGE_POOL_2D", [b], (-1, 3, 3, 8), padding=0, stride_w=1, stride_h=1,
             filter_width=2, filter_height=2)
    d = m.op("MAX_POOL_2D", [c], (-1, 2, 2, 8), padding=1, stride_w=1, stride_h=1,
             filter_width=2, filter_height=2)
    e = m.op("MEAN", [d, m.tensor((2,), [1, 2], np.int32)], (-1, 1, 1, 8), keep_dims=True)
    f = m.op("SQUEEZE", [e], (-1, 8), squeeze_dims=[1, 2])
    g = m.op("FULLY_CONNECTED", [f, m.weight(5, 8), m.weight(5)], (-1, 5))
    return [x], [m.op("SOFTMAX", [g], (-1, 5), beta=1.5)], (6, 6, 2), "cce"


def elementwise(m: GraphMaker):
    """Branches everywhere: a and b each feed two ops; broadcasting MUL, SUB, DIV, ADD."""
    x = m.tensor((-1, 5))
    a = m.op("FULLY_CONNECTED", [x, m.weight(6, 5), m.weight(6)], (-1, 6))
    b = m.op("LEAKY_RELU", [a], (-1, 6), alpha=0.1)
    c = m.op("MUL", [b, m.weight(6)], (-1, 6))
    d = m.op("SUB", [c, a], (-1, 6))
    e = m.op("DIV", [d, m.tensor((1, 6), RNG.uniform(1, 2, (1, 6)))], (-1, 6))
    f = m.op("ADD", [e, b], (-1, 6), fused_activation_function=1)
    g = m.op("LOGISTIC", [f], (-1, 6))
    h = m.op("RELU6", [m.op("FULLY_CONNECTED", [g, m.weight(3, 6)], (-1, 3))], (-1, 3))
    return [x], [m.op("TANH", [h], (-1, 3))], (5,), "mse"


def shape_ops(m: GraphMaker):
    """keep_num_dims FC, TRANSPOSE, BATCH_MATMUL (adjoint, both operands computed),
    RESHAPE, CONCATENATION, PAD, DIV by a computed tensor."""
    x = m.tensor((-1, 4, 3))
    a = m.op("FULLY_CONNECTED", [x, m.weight(5, 3), m.weight(5)], (-1, 4, 5), keep_num_dims=True)
    b = m.op("TRANSPOSE", [a, m.tensor((3,), [0, 2, 1], np.int32)], (-1, 5, 4))
    c = m.op("BATCH_MATMUL", [b, m.tensor((4, 2), RNG.normal(0, 1, (4, 2)))], (-1, 5, 2))
    gram = m.op("BATCH_MATMUL", [a, a], (-1, 4, 4), adj_y=True)
    d = m.op("RESHAPE", [c, m.tensor((2,), [-1, 10], np.int32)], (-1, 10))
    e = m.op("RESHAPE", [gram, m.tensor((2,), [-1, 16], np.int32)], (-1, 16))
    f = m.op("CONCATENATION", [d, e, m.op("RELU", [d], (-1, 10))], (-1, 36), axis=-1)
    g = m.op("PAD", [f, m.tensor((2, 2), [[0, 0], [2, 1]], np.int32)], (-1, 39))
    h = m.op("DIV", [g, m.op("ADD", [m.op("LOGISTIC", [g], (-1, 39)),
                                     m.tensor((1,), [1.0])], (-1, 39))], (-1, 39))
    out = m.op("FULLY_CONNECTED", [h, m.weight(4, 39), m.weight(4)], (-1, 4))
    return [x], [m.op("SOFTMAX", [out], (-1, 4))], (4, 3), "sparse_cce"


def logistic_head(m: GraphMaker):
    x = m.tensor((-1, 4))
    a = m.op("FULLY_CONNECTED", [x, m.weight(3, 4), m.weight(3)], (-1, 3), fused_activation_function=2)
    b = m.op("FULLY_CONNECTED", [a, m.weight(2, 3), m.weight(2)], (-1, 2))
    return [x], [m.op("LOGISTIC", [b], (-1, 2))], (4,), "bce"


def mobile_activations(m: GraphMaker):
    """PRELU (alpha trains), HARD_SWISH, GELU (both forms), ELU, MAXIMUM/MINIMUM against computed
    and constant operands, SQUARED_DIFFERENCE, EXP, SQRT, RSQRT, LOG, SQUARE, LOG_SOFTMAX."""
    x = m.tensor((-1, 5))
    a = m.op("FULLY_CONNECTED", [x, m.weight(6, 5), m.weight(6)], (-1, 6))
    b = m.op("PRELU", [a, m.weight(6)], (-1, 6))
    c = m.op("HARD_SWISH", [m.op("MUL", [b, m.tensor((1,), [3.0])], (-1, 6))], (-1, 6))
    d = m.op("ELU", [m.op("GELU", [c], (-1, 6), approximate=True)], (-1, 6))
    e = m.op("MINIMUM", [m.op("MAXIMUM", [d, m.op("GELU", [a], (-1, 6))], (-1, 6)),
                         m.tensor((6,), RNG.uniform(0, 1, 6))], (-1, 6))
    f = m.op("SQUARED_DIFFERENCE", [e, b], (-1, 6))
    g = m.op("SQRT", [m.op("ADD", [m.op("EXP", [e], (-1, 6)), f], (-1, 6))], (-1, 6))
    h = m.op("LOG", [m.op("ADD", [m.op("RSQRT", [g], (-1, 6)), m.op("SQUARE", [d], (-1, 6))],
                          (-1, 6))], (-1, 6))
    out = m.op("FULLY_CONNECTED", [h, m.weight(4, 6), m.weight(4)], (-1, 4))
    return [x], [m.op("LOG_SOFTMAX", [out], (-1, 4))], (5,), "mse"


def layout_ops(m: GraphMaker):
    """DEPTH_TO_SPACE, MIRROR_PAD, STRIDED_SLICE, SPACE_TO_DEPTH, PADV2, SPLIT, SPLIT_V with an
    unused part, SUM, REDUCE_MAX, GATHER with a repeated index, EXPAND_DIMS, SLICE,
    L2_NORMALIZATION with a fused RELU."""
    def ints(*v):
        return m.tensor((len(v),), v, np.int32) if np.ndim(v[0]) == 0 else \
            m.tensor(np.shape(v), v, np.int32)
    x = m.tensor((-1, 4, 4, 2))
    a = m.op("CONV_2D", [x, m.weight(8, 1, 1, 2), m.weight(8)], (-1, 4, 4, 8), padding=1,
             stride_w=1, stride_h=1)
    b = m.op("DEPTH_TO_SPACE", [a], (-1, 8, 8, 2), block_size=2)
    c = m.op("MIRROR_PAD", [b, ints([0, 0], [1, 2], [2, 1], [0, 0])], (-1, 11, 11, 2), mode=0)
    d = m.op("STRIDED_SLICE", [c, ints(0, 1, 0, 0), ints(0, 9, 11, 2), ints(1, 2, 3, 1)],
             (-1, 4, 4, 2), begin_mask=1, end_mask=1)
    e = m.op("SPACE_TO_DEPTH", [d], (-1, 2, 2, 8), block_size=2)
    f = m.op("PADV2", [e, ints([0, 0], [1, 0], [0, 1], [0, 0]), m.tensor((1,), [0.5])],
             (-1, 3, 3, 8))
    g, h = m.tensor((-1, 3, 3, 4)), m.tensor((-1, 3, 3, 4))
    m.ops.append(Op(len(m.ops), "SPLIT", [ints(3), f], [g, h], {"num_splits": 2}))
    parts = [m.tensor((-1, 1, 3, 4)) for _ in range(3)]
    m.ops.append(Op(len(m.ops), "SPLIT_V", [g, ints(1, -1, 1), ints(1)], parts, {"num_splits": 3}))
    j = m.op("SUM", [parts[0], ints(1)], (-1, 3, 4), keep_dims=False)
    k = m.op("REDUCE_MAX", [h, ints(1, 2)], (-1, 4), keep_dims=False)
    gathered = m.op("GATHER", [j, ints(2, 0, 2)], (-1, 3, 4), axis=1)
    expanded = m.op("EXPAND_DIMS", [k, ints(1)], (-1, 1, 4))
    n = m.op("SLICE", [parts[2], ints(0, 0, 1, 0), ints(-1, 1, 2, -1)], (-1, 1, 2, 4))
    flat = [m.op("RESHAPE", [t, ints(-1, size)], (-1, size))
            for t, size in ((gathered, 12), (expanded, 4), (n, 8))]
    joined = m.op("CONCATENATION", flat, (-1, 24), axis=1)
    o = m.op("L2_NORMALIZATION", [joined], (-1, 24), fused_activation_function=1)
    out = m.op("FULLY_CONNECTED", [o, m.weight(3, 24), m.weight(3)], (-1, 3))
    return [x], [m.op("SOFTMAX", [out], (-1, 3))], (4, 4, 2), "cce"


def upsampling(m: GraphMaker):
    """MediaPipe's Convolution2DTransposeBias (SAME), RESIZE_BILINEAR (half-pixel centers),
    TRANSPOSE_CONV (VALID, fused RELU), RESIZE_NEAREST_NEIGHBOR; every weight trains."""
    x = m.tensor((-1, 3, 3, 2))
    strides = dict(stride_w=2, stride_h=2)
    a = m.op("Convolution2DTransposeBias", [x, m.weight(4, 3, 3, 2), m.weight(4)], (-1, 6, 6, 4),
             padding=0, **strides)
    b = m.op("RESIZE_BILINEAR", [a, m.tensor((2,), [9, 9], np.int32)], (-1, 9, 9, 4),
             half_pixel_centers=True)
    c = m.op("TRANSPOSE_CONV", [m.tensor((4,), [1, 18, 18, 3], np.int32), m.weight(3, 2, 2, 4), b,
                                m.weight(3)], (-1, 18, 18, 3), padding=1,
             fused_activation_function=1, **strides)
    d = m.op("RESIZE_NEAREST_NEIGHBOR", [c, m.tensor((2,), [6, 6], np.int32)], (-1, 6, 6, 3))
    e = m.op("MEAN", [d, m.tensor((2,), [1, 2], np.int32)], (-1, 3))
    out = m.op("FULLY_CONNECTED", [e, m.weight(4, 3), m.weight(4)], (-1, 4))
    return [x], [m.op("SOFTMAX", [out], (-1, 4))], (3, 3, 2), "cce"


def landmarks(m: GraphMaker):
    """MediaPipe's TransformLandmarks moving landmarks a layer computed, by a matrix
    no trained weight reaches (a constant here)."""
    x = m.tensor((-1, 6))
    a = m.op("FULLY_CONNECTED", [x, m.weight(8, 6), m.weight(8)], (-1, 8))
    b = m.op("RESHAPE", [a, m.tensor((3,), [-1, 4, 2], np.int32)], (-1, 4, 2))
    turn = np.eye(4)
    turn[:2, :2], turn[:2, 3] = [[0.6, -1.2], [0.9, 0.4]], [3, -1]
    c = m.op("TransformLandmarks", [b, m.tensor((1, 4, 4), turn[None])], (-1, 4, 2))
    m.ops[-1].version = 2  # the version microtrain runs
    d = m.op("RESHAPE", [c, m.tensor((2,), [-1, 8], np.int32)], (-1, 8))
    return [x], [m.op("FULLY_CONNECTED", [d, m.weight(3, 8), m.weight(3)], (-1, 3))], (6,), "mse"


def sequence_ops(m: GraphMaker):
    """Masks and ids off the gradient path (LESS, LOGICAL_AND, ARG_MAX, ONE_HOT, CAST to
    int and back), SELECT_V2 with a broadcast branch, SELECT by a rank-1 condition, NEG,
    CAST float to float, REVERSE_V2, CUMSUM (exclusive, reverse), TILE, BROADCAST_TO,
    REDUCE_PROD."""
    def ints(*v):
        return m.tensor((len(v),), v, np.int32)
    x = m.tensor((-1, 6))
    a = m.op("FULLY_CONNECTED", [x, m.weight(6, 6), m.weight(6)], (-1, 6))
    low = m.op("LESS", [a, m.tensor((1,), [0.2])], (-1, 6), dtype=np.bool_)
    both = m.op("LOGICAL_AND", [low, m.op("GREATER", [x, m.tensor((1,), [-1.0])], (-1, 6),
                                          dtype=np.bool_)], (-1, 6), dtype=np.bool_)
    row_sum = m.op("SUM", [a, ints(1)], (-1,), keep_dims=False)
    column = m.op("NEG", [m.op("RESHAPE", [row_sum, ints(-1, 1)], (-1, 1))], (-1, 1))
    b = m.op("SELECT_V2", [both, a, column], (-1, 6))
    rows = m.op("LESS", [row_sum, m.tensor((), 0.0)], (-1,), dtype=np.bool_)
    c = m.op("SELECT", [rows, b, m.op("TANH", [a], (-1, 6))], (-1, 6))
    hot = m.op("ONE_HOT", [m.op("ARG_MAX", [a, ints(1)], (-1,), dtype=np.int32, output_type=2),
                           m.tensor((), 6, np.int32), m.tensor((), 1.5), m.tensor((), 0.5)],
               (-1, 6), axis=-1)
    rounded = m.op("CAST", [m.op("CAST", [a], (-1, 6), dtype=np.int32)], (-1, 6))
    d = m.op("MUL", [m.op("ADD", [c, rounded], (-1, 6)), hot], (-1, 6))
    e = m.op("CUMSUM", [m.op("REVERSE_V2", [m.op("CAST", [d], (-1, 6)), ints(1)], (-1, 6)),
                        m.tensor((), 1, np.int32)], (-1, 6), exclusive=True, reverse=True)
    f = m.op("TILE", [m.op("RESHAPE", [e, ints(-1, 2, 3)], (-1, 2, 3)), ints(1, 2, 1)],
             (-1, 4, 3))
    g = m.op("BROADCAST_TO", [m.op("RESHAPE", [a, ints(-1, 1, 6)], (-1, 1, 6)), ints(-1, 2, 6)],
             (-1, 2, 6))
    h = m.op("REDUCE_PROD", [m.op("RESHAPE", [g, ints(-1, 4, 3)], (-1, 4, 3)), ints(1)],
             (-1, 3), keep_dims=False)
    joined = m.op("CONCATENATION", [m.op("RESHAPE", [f, ints(-1, 12)], (-1, 12)), h], (-1, 15),
                  axis=1)
    return [x], [m.op("FULLY_CONNECTED", [joined, m.weight(3, 15), m.weight(3)], (-1, 3))], \
        (6,), "mse"


def attention(m: GraphMaker):
    """Two-head self-attention, every BATCH_MATMUL operand an activation: Q·Kᵀ (adj_y),
    scores·V, and Q times a per-sample matrix shared by the heads (batch broadcast)
    and by a weight matrix of no batch."""
    def ints(*v):
        return m.tensor((len(v),), v, np.int32)
    x = m.tensor((-1, 4, 8))

    def heads(t):
        split = m.op("RESHAPE", [t, ints(-1, 4, 2, 4)], (-1, 4, 2, 4))
        return m.op("TRANSPOSE", [split, ints(0, 2, 1, 3)], (-1, 2, 4, 4))
    q, k, v = (heads(m.op("FULLY_CONNECTED", [x, m.weight(8, 8), m.weight(8)], (-1, 4, 8),
                          keep_num_dims=True)) for _ in range(3))
    scores = m.op("BATCH_MATMUL", [q, k], (-1, 2, 4, 4), adj_y=True)
    weights = m.op("SOFTMAX", [m.op("MUL", [scores, m.tensor((1,), [0.5])], (-1, 2, 4, 4))],
                   (-1, 2, 4, 4))
    mixed = m.op("BATCH_MATMUL", [weights, v], (-1, 2, 4, 4))
    shared = m.op("RESHAPE", [m.op("FULLY_CONNECTED", [x, m.weight(4, 8)], (-1, 4, 4),
                                   keep_num_dims=True), ints(-1, 1, 4, 4)], (-1, 1, 4, 4))
    turned = m.op("BATCH_MATMUL", [q, shared], (-1, 2, 4, 4), adj_x=True)
    moved = m.op("BATCH_MATMUL", [m.op("ADD", [mixed, turned], (-1, 2, 4, 4)), m.weight(4, 4)],
                 (-1, 2, 4, 4), adj_y=True)
    back = m.op("TRANSPOSE", [moved, ints(0, 2, 1, 3)], (-1, 4, 2, 4))
    flat = m.op("RESHAPE", [back, ints(-1, 32)], (-1, 32))
    out = m.op("FULLY_CONNECTED", [flat, m.weight(3, 32), m.weight(3)], (-1, 3))
    return [x], [m.op("SOFTMAX", [out], (-1, 3))], (4, 8), "cce"


def layer_norm(m: GraphMaker, x: int, gamma: int, beta: int | None) -> int:
    """Keras 3's LayerNormalization over the last axis as the converter writes it:
    x·inv + (−mean·inv + beta), inv = rsqrt(var + eps)·gamma."""
    shape = m.tensors[x].shape
    stats = shape[:-1] + (1,)
    axis = m.tensor((1,), [len(shape) - 1], np.int32)
    mean = m.op("MEAN", [x, axis], stats, keep_dims=True)
    var = m.op("MEAN", [m.op("SQUARED_DIFFERENCE", [x, mean], shape), axis], stats,
               keep_dims=True)
    rsqrt = m.op("RSQRT", [m.op("ADD", [var, m.tensor((), 1e-3)], stats)], stats)
    inv = m.op("MUL", [rsqrt, gamma], shape)
    offset = m.op("MUL", [m.op("NEG", [mean], stats), inv], shape)
    if beta is not None:
        offset = m.op("ADD", [offset, beta], shape)
    return m.op("ADD", [m.op("MUL", [x, inv], shape), offset], shape)


def keras_parameters(m: GraphMaker):
    """Parameters Keras layers keep outside weighted ops, as converters leave them: an
    added position table, a Tensordot dense's bias added after its bias-less
    FULLY_CONNECTED and a RESHAPE, two LayerNorms reading one gamma tensor (the
    converter stores identical constants once), one with a beta, and a constant that
    is SUB's first operand; the LayerNorms' scalar epsilon stays a constant."""
    x = m.tensor((-1, 4, 6))
    placed = m.op("ADD", [x, m.weight(1, 4, 6)], (-1, 4, 6))
    dense = m.op("FULLY_CONNECTED", [placed, m.weight(6, 6)], (-1, 4, 6), keep_num_dims=True)
    flat = m.op("RESHAPE", [dense, m.tensor((2,), [-1, 24], np.int32)], (-1, 24))
    biased = m.op("ADD", [flat, m.weight(24)], (-1, 24))
    h = m.op("RESHAPE", [biased, m.tensor((3,), [-1, 4, 6], np.int32)], (-1, 4, 6))
    gamma = m.tensor((1, 1, 6), np.ones((1, 1, 6)))  # Keras's initial scales, stored once
    h = layer_norm(m, m.op("ADD", [h, placed], (-1, 4, 6)), gamma, m.weight(6))
    h = layer_norm(m, m.op("TANH", [h], (-1, 4, 6)), gamma, None)
    h = m.op("SUB", [m.weight(4, 1), h], (-1, 4, 6))
    pooled = m.op("MEAN", [h, m.tensor((1,), [1], np.int32)], (-1, 6), keep_dims=False)
    out = m.op("FULLY_CONNECTED", [pooled, m.weight(3, 6), m.weight(3)], (-1, 3))
    return [x], [m.op("SOFTMAX", [out], (-1, 3))], (4, 6), "cce"


def _targets(loss: str, out_shape, n: int) -> np.ndarray:
    if loss == "cce":
        return np.eye(out_shape[-1], dtype=np.float32)[RNG.integers(0, out_shape[-1], n)]
    if loss == "sparse_cce":
        return RNG.integers(0, out_shape[-1], n).astype(np.float32)
    return RNG.uniform(0, 1, (n,) + tuple(out_shape[1:])).astype(np.float32)


@pytest.mark.parametrize("build", [conv_block, elementwise, shape_ops, logistic_head,
                                   mobile_activations, layout_ops, upsampling, landmarks,
                                   sequence_ops, attention, keras_parameters])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_rule_gradients_match_torch(build, reduction, tmp_path):
    m = GraphMaker()
    inputs, outputs, sample, loss = build(m)
    path = m.save(tmp_path / f"{build.__name__}.circle", inputs, outputs)
    x = RNG.normal(0, 1, (5,) + sample).astype(np.float32)
    t = _targets(loss, m.tensors[outputs[0]].shape, 5)
    check_gradients(path, tmp_path, x, t, loss, reduction)


def test_sign_bit_activation_is_refused_in_one_line(tmp_path):
    m = GraphMaker()
    x = m.tensor((-1, 4))
    a = m.op("FULLY_CONNECTED", [x, m.weight(3, 4)], (-1, 3), fused_activation_function=5)
    out = m.op("FULLY_CONNECTED", [a, m.weight(2, 3)], (-1, 2))
    path = m.save(tmp_path / "sign_bit.circle", [x], [out])
    with pytest.raises(UserError, match=r"operator 0 \(FULLY_CONNECTED\) has fused activation 5 "
                                        r"\(SIGN_BIT\), which has no gradient"):
        split(path, tmp_path, loss="mse")
    split(path, tmp_path, loss="mse", trainable="last:1")  # above it, training works


def test_a_landmark_matrix_on_the_gradient_path_is_refused_in_one_line(tmp_path):
    """MediaPipe's matrices come through Landmarks2TransformMatrix, which has no
    gradient: TransformLandmarks' gradient covers its landmarks only."""
    m = GraphMaker()
    x = m.tensor((-1, 16))
    a = m.op("FULLY_CONNECTED", [x, m.weight(16, 16)], (-1, 16))
    turn = m.op("RESHAPE", [a, m.tensor((3,), [-1, 4, 4], np.int32)], (-1, 4, 4))
    points = m.op("RESHAPE", [x, m.tensor((3,), [-1, 8, 2], np.int32)], (-1, 8, 2))
    moved = m.op("TransformLandmarks", [points, turn], (-1, 8, 2))
    m.ops[-1].version = 2
    out = m.op("FULLY_CONNECTED", [m.op("RESHAPE", [moved, m.tensor((2,), [-1, 16], np.int32)],
                                        (-1, 16)), m.weight(2, 16)], (-1, 2))
    path = m.save(tmp_path / "matrix.circle", [x], [out])
    with pytest.raises(UserError, match=r"operator 3 \(TransformLandmarks\): its transform matrix "
                                        r"\(input 1\) is on the gradient path, but only its "
                                        r"landmarks \(input 0\) have a gradient rule"):
        split(path, tmp_path, loss="mse")
    split(path, tmp_path, loss="mse", trainable="last:1")  # above it, training works


def test_slices_of_a_batch_of_one_take_the_whole_batch(tmp_path):
    """A model with a fixed batch of 1 slices [0:1] on the batch axis; split at any batch
    size keeps every sample (STRIDED_SLICE's end and SLICE's size become "to the end")."""
    m = GraphMaker()
    x = m.tensor((1, 6))
    a = m.op("FULLY_CONNECTED", [x, m.weight(8, 6), m.weight(8)], (1, 8))
    ints = lambda *v: m.tensor((len(v),), v, np.int32)  # noqa: E731
    b = m.op("STRIDED_SLICE", [a, ints(0, 1), ints(1, 7), ints(1, 2)], (1, 3))
    c = m.op("SLICE", [a, ints(0, 2), ints(1, 4)], (1, 4))
    joined = m.op("CONCATENATION", [b, c], (1, 7), axis=1)
    out = m.op("FULLY_CONNECTED", [joined, m.weight(3, 7), m.weight(3)], (1, 3))
    path = m.save(tmp_path / "batch_one.circle", [x], [out])
    x_data = RNG.normal(0, 1, (5, 6)).astype(np.float32)
    check_gradients(path, tmp_path, x_data, _targets("mse", (1, 3), 5), "mse")


def _trained_names(result) -> list[str]:
    return [t["name"] for t in result.trainable]


def test_parameters_of_elementwise_ops_train_as_keras_layers(tmp_path):
    """keras_parameters' constants train with `all` (the shared gamma as one copy per
    LayerNorm, the epsilon not); the bias added after the dense trains with it and
    freezes with --freeze-bias; `last:N` counts each parameter as a layer but for
    that bias, which belongs to its dense."""
    m = GraphMaker()
    inputs, outputs, _, _ = keras_parameters(m)
    path = m.save(tmp_path / "params.circle", inputs, outputs)
    named = {t.shape: t.name for t in m.tensors if t.data is not None}
    table, kernel, bias, gamma, beta, first, head, head_bias = (named[s] for s in (
        (1, 4, 6), (6, 6), (24,), (1, 1, 6), (6,), (4, 1), (3, 6), (3,)))
    assert _trained_names(split(path, tmp_path, loss="cce")) == [
        table, kernel, bias, f"{gamma}@op11", beta, f"{gamma}@op23", first, head, head_bias]
    frozen = _trained_names(split(path, tmp_path, loss="cce", freeze_bias=True))
    assert bias not in frozen and head_bias not in frozen and beta in frozen
    assert _trained_names(split(path, tmp_path, loss="cce", trainable="last:2")) == \
        [first, head, head_bias]
    assert _trained_names(split(path, tmp_path, loss="cce", trainable="last:6"))[:2] == \
        [kernel, bias]  # the dense and its bias: one layer


def test_a_constant_of_the_activations_shape_is_not_a_parameter(tmp_path):
    """A constant of an activation's own shape holds a sample's values (the zero initial
    state of a batch-1 LSTM, unrolled: the graph keeps its batch of 1): it stays constant,
    while the LSTM's bias, added after its two bias-less matmuls, trains with them."""
    trained = _trained_names(split(FIXTURES / "loops" / "lstm.tflite", tmp_path))
    assert [name.rsplit("/", 1)[-1] for name in trained] == [
        "MatMul_1", "MatMul", "ReadVariableOp", "MatMul1"]  # U, W, the cell's bias, dense
    assert len(_trained_names(split(FIXTURES / "loops" / "lstm.tflite", tmp_path,
                                    trainable="last:2"))) == 4  # the cell is one layer


def test_constants_of_one_samples_shape_are_data_but_for_added_tables(tmp_path):
    """In a batch-1 model a constant shaped like one sample's activations is data when it
    scales them (MediaPipe's constant matrix scales) or is all zeros (a loop's initial
    state); a non-zero table added to them (a position table) trains."""
    m = GraphMaker()
    x = m.tensor((1, 4))
    a = m.op("FULLY_CONNECTED", [x, m.weight(4, 4)], (1, 4))
    scaled = m.op("MUL", [a, m.tensor((1, 4), RNG.uniform(1, 2, (1, 4)))], (1, 4))
    placed = m.op("ADD", [scaled, m.tensor((1, 4), RNG.normal(0, 1, (1, 4)))], (1, 4))
    started = m.op("ADD", [placed, m.tensor((1, 4), np.zeros((1, 4)))], (1, 4))
    path = m.save(tmp_path / "sample_shaped.circle", [x], [started])
    trained = {t["name"] for t in split(path, tmp_path, loss="mse").trainable}
    assert trained == {m.tensors[t].name for t in (1, 5)}  # the kernel, the added table
