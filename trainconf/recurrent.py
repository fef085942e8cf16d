"""Fused recurrent operators, lowered at split into operators that train.

UNIDIRECTIONAL_SEQUENCE_LSTM, BIDIRECTIONAL_SEQUENCE_LSTM and UNIDIRECTIONAL_SEQUENCE_RNN
each hold a whole loop over time.  Rather than kernels and gradient rules of their own,
each is rewritten in the model as its cell's operators, unrolled over the static sequence
length; backpropagation through time then follows from the existing gradient rules (a
weight read at every step gets the sum of the steps' gradients).  The device never sees a
fused operator, and an exported model is the unrolled graph.

- Batch-major: the input projections of all steps are one FULLY_CONNECTED over [B, T, D]
  (keep_num_dims), SPLIT into steps of [B, 1, ...]; per step only the recurrence runs, and
  the outputs are joined by one CONCATENATION.  A time-major op goes through TRANSPOSEs.
- The gates' kernels are joined into one weight each, so one FULLY_CONNECTED computes every
  gate: NAME/input_kernel, NAME/bias and NAME/recurrent_kernel hold the rows of gates i, f,
  c, o (no i for CIFG).  A peephole is the weight of a 1x1 DEPTHWISE_CONV_2D over the cell
  viewed as [B, 1, 1, H] (NAME/peephole_i, _f, _o), whose bias is its gate's (NAME/bias_i,
  ...: LiteRT needs one, and the gate must not get two); such gates' input rows are
  NAME/peephole_gates_input_kernel, and come first in NAME/recurrent_kernel.  The
  projection is a FULLY_CONNECTED with the model's own weights.  NAME is the fused
  operator's output tensor's name (NAME/fw/..., NAME/bw/... for the two directions).
- The state inputs (variable tensors) are the zero state of every sample, Keras's stateless
  default: step 0 reads no state, so no operator reads them.
- A STRIDED_SLICE of one step of the joined output (a classifier's last step) reads that
  step instead (read_steps_directly).
"""
from dataclasses import dataclass

import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import enum_names, int_list
from microtrain.files.graph import Graph, Op, Tensor, graph_of

from .constants import drop_unread
from .gradients import FUSED_NAMES
from .operators import spec
from .writer import circle_operator, circle_tensor

FLOAT32 = np.dtype(np.float32)
LSTM_GATES = "ifco"
ACTIVATION_NAMES = enum_names(circle.ActivationFunctionType)
# LiteRT's LSTM kernels give NONE no meaning we could reproduce (not the identity)
LSTM_ACTIVATIONS = tuple(FUSED_NAMES)


def lower_recurrent(model) -> int:
    """Rewrite every fused recurrent operator of the first subgraph in place; returns
    how many there were."""
    g = graph_of(model)
    fused = [op for op in g.ops if spec(op.type).lowered]
    if not fused:
        return 0
    sg = model.subgraphs[0]
    written = {t for op in g.ops for t in op.outputs} | set(g.inputs)
    operators = []
    for op, original in zip(g.ops, sg.operators):
        if not spec(op.type).lowered:
            operators.append(original)
            continue
        b = _Builder(model, g, op, written)
        LOWERINGS[op.type](b, op)
        operators.extend(b.ops)
    sg.operators = operators
    drop_unread(model, {t for op in fused for t in op.inputs if t >= 0})
    read_steps_directly(model)
    return len(fused)


def read_steps_directly(model) -> int:
    """A STRIDED_SLICE that takes one whole step out of a CONCATENATION of steps (a
    lowered layer's output sequence, of which a classifier keeps the last step) becomes
    a RESHAPE of that step: no copy of the sequence forward, and in backprop no
    gradient of zeros sliced back into every step.  Returns how many were rewritten."""
    g = graph_of(model)
    producers, sg = g.producers(), model.subgraphs[0]
    picked, sources = {}, set()  # STRIDED_SLICE index -> the RESHAPE that replaces it
    for op in g.ops:
        source = producers.get(op.inputs[0]) if op.type == "STRIDED_SLICE" else None
        step = _picked_step(g, op, source) if source and source.type == "CONCATENATION" else None
        if step is not None:
            b = _Builder(model, g, op, set())
            b.op("RESHAPE", [step, b.ints([-1, *g.tensors[op.outputs[0]].shape[1:]], "shape")],
                 g.tensors[op.outputs[0]].shape, "", output=op.outputs[0])
            picked[op.index] = b.ops[0]
            sources.add(source.index)
    sg.operators = [picked.get(k, op) for k, op in enumerate(sg.operators)]
    read = {t for op in sg.operators for t in int_list(op.inputs)} | set(int_list(sg.outputs))
    sg.operators = [op for k, op in enumerate(sg.operators)
                    if k not in sources or any(t in read for t in int_list(op.outputs))]
    return len(picked)


def _picked_step(g: Graph, op: Op, concat: Op) -> int | None:
    """The input of `concat` (along its axis, each of size 1 there) that the
    STRIDED_SLICE `op` takes whole, shrinking that axis away; None otherwise."""
    x = g.tensors[op.inputs[0]].shape
    axis = concat.options.get("axis", 0) % len(x)
    begin, end, strides = (g.tensors[t].data for t in op.inputs[1:4])
    o = op.options
    if any(v is None for v in (begin, end, strides)) or o.get("ellipsis_mask", 0) or \
            o.get("new_axis_mask", 0) or o.get("shrink_axis_mask", 0) != 1 << axis or \
            any(g.tensors[t].shape[axis] != 1 for t in concat.inputs) or axis == 0:
        return None
    whole = all(s == 1 and (b == 0 or o.get("begin_mask", 0) >> k & 1)
                and (o.get("end_mask", 0) >> k & 1 or e >= d)
                for k, (b, e, s, d) in enumerate(zip(begin, end, strides, x)) if k != axis)
    return concat.inputs[int(begin[axis]) % x[axis]] if whole and strides[axis] == 1 else None


class _Builder:
    """Appends the tensors of one fused operator's lowering to the model and collects
    the operators that replace it."""

    def __init__(self, model, g: Graph, op: Op, written: set[int]):
        self.model, self.g, self.fused, self.written = model, g, op, written
        self.ops = []
        self.prefix = g.tensors[op.outputs[0]].name
        self.shapes: dict[int, tuple[int, ...]] = {}  # of the tensors added here

    def refuse(self, what: str) -> UserError:
        return UserError(None, f"operator {self.fused.index} ({self.fused.type}) {what}")

    def _add(self, name: str, shape, data=None) -> int:
        sg = self.model.subgraphs[0]
        dtype = FLOAT32 if data is None else data.dtype
        sg.tensors.append(circle_tensor(self.model, Tensor(len(sg.tensors), f"{self.prefix}/{name}",
                                                     tuple(shape), dtype, data)))
        self.shapes[len(sg.tensors) - 1] = tuple(shape)
        return len(sg.tensors) - 1

    def const(self, value: np.ndarray, name: str) -> int:
        return self._add(name, value.shape, value)

    def ints(self, values, name: str) -> int:
        return self.const(np.asarray(values, np.int32), name)

    def op_many(self, type_: str, inputs, shapes, names, outputs=None, **options) -> list[int]:
        """One operator; its outputs are new tensors, or the given `outputs`."""
        outs = outputs or [self._add(n, s) for n, s in zip(names, shapes)]
        self.ops.append(circle_operator(self.model, Op(0, type_, list(inputs), outs, options)))
        return outs

    def op(self, type_: str, inputs, shape, name: str, output=None, **options) -> int:
        return self.op_many(type_, inputs, [shape], [name],
                            None if output is None else [output], **options)[0]

    def shape(self, t: int) -> tuple[int, ...]:
        return self.shapes[t] if t in self.shapes else self.g.tensors[t].shape

    # -- what the fused operator reads

    def weight(self, t: int, what: str) -> np.ndarray | None:
        """A constant float32 input; None when absent (-1)."""
        if t < 0:
            return None
        data = self.g.tensors[t].data
        if data is None or t in self.written:
            raise self.refuse(f"reads its {what} from tensor {t}, which is not a constant: "
                              "only constant weights can be lowered")
        if data.dtype != FLOAT32:
            raise self.refuse(f"has {what} of type {data.dtype}: only float32 (or "
                              "dequantized) weights are supported")
        return data

    def zero_state(self, t: int) -> None:
        """Refuse a state input that is not the zero state."""
        data = self.g.tensors[t].data if t >= 0 else None
        if t in self.written or (data is not None and np.any(data)):
            raise self.refuse(f"starts from the state in tensor {t}: only the zero state "
                              "(a variable tensor) is supported")

    def sequence(self, x: int, time_major: bool) -> int:
        """The input as batch-major [B, T, D] (a TRANSPOSE when time-major)."""
        shape = self.shape(x)
        if len(shape) != 3 or self.g.tensors[x].dtype != FLOAT32:
            raise self.refuse(f"reads a {self.g.tensors[x].dtype} input of shape {list(shape)}: "
                              "a float32 sequence of rank 3 is supported")
        steps = shape[0] if time_major else shape[1]
        if steps < 1:
            raise self.refuse("has a sequence length only known at run time: only a static "
                              "length can be unrolled")
        if time_major:
            x = self.op("TRANSPOSE", [x, self.ints([1, 0, 2], "perm")],
                        (shape[1], shape[0], shape[2]), "batch_major")
        return x

    def output(self, steps: list[int], out: int, time_major: bool, name: str = "sequence",
               axis: int = 1) -> None:
        """Join tensors along `axis` of the batch-major sequence into the fused op's output."""
        shape = list(self.shape(steps[0]))
        shape[axis] = sum(self.shape(t)[axis] for t in steps)
        if not time_major:
            self.op("CONCATENATION", steps, shape, name, output=out, axis=axis)
            return
        joined = self.op("CONCATENATION", steps, shape, name, axis=axis)
        self.op("TRANSPOSE", [joined, self.ints([1, 0, 2], "perm")],
                (shape[1], shape[0], shape[2]), f"{name}/time_major", output=out)

    # -- building blocks

    def activation(self, x: int, code: int, name: str) -> int:
        """x through a fused activation code, as its own operator."""
        if code == 0:
            return x
        return self.op(FUSED_NAMES[code].upper(), [x], self.shape(x), name)

    def clip(self, x: int, limit: float, name: str) -> int:
        """x clamped to [-limit, limit] (a limit of 0 means no clipping)."""
        if limit <= 0:
            return x
        low = self.op("MINIMUM", [x, self.const(np.array([limit], FLOAT32), f"{name}/limit")],
                      self.shape(x), f"{name}/min")
        return self.op("MAXIMUM", [low, self.const(np.array([-limit], FLOAT32),
                                                   f"{name}/-limit")], self.shape(x), name)

    def fully_connected(self, x: int, w: int, bias: int | None, name: str) -> int:
        units = self.shape(w)[0]
        return self.op("FULLY_CONNECTED", [x, w, -1 if bias is None else bias],
                       self.shape(x)[:-1] + (units,), name, keep_num_dims=True)

    def split(self, x: int, axis: int, parts: int, name: str) -> list[int]:
        shape = list(self.shape(x))
        shape[axis] //= parts
        return self.op_many("SPLIT", [self.ints(axis, f"{name}/axis"), x], [shape] * parts,
                            [f"{name}{k}" for k in range(parts)], num_splits=parts)

    def projected_steps(self, x: int, groups: list[tuple], name: str) -> list[int]:
        """The input projections of every step: per (kernel name, kernel, bias name, bias)
        group one FULLY_CONNECTED over the whole sequence, joined on the feature axis and
        split into steps [B, 1, units]."""
        parts = [self.fully_connected(
            x, self.const(kernel, f"{name}{kernel_name}"),
            None if bias is None else self.const(bias, f"{name}{bias_name}"),
            f"{name}{kernel_name}/projection") for kernel_name, kernel, bias_name, bias in groups]
        xp = parts[0]
        if len(parts) > 1:
            shape = self.shape(xp)[:-1] + (sum(self.shape(p)[-1] for p in parts),)
            xp = self.op("CONCATENATION", parts, shape, f"{name}input_projection", axis=2)
        return self.split(xp, 1, self.shape(x)[1], f"{name}t")

    def fused_activation(self, options: dict, allowed=(0, *FUSED_NAMES)) -> int:
        code = options.get("fused_activation_function", 0)
        if code not in allowed:
            names = ", ".join(ACTIVATION_NAMES[c] for c in allowed)
            raise self.refuse(f"has fused activation {ACTIVATION_NAMES.get(code, code)}: "
                              f"{names} can be lowered")
        return code


# -- LSTM

@dataclass
class _LstmWeights:
    """One direction's inputs: per gate i, f, c, o (None where absent)."""
    input_kernels: list
    recurrent_kernels: list
    peepholes: dict  # gate -> [H] (i, f, o)
    biases: list
    projection: tuple[int, int]  # tensor indices of the projection kernel and bias (-1 absent)
    states: tuple[int, int]


def _lstm_weights(b: _Builder, inputs: list[int], first: int, states: tuple[int, int]):
    """The weights of a direction whose input-to-input kernel is input `first`: 4 input
    kernels, 4 recurrent kernels, 3 peepholes, 4 biases, the projection kernel and bias."""
    at = lambda k: inputs[first + k] if first + k < len(inputs) else -1  # noqa: E731
    read = lambda k, what: b.weight(at(k), what)  # noqa: E731
    return _LstmWeights(
        [read(k, f"input-to-{gate} weights") for k, gate in enumerate(LSTM_GATES)],
        [read(4 + k, f"recurrent-to-{gate} weights") for k, gate in enumerate(LSTM_GATES)],
        {gate: w for k, gate in enumerate("ifo")
         if (w := read(8 + k, f"cell-to-{gate} weights")) is not None},
        [read(11 + k, f"{gate} gate bias") for k, gate in enumerate(LSTM_GATES)],
        (at(15), at(16)), states)


def _lstm_direction(b: _Builder, x: int, w: _LstmWeights, options: dict, reverse: bool,
                    name: str) -> list[int]:
    """The outputs [B, 1, units] of every step of one direction, in time order.  A gate with
    a peephole has its bias in its peephole's DEPTHWISE_CONV_2D (LiteRT's needs one), so its
    input projection is a FULLY_CONNECTED without bias, and its rows come first."""
    for t in w.states:
        b.zero_state(t)
    cifg = w.input_kernels[0] is None
    gates = LSTM_GATES[1:] if cifg else LSTM_GATES
    use = {gate: LSTM_GATES.index(gate) for gate in gates}
    if any(w.input_kernels[k] is None or w.recurrent_kernels[k] is None for k in use.values()) \
            or (cifg and "i" in w.peepholes):
        raise b.refuse("lacks a gate's weights (only the input gate may be absent: CIFG)")
    cells = w.recurrent_kernels[use["c"]].shape[0]
    bias = {g: w.biases[k] if w.biases[k] is not None else np.zeros(cells, FLOAT32)
            for g, k in use.items()}
    peeped = [g for g in gates if g in w.peepholes]
    plain = [g for g in gates if g not in peeped]
    kernels = lambda group: np.concatenate([w.input_kernels[use[g]] for g in group])  # noqa: E731
    groups = [("peephole_gates_input_kernel", kernels(peeped), None, None)] if peeped else []
    groups.append(("input_kernel", kernels(plain), "bias",
                   np.concatenate([bias[g] for g in plain])))
    steps = b.projected_steps(x, groups, name)
    order = peeped + plain  # the gates' rows in the projections and the recurrent kernel
    recurrent = b.const(np.concatenate([w.recurrent_kernels[use[g]] for g in order]),
                        f"{name}recurrent_kernel")
    peepholes = {g: (b.const(w.peepholes[g].reshape(1, 1, 1, -1), f"{name}peephole_{g}"),
                     b.const(bias[g], f"{name}bias_{g}")) for g in peeped}
    code = b.fused_activation(options, LSTM_ACTIVATIONS)
    kernel, projection_bias = w.projection
    if kernel >= 0:
        b.weight(kernel, "projection weights")
        b.weight(projection_bias, "projection bias")
    h = c = None
    outputs = [None] * len(steps)
    for t in range(len(steps) - 1, -1, -1) if reverse else range(len(steps)):
        at = f"{name}t{t}/"
        z = steps[t] if h is None else \
            b.op("ADD", [steps[t], b.fully_connected(h, recurrent, None, f"{at}recurrent")],
                 b.shape(steps[t]), f"{at}gates")
        raw = dict(zip(order, b.split(z, 2, len(order), f"{at}gate")))
        c = _lstm_cell(b, raw, c, peepholes, code, options.get("cell_clip", 0.0), at)
        o = b.op("LOGISTIC", [_peephole(b, raw["o"], c, peepholes.get("o"), f"{at}o")],
                 b.shape(c), f"{at}output_gate")
        h = b.op("MUL", [o, b.activation(c, code, f"{at}cell_activation")], b.shape(c),
                 f"{at}hidden")
        if kernel >= 0:
            h = b.clip(b.fully_connected(h, kernel, projection_bias if projection_bias >= 0
                                         else None, f"{at}projection"),
                       options.get("proj_clip", 0.0), f"{at}projection_clip")
        outputs[t] = h
    return outputs


def _lstm_cell(b: _Builder, raw: dict, c: int | None, peepholes: dict, code: int, clip: float,
               at: str) -> int:
    """The new cell state f·c + i·g (CIFG: i = 1 - f), clipped; c None is the zero state."""
    shape = b.shape(raw["c"])
    forget = None
    if c is not None or "i" not in raw:
        forget = b.op("LOGISTIC", [_peephole(b, raw["f"], c, peepholes.get("f"), f"{at}f")],
                      shape, f"{at}forget_gate")
    if "i" in raw:
        gate = b.op("LOGISTIC", [_peephole(b, raw["i"], c, peepholes.get("i"), f"{at}i")],
                    shape, f"{at}input_gate")
    else:
        gate = b.op("SUB", [b.const(np.ones(1, FLOAT32), f"{at}one"), forget], shape,
                    f"{at}input_gate")
    new = b.op("MUL", [gate, b.activation(raw["c"], code, f"{at}candidate")], shape,
               f"{at}new_cell")
    if c is not None:
        new = b.op("ADD", [b.op("MUL", [forget, c], shape, f"{at}kept_cell"), new], shape,
                   f"{at}cell_sum")
    return b.clip(new, clip, f"{at}cell")


def _peephole(b: _Builder, raw: int, c: int | None, peephole: tuple | None, name: str) -> int:
    """raw + weight ⊙ c + bias for a gate with a peephole (weight, bias): a 1x1
    DEPTHWISE_CONV_2D over c viewed as [B, 1, 1, H]; raw + bias from the zero state."""
    if peephole is None:
        return raw
    weight, bias = peephole
    shape = b.shape(raw)
    if c is None:
        return b.op("ADD", [raw, bias], shape, f"{name}/with_bias")
    view = (shape[0], 1, 1, shape[-1])
    c4 = b.op("RESHAPE", [c, b.ints([-1, 1, 1, shape[-1]], f"{name}/shape4")], view,
              f"{name}/cell4")
    product = b.op("DEPTHWISE_CONV_2D", [c4, weight, bias], view, f"{name}/peephole4",
                   padding=1, stride_w=1, stride_h=1, depth_multiplier=1, dilation_w_factor=1,
                   dilation_h_factor=1)
    back = b.op("RESHAPE", [product, b.ints([-1, 1, shape[-1]], f"{name}/shape3")], shape,
                f"{name}/peephole")
    return b.op("ADD", [raw, back], shape, f"{name}/with_peephole")


def _check_lstm_options(b: _Builder, options: dict) -> None:
    if options.get("diagonal_recurrent_tensors"):
        raise b.refuse("has diagonal recurrent weights: not supported")


def unidirectional_lstm(b: _Builder, op: Op) -> None:
    _check_lstm_options(b, op.options)
    if any(t >= 0 for t in op.inputs[20:24]):
        raise b.refuse("has layer normalization coefficients: not supported")
    time_major = bool(op.options.get("time_major", False))
    x = b.sequence(op.inputs[0], time_major)
    weights = _lstm_weights(b, op.inputs, 1, (op.inputs[18], op.inputs[19]))
    steps = _lstm_direction(b, x, weights, op.options, False, "")
    b.output(steps, op.outputs[0], time_major)


def bidirectional_lstm(b: _Builder, op: Op) -> None:
    _check_lstm_options(b, op.options)
    if any(t >= 0 for t in op.inputs[39:48]):
        raise b.refuse("has an auxiliary input: not supported")
    time_major = bool(op.options.get("time_major", True))
    x = b.sequence(op.inputs[0], time_major)
    fw = _lstm_direction(b, x, _lstm_weights(b, op.inputs, 1, (op.inputs[35], op.inputs[36])),
                         op.options, False, "fw/")
    bw = _lstm_direction(b, x, _lstm_weights(b, op.inputs, 18, (op.inputs[37], op.inputs[38])),
                         op.options, True, "bw/")
    if op.options.get("merge_outputs", False):
        # per step [fw, bw] on the feature axis, then the steps along time
        b.output([b.op("CONCATENATION", [f, r], b.shape(f)[:2] + (b.shape(f)[2] + b.shape(r)[2],),
                       f"t{t}/merged", axis=2) for t, (f, r) in enumerate(zip(fw, bw))],
                 op.outputs[0], time_major)
    else:
        b.output(fw, op.outputs[0], time_major, "fw/sequence")
        b.output(bw, op.outputs[1], time_major, "bw/sequence")


# -- RNN

def unidirectional_rnn(b: _Builder, op: Op) -> None:
    """h_t = act(W x_t + R h_{t-1} + b)."""
    time_major = bool(op.options.get("time_major", False))
    code = b.fused_activation(op.options)
    x = b.sequence(op.inputs[0], time_major)
    kernel, recurrent, bias = (b.weight(t, what) for t, what in zip(
        op.inputs[1:4], ("input weights", "recurrent weights", "bias")))
    if kernel is None or recurrent is None:
        raise b.refuse("lacks its input or recurrent weights")
    b.zero_state(op.inputs[4] if len(op.inputs) > 4 else -1)
    bias = np.zeros(kernel.shape[0], FLOAT32) if bias is None else bias
    steps = b.projected_steps(x, [("input_kernel", kernel, "bias", bias)], "")
    recurrent = b.const(recurrent, "recurrent_kernel")
    h, outputs = None, []
    for t, step in enumerate(steps):
        if h is not None:  # an activation op after the ADD: LiteRT's ADD fuses no TANH
            step = b.op("ADD", [step, b.fully_connected(h, recurrent, None, f"t{t}/recurrent")],
                        b.shape(step), f"t{t}/sum")
        h = b.activation(step, code, f"t{t}/hidden")
        outputs.append(h)
    b.output(outputs, op.outputs[0], time_major)


LOWERINGS = {"UNIDIRECTIONAL_SEQUENCE_LSTM": unidirectional_lstm,
             "BIDIRECTIONAL_SEQUENCE_LSTM": bidirectional_lstm,
             "UNIDIRECTIONAL_SEQUENCE_RNN": unidirectional_rnn}
