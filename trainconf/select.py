"""Choose which weights train: `all`, `last:N` weighted ops from the output, names,
or the weighted ops among circle+'s trainable operators."""
from microtrain.errors import UserError
from microtrain.graph import Graph, Op

from .operators import WEIGHTED, spec


def weighted_ops(g: Graph) -> list[Op]:
    """Ops with a constant weight input, in execution order."""
    return [op for op in g.ops if spec(op.type).weighted
            and g.tensors[op.inputs[spec(op.type).weight]].data is not None]


def layers(ops: list[Op]) -> list[list[Op]]:
    """Weighted ops grouped by their weight tensor, in the order of each group's
    first op: the steps of an unrolled loop share one weight and are one layer."""
    groups: dict[int, list[Op]] = {}
    for op in ops:
        groups.setdefault(kernel_of(op), []).append(op)
    return list(groups.values())


def kernel_of(op: Op) -> int:
    """The weight tensor of a weighted op."""
    return op.inputs[spec(op.type).weight]


def bias_of(op: Op) -> int | None:
    """The bias tensor of a weighted op, None when it has none."""
    position = spec(op.type).bias
    if position is None or position >= len(op.inputs) or op.inputs[position] < 0:
        return None
    return op.inputs[position]


def _weights_of(op: Op, freeze_bias: bool) -> list[int]:
    bias = None if freeze_bias else bias_of(op)
    return [kernel_of(op)] + ([bias] if bias is not None else [])


def _named(g: Graph, ops: list[Op], names: list[str], freeze_bias: bool) -> list[int]:
    by_name: dict[str, list[int]] = {}
    for op in ops:
        by_name.setdefault(g.tensors[op.outputs[0]].name, []).extend(_weights_of(op, freeze_bias))
        for t in _weights_of(op, False):
            by_name.setdefault(g.tensors[t].name, []).append(t)
    chosen: list[int] = []
    for name in names:
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise UserError(None, f"--trainable: no weighted op or weight named {name!r}; "
                                  f"names: {known}")
        chosen.extend(t for t in by_name[name] if t not in chosen)
    return chosen


def select_trainable(g: Graph, spec: str | set[int], freeze_bias: bool = False) -> list[int]:
    """Trainable tensor indices in execution order.  `spec` is a --trainable
    text, or the output tensors of the operators circle+'s trainable_ops names."""
    if isinstance(spec, set):
        return select_by_outputs(g, spec, freeze_bias)
    ops = weighted_ops(g)
    if not ops:
        raise UserError(None, f"the model has no weighted operator ({', '.join(WEIGHTED)}) "
                              "with constant weights to train")
    if spec == "all":
        chosen = [t for op in ops for t in _weights_of(op, freeze_bias)]
    elif spec.startswith("last:"):
        try:
            n = int(spec[5:])
        except ValueError:
            n = 0
        groups = layers(ops)
        if not 1 <= n <= len(groups):
            raise UserError(None, f"--trainable {spec}: N must be between 1 and {len(groups)}")
        chosen = [t for layer in groups[-n:] for op in layer for t in _weights_of(op, freeze_bias)]
    else:
        chosen = _named(g, ops, [s.strip() for s in spec.split(",") if s.strip()], freeze_bias)
    if not chosen:
        raise UserError(None, f"--trainable {spec!r} chooses nothing to train "
                              "(all, last:N or a comma list of names)", "--trainable")
    return _in_first_use_order(g, chosen)


def select_by_outputs(g: Graph, outputs: set[int], freeze_bias: bool = False) -> list[int]:
    """The weights of the weighted ops that write one of `outputs` (tensor indices:
    they name an operator across the split's folding, which renumbers operators)."""
    chosen = [t for op in weighted_ops(g) if op.outputs[0] in outputs
              for t in _weights_of(op, freeze_bias)]
    if not chosen:
        raise UserError(None, "circle+'s trainable_ops name no weighted operator "
                              f"({', '.join(WEIGHTED)}): give --trainable")
    return _in_first_use_order(g, chosen)


def _in_first_use_order(g: Graph, chosen: list[int]) -> list[int]:
    first_use: dict[int, int] = {}
    for t in (t for op in g.ops for t in op.inputs):
        first_use.setdefault(t, len(first_use))
    return sorted(set(chosen), key=first_use.__getitem__)


# Operators that pass token ids through unchanged in value (reshaped, cast, or
# Keras's wrap of negative ids: SELECT(LESS(ids, 0), ADD(ids, n), ids)), by the
# inputs that carry them.
_ID_CARRIERS = {"RESHAPE": (0,), "SQUEEZE": (0,), "EXPAND_DIMS": (0,), "CAST": (0,),
                "STRIDED_SLICE": (0,), "SLICE": (0,), "TRANSPOSE": (0,), "ADD": (0, 1),
                "SELECT": (1, 2), "SELECT_V2": (1, 2)}


def id_inputs(g: Graph) -> dict[int, int]:
    """{model input: rows} for the inputs whose values index an embedding table
    (GATHER/EMBEDDING_LOOKUP on a constant table), directly or through the ops
    above; rows: those of the smallest such table."""
    producers, vocab = g.producers(), {}
    for op in weighted_ops(g):
        if spec(op.type).ids is None or op.options.get("axis", 0) != 0:
            continue
        ids = op.inputs[spec(op.type).ids]
        rows = g.tensors[kernel_of(op)].shape[0]
        todo, seen = [ids], set()
        while todo:
            t = todo.pop()
            if t in seen or g.tensors[t].data is not None:
                continue
            seen.add(t)
            if t in g.inputs:
                vocab[t] = min(rows, vocab.get(t, rows))
            elif t in producers and producers[t].type in _ID_CARRIERS:
                todo += [producers[t].inputs[i] for i in _ID_CARRIERS[producers[t].type]]
    return vocab
