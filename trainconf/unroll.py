"""Control flow resolved on the host: every WHILE loop becomes flat operators.

Converters lower recurrent layers (Keras 3 LSTM, GRU, Bidirectional) to a WHILE
operator whose cond and body subgraphs step a counter over a fixed sequence
length.  The device never interprets a loop: `trainconf split` evaluates the
condition at split time and writes one copy of the body's operators per
iteration into subgraph 0.  Body operators whose inputs are all constants (the
counters, the zero initial state) are folded into constants with the runtime's
own forward kernels, so a GATHER of the sequence at the counter becomes a
GATHER at a constant index.  The body's constants are shared by all copies:
a weight stays one tensor read by one operator per step, so its gradient sums
over the steps (backprop accumulates over a tensor's readers).

A loop whose condition reads a value computed from the model's inputs has no
static trip count and is refused, as is one that would unroll past MAX_STEPS
steps and any other control flow (IF, CALL_ONCE).  Loops inside a body unroll
like the others.
"""
import copy
from dataclasses import dataclass, field

import numpy as np

from microtrain.step import kernels
from microtrain.files.errors import UserError
from microtrain.files.format.model import (buffer_array, int_list, op_name, options_dict,
                                           tensor_dtype)
from microtrain.step.kernels.shape import strided_index

from .operators import spec
from .writer import set_constant

MAX_STEPS = 10_000  # body copies in all, nested loops counted once per copy
REFUSED = ("IF", "CALL_ONCE")  # control flow that is not unrolled
KERNEL_ERRORS = (ValueError, IndexError, TypeError, UserError)


@dataclass(eq=False)
class Folded:
    """A value known at split time; it becomes a constant tensor of subgraph 0
    (`index`) only when an operator that stays reads it."""
    value: np.ndarray
    like: object  # the TensorT it stands for (name, type)
    name: str
    buffer: int | None = None  # a body constant keeps its buffer
    index: int | None = None


Ref = int | Folded  # a tensor of subgraph 0, or a folded value


@dataclass
class Loop:
    """A WHILE operator (of subgraph `subgraph`) and what unrolling it found."""
    subgraph: int
    operator: int
    cond: str
    body: str
    trips: list[int] = field(default_factory=list)  # one per unrolled instance
    reason: str | None = None  # why its trip count is not static

    def to_dict(self) -> dict:
        trips = sorted(set(self.trips))
        return {"subgraph": self.subgraph, "operator": self.operator, "cond": self.cond,
                "body": self.body, "trips": trips[0] if len(trips) == 1 else (trips or None),
                "reason": self.reason}


def unroll_loops(model) -> list[Loop]:
    """Unroll every WHILE of subgraph 0 in place and drop the subgraphs only
    the loops used; refuses (UserError) what cannot be unrolled."""
    unroller = Unroller(model)
    if unroller.has_control_flow():
        unroller.run(strict=True)
        drop_unused_subgraphs(model)
    return list(unroller.loops.values())


def loops_of(model) -> list[Loop]:
    """The loops of subgraph 0 with their trip counts, or why one is not static
    (for inspect); the model is left as it is."""
    if not Unroller(model).has_control_flow():
        return []
    unroller = Unroller(copy.deepcopy(model))
    unroller.run(strict=False)
    return list(unroller.loops.values())


class Unroller:
    def __init__(self, model):
        self.model = model
        self.sg = model.subgraphs[0]
        self.ops: list = []  # the operators of subgraph 0, unrolled
        self.shared: dict[tuple[int, int], Folded] = {}  # a body's constants, for every copy
        self.steps = 0
        self.copies: set[int] = set()  # id() of the operators copied from a body
        self.loops: dict[tuple[int, int], Loop] = {}

    def has_control_flow(self) -> bool:
        return any(op_name(self.model, op) in ("WHILE",) + REFUSED
                   for op in self.sg.operators or ())

    def run(self, strict: bool) -> None:
        """Unroll subgraph 0; unless `strict`, a loop that cannot be unrolled is
        kept as it is and its Loop says why."""
        env: dict[int, Ref] = {}
        for k, op in enumerate(self.sg.operators or ()):
            emitted = len(self.ops)
            try:
                self._operator(0, k, op, env, "")
            except UserError as e:
                if strict or op_name(self.model, op) != "WHILE":
                    raise
                self.loops[(0, k)].reason = e.problem
                del self.ops[emitted:]
                self._emit(0, op, [self._ref(0, t, env) for t in int_list(op.inputs)], "")
        self.sg.outputs = [self._tensor(self._ref(0, t, env)) for t in int_list(self.sg.outputs)]
        self.sg.operators = self._without_unread_copies()

    def _without_unread_copies(self) -> list:
        """The operators but the copies from a body that nothing reads (a step's
        slice of an empty part of a sequence, a counter's last increment)."""
        read, kept = set(int_list(self.sg.outputs)), []
        for op in reversed(self.ops):
            if id(op) not in self.copies or read & set(int_list(op.outputs)):
                kept.append(op)
                read.update(int_list(op.inputs))
        return kept[::-1]

    # -------------------------------------------------------------- operators

    def _operator(self, s: int, k: int, op, env: dict, suffix: str) -> None:
        name = op_name(self.model, op)
        inputs = [None if t < 0 else self._ref(s, t, env) for t in int_list(op.inputs)]
        if name == "WHILE":
            outputs = self._while(s, k, op, inputs, suffix)
        elif name in REFUSED:
            raise UserError(None, f"{self._where(s, k, name)}: control flow other than WHILE "
                                  "loops cannot be split")
        else:
            outputs = (self._fold(s, op, inputs) if s else None) or self._emit(s, op, inputs,
                                                                               suffix)
        env.update(zip(int_list(op.outputs), outputs))

    def _where(self, s: int, k: int, name: str) -> str:
        inside = f" of subgraph {s} {self._name(s)!r}" if s else ""
        return f"operator {k} ({name}){inside}"

    def _name(self, s: int) -> str:
        name = self.model.subgraphs[s].name
        return (name.decode() if isinstance(name, bytes) else name) or f"subgraph {s}"

    def _ref(self, s: int, t: int, env: dict) -> Ref:
        """What tensor t of subgraph s stands for in subgraph 0."""
        if t in env:
            return env[t]
        if s == 0:
            return t
        if (s, t) not in self.shared:  # a constant of the body: one for all copies
            tensor = self.model.subgraphs[s].tensors[t]
            value = buffer_array(self.model, tensor)
            if value is None:
                raise UserError(None, f"subgraph {s} {self._name(s)!r} reads tensor {t} "
                                      f"'{tensor.name}' before any operator writes it")
            self.shared[(s, t)] = Folded(value, tensor, _text(tensor.name), tensor.buffer)
        return self.shared[(s, t)]

    def _value(self, ref: Ref | None) -> np.ndarray | None:
        if isinstance(ref, Folded):
            return ref.value
        return None if ref is None else buffer_array(self.model, self.sg.tensors[ref])

    def _tensor(self, ref: Ref) -> int:
        """The tensor of subgraph 0 that holds `ref`, made when first needed."""
        if not isinstance(ref, Folded):
            return ref
        if ref.index is None:
            tensor = copy.copy(ref.like)
            tensor.name = ref.name
            self.sg.tensors.append(tensor)
            ref.index = len(self.sg.tensors) - 1
            if ref.buffer is None:
                set_constant(self.model, ref.index, ref.value)
        return ref.index

    def _emit(self, s: int, op, inputs: list, suffix: str) -> list[Ref]:
        """A copy of op in subgraph 0; a body's op writes new tensors."""
        out = copy.copy(op)
        if op_name(self.model, op) == "CONCATENATION":  # an empty part adds nothing
            inputs = [r for r in inputs if r is None or 0 not in self._shape_of(r)]
        out.inputs = [-1 if r is None else self._tensor(r) for r in inputs]
        if s:
            shapes = self._shapes(s, op, inputs)
            out.outputs = [self._new_tensor(self.model.subgraphs[s].tensors[t], suffix, shape)
                           for t, shape in zip(int_list(op.outputs), shapes)]
        self.ops.append(out)
        if s:
            self.copies.add(id(out))
        return list(int_list(out.outputs))

    def _new_tensor(self, like, suffix: str, shape: tuple | None) -> int:
        tensor = copy.copy(like)
        tensor.name = _text(like.name) + suffix
        if shape is not None:
            tensor.shape, tensor.shapeSignature = list(shape), None
        self.sg.tensors.append(tensor)
        return len(self.sg.tensors) - 1

    def _fold(self, s: int, op, inputs: list) -> list[Folded] | None:
        """The op's outputs computed now, when its inputs are all known and the
        runtime has a kernel for it; None otherwise.  An op with a kernel is
        never folded: its weight may train (an elementwise op on constants alone
        has no parameter: parameters meet a computed operand)."""
        name = op_name(self.model, op)
        values = [self._value(r) for r in inputs]
        if spec(name).kernel or name not in kernels.KERNELS or any(
                v is None for r, v in zip(inputs, values) if r is not None) or \
                kernels.version_problem(name, self.model.operatorCodes[op.opcodeIndex].version):
            return None
        shapes = self._shapes(s, op, inputs)
        if None in shapes:
            return None
        likes = [self.model.subgraphs[s].tensors[t] for t in int_list(op.outputs)]
        outputs = [np.zeros(shape, tensor_dtype(like)) for shape, like in zip(shapes, likes)]
        try:
            kernels.build(name, values, outputs, **options_dict(op, name))()
        except KERNEL_ERRORS:
            return None
        return [Folded(v, like, _text(like.name)) for v, like in zip(outputs, likes)]

    def _shapes(self, s: int, op, inputs: list) -> list[tuple | None]:
        """The output shapes: as the body declares them, or, where it leaves a
        dimension to run time, computed from the inputs now known."""
        name = op_name(self.model, op)
        shapes = []
        for t in int_list(op.outputs):
            tensor = self.model.subgraphs[s].tensors[t]
            signature = int_list(tensor.shapeSignature) or int_list(tensor.shape)
            shapes.append(tuple(signature) if -1 not in signature
                          else self._inferred(name, op, inputs))
        return shapes

    def _inferred(self, name: str, op, inputs: list) -> tuple | None:
        """The output shape of a slicing or joining op whose shape inputs are known."""
        shape_of = [None if r is None else self._shape_of(r) for r in inputs]
        values = [self._value(r) for r in inputs]
        if name in ("SLICE", "STRIDED_SLICE") and all(v is not None for v in values[1:]):
            x = np.broadcast_to(np.zeros((), np.uint8), shape_of[0])  # a view without memory
            if name == "SLICE":
                begin, size = (np.asarray(v).reshape(-1).tolist() for v in values[1:3])
                index = tuple(slice(b, None if n == -1 else b + n) for b, n in zip(begin, size))
            else:
                index = strided_index(x.ndim, *values[1:4], **options_dict(op, name))
            return x[index].shape
        if name == "CONCATENATION":
            axis = options_dict(op, name).get("axis", 0) % len(shape_of[0])
            return shape_of[0][:axis] + (sum(x[axis] for x in shape_of),) + shape_of[0][axis + 1:]
        return None

    def _shape_of(self, ref: Ref) -> tuple:
        if isinstance(ref, Folded):
            return ref.value.shape
        return tuple(int_list(self.sg.tensors[ref].shape))

    # -------------------------------------------------------------- loops

    def _while(self, s: int, k: int, op, inputs: list, suffix: str) -> list[Ref]:
        options = op.builtinOptions
        cond, body = options.condSubgraphIndex, options.bodySubgraphIndex
        loop = self.loops.setdefault((s, k), Loop(s, k, self._name(cond), self._name(body)))
        where = self._where(s, k, "WHILE")
        carried, trips = inputs, 0
        while self._condition(cond, carried, where):
            if self.steps == MAX_STEPS:
                raise UserError(None, f"{where}: unrolling it passes {MAX_STEPS} steps (of all "
                                      "loops), the most split unrolls")
            self.steps += 1
            carried = self._body(body, carried, f"{suffix}@t{trips}")
            trips += 1
        loop.trips.append(trips)
        return carried

    def _body(self, s: int, carried: list, suffix: str) -> list[Ref]:
        sg = self.model.subgraphs[s]
        env = dict(zip(int_list(sg.inputs), carried))
        for k, op in enumerate(sg.operators or ()):
            self._operator(s, k, op, env, suffix)
        return [self._ref(s, t, env) for t in int_list(sg.outputs)]

    def _condition(self, s: int, carried: list, where: str) -> bool:
        """The loop's condition, evaluated now; refuses one that depends on the
        model's inputs."""
        sg = self.model.subgraphs[s]
        env = dict(zip(int_list(sg.inputs), carried))
        for op in sg.operators or ():
            inputs = [None if t < 0 else self._ref(s, t, env) for t in int_list(op.inputs)]
            outputs = self._fold(s, op, inputs)
            if outputs is None:
                name = op_name(self.model, op)
                unknown = [t for t, r in zip(int_list(op.inputs), inputs)
                           if r is not None and self._value(r) is None]
                why = (f"its {name} reads '{_text(sg.tensors[unknown[0]].name)}', which is "
                       "computed from the model's inputs") if unknown else \
                    f"split cannot evaluate its {name}"
                raise UserError(None, f"{where}: its trip count is not static: the condition "
                                      f"{self._name(s)!r}: {why}")
            env.update(zip(int_list(op.outputs), outputs))
        (out,) = [self._value(self._ref(s, t, env)) for t in int_list(sg.outputs)]
        if out is None:
            raise UserError(None, f"{where}: its trip count is not static: the condition "
                                  f"{self._name(s)!r} returns a value computed from the "
                                  "model's inputs")
        return bool(np.asarray(out).reshape(-1)[0])


def _text(name) -> str:
    return (name.decode() if isinstance(name, bytes) else name) or ""


# ------------------------------------------------------------------ subgraphs

def _subgraph_fields(op) -> list[str]:
    """The option fields of op that name a subgraph (WHILE's cond and body, IF's
    branches, CALL_ONCE's init, StableHLO's bodies...)."""
    options = op.builtinOptions
    return [] if options is None else [f for f in vars(options) if f.endswith("SubgraphIndex")]


def drop_unused_subgraphs(model) -> None:
    """Remove the subgraphs that neither subgraph 0, a signature nor a subgraph
    kept names, renumbering the references to those kept."""
    used, todo = {0}, [0] + [sig.subgraphIndex for sig in model.signatureDefs or ()]
    while todo:
        s = todo.pop()
        used.add(s)
        todo += [getattr(op.builtinOptions, f) for op in model.subgraphs[s].operators or ()
                 for f in _subgraph_fields(op) if getattr(op.builtinOptions, f) not in used]
    number = {s: n for n, s in enumerate(sorted(used))}
    model.subgraphs = [model.subgraphs[s] for s in sorted(used)]
    for sg in model.subgraphs:
        for op in sg.operators or ():
            for f in _subgraph_fields(op):
                setattr(op.builtinOptions, f, number[getattr(op.builtinOptions, f)])
    for sig in model.signatureDefs or ():
        sig.subgraphIndex = number[sig.subgraphIndex]
