"""`trainconf split --memory-budget`: choose what trains so that the planned
peak RAM of a training step fits a budget (the files read in place are not RAM).

The choices are sparse updates as MIT TTE's: the weights of the last j layers
(onert-micro's train ranks), the biases of the last k >= j layers (TinyTL's
bias-only update, as deep as it reaches), and the last r output channels (rows)
of the kernel of layer j + 1 from the output, its bias included.  "Most
training" orders them as (j, k, r): whole layers first, since a kernel adds the
most capacity per layer, then the depth the biases reach (each costs little but
the backward pass down to it), then rows filling what is left.  More of any
needs more memory (gradients, optimizer state, kept activations), so bisection
finds the largest j that fits, then the largest k, then the largest r.
"""
import re
from dataclasses import dataclass

from microtrain.files.errors import UserError
from microtrain.files.graph import Graph
from microtrain.step.lazy import DEFAULT_EMBEDDING_UPDATE
from microtrain.step.loss_scale import DEFAULT_LOSS_SCALE

from .operators import spec
from .select import Weighted, in_first_use_order, layers, weighted_ops

UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3,
         "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}


def parse_size(text) -> int:
    """Bytes from 65536, "64KiB", "1.5MB" (KB/MB/GB: powers of 1000; KiB/MiB/GiB: of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(None, f"--memory-budget {text!r} is not a size (examples: 65536, "
                              "64KiB, 1.5MB)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def row_kernel(layer: list[Weighted], g: Graph) -> Weighted | None:
    """The layer's kernel when it can train some output channels: one op whose
    rows (leading axis) are contiguous, so they can be a slice of the runtime's
    flat parameter buffer."""
    if len(layer) != 1 or not spec(layer[0].op.type).row_grad:
        return None
    return layer[0] if g.tensors[layer[0].kernel].shape[0] > 1 else None


@dataclass(frozen=True)
class Choice:
    """All weights of the last `whole` layers, the biases of the last `biases`,
    and the last `rows` rows of the kernel of the layer before the whole ones."""
    whole: int
    biases: int
    rows: int = 0

    def units(self, groups: list[list[Weighted]]) -> list[tuple[Weighted, str]]:
        """(unit, part trained: "all", "rows" or "bias"), in execution order."""
        reach = max(self.biases, self.whole + (self.rows > 0))
        parts = []
        for depth, layer in enumerate(reversed(groups[len(groups) - reach:]), 1):
            part = "all" if depth <= self.whole else \
                "rows" if depth == self.whole + 1 and self.rows else "bias"
            parts += [(u, part) for u in layer if part != "bias" or u.bias is not None]
        return parts[::-1]

    def choose(self, g: Graph, groups: list[list[Weighted]]):
        """The trainable tensors and their partial rows: the kernel training
        some rows first (the runtime's flat parameter buffer is one span, its
        frozen rows before it), then the others in execution order."""
        tensors, rows = [], {}
        for unit, part in self.units(groups):
            tensors += [t for t in (unit.kernel if part != "bias" else None, unit.bias)
                        if t is not None]
            if part == "rows":
                out = g.tensors[unit.kernel].shape[0]
                rows[unit.kernel] = (out - self.rows, out)
        tensors = in_first_use_order(g, tensors)
        return sorted(tensors, key=lambda t: t not in rows), rows

    def scheme(self, layer_count: int) -> str:
        """The --trainable text of the whole layers and biases (rows aside)."""
        terms = []
        if self.biases > self.whole:
            terms.append("biases" if self.biases == layer_count else f"biases:last:{self.biases}")
        if self.whole:
            terms.append("all" if self.whole == layer_count else f"last:{self.whole}")
        return ",".join(terms)

    def describe(self, g: Graph, groups: list[list[Weighted]]) -> dict:
        """The scheme, what trains by operator (named by its kernel tensor) and a line."""
        trains = []
        for unit, part in self.units(groups):
            kernel = g.tensors[unit.kernel]
            trains.append({"op": unit.op.index, "kernel": kernel.name, "part": part})
            if part == "rows":
                trains[-1]["rows"] = [kernel.shape[0] - self.rows, kernel.shape[0]]
        scheme = self.scheme(len(groups))
        text = [scheme] if scheme else []
        text += [f"kernel rows {t['rows'][0]}..{t['rows'][1]} of op {t['op']} ({t['kernel']})"
                 for t in trains if t["part"] == "rows"]
        return {"scheme": scheme, "trains": trains, "text": " and ".join(text)}


def smallest(g: Graph, groups: list[list[Weighted]]) -> Choice:
    """The least that can train: the last layer's bias, else one of its rows,
    else all of it."""
    if any(u.bias is not None for u in groups[-1]):
        return Choice(0, 1)
    return Choice(0, 0, 1) if row_kernel(groups[-1], g) else Choice(1, 1)


def _last_fitting(fits, lo: int, hi: int) -> int:
    """The largest i in lo..hi with fits(i), given fits(lo) and a monotone fits."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def fit_budget(make, g: Graph, budget: int, batch: int, optimizer: str, accum_steps: int = 1,
               embedding_update: str = DEFAULT_EMBEDDING_UPDATE,
               loss_scale: str = DEFAULT_LOSS_SCALE):
    """The most training (see the module's docstring) whose planned peak fits
    `budget` bytes: its Built (make(choose, scheme) builds one choice) and a
    summary of the choice."""
    groups = layers(g, weighted_ops(g))
    built: dict = {}

    def peak_of(c: Choice) -> int:
        if not c.units(groups):
            return 0  # nothing to train: less than any choice
        if c not in built:
            b = make(lambda graph: c.choose(graph, groups), c.scheme(len(groups)))
            built[c] = b, b.peak(batch, optimizer, accum_steps, embedding_update,
                                 loss_scale)["ram"]
        return built[c][1]
    least = smallest(g, groups)
    if peak_of(least) > budget:
        raise UserError(None, f"--memory-budget {budget} bytes: even the smallest trainable set "
                              f"({least.describe(g, groups)['text']}) needs {peak_of(least)} "
                              f"bytes at batch {batch} with {optimizer}")
    n = len(groups)
    whole = _last_fitting(lambda j: peak_of(Choice(j, j)) <= budget, 0, n)
    deepest = _last_fitting(lambda k: peak_of(Choice(whole, k)) <= budget, whole, n)
    rows = 0
    kernel = row_kernel(groups[n - whole - 1], g) if whole < n else None
    if kernel is not None:
        out = g.tensors[kernel.kernel].shape[0]
        reach = max(deepest, whole + 1)
        rows = _last_fitting(lambda r: peak_of(Choice(whole, reach, r)) <= budget, 0, out - 1)
        deepest = reach if rows else deepest
    choice = Choice(whole, deepest, rows)
    if not choice.units(groups):
        choice = least
    return built[choice][0], {"bytes": budget, **choice.describe(g, groups),
                              "evaluated": len(built)}
