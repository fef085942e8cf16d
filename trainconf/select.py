"""Choose which weights train: `all`, `last:N` layers from the output, the
biases of all or the last K layers, names (comma lists of these add up), or the
weighted ops among circle+'s trainable operators.

A weighted op is a kernel op (FULLY_CONNECTED, CONV_2D, ... with a constant
weight) or an elementwise op whose constant operand is a per-feature parameter
(trainconf/operators.py: `parameter_operand`).  Such a parameter ADD/SUB right
after bias-less kernel ops (through RESHAPEs and sums of their outputs: a
converter's Tensordot, Keras 3's LSTM cell x·W + h·U + b) is their bias: it
trains with them, `--freeze-bias` freezes it, and it is not a layer of its own.
"""
from dataclasses import dataclass

from microtrain.files.errors import UserError
from microtrain.files.graph import Graph, Op

from .operators import WEIGHTED, Operand, spec


@dataclass
class Weighted:
    """A weighted op, its weight tensor and its bias (None when it has none)."""
    op: Op
    kernel: int
    bias: int | None


def operand(g: Graph, t: int) -> Operand | None:
    if t < 0:
        return None
    tensor = g.tensors[t]
    return Operand(tuple(tensor.shape), tensor.dtype.kind == "f", tensor.data is not None,
                   tensor.data is not None and not tensor.data.any())


def weight_position(g: Graph, op: Op) -> int | None:
    """The input of `op` that can train, None when none can."""
    return spec(op.type).weight_input([operand(g, t) for t in op.inputs],
                                      tuple(g.tensors[op.outputs[0]].shape))


def weighted_ops(g: Graph) -> list[Weighted]:
    """The weighted ops in execution order, a bias a later ADD/SUB adds included."""
    units: dict[int, Weighted] = {}
    attached: set[int] = set()
    readers: dict[int, int] = {}
    for op in g.ops:
        for t in op.inputs:
            readers[t] = readers.get(t, 0) + 1
    for op in g.ops:
        position = weight_position(g, op)
        if position is None:
            continue
        hosts = _bias_hosts(g, op, position, units, readers)
        if hosts:
            for host in hosts:
                host.bias = op.inputs[position]
            attached.add(op.index)
        units[op.index] = Weighted(op, op.inputs[position], _bias_input(op))
    return [w for i, w in units.items() if i not in attached]


def _bias_input(op: Op) -> int | None:
    position = spec(op.type).bias
    if position is None or position >= len(op.inputs) or op.inputs[position] < 0:
        return None
    return op.inputs[position]


def _bias_hosts(g: Graph, op: Op, position: int, units: dict, readers: dict) -> list[Weighted]:
    """The bias-less kernel ops whose outputs the parameter ADD/SUB `op` adds its
    constant to (their sum, reshaped), each output read on that path alone; []
    when its other operand is anything else."""
    if op.type not in ("ADD", "SUB"):
        return []
    producers = g.producers()
    hosts, pending = [], [op.inputs[1 - position]]
    while pending:
        t = pending.pop()
        source = producers.get(t)
        if source is None or readers.get(t, 0) != 1:
            return []
        unit = units.get(source.index)
        if unit is not None and spec(source.type).kernel and unit.bias is None:
            hosts.append(unit)
        elif source.type == "RESHAPE":
            pending.append(source.inputs[0])
        elif source.type == "ADD" and weight_position(g, source) is None \
                and all(g.tensors[x].data is None for x in source.inputs):
            pending.extend(source.inputs)
        else:
            return []
    return hosts


def layers(g: Graph, units: list[Weighted]) -> list[list[Weighted]]:
    """Weighted ops grouped into the layers `last:N` counts, in the order of each
    layer's first op: ops sharing a weight or bias are one layer (the steps of an
    unrolled loop; an LSTM cell's kernels, which share their bias), and so are an
    RNN cell's input and recurrent kernels (see _cell_sums)."""
    parent: dict[int, int] = {}  # union-find over the weight tensors

    def root(t: int) -> int:
        while parent.setdefault(t, t) != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t
    for unit in units:
        if unit.bias is not None:
            parent[root(unit.bias)] = root(unit.kernel)
    for a, b in _cell_sums(g, units):
        parent[root(a)] = root(b)
    groups: dict[int, list[Weighted]] = {}
    for unit in units:  # in execution order: each layer in the order of its first op
        groups.setdefault(root(unit.kernel), []).append(unit)
    return list(groups.values())


def _cell_sums(g: Graph, units: list[Weighted]) -> list[tuple[int, int]]:
    """The kernels of the products x·W and h·U one ADD sums, the input's a step SPLIT
    out of its projection of the whole sequence (an unrolled RNN's cell, its input
    projected for all steps at once: trainconf/hoist.py, trainconf/recurrent.py),
    each product reaching the ADD alone, through RESHAPEs."""
    products = {u.op.outputs[0]: u.kernel for u in units if spec(u.op.type).kernel}
    producers = g.producers()
    readers: dict[int, int] = {}
    for op in g.ops:
        for t in op.inputs:
            readers[t] = readers.get(t, 0) + 1

    def product(t: int) -> tuple[int | None, bool]:
        """The kernel whose product t is, and whether a SPLIT was on the way."""
        split = False
        while readers.get(t, 0) == 1 and t not in products:
            source = producers.get(t)
            if source is None or source.type not in ("RESHAPE", "SPLIT"):
                return None, split
            split |= source.type == "SPLIT"
            t = source.inputs[1 if source.type == "SPLIT" else 0]
        return (products[t], split) if readers.get(t, 0) == 1 and t in products else (None, split)

    pairs = []
    for op in g.ops:
        if op.type != "ADD" or any(t < 0 or g.tensors[t].data is not None for t in op.inputs):
            continue
        (a, a_split), (b, b_split) = (product(t) for t in op.inputs)
        if a is not None and b is not None and a != b and a_split != b_split:
            pairs.append((a, b))
    return pairs


def _weights_of(unit: Weighted, freeze_bias: bool) -> list[int]:
    bias = None if freeze_bias else unit.bias
    return [unit.kernel] + ([bias] if bias is not None else [])


def _named(g: Graph, units: list[Weighted], names: list[str], freeze_bias: bool) -> list[int]:
    by_name: dict[str, list[int]] = {}
    for unit in units:
        by_name.setdefault(g.tensors[unit.op.outputs[0]].name, []).extend(
            _weights_of(unit, freeze_bias))
        for t in _weights_of(unit, False):
            by_name.setdefault(g.tensors[t].name, []).append(t)
    chosen: list[int] = []
    for name in names:
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise UserError(None, f"--trainable: no weighted op or weight named {name!r}; "
                                  f"names: {known}")
        chosen.extend(t for t in by_name[name] if t not in chosen)
    return chosen


def _count(term: str, prefix: str, most: int) -> int:
    """N of a `PREFIX:N` term, checked to be 1..most."""
    try:
        n = int(term[len(prefix):])
    except ValueError:
        n = 0
    if not 1 <= n <= most:
        raise UserError(None, f"--trainable {term}: N must be between 1 and {most}")
    return n


def biases(layers_: list[list[Weighted]]) -> list[int]:
    """The biases of `layers_` (a unit's bias can be shared: listed once)."""
    return list(dict.fromkeys(u.bias for layer in layers_ for u in layer if u.bias is not None))


def weights(layers_: list[list[Weighted]], freeze_bias: bool = False) -> list[int]:
    return [t for layer in layers_ for unit in layer for t in _weights_of(unit, freeze_bias)]


SCHEMES = "all, last:N, biases, biases:last:K, or weighted-op or weight names"


def select_trainable(g: Graph, spec: str | set[int], freeze_bias: bool = False) -> list[int]:
    """Trainable tensor indices in execution order.  `spec` is a --trainable
    text, or the output tensors of the operators circle+'s trainable_ops names.
    The text is a comma list whose terms add up: `all`; `last:N` (every weight
    of the last N layers); `biases` (the biases of all layers, TinyTL's
    bias-only update); `biases:last:K` (those of the last K layers); or names.
    So `biases,last:2` is MIT TTE's sparse update: all biases and the last two
    layers' kernels.  `freeze_bias` drops the biases of the other terms."""
    if isinstance(spec, set):
        return select_by_outputs(g, spec, freeze_bias)
    units = weighted_ops(g)
    if not units:
        raise UserError(None, f"the model has no weighted operator ({', '.join(WEIGHTED)}) "
                              "with constant weights to train")
    groups = layers(g, units)
    chosen: list[int] = []
    names: list[str] = []
    for term in (s.strip() for s in spec.split(",")):
        if term == "all":
            chosen += weights(groups, freeze_bias)
        elif term.startswith("last:"):
            chosen += weights(groups[-_count(term, "last:", len(groups)):], freeze_bias)
        elif term == "biases":
            chosen += biases(groups)
        elif term.startswith("biases:last:"):
            chosen += biases(groups[-_count(term, "biases:last:", len(groups)):])
        elif term:
            names.append(term)
    chosen += _named(g, units, names, freeze_bias)
    if not chosen:
        raise UserError(None, f"--trainable {spec!r} chooses nothing to train ({SCHEMES})",
                        "--trainable")
    return in_first_use_order(g, chosen)


def select_by_outputs(g: Graph, outputs: set[int], freeze_bias: bool = False) -> list[int]:
    """The weights of the weighted ops that write one of `outputs` (tensor indices:
    they name an operator across the split's folding, which renumbers operators)."""
    chosen = [t for unit in weighted_ops(g) if unit.op.outputs[0] in outputs
              for t in _weights_of(unit, freeze_bias)]
    if not chosen:
        raise UserError(None, "circle+'s trainable_ops name no weighted operator "
                              f"({', '.join(WEIGHTED)}): give --trainable")
    return in_first_use_order(g, chosen)


def in_first_use_order(g: Graph, chosen: list[int]) -> list[int]:
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
    for unit in weighted_ops(g):
        op = unit.op
        if spec(op.type).ids is None or op.options.get("axis", 0) != 0:
            continue
        ids = op.inputs[spec(op.type).ids]
        rows = g.tensors[unit.kernel].shape[0]
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
