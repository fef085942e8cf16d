"""An independent reference: run a circle forward graph in PyTorch (float64) and let
autograd compute the loss gradients.  Shares nothing with trainconf's gradient rules."""
import numpy as np
import torch
import torch.nn.functional as F

from microtrain.files.graph import Graph

ACT = {0: lambda x: x, 1: torch.relu, 2: lambda x: x.clamp(-1, 1), 3: lambda x: x.clamp(0, 6),
       4: torch.tanh}


def _same_pad(size, k, stride, dilation):
    out = -(-size // stride)
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def _pad_nchw(x, o, kh, kw, value=0.0):
    if o.get("padding", 1) != 0:
        return x
    top, bottom = _same_pad(x.shape[2], kh, o.get("stride_h", 1), o.get("dilation_h_factor", 1))
    left, right = _same_pad(x.shape[3], kw, o.get("stride_w", 1), o.get("dilation_w_factor", 1))
    return F.pad(x, (left, right, top, bottom), value=value)


def _conv(x, w, b, o, groups=1):
    x = x.permute(0, 3, 1, 2)
    x = _pad_nchw(x, o, w.shape[2], w.shape[3])
    y = F.conv2d(x, w, b, stride=(o["stride_h"], o["stride_w"]),
                 dilation=(o.get("dilation_h_factor", 1), o.get("dilation_w_factor", 1)), groups=groups)
    return y.permute(0, 2, 3, 1)


def conv_2d(x, w, b, o):
    return _conv(x, w.permute(0, 3, 1, 2), b, o)


def depthwise(x, w, b, o):
    channels = x.shape[-1]
    return _conv(x, w[0].permute(2, 0, 1).unsqueeze(1), b, o, groups=channels)


def pool(x, o, kind):
    kh, kw = o["filter_height"], o["filter_width"]
    x = x.permute(0, 3, 1, 2)
    stride = (o["stride_h"], o["stride_w"])
    if kind == "max":
        y = F.max_pool2d(_pad_nchw(x, o, kh, kw, -float("inf")), (kh, kw), stride)
    else:
        ones = _pad_nchw(torch.ones_like(x[:1, :1]), o, kh, kw)
        total = F.avg_pool2d(_pad_nchw(x, o, kh, kw), (kh, kw), stride, divisor_override=1)
        y = total / F.avg_pool2d(ones, (kh, kw), stride, divisor_override=1)
    return y.permute(0, 2, 3, 1)


def _tracked_scales(w, axis: int, qmax: int):
    """Each channel's max|w|/qmax (0: 1), as a constant: no gradient flows into it."""
    peak = w.detach().abs().amax(dim=[d for d in range(w.dim()) if d != axis])
    return torch.where(peak > 0, peak / qmax, torch.ones_like(peak)).float()


def _mirror_pad(x, paddings, mode):
    """Mirror padding as a gather of x's elements by numpy's padded index."""
    index = np.pad(np.arange(int(np.prod(x.shape[1:]))).reshape(x.shape[1:]), paddings[1:],
                   mode=("reflect", "symmetric")[mode])
    return x.reshape(x.shape[0], -1)[:, torch.tensor(index.reshape(-1))].reshape(-1, *index.shape)


def _depth_space(x, b, to_space):
    """TFLite's DEPTH_TO_SPACE (channel (i·b+j)·C + c goes to pixel offset (i, j)) or its inverse."""
    n, h, w, c = x.shape
    if to_space:
        return x.reshape(n, h, w, b, b, c // (b * b)).permute(0, 1, 3, 2, 4, 5).reshape(
            n, h * b, w * b, c // (b * b))
    return x.reshape(n, h // b, b, w // b, b, c).permute(0, 1, 3, 2, 4, 5).reshape(
        n, h // b, w // b, b * b * c)


def _slices(op, g):
    """SLICE, or STRIDED_SLICE with positive strides, begin/end/shrink masks only."""
    data = [g.tensors[t].data.reshape(-1).tolist() for t in op.inputs[1:]]
    if op.type == "SLICE":
        return tuple(slice(b, None if s == -1 else b + s) for b, s in zip(*data))
    o, index = op.options, []
    for i, (b, e, s) in enumerate(zip(*data)):
        if o.get("shrink_axis_mask", 0) >> i & 1:
            index.append(b)
        else:
            index.append(slice(None if o.get("begin_mask", 0) >> i & 1 else b,
                               None if o.get("end_mask", 0) >> i & 1 else e, s))
    return tuple(index)


def _resize(x, size, kind, o):
    """TFLite's resizes in the forms PyTorch has: bilinear with align_corners or
    half_pixel_centers; nearest floor(i·scale) or (half_pixel_centers) floor((i+½)·scale)."""
    nchw = x.permute(0, 3, 1, 2)
    if kind == "RESIZE_BILINEAR":
        if not (o.get("align_corners") or o.get("half_pixel_centers")):
            raise NotImplementedError("TFLite's legacy bilinear sampling")
        y = F.interpolate(nchw, size=tuple(size), mode="bilinear",
                          align_corners=bool(o.get("align_corners")))
    else:
        if o.get("align_corners"):
            raise NotImplementedError("nearest neighbour with align_corners")
        mode = "nearest-exact" if o.get("half_pixel_centers") else "nearest"
        y = F.interpolate(nchw, size=tuple(size), mode=mode)
    return y.permute(0, 2, 3, 1)


def transpose_conv(x, w, b, size, o):
    """TFLite's transposed convolution: torch's full output (W [O, KH, KW, I] as
    [I, O, KH, KW]) cropped to `size` from the top-left padding of the
    convolution y -> x with TFLite's SAME/VALID rule."""
    stride = (o["stride_h"], o["stride_w"])
    full = F.conv_transpose2d(x.permute(0, 3, 1, 2), w.permute(3, 0, 1, 2), stride=stride)
    tops = []
    for n, k, s in zip(size, w.shape[1:3], stride):
        out = -(-n // s) if o.get("padding", 0) == 0 else -(-(n - k + 1) // s)
        tops.append(max((out - 1) * s + k - n, 0) // 2)
    y = full[:, :, tops[0]:tops[0] + size[0], tops[1]:tops[1] + size[1]]
    y = F.pad(y, (0, size[1] - y.shape[3], 0, size[0] - y.shape[2]))  # rows no tap reaches
    return y.permute(0, 2, 3, 1) + (0 if b is None else b)


def _operand(value, t: int, g: Graph):
    """A computed value, or a constant of any type read from the graph."""
    return torch.tensor(g.tensors[t].data) if value is None else value


def run_op(op, v, g: Graph):
    x = [v.get(i) for i in op.inputs]  # integer constants are read from the graph
    o = op.options
    act = ACT[o.get("fused_activation_function", 0)]
    t = op.type
    if t == "FULLY_CONNECTED":
        flat = x[0].reshape(-1, x[1].shape[1])
        y = flat @ x[1].T + (x[2] if len(x) > 2 and x[2] is not None else 0)
        return act(y.reshape(*x[0].shape[:-1], -1) if o.get("keep_num_dims") else y)
    if t == "CONV_2D":
        return act(conv_2d(x[0], x[1], x[2], o))
    if t == "DEPTHWISE_CONV_2D":
        return act(depthwise(x[0], x[1], x[2], o))
    if t in ("MAX_POOL_2D", "AVERAGE_POOL_2D"):
        return act(pool(x[0], o, "max" if t == "MAX_POOL_2D" else "avg"))
    if t == "MEAN":
        axes = [int(a) for a in np.atleast_1d(g.tensors[op.inputs[1]].data)]
        return x[0].mean(dim=axes, keepdim=bool(o.get("keep_dims")))
    if t in ("RESHAPE", "SQUEEZE", "EXPAND_DIMS"):
        return x[0].reshape(-1, *g.tensors[op.outputs[0]].shape[1:])
    if t == "SOFTMAX":
        return torch.softmax(x[0] * o.get("beta", 1.0), dim=-1)
    simple = {"RELU": torch.relu, "RELU6": lambda a: a.clamp(0, 6), "TANH": torch.tanh,
              "LOGISTIC": torch.sigmoid, "LEAKY_RELU": lambda a: F.leaky_relu(a, o.get("alpha", 0.2)),
              "HARD_SWISH": F.hardswish, "ELU": F.elu, "EXP": torch.exp, "LOG": torch.log,
              "SQRT": torch.sqrt, "RSQRT": torch.rsqrt, "SQUARE": torch.square,
              "GELU": lambda a: F.gelu(a, approximate="tanh" if o.get("approximate") else "none"),
              "LOG_SOFTMAX": lambda a: torch.log_softmax(a, dim=-1)}
    if t in simple:
        return simple[t](x[0])
    if t == "PRELU":
        return torch.where(x[0] >= 0, x[0], x[1] * x[0])
    if t == "FAKE_QUANT":  # TensorFlow's nudged range: 0.0 is a level
        low, high = int(o.get("narrow_range", False)), (1 << o.get("num_bits", 8)) - 1
        scale = (o["max"] - o["min"]) / (high - low)
        zero = int(min(max(round(low - o["min"] / scale), low), high))
        return torch.fake_quantize_per_tensor_affine(x[0], scale, zero, low, high)
    if t == "FakeQuantPerChannel":  # symmetric, zero point 0
        qmax = (1 << (o.get("num_bits", 8) - 1)) - 1
        scales = torch.tensor(g.tensors[op.inputs[1]].data, dtype=torch.float32) \
            if len(op.inputs) > 1 else _tracked_scales(x[0], o["axis"], qmax)
        return torch.fake_quantize_per_channel_affine(
            x[0], scales, torch.zeros(len(scales), dtype=torch.int32), o["axis"], -qmax, qmax)
    binary = {"ADD": torch.add, "SUB": torch.sub, "MUL": torch.mul, "DIV": torch.div,
              "MAXIMUM": torch.maximum, "MINIMUM": torch.minimum,
              "SQUARED_DIFFERENCE": lambda a, b: (a - b) ** 2}
    if t in binary:
        return act(binary[t](x[0], x[1]))
    if t == "CONCATENATION":
        return act(torch.cat(x, dim=o.get("axis", 0)))
    if t == "PAD":
        pads = g.tensors[op.inputs[1]].data
        return F.pad(x[0], tuple(int(p) for pair in pads[::-1] for p in pair))
    if t in ("PADV2", "MIRROR_PAD"):
        pads = tuple(int(p) for pair in g.tensors[op.inputs[1]].data[::-1] for p in pair)
        if t == "PADV2":
            return F.pad(x[0], pads, value=float(g.tensors[op.inputs[2]].data.reshape(-1)[0]))
        return _mirror_pad(x[0], g.tensors[op.inputs[1]].data, o.get("mode", 0))
    if t in ("DEPTH_TO_SPACE", "SPACE_TO_DEPTH"):
        return _depth_space(x[0], o["block_size"], t == "DEPTH_TO_SPACE")
    if t in ("STRIDED_SLICE", "SLICE"):
        return x[0][_slices(op, g)]
    if t in ("SPLIT", "SPLIT_V"):
        data, axis = (x[1], op.inputs[0]) if t == "SPLIT" else (x[0], op.inputs[2])
        axis = int(g.tensors[axis].data.reshape(-1)[0])
        return torch.split(data, [g.tensors[u].shape[axis] for u in op.outputs], dim=axis)
    if t in ("GATHER", "EMBEDDING_LOOKUP"):
        table_at, ids_at = (0, 1) if t == "GATHER" else (1, 0)
        const = g.tensors[op.inputs[ids_at]].data  # constant indices, or computed ids
        index = torch.tensor(const.astype(np.int64)) if const is not None else x[ids_at].long()
        axis = o.get("axis", 0) % x[table_at].ndim
        y = torch.index_select(x[table_at], axis, index.reshape(-1))
        return y.reshape(x[table_at].shape[:axis] + index.shape + x[table_at].shape[axis + 1:])
    if t in ("SUM", "REDUCE_MAX"):
        axes = [int(a) for a in np.atleast_1d(g.tensors[op.inputs[1]].data)]
        reduce = torch.sum if t == "SUM" else torch.amax
        return reduce(x[0], dim=axes, keepdim=bool(o.get("keep_dims")))
    if t == "L2_NORMALIZATION":
        return act(x[0] / x[0].norm(dim=-1, keepdim=True).clamp_min(1e-6))
    if t in ("RESIZE_BILINEAR", "RESIZE_NEAREST_NEIGHBOR"):
        return _resize(x[0], g.tensors[op.outputs[0]].shape[1:3], t, o)
    if t in ("TRANSPOSE_CONV", "Convolution2DTransposeBias"):
        data, bias = (x[2], x[3] if len(x) > 3 else None) if t == "TRANSPOSE_CONV" else (x[0], x[2])
        return act(transpose_conv(data, x[1], bias, g.tensors[op.outputs[0]].shape[1:3], o))
    if t == "TRANSPOSE":
        return x[0].permute(*[int(p) for p in g.tensors[op.inputs[1]].data])
    if t == "BATCH_MATMUL":
        a = x[0].transpose(-1, -2) if o.get("adj_x") else x[0]
        b = x[1].transpose(-1, -2) if o.get("adj_y") else x[1]
        return a @ b
    compare = {"LESS": torch.lt, "LESS_EQUAL": torch.le, "GREATER": torch.gt,
               "GREATER_EQUAL": torch.ge, "EQUAL": torch.eq, "NOT_EQUAL": torch.ne,
               "LOGICAL_AND": torch.logical_and, "LOGICAL_OR": torch.logical_or}
    if t in compare:
        return compare[t](*(_operand(x[i], op.inputs[i], g) for i in (0, 1)))
    if t in ("SELECT", "SELECT_V2"):
        cond = x[0]
        if t == "SELECT" and cond.dim() == 1:
            cond = cond.reshape(-1, *[1] * (x[1].dim() - 1))
        return torch.where(cond, x[1], x[2])
    if t == "NEG":
        return -x[0]
    if t == "CAST":  # float to float keeps float64 here; to ints and back is constant
        dtype = g.tensors[op.outputs[0]].dtype
        return x[0] if np.issubdtype(dtype, np.floating) else \
            x[0].to(torch.bool if dtype == np.bool_ else torch.int64)
    if t == "REVERSE_V2":
        return torch.flip(x[0], [int(a) for a in g.tensors[op.inputs[1]].data.reshape(-1)])
    if t == "BROADCAST_TO":
        batch = x[0].shape[0]  # a symbolic batch in the shape is x's own
        return x[0].broadcast_to([batch if d == -1 else d for d in g.tensors[op.outputs[0]].shape])
    if t == "TILE":
        return x[0].repeat(*[int(m) for m in g.tensors[op.inputs[1]].data.reshape(-1)])
    if t == "REDUCE_PROD":
        y = x[0]
        for a in sorted((int(a) % y.dim() for a in np.atleast_1d(g.tensors[op.inputs[1]].data)),
                        reverse=True):
            y = y.prod(dim=a, keepdim=bool(o.get("keep_dims")))
        return y
    if t == "CUMSUM":
        axis = int(g.tensors[op.inputs[1]].data.reshape(-1)[0])
        y = x[0].flip(axis) if o.get("reverse") else x[0]
        y = y.cumsum(axis) - (y if o.get("exclusive") else 0)
        return y.flip(axis) if o.get("reverse") else y
    if t in ("ARG_MAX", "ARG_MIN"):
        pick = torch.argmax if t == "ARG_MAX" else torch.argmin
        return pick(x[0], dim=int(g.tensors[op.inputs[1]].data.reshape(-1)[0]))
    if t == "ONE_HOT":
        on, off = (float(g.tensors[i].data) for i in op.inputs[2:4])
        hot = F.one_hot(x[0].long(), int(g.tensors[op.inputs[1]].data)).to(torch.float64)
        return hot * (on - off) + off
    if t == "TransformLandmarks":  # MediaPipe's: (x, y) moved by the matrix's first two rows
        m = x[1]
        moved = x[0][..., :2] @ m[:, :2, :2].transpose(1, 2) + m[:, None, :2, 3]
        return torch.cat([moved, x[0][..., 2:]], -1)
    raise NotImplementedError(t)


def keras_loss(y, logits, t, loss: str, final: str | None):
    """Keras 3's per-sample losses; from logits where Keras uses them (softmax/sigmoid outputs)."""
    if loss in ("cce", "sparse_cce"):
        if loss == "sparse_cce":
            t = F.one_hot(t.long().reshape(-1), y.shape[-1]).to(y.dtype)
        if final == "SOFTMAX":
            return -(t * torch.log_softmax(logits, dim=-1)).sum(-1)
        p = (y / y.sum(-1, keepdim=True)).clamp(1e-7, 1 - 1e-7)
        return -(t * torch.log(p)).sum(-1)
    if loss == "bce":
        if final == "LOGISTIC":
            return F.binary_cross_entropy_with_logits(logits, t, reduction="none").mean(-1)
        p = y.clamp(1e-7, 1 - 1e-7)
        return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean(-1)
    if loss == "mse":
        return ((y - t) ** 2).mean(-1)
    return (y - t).abs().mean(-1)


def reference_gradients(g: Graph, weights: dict[int, np.ndarray], inputs, target,
                        loss: str, reduction: str = "mean"):
    """(loss, {tensor: gradient}) in float64 for the trainable `weights`."""
    v = {t.index: torch.tensor(np.asarray(t.data, np.float64)) for t in g.tensors
         if t.data is not None and np.issubdtype(t.data.dtype, np.floating)}
    params = {i: torch.tensor(np.asarray(w, np.float64), requires_grad=True) for i, w in weights.items()}
    v.update(params)
    for i, x in zip(g.inputs, inputs):
        v[i] = torch.tensor(np.asarray(x, np.float64))
    last = {}
    for op in g.ops:
        y = run_op(op, v, g)
        for t, value in zip(op.outputs, y if isinstance(y, tuple) else (y,)):
            v[t] = value
            last[t] = op
    out = g.outputs[0]
    final = last[out].type if last[out].type in ("SOFTMAX", "LOGISTIC") else None
    logits = v[last[out].inputs[0]] if final else None
    if final == "SOFTMAX":
        logits = logits * last[out].options.get("beta", 1.0)
    per_sample = keras_loss(v[out], logits, torch.tensor(np.asarray(target, np.float64)), loss, final)
    total = per_sample.sum() / (per_sample.shape[0] if reduction == "mean" else 1)
    total.backward()
    return float(total.detach()), {i: p.grad.numpy() for i, p in params.items()}

