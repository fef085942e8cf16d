"""The records the two stages exchange inside the files, typed and versioned.

trainconf writes these records and microtrain reads them, from the same
classes, so the writer and the reader cannot drift.  Every record is validated
completely when it is read: a missing, unknown or mistyped field, a value out
of its range or another version is a ContractError naming the file and the
field.  schemas/contracts.md documents them; scripts/contracts_doc.py writes it
from this module.

Plain dataclasses and a small validator of our own, not a schema library: the
runtime may import only numpy, flatbuffers and click, and these records need
little (scalars, lists, fixed-length tuples, maps, enums, ranges, nesting).

To add a record: a dataclass deriving from Record with a `NAME` (where it is
stored), a `VERSION` if it carries one, a `doc(...)` for each field, and
`check()` for rules that span fields; then list it in RECORDS.
"""
import json
import math
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints
from types import UnionType

from microtrain.files.errors import ContractError
from microtrain.step.lazy import EMBEDDING_UPDATES
from microtrain.files.loss_registry import LOSS_NAMES
from microtrain.step.optimizers import DEFAULTS, OPTIMIZERS
from microtrain.step.precision import TYPES


# -- value constraints --------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    lo: float
    hi: float

    def check(self, value) -> str | None:
        return None if self.lo <= value <= self.hi else f"{value} is outside {self.lo}..{self.hi}"


@dataclass(frozen=True)
class Pattern:
    regex: str
    meaning: str

    def check(self, value) -> str | None:
        return None if re.fullmatch(self.regex, value) else f"{value!r} is not {self.meaning}"


MAX_INDEX = (1 << 31) - 1     # tensor indices, as circle stores them (int32)
MAX_COUNT = 1 << 53           # counters: exact in a JSON number
MAX_BYTES = 1 << 40           # sizes and offsets in bytes, a TiB: far beyond any device
Index = Annotated[int, Range(0, MAX_INDEX)]
Count = Annotated[int, Range(0, MAX_COUNT)]
Bytes = Annotated[int, Range(0, MAX_BYTES)]
SignedBytes = Annotated[int, Range(-MAX_BYTES, MAX_BYTES)]
Sha256 = Annotated[str, Pattern("[0-9a-f]{64}", "a hex SHA-256")]
Loss = Literal[LOSS_NAMES]
Reduction = Literal["mean", "sum"]
Dtype = Literal[TYPES]
Optimizer = Literal[tuple(OPTIMIZERS)]
LossScaleKind = Literal["none", "static", "dynamic", "adaptive"]  # microtrain/step/loss_scale.py's
JSONValue = Any  # any JSON value, for maps whose keys the reader checks itself

REDUCTIONS = get_args(Reduction)


def doc(text: str, default=MISSING, **kw):
    """A field with its documentation (and a default, for optional fields)."""
    if isinstance(default, (list, dict)):
        kw["default_factory"] = lambda: type(default)(default)
    elif default is not MISSING:
        kw["default"] = default
    return field(metadata={"doc": text}, **kw)


# -- validation ---------------------------------------------------------------------------------

class _Bad(Exception):
    """A violation at `where` (a field path), before the file is known."""

    def __init__(self, where: str, problem: str):
        super().__init__(problem)
        self.where, self.problem = where, problem


def _type_name(hint) -> str:
    return getattr(hint, "__name__", str(hint))


def _scalar(value, hint, where: str):
    if hint is bool:
        ok = type(value) is bool
    elif hint is int:
        ok = type(value) is int
    elif hint is float:
        ok = type(value) in (int, float)
        if ok and not math.isfinite(value):
            raise _Bad(where, f"{value} is not a finite number")
        value = float(value) if ok else value
    elif hint is str:
        ok = type(value) is str
    else:
        raise TypeError(f"contracts: unsupported type {hint!r}")
    if not ok:
        raise _Bad(where, f"expected {_type_name(hint)}, found {json.dumps(value)[:40]}")
    return value


def _convert(value, hint, where: str):
    """`value` (parsed JSON) as `hint` says, or _Bad."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin is Annotated:
        value = _convert(value, args[0], where)
        for constraint in args[1:]:
            problem = constraint.check(value)
            if problem:
                raise _Bad(where, problem)
        return value
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in args):
            raise _Bad(where, f"{json.dumps(value)[:40]} is not one of "
                              f"{', '.join(json.dumps(a) for a in args)}")
        return value
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for inner in options[:-1]:
            try:
                return _convert(value, inner, where)
            except _Bad:
                pass
        return _convert(value, options[-1], where)
    if origin is list:
        if type(value) is not list:
            raise _Bad(where, f"expected a list, found {json.dumps(value)[:40]}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if type(value) is not list or len(value) != len(args):
            raise _Bad(where, f"expected a list of {len(args)} values, found {json.dumps(value)[:40]}")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if type(value) is not dict:
            raise _Bad(where, f"expected an object, found {json.dumps(value)[:40]}")
        return {_key(k, args[0], where): _convert(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if is_dataclass(hint):
        return hint._from(value, where)
    return _scalar(value, hint, where)


def _key(key: str, hint, where: str):
    """A map key: JSON keys are strings; int keys are written as decimal strings."""
    if get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    if hint is int:
        if not re.fullmatch(r"-?\d{1,18}", key):
            raise _Bad(where, f"key {key!r} is not a whole number")
        return int(key)
    return key


def _plain(value):
    """A record's value as JSON: records become objects, tuples lists, int keys strings."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class Record:
    """Base of the typed records: `_from` validates, `to_dict` writes."""

    NAME: ClassVar[str]                  # where the record is stored (for docs and errors)
    VERSION: ClassVar[int | None] = None  # when set, the record has a `version` field

    def check(self) -> None:
        """Rules across fields; raise `self.bad(field, problem)` on a violation."""

    @staticmethod
    def bad(where: str, problem: str) -> Exception:
        return _Bad(where, problem)

    @classmethod
    def _from(cls, obj, where: str):
        if type(obj) is not dict:
            raise _Bad(where, f"expected an object, found {json.dumps(obj)[:40]}")
        prefix = f"{where}." if where else ""
        if cls.VERSION is not None and obj.get("version") != cls.VERSION:
            raise _Bad(f"{prefix}version", f"version {json.dumps(obj.get('version'))[:20]}; "
                                           f"this microtrain reads version {cls.VERSION}")
        hints = get_type_hints(cls, include_extras=True)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise _Bad(f"{prefix}{unknown[0]}", "unknown field")
        values = {}
        for f in fields(cls):
            if f.name in obj:
                values[f.name] = _convert(obj[f.name], hints[f.name], prefix + f.name)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise _Bad(prefix + f.name, "missing")
        record = cls(**values)
        try:
            record.check()
        except _Bad as e:
            raise _Bad(prefix + e.where, e.problem) from None
        return record

    @classmethod
    def from_dict(cls, obj, path, where: str = ""):
        """Validate parsed JSON; ContractError(path, field) on any violation."""
        try:
            return cls._from(obj, where or "")
        except _Bad as e:
            raise ContractError(path, e.problem, _field_name(cls, e.where)) from None

    @classmethod
    def from_json(cls, raw: bytes | str, path):
        """Parse and validate one JSON document."""
        return cls.from_dict(parse_json(raw, path, cls.NAME), path)

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_json(self) -> bytes:
        """The record as JSON, checked as a reader will check it."""
        data = self.to_dict()
        try:
            type(self)._from(data, "")
        except _Bad as e:
            raise ValueError(f"writing an invalid {self.NAME}: {e.where}: {e.problem}") from None
        return json.dumps(data).encode()


def _field_name(cls, where: str) -> str:
    return f"{cls.NAME}: {where}" if where else cls.NAME


MAX_JSON_DEPTH = 64  # deeper nesting is damage: no record nests more than a few levels


def parse_json(raw: bytes | str, path, what: str):
    """Parse JSON that a record is read from; ContractError naming `what`."""
    try:
        text = raw.decode() if isinstance(raw, (bytes, bytearray)) else raw
        depth = _depth(text)
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested {depth} levels deep")
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ContractError(path, f"not valid JSON ({str(e)[:80]})", what) from None


def _depth(text: str) -> int:
    """The deepest nesting of brackets, counted without recursion (strings skipped)."""
    depth = deepest = 0
    for token in re.finditer(r'"(?:\\.|[^"\\])*"|[\[\]{}]', text):
        c = token.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


# -- the records --------------------------------------------------------------------------------

@dataclass
class Precision(Record):
    NAME = "precision"
    weights: Dtype = doc("type the graphs compute with for trainable weights (the .wof keeps fp32)")
    activations: Dtype = doc("type of activations")
    gradients: Dtype = doc("type of gradients in the backprop graph")


@dataclass
class TrainingParameters(Record):
    """How to train: what `microtrain run` starts from (its options override it)."""
    NAME = "parameters"
    optimizer: Optimizer = doc("the optimizer, as `--optimizer` names it", default="adam")
    hyperparameters: dict[str, float] = doc(
        "the optimizer's arguments that were given, by Keras's names (`learning_rate`, "
        "`beta_1`, ...); the others take the optimizer's defaults", default={})
    batch_size: Annotated[int, Range(1, MAX_COUNT)] = doc("samples per step", default=32)
    epochs: Annotated[int, Range(1, MAX_COUNT)] = doc("epochs to train", default=5)

    def check(self) -> None:
        unknown = sorted(set(self.hyperparameters) - set(DEFAULTS[self.optimizer]))
        if unknown:
            raise self.bad(f"hyperparameters.{unknown[0]}",
                           f"{self.optimizer} has no such hyperparameter")


@dataclass
class PlannedRun(Record):
    """What `trainconf split`'s memory plan assumed of the `microtrain run` options
    that change the memory a run holds but not the files; a run given others
    says so."""
    NAME = "planned_for"
    loss_scale: LossScaleKind = doc("the kind of `--loss-scale` (static: a number)")
    accum_steps: Annotated[int, Range(1, MAX_COUNT)] = doc("`--accum-steps`")
    embedding_update: Literal[tuple(EMBEDDING_UPDATES)] = doc("`--embedding-update`")


@dataclass
class TrainingMeta(Record):
    """The training setup, in the frozen model's `microtrain.training` metadata."""
    NAME = "microtrain.training"
    VERSION = 1
    version: int = doc("1")
    loss: Loss = doc("the loss, as chosen with `trainconf split --loss`")
    reduction: Reduction = doc("mean: the summed per-sample losses divided by the batch size; sum")
    trainable: list[Index] = doc("trainable tensor indices, in the order of the runtime's flat "
                                 "parameter buffer; not empty, no repeats")
    precision: Precision = doc("the types of weights, activations and gradients")
    batch: Literal[-1, 1] = doc("the batch dimension of the model that was split: -1 dynamic, "
                                "1 fixed (the artifacts keep it symbolic; `trainconf export` "
                                "restores it)")
    stable_logits_loss: bool = doc("the loss is computed from the logits of a final "
                                   "SOFTMAX/LOGISTIC")
    ignore_index: Annotated[int, Range(-MAX_INDEX, MAX_INDEX)] | None = doc(
        "cce/sparse_cce: tokens of this class (target id, or one-hot column) count in neither "
        "the loss nor a mean's denominator (null: every token counts)", default=None)
    from_logits: bool = doc("the model's outputs are logits: cce/sparse_cce apply to their "
                            "softmax", default=False)
    rows: dict[Index, tuple[Index, Index]] = doc(
        "`{t: [lo, hi]}`: trainable tensor t trains only rows lo..hi-1 of its leading axis",
        default={})
    scratch_tile: Bytes | None = doc(
        "the kernels bound their scratch, working tiles of this many bytes at a time, at some "
        "cost in speed (`trainconf split --compact-scratch`, implied by `--memory-budget`); "
        "null: their fastest layouts", default=None)
    scheme: str = doc("the `--trainable` text that chose the trainable tensors, or what "
                      "`--memory-budget` chose in its terms (its partial rows in `rows`); empty "
                      "for circle+'s trainable_ops or adapters alone", default="")
    vocab: dict[Index, Annotated[int, Range(1, MAX_INDEX)]] = doc(
        "`{t: n}`: model input t holds the ids of embedding tables whose smallest has n rows; "
        "data outside 0..n-1 is refused when loaded", default={})
    parameters: TrainingParameters = doc(
        "the training parameters `trainconf split` recorded (from its options, else the "
        "input's circle+ CIRCLE_TRAINING, else the defaults)", default_factory=TrainingParameters)
    planned_for: PlannedRun | None = doc(
        "what the memory plan assumed of `microtrain run`'s options beyond the training "
        "parameters (null: not recorded, by files written before it was)", default=None)

    def check(self) -> None:
        if not self.trainable:
            raise self.bad("trainable", "no trainable tensors")
        if len(set(self.trainable)) != len(self.trainable):
            raise self.bad("trainable", f"repeats a tensor: {self.trainable}")
        for t, (lo, hi) in self.rows.items():
            if t not in self.trainable or not lo < hi:
                raise self.bad(f"rows.{t}", f"rows {lo}..{hi} of a tensor that is not trainable "
                                            "or an empty range")


@dataclass
class MemoryPlan(Record):
    """Where every tensor of a training step lives (schemas/memory.md)."""
    NAME = "memory"
    VERSION = 1
    version: int = doc("1")
    align: Literal[8] = doc("every offset is a multiple of it")
    arena: tuple[Bytes, Bytes] = doc("`[a, c]`: the arena holds a·B + c bytes at batch size B")
    forward: list[tuple[Index, Bytes, Bytes]] = doc(
        "`[t, a, c]` per planned forward tensor t: it starts at byte a·B + c")
    backprop: list[tuple[Index, Bytes, Bytes]] = doc(
        "the same for the backprop graph's own tensors")
    kernel_scratch: tuple[SignedBytes, SignedBytes] = doc(
        "`[a, c]`: bytes of the kernels' workspace and kept arrays, a·B + c", default=(0, 0))
    kernel_scratch_measured_at: tuple[Count, Count] = doc(
        "the two batch sizes at which kernel_scratch was measured", default=(1, 2))
    updates: list[tuple[Index, Index]] = doc(
        "`[g, i]` per weight gradient g: after backprop operator i, g is complete and its "
        "weight read no more, so its update may run there (operator reordering)", default=[])
    gradients: list[tuple[Index, Bytes]] = doc(
        "`[g, o]`: weight gradient g lies at byte o of the gradient buffer (float32) when "
        "each update runs at its `updates` operator", default=[])
    gradient_bytes: Bytes = doc("bytes of that gradient buffer", default=0)
    fused: list[tuple[Index, Count]] = doc(
        "`[g, r]`: weight gradient g (its leading axis the output channels, the last of its "
        "operator's first input) is computed r rows at a time, each tile updated as it is "
        "complete; it lies in the gradient buffer as r rows", default=[])

    def check(self) -> None:
        for graph in ("forward", "backprop"):
            placed = [t for t, *_ in getattr(self, graph)]
            if len(set(placed)) != len(placed):
                raise self.bad(graph, "places a tensor twice")
        for g, r in self.fused:
            if r < 1:
                raise self.bad("fused", f"gradient {g} is fused in tiles of {r} rows")
        for g, o in self.gradients:
            if o % self.align:
                raise self.bad("gradients", f"gradient {g} lies at unaligned byte {o}")


@dataclass
class GraphLinks(Record):
    """How the backprop graph reads and feeds the forward graph, in its
    `microtrain.backprop` metadata."""
    NAME = "microtrain.backprop"
    VERSION = 1
    version: int = doc("1")
    frozen_sha256: Sha256 = doc("SHA-256 of the STEM.frozen.circle it was generated with")
    backprop_sha256: Sha256 = doc("SHA-256 of this backprop graph's own file with these 64 "
                                  "digits written as zeros: any edit of the file is detected")
    forward: list[tuple[Index, Index]] = doc(
        "`[b, f]`: backprop tensor b is forward tensor f (they share memory)")
    targets: list[Index] = doc("backprop tensors holding the targets, one per model output")
    loss: Index = doc("the backprop tensor holding the loss, shape [1]")
    gradients: list[tuple[Index, Index]] = doc(
        "`[g, f]`: backprop tensor g holds dLoss/d(forward tensor f), in the order of `trainable`")
    layers: list[Index] = doc(
        "backprop tensors holding a weighted layer's input gradient (from an operator whose "
        "inputs are dY, W), where `--loss-scale adaptive` chooses a scale; trainconf marks "
        "them from its operator registry")
    memory: MemoryPlan | None = doc("the memory plan of a training step (none: every tensor "
                                    "gets an array of its own)", default=None)
    recomputed: list[Index] | None = doc(
        "backprop tensors that recompute a forward activation (`trainconf split --recompute`), "
        "written by copies of forward operators: not gradients", default=None)

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if v is not None}

    def check(self) -> None:
        if not self.targets:
            raise self.bad("targets", "no targets")
        backprop = [b for b, _ in self.forward]
        if len(set(backprop)) != len(backprop):
            raise self.bad("forward", "links a backprop tensor twice")


@dataclass
class OptimizerState(Record):
    NAME = "optimizer"
    name: Optimizer = doc("the optimizer as `--optimizer` names it")
    config: dict[str, float | bool | None] = doc("its hyperparameters with Keras's names")
    iterations: Count = doc("optimizer updates applied so far")
    state: list[str] = doc("names of the `optimizer/<slot>.npy` members, sorted")

    def check(self) -> None:
        if self.state != sorted(set(self.state)) or not all(
                re.fullmatch(r"[a-z_]{1,32}", s) for s in self.state):
            raise self.bad("state", f"not a sorted list of slot names: {self.state}")


@dataclass
class ShufflerState(Record):
    NAME = "rng_state"
    seed: Annotated[int, Range(0, (1 << 64) - 1)] = doc("64-bit unsigned seed")
    draws: Count = doc("permutations drawn so far")


@dataclass
class LossScaleState(Record):
    """The loss-scale state of mixed-precision training (microtrain/step/loss_scale.py)."""
    NAME = "loss_scale"
    kind: LossScaleKind = doc("the `--loss-scale` kind")
    seed: Annotated[float, Range(0, 3.5e38)] = doc("the scale of the loss gradient")
    skipped: Count = doc("updates skipped for inf/NaN gradients")
    good_steps: Count | None = doc("dynamic, adaptive: finite steps in a row", default=None)
    steps: Count | None = doc("adaptive: steps so far", default=None)
    redo: bool | None = doc("adaptive: choose the scales again at the next step", default=None)
    factors: dict[Index, list[Annotated[float, Range(0, 3.5e38)]]] | None = doc(
        "adaptive: per-layer factors, by backprop tensor", default=None)
    scales: dict[Index, Annotated[float, Range(0, 3.5e38)]] | None = doc(
        "adaptive: total scale, by backprop tensor", default=None)

    def check(self) -> None:
        needed = {"dynamic": ("good_steps",),
                  "adaptive": ("good_steps", "steps", "redo", "factors", "scales")}
        for name in needed.get(self.kind, ()):
            if getattr(self, name) is None:
                raise self.bad(name, f"missing (needed by {self.kind} loss scaling)")

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if v is not None}


@dataclass
class RunState(Record):
    """What `microtrain run` keeps to resume a run faithfully."""
    NAME = "extra"
    baseline: dict[str, float] = doc("loss and metric of the starting weights on the set that "
                                     "judges improvement")
    batch_size: Annotated[int, Range(1, MAX_INDEX)] | None = doc(
        "the run's --batch-size; a resume with another is refused", default=None)
    data_sha256: Sha256 | None = doc("SHA-256 of the training data (inputs and targets, after any "
                                     "validation split); a resume on other data is refused",
                                     default=None)
    test_sha256: Sha256 | None = doc("the same for the test set (null: none, improvement is "
                                     "judged on the training data)", default=None)

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if v is not None}


@dataclass
class Adapter(Record):
    """One low-rank adapter: y = OP(x, W) + (alpha/rank)·B·A(x)."""
    NAME = "adapter"
    op: Literal["FULLY_CONNECTED", "BATCH_MATMUL", "CONV_2D", "GATHER", "EMBEDDING_LOOKUP"] = doc(
        "the adapted operator")
    weight: Index = doc("its frozen weight W")
    a: Index = doc("A: [rank, in] (CONV_2D: [rank, kh, kw, in]; an embedding: the table "
                   "[rows, rank])")
    b: Index = doc("B: [out, rank] (CONV_2D: [out, 1, 1, rank]; an embedding: [dim, rank])")
    base: Index = doc("the operator's own output, OP(x, W)")
    output: Index = doc("the adapted output (the operator's output in the original model)")


@dataclass
class Adapters(Record):
    """The low-rank adapters `trainconf split --lora` added, in the frozen model's
    `microtrain.lora` metadata: a .wof of another rank or other targets is refused."""
    NAME = "microtrain.lora"
    VERSION = 1
    version: int = doc("1")
    rank: Annotated[int, Range(1, MAX_INDEX)] = doc("r, the rank of every adapter")
    alpha: Annotated[float, Range(1e-30, 1e30)] = doc("alpha: adapters scale B·A by alpha/r")
    adapters: list[Adapter] = doc("the adapters, in execution order")

    def check(self) -> None:
        if not self.adapters:
            raise self.bad("adapters", "no adapters")


Scale = Annotated[float, Range(1e-30, 1e30)]


@dataclass
class TensorRange(Record):
    """An activation's int8 quantization: its scale and zero point, or the range
    of its float values that export turns into them."""
    NAME = "tensor_range"
    scale: Scale | None = doc("real value of one step: x = scale·(q − zero_point)", default=None)
    zero_point: Annotated[int, Range(-128, 127)] | None = doc(
        "the int8 value that stands for 0.0", default=None)
    min: float | None = doc("the least float value seen (with max, instead of scale and "
                            "zero_point)", default=None)
    max: float | None = doc("the greatest float value seen", default=None)

    def check(self) -> None:
        given = (self.scale is not None, self.zero_point is not None,
                 self.min is not None, self.max is not None)
        if given not in ((True, True, False, False), (False, False, True, True)):
            raise self.bad("scale", "give scale and zero_point, or min and max")
        if self.min is not None and self.min > self.max:
            raise self.bad("min", f"{self.min} is above max {self.max}")


@dataclass
class WeightScales(Record):
    """The int8 scales of one weight (symmetric: zero point 0)."""
    NAME = "weight_scales"
    scale: list[Scale] = doc("one per output channel (the operator's channel axis), or one "
                             "for the whole tensor")
    axis: Annotated[int, Range(0, 7)] | None = doc(
        "the channel axis (a fake-quantized split's record; export takes the operator's)",
        default=None)
    bits: Literal[8, 32] | None = doc("8: an int8 weight; 32: an int32 bias, scale s_in·s_w "
                                      "(absent: 8)", default=None)

    def check(self) -> None:
        if not self.scale:
            raise self.bad("scale", "no scales")


@dataclass
class Quantization(Record):
    """The int8 quantization of a model's activations (and, optionally, weights),
    in the frozen model's `microtrain.quantization` metadata: what
    `trainconf export --int8` writes a full-integer model with
    (schemas/quantization.md)."""
    NAME = "microtrain.quantization"
    VERSION = 1
    version: int = doc("1")
    activations: dict[Index, TensorRange] = doc(
        "frozen-graph tensor index → its quantization, for inputs and operator outputs")
    weights: dict[Index, WeightScales] = doc(
        "frozen-graph weight tensor index → its scales (absent: the largest magnitude in each "
        "channel of the trained weights over 127)", default={})
    qas: bool | None = doc("a fake-quantized split's `--qas` (how it derived the weights' "
                           "gradients)", default=None)


CHECKPOINT_FORMAT = "microtrain-checkpoint"


@dataclass
class CheckpointMeta(Record):
    """`meta.json` of a checkpoint archive (schemas/checkpoint.md)."""
    NAME = "meta.json"
    VERSION = 1
    format: Literal["microtrain-checkpoint"] = doc('"microtrain-checkpoint"')
    version: int = doc("1")
    model_sha256: Sha256 = doc("SHA-256 of the STEM.frozen.circle the run trains")
    optimizer: OptimizerState = doc("the optimizer and its counters")
    epoch: Count = doc("epochs completed")
    step: Count = doc("training steps completed")
    rng_state: ShufflerState = doc("the shuffler's state after the last completed epoch")
    loss_scale: LossScaleState = doc("the loss-scale state")
    extra: RunState = doc("the run's own values")

    @classmethod
    def _from(cls, obj, where: str):
        if type(obj) is not dict or obj.get("format") != CHECKPOINT_FORMAT:
            raise _Bad("format", "not a microtrain checkpoint")
        return super()._from(obj, where)


# Every record stored in a file, in the order schemas/contracts.md lists them.
RECORDS = [TrainingMeta, Precision, TrainingParameters, PlannedRun, Adapters, Adapter, Quantization,
           TensorRange, WeightScales, GraphLinks, MemoryPlan, CheckpointMeta, OptimizerState,
           ShufflerState, LossScaleState, RunState]
