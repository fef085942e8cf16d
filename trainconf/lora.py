"""Low-rank adapters (LoRA, Hu et al. 2021): `trainconf split --lora RANK`.

Each adapted operator y = OP(x, W) becomes

    y = OP(x, W) + MUL(B(A(x)), alpha/r)

where A and B are new FULLY_CONNECTED (CONV_2D for a convolution, the lookup
itself for an embedding table) weights, so the gradients, kernels and memory
plan of existing weighted operators serve them: W stays a constant of the
frozen model, only A and B train, and W + (alpha/r)·B·A is never formed.  The
operator's fused activation moves to the ADD.  B starts at zero, so the first
outputs equal the original model's bit for bit; A is Kaiming-uniform as torch
and PEFT initialise it (bound 1/sqrt(fan_in)); an embedding's A starts at zero
and its B normal, as PEFT does.  `merge` folds the adapters back into W
(`trainconf export --lora merge`).
"""
from dataclasses import dataclass

import numpy as np

from microtrain.files.contracts import Adapter, Adapters
from microtrain.files.errors import UserError
from microtrain.files.format.model import get_metadata, set_metadata
from microtrain.files.graph import Graph, Op, graph_of

from .portable import Editor
from .select import select_trainable
from .writer import set_constant

ADAPTED = ("FULLY_CONNECTED", "BATCH_MATMUL", "CONV_2D", "GATHER", "EMBEDDING_LOOKUP")
FLOAT32 = np.dtype(np.float32)


@dataclass
class LoraSpec:
    """What `--lora`, `--lora-alpha`, `--lora-targets` and `--seed` ask for."""
    rank: int
    alpha: float | None = None  # None: the rank (a scale of 1)
    targets: str = "all"  # a --trainable style spec of the operators to adapt
    seed: int = 0

    def scale(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


def _constant_weight(g: Graph, op: Op) -> int | None:
    """The frozen weight an adapter can sit beside, None when `op` has none."""
    position = {"FULLY_CONNECTED": 1, "BATCH_MATMUL": 1, "CONV_2D": 1, "GATHER": 0,
                "EMBEDDING_LOOKUP": 1}.get(op.type)
    if position is None or position >= len(op.inputs):
        return None
    w = g.tensors[op.inputs[position]]
    if w.data is None or w.data.dtype != FLOAT32:
        return None
    if op.type == "BATCH_MATMUL" and (w.data.ndim != 2 or op.options.get("adj_x")
                                      or g.tensors[op.inputs[0]].data is not None):
        return None
    if op.type == "GATHER" and (op.options.get("axis", 0) != 0 or op.options.get("batch_dims", 0)
                                or w.data.ndim != 2):
        return None
    return w.index


def adaptable(g: Graph, spec: str) -> list[Op]:
    """The operators `spec` selects that can take an adapter, in execution order:
    all, last:N or names as --trainable chooses, and operator types (e.g.
    FULLY_CONNECTED,CONV_2D: every such operator)."""
    weights = {_constant_weight(g, op): op for op in g.ops if op.type in ADAPTED}
    weights.pop(None, None)
    items = [s.strip() for s in spec.split(",") if s.strip()]
    chosen = [t for t, op in weights.items() if spec == "all" or op.type in items]
    rest = ",".join(s for s in items if s not in ADAPTED)
    if rest and spec != "all":
        try:
            chosen += [t for t in select_trainable(g, rest, freeze_bias=True) if t in weights]
        except UserError as e:  # chosen as --trainable chooses, but named as given
            raise UserError(None, e.problem.replace("--trainable", "--lora-targets")) from None
    ops = sorted({weights[t].index: weights[t] for t in chosen}.values(), key=lambda op: op.index)
    if not ops:
        raise UserError(None, f"--lora-targets {spec!r}: no {', '.join(ADAPTED)} operator with a "
                              "constant float32 weight to adapt", "--lora-targets")
    return ops


def _initial_pair(op: Op, w: np.ndarray, r: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A and B for `op`'s weight w: A Kaiming-uniform and B zero, as torch and PEFT
    initialise them (an embedding: A zero and B normal, as PEFT does)."""
    if op.type == "FULLY_CONNECTED":  # W [out, in]
        a_shape, b_shape = (r, w.shape[1]), (w.shape[0], r)
    elif op.type == "BATCH_MATMUL":  # x @ W, W [in, out] (adj_y: [out, in])
        out, inp = w.shape if op.options.get("adj_y") else w.shape[::-1]
        a_shape, b_shape = (r, inp), (out, r)
    elif op.type == "CONV_2D":  # W [out, kh, kw, in]
        a_shape, b_shape = (r,) + w.shape[1:], (w.shape[0], 1, 1, r)
    else:  # an embedding table [rows, dim]
        return np.zeros((w.shape[0], r), FLOAT32), \
            rng.standard_normal((w.shape[1], r)).astype(FLOAT32)
    # kaiming_uniform_(a=sqrt(5)): bound = gain·sqrt(3/fan_in), gain = sqrt(2/(1+a²)) = sqrt(1/3)
    bound = 1 / np.sqrt(np.prod(a_shape[1:]))
    return rng.uniform(-bound, bound, a_shape).astype(FLOAT32), np.zeros(b_shape, FLOAT32)


def add_adapters(model, g: Graph, lora: LoraSpec, batch: int) -> tuple[Graph, list[int]]:
    """Give the chosen operators of the prepared model adapters, record them in
    its `microtrain.lora` metadata; returns the new graph and the adapter weights."""
    if lora.rank < 1:
        raise UserError(None, f"--lora {lora.rank}: the rank must be at least 1", "--lora")
    targets = {op.index: op for op in adaptable(g, lora.targets)}
    rng = np.random.default_rng(lora.seed)
    edit = Editor(model, g, batch)
    records = []
    for op, original in zip(list(g.ops), model.subgraphs[0].operators):
        edit.ops.append(original)
        if op.index in targets:
            records.append(_adapt(edit, op, original, lora, rng))
    model.subgraphs[0].operators = edit.ops
    meta = Adapters(version=Adapters.VERSION, rank=lora.rank, alpha=float(lora.rank * lora.scale()),
                    adapters=records)
    set_metadata(model, Adapters.NAME, meta.to_json())
    return graph_of(model), [t for r in records for t in (r.a, r.b)]


def _adapt(edit: Editor, op: Op, original, lora: LoraSpec, rng) -> Adapter:
    """Append op's adapter after it: op writes a new base tensor, the sum its output."""
    g, w, y = edit.g, _constant_weight(edit.g, op), op.outputs[0]
    name, out_shape = g.tensors[y].name, edit.shape(y)
    a_value, b_value = _initial_pair(op, g.tensors[w].data, lora.rank, rng)
    a, b = edit.const(f"{name}/lora_A", a_value), edit.const(f"{name}/lora_B", b_value)
    base = edit.tensor(f"{name}/base", out_shape, FLOAT32)
    original.outputs = [base]
    activation = op.options.get("fused_activation_function", 0)
    if activation:
        original.builtinOptions.fusedActivationFunction = 0
    u = _low_rank(edit, op, a, b, lora.rank, name, out_shape)
    scale = edit.const(f"{name}/lora_scale", np.array(lora.scale(), FLOAT32))
    v = edit.new("MUL", [u, scale], f"{name}/lora", out_shape, FLOAT32)
    edit.op("ADD", [base, v], y, fused_activation_function=activation)
    return Adapter(op=op.type, weight=w, a=a, b=b, base=base, output=y)


def _low_rank(edit: Editor, op: Op, a: int, b: int, r: int, name: str, out_shape) -> int:
    """B(A(x)) for op's input x, as operators of op's kind."""
    low = out_shape[:-1] + (r,)
    if op.type == "CONV_2D":
        keep = ("padding", "stride_w", "stride_h", "dilation_w_factor", "dilation_h_factor")
        # zero biases: onert loads no CONV_2D without one (--lora keep)
        zeros = [edit.const(f"{name}/lora_{k}_bias", np.zeros(n, FLOAT32))
                 for k, n in (("A", r), ("B", out_shape[-1]))]
        z = edit.new("CONV_2D", [op.inputs[0], a, zeros[0]], f"{name}/lora_Ax", low, FLOAT32,
                     **{k: op.options[k] for k in keep if k in op.options})
        return edit.new("CONV_2D", [z, b, zeros[1]], f"{name}/lora_BAx", out_shape, FLOAT32,
                        padding=1, stride_w=1, stride_h=1)  # 1x1, VALID
    if op.type == "GATHER":
        z = edit.new("GATHER", [a, op.inputs[1]], f"{name}/lora_Ax", low, FLOAT32, **op.options)
    elif op.type == "EMBEDDING_LOOKUP":
        z = edit.new("EMBEDDING_LOOKUP", [op.inputs[0], a], f"{name}/lora_Ax", low, FLOAT32)
    else:
        keep = bool(op.options.get("keep_num_dims")) or op.type == "BATCH_MATMUL"
        z = edit.new("FULLY_CONNECTED", [op.inputs[0], a, -1], f"{name}/lora_Ax", low, FLOAT32,
                     keep_num_dims=keep)
    return edit.new("FULLY_CONNECTED", [z, b, -1], f"{name}/lora_BAx", out_shape, FLOAT32,
                    keep_num_dims=len(out_shape) > 2)


def adapters_of(model) -> Adapters | None:
    raw = get_metadata(model, Adapters.NAME)
    return None if raw is None else Adapters.from_json(raw, None)


def merge(model, weights: dict[int, np.ndarray]) -> set[int]:
    """Fold each adapter into its weight, W += (alpha/r)·B·A, and give the
    operators back their original structure; returns the tensors that trained:
    `weights`' with the merged weights in place of the adapters."""
    meta = adapters_of(model)
    scale = meta.alpha / meta.rank
    sg = model.subgraphs[0]
    g = graph_of(model)
    producers = g.producers()
    dropped = set()
    for ad in meta.adapters:
        a, b = weights[ad.a].astype(np.float64), weights[ad.b].astype(np.float64)
        host = producers[ad.base]
        w = g.tensors[ad.weight].data.astype(np.float64)
        set_constant(model, ad.weight, (w + scale * _product(ad, host, a, b)).astype(FLOAT32))
        add = producers[ad.output]
        sg.operators[host.index].outputs = [ad.output]
        activation = add.options.get("fused_activation_function", 0)
        if activation:
            sg.operators[host.index].builtinOptions.fusedActivationFunction = activation
        dropped |= _adapter_ops(g, producers, ad)
    sg.operators = [o for i, o in enumerate(sg.operators) if i not in dropped]
    adapters = {t for ad in meta.adapters for t in (ad.a, ad.b)}
    return set(weights) - adapters | {ad.weight for ad in meta.adapters}


def _product(ad: Adapter, host: Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """B·A laid out as W."""
    if ad.op == "CONV_2D":
        return np.einsum("or,rhwi->ohwi", b[:, 0, 0, :], a)
    if ad.op in ("GATHER", "EMBEDDING_LOOKUP"):
        return a @ b.T
    if ad.op == "BATCH_MATMUL" and not host.options.get("adj_y"):
        return (b @ a).T  # W [in, out]
    return b @ a


def _adapter_ops(g: Graph, producers: dict, ad: Adapter) -> set[int]:
    """The operators between the adapter's input and its sum: A, B, the scale, the ADD."""
    add = producers[ad.output]
    mul = producers[add.inputs[1]]
    b_op = producers[mul.inputs[0]]
    a_op = producers[b_op.inputs[0]]
    return {add.index, mul.index, b_op.index, a_op.index}
