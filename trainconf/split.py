"""`trainconf split`: cut the trainable weights out of a model into a .wof and
generate its backpropagation graph."""
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from microtrain.files.artifacts import UNSEALED, Artifacts, fingerprint, load_artifacts, seal
from microtrain.step.arena import START_ALIGN
from microtrain.files.atomic import PENDING, atomic_write_set
from microtrain.step.kernels.workspace import tile_bytes
from microtrain.step.lazy import DEFAULT_EMBEDDING_UPDATE
from microtrain.files.loss_registry import LOSS_KINDS, default_loss
from microtrain.step.loss_scale import DEFAULT_LOSS_SCALE, make_loss_scale
from microtrain.files.contracts import (GraphLinks, PlannedRun, Precision, TrainingMeta,
                                        TrainingParameters)
from microtrain.files.errors import UserError
from microtrain.files.opening import check_output
from microtrain.files.format.model import (buffer_array, load_model, model_to_bytes,
                                           remove_metadata, set_metadata)
from microtrain.files.format.wof import wof_to_bytes
from microtrain.files.graph import BATCH, Graph, batched, check_dataflow, graph_of
from microtrain.step.optimizers import make_optimizer
from microtrain.parameters import Resolved, resolve
from microtrain.step.precision import TYPES, dtype_of

from .backprop import Backprop, Builder, LossSpec, build_backprop, check_loss
from .budget import fit_budget, parse_size
from .circle_plus import METADATA as CIRCLE_PLUS, read_circle_plus
from .constants import resolve_constants, untie_weights
from .batch import FixedBatch, infer_batch
from .memory import FUSED_TILE, fused_tile, measure_scratch, peak, plan_memory, scratch_points
from .operators import FOLDS, ROW_GRADS
from .recompute import default_mode, recompute as recompute_backprop, summary as recompute_summary
from .quantize import (QuantSpec, fake_quantize_weights, from_integer, prepare, record_of,
                       store_levels)
from .hoist import hoist_input_projections
from .recurrent import lower_recurrent
from .lora import LoraSpec, add_adapters
from .select import in_first_use_order, id_inputs, select_trainable
from .sequence_reads import read_sequences_batch_major
from .support import check_forward
from .unroll import unroll_loops
from .writer import graph_to_model, set_constant, tensor_type


@dataclass
class SplitResult:
    frozen: Path
    wof: Path
    backprop: Path
    trainable: list[dict]
    backprop_ops: int
    loss: str
    reduction: str
    precision: dict
    memory: dict  # the planned peak of a training step, by part (trainconf.memory.peak)
    parameters: dict  # the recorded training parameters: {name: {"value", "source"}}
    recompute: dict  # the --recompute mode and, when auto, the arena without recomputation

    def summary(self) -> dict:
        files = {k: {"path": str(p), "bytes": p.stat().st_size}
                 for k, p in (("frozen", self.frozen), ("wof", self.wof), ("backprop", self.backprop))}
        return {"trainable_tensors": len(self.trainable),
                "trainable_parameters": sum(t["parameters"] for t in self.trainable),
                "trainable": self.trainable, "backprop_ops": self.backprop_ops,
                "loss": self.loss, "reduction": self.reduction, "precision": self.precision,
                "memory": self.memory, "parameters": self.parameters,
                "recompute": self.recompute, "files": files}


def activations(g: Graph) -> set[int]:
    """Float tensors computed from the inputs: those that have a batch dimension."""
    computed = set(g.inputs) | {t for op in g.ops for t in op.outputs}
    return {t for t in computed if np.issubdtype(g.tensors[t].dtype, np.floating)}


def make_batch_symbolic(model, g: Graph) -> tuple[Graph, int]:
    """Give the model a symbolic batch (trainconf/batch.py) where its graph allows,
    so the artifacts train at any batch size, and fold its shape computations.
    Models with a fixed batch above 1 are refused.  Returns the graph of the
    folded model and the model's own batch: -1 when an input's batch is dynamic,
    else 1 (export restores it)."""
    file_shapes = [t.shape for t in g.tensors]
    batches = {g.tensors[i].shape[0] for i in g.inputs if g.tensors[i].shape}
    for i in g.inputs:
        if g.tensors[i].shape and g.tensors[i].shape[0] not in (1, BATCH):
            raise UserError(None, f"input {g.tensors[i].name!r} has a fixed batch of "
                                  f"{g.tensors[i].shape[0]}; only models with a dynamic batch "
                                  "or a batch of 1 can be split")
    try:
        walk = infer_batch(g, FOLDS)
    except FixedBatch as e:
        if BATCH in batches:
            raise UserError(None, f"{e}, which a model with a dynamic batch cannot do here") \
                from None
        for t, shape in zip(g.tensors, file_shapes):  # the model keeps its batch of 1
            t.shape = shape
        walk = infer_batch(g, FOLDS, symbolic=False)
    for t, value in walk.constants(g).items():
        set_constant(model, t, value)
    _write_shapes(model, g, walk.values)
    sg = model.subgraphs[0]
    sg.operators = [op for i, op in enumerate(sg.operators) if i not in walk.folded]
    return graph_of(model), BATCH if BATCH in batches else 1


def _write_shapes(model, g: Graph, values: dict) -> None:
    """Store the symbolic shapes in the model: -1 in the signature, the rows at batch
    1 in the shape; RESHAPE's target (`values`: the constants, folded ones included)
    and whole-batch slices follow."""
    sg = model.subgraphs[0]
    for t in g.tensors:
        if batched(t.shape):
            sg.tensors[t.index].shapeSignature = [-1] + list(t.shape[1:])
            sg.tensors[t.index].shape = [-t.shape[0]] + list(t.shape[1:])
    for op in g.ops:
        if not batched(g.tensors[op.inputs[0]].shape if op.inputs[0] >= 0 else ()):
            continue
        if op.type == "RESHAPE" and len(op.inputs) > 1 and op.inputs[1] in values:
            set_constant(model, op.inputs[1], np.array((-1,) + g.tensors[op.outputs[0]].shape[1:],
                                                       np.int32))
        if op.type in ("STRIDED_SLICE", "SLICE"):
            _keep_whole_batch(model, op, values)


def _keep_whole_batch(model, op, values: dict) -> None:
    """A slice that took every row of the batch at batch 1 (trainconf/batch.py checked
    it does) takes them at any batch size: its end on that axis becomes "to the end"."""
    if op.type == "SLICE":
        size = np.asarray(values[op.inputs[2]]).reshape(-1).copy()
        size[0] = -1
        set_constant(model, op.inputs[2], size)
        return
    options = model.subgraphs[0].operators[op.index].builtinOptions
    options.beginMask, options.endMask = options.beginMask | 1, options.endMask | 1


PRECISIONS = TYPES  # fp32, fp16, bf16 (ml_dtypes' bfloat16, imported when used)


def resolve_precision(precision: str = "fp32", weight_dtype: str | None = None,
                      activation_dtype: str | None = None, grad_dtype: str | None = None) -> Precision:
    """The preset, with any of the three types overridden."""
    chosen = {"weights": weight_dtype, "activations": activation_dtype, "gradients": grad_dtype}
    for key, value in chosen.items():
        value = value or precision
        if value not in PRECISIONS:
            raise UserError(None, f"unknown {key} type {value!r} (choose {', '.join(TYPES)})")
        chosen[key] = value
    return Precision(**chosen)


def set_activation_dtype(model, g: Graph, dtype: np.dtype) -> None:
    for t in activations(g):
        g.tensors[t].dtype = dtype
        model.subgraphs[0].tensors[t].type = tensor_type(dtype)


def cut_weights(model, trainable: list[int]) -> dict[int, np.ndarray]:
    """Remove the trainable tensors' data from the model; returns it for the .wof."""
    sg = model.subgraphs[0]
    weights = {t: buffer_array(model, sg.tensors[t]) for t in trainable}
    empty = [t for t, w in weights.items() if w is None]
    if empty:
        raise UserError(None, f"tensor {empty[0]} '{sg.tensors[empty[0]].name}' would train but "
                              "holds no data")
    for t in trainable:
        old = sg.tensors[t].buffer
        sg.tensors[t].buffer = 0
        if all(x.buffer != old for x in sg.tensors):
            model.buffers[old].data = None
    return weights


def _graph_links(bp: Backprop, frozen_bytes: bytes) -> GraphLinks:
    return GraphLinks(version=GraphLinks.VERSION, frozen_sha256=fingerprint(frozen_bytes),
                      backprop_sha256=UNSEALED,
                      forward=sorted(bp.forward_links.items()), targets=list(bp.targets),
                      loss=bp.loss, gradients=[(b, f) for b, f in bp.gradients],
                      layers=list(bp.layers))


def output_paths(model_path: Path, out_dir: Path | None) -> tuple[Path, Path, Path]:
    out = Path(out_dir) if out_dir else model_path.parent
    stem = model_path.stem
    return out / f"{stem}.frozen.circle", out / f"{stem}.wof", out / f"{stem}.backprop.circle"


def check_outputs(model_path: Path, out_dir: Path | None, force: bool) -> None:
    """The three files may be written (their folder may not exist yet)."""
    frozen, wof, backprop = output_paths(model_path, out_dir)
    for path, kind in ((frozen, "circle"), (wof, "wof"), (backprop, "circle")):
        check_output(path, (kind,), force, reads=(("MODEL", model_path),), make_folder=True)


DEFAULT_TRAINABLE = "all"
DEFAULT_REDUCTION = "mean"


def split(model_path, out_dir=None, trainable: str | None = None, loss: str | None = None,
          reduction: str | None = None, freeze_bias: bool = False, precision: str = "fp32",
          weight_dtype: str | None = None, activation_dtype: str | None = None,
          grad_dtype: str | None = None, memory_budget: str | int | None = None,
          optimizer: str | None = None, batch_size: int | None = None, accum_steps: int = 1,
          embedding_update: str = DEFAULT_EMBEDDING_UPDATE, loss_scale: str = DEFAULT_LOSS_SCALE,
          epochs: int | None = None, ignore_index: int | None = None, from_logits: bool = False,
          force: bool = False, lora: LoraSpec | None = None, recompute: str | None = None,
          quant: QuantSpec = QuantSpec(), compact_scratch: bool = False,
          **hyperparameters) -> SplitResult:
    """Write STEM.frozen.circle, STEM.wof and STEM.backprop.circle for MODEL.
    What is not given (None) comes from the model's circle+ CIRCLE_TRAINING when
    it has one, else the defaults; the training parameters (optimizer and its
    hyperparameters, batch size, epochs) are recorded for `microtrain run`.
    The planned peak memory is estimated for the batch size, the optimizer,
    `accum_steps` (batches accumulated per update), `embedding_update` (how
    embedding tables update, microtrain/step/lazy.py) and `loss_scale` (as microtrain
    run's --loss-scale); `ignore_index` and
    `from_logits` qualify the loss (LossSpec); with `memory_budget`
    (bytes, or a size such as "64KiB") what trains is chosen so that it fits
    (trainconf/budget.py), unless `trainable` (or `freeze_bias`) says it: then the
    budget chooses only the tiles and recomputation (an error if none fits).  With
    `lora`, low-rank adapters train (trainconf/lora.py), plus what `trainable`
    names.  `recompute` (auto or none; default: trainconf.recompute.default_mode)
    lets the backward pass recompute forward activations instead of keeping them
    (trainconf/recompute.py); under a budget only when training that choice
    does not fit otherwise.  `quant` trains an int8 model, or a float model,
    through fake quantization (trainconf/quantize.py).  With `compact_scratch`
    the kernels bound their scratch memory at some cost in speed, working tiles of
    microtrain.step.kernels.workspace.tile_bytes at the split's batch size; a budget
    takes the fastest tiles that fit (budget_tiles; compact ones only with
    `compact_scratch`)."""
    model_path = Path(model_path)
    check_outputs(model_path, out_dir, force)
    try:
        types = resolve_precision(precision, weight_dtype, activation_dtype, grad_dtype)
        setup = training_setup(model_path, trainable, loss, reduction,
                               optimizer, batch_size, epochs, hyperparameters)
        params = setup.resolved.parameters
        if not force and replaces_weights(model_path, out_dir):  # refused before the work
            check_weights_kept(model_weights(model_path, types, quant), model_path, out_dir, None)

        mode = recompute or default_mode(memory_budget)
        planned_for = PlannedRun(make_loss_scale(loss_scale).kind, accum_steps, embedding_update)
        made: dict = {}  # id of a Built -> (choose, scheme) it was built for

        def make(choose, scheme: str, target: int | None = 0 if mode == "auto" else None,
                 tiles: Tiles = Tiles(tile_bytes(params.batch_size) if compact_scratch else None,
                                      fused_tile(params.batch_size))) -> Built:
            built = build(model_path, choose, setup.loss, setup.reduction, types,
                          params.batch_size, params, ignore_index, from_logits, lora, scheme,
                          tiles, recompute=target, quant=quant, planned_for=planned_for)
            made[id(built)] = choose, scheme
            return built
        if lora is not None and memory_budget is not None:
            raise UserError(None, "--memory-budget chooses what trains: leave out --lora")
        budget = None
        given = (lambda g: (select_trainable(g, setup.trainable, freeze_bias), {}),
                 setup.trainable if isinstance(setup.trainable, str) else "")
        if lora is not None and trainable is None:
            built = make(lambda g: ([], {}), "")  # the adapters alone
        elif memory_budget is None:
            built = make(*given)
        else:
            size = parse_size(memory_budget)

            def planned(built: Built) -> dict:
                return built.peak(params.batch_size, params.optimizer, accum_steps,
                                  embedding_update, loss_scale)

            def fitting(choose, scheme: str, tiles: Tiles) -> Built:
                """Recomputing only what the budget needs."""
                built = make(choose, scheme, None, tiles)
                memory = planned(built)
                over = memory["ram"] - size
                if mode == "none" or over <= 0:
                    return built
                return make(choose, scheme, max(0, memory["arena"] - START_ALIGN - over), tiles)
            ladder = budget_tiles(params.batch_size, compact_scratch)
            if trainable is None and not freeze_bias:  # the budget chooses what trains
                built, budget = fit_budget(lambda c, s: fitting(c, s, ladder[-1]),
                                           load_prepared(model_path, types, quant)[1], size,
                                           params.batch_size, params.optimizer, accum_steps,
                                           embedding_update, loss_scale)
            else:  # what trains is given: the budget chooses how
                built = fitting(*given, ladder[-1])
                if (least := planned(built)["ram"]) > size:
                    raise UserError(None, f"--memory-budget {size} bytes: --trainable "
                                          f"{given[1] or 'as given'} needs at least {least} "
                                          f"bytes at batch {params.batch_size} with "
                                          f"{params.optimizer}")
                budget = {"bytes": size, "scheme": given[1], "text": given[1] or "as given"}
            for tiles in ladder[:-1]:  # what trains fits the leanest: the fastest that fits
                faster = fitting(*made[id(built)], tiles)
                if planned(faster)["ram"] <= size:
                    built = faster
                    break
            budget.update(built.tiles.summary())
        if not force:
            built_weights = {t.name: built.art.weights.get(t.index, t.data)
                             for t in built.art.forward.tensors}
            check_weights_kept(built_weights, model_path, out_dir, built.wof)
        return write(built, model_path, out_dir, setup, budget, accum_steps, embedding_update,
                     loss_scale, mode)
    except UserError as e:
        raise e.at(model_path) from None


@dataclass
class Setup:
    """What to train and how, before the graph is split."""
    trainable: str | set[int]  # a --trainable spec, or circle+'s operators by output tensor
    loss: str | None  # None: by the model's last operator (default_loss)
    reduction: str
    resolved: Resolved  # the training parameters and where each came from


def training_setup(model_path: Path, trainable, loss, reduction, optimizer, batch_size, epochs,
                   hyperparameters: dict) -> Setup:
    """The given choices, else the model's circle+ CIRCLE_TRAINING's, else the defaults."""
    model = load_model(model_path)
    plus = read_circle_plus(model, model_path)
    resolved = resolve(plus.parameters() if plus else None, CIRCLE_PLUS, optimizer, batch_size,
                       epochs, **hyperparameters)
    p = resolved.parameters
    make_optimizer(p.optimizer, 1, **p.hyperparameters)  # refuses unknown hyperparameters
    if trainable is None and plus and plus.trainable_ops is not None:
        trainable = operator_outputs(graph_of(model), plus.trainable_ops)
    if plus:
        loss, reduction = loss or plus.loss, reduction or plus.reduction
    return Setup(DEFAULT_TRAINABLE if trainable is None else trainable, loss,
                 reduction or DEFAULT_REDUCTION, resolved)


def operator_outputs(g: Graph, operators: list[int]) -> set[int]:
    """The first output of each operator: it names the operator across folding."""
    for i in operators:
        if not 0 <= i < len(g.ops):
            raise UserError(None, f"{CIRCLE_PLUS}'s trainable_ops names operator {i}, but the "
                                  f"model has {len(g.ops)}")
    return {g.ops[i].outputs[0] for i in operators}


@dataclass(frozen=True)
class Tiles:
    """How finely a split's kernels work: the compact workspace's scratch tile in
    bytes (None: the kernels' fastest layouts; microtrain.step.kernels.workspace) and
    the least elements of a fused gradient's tile (trainconf.memory.fused_rows)."""
    scratch: int | None
    fused: int

    def summary(self) -> dict:
        return {"scratch_tile": self.scratch, "fused_tile": self.fused}


LARGE_SCRATCH_TILE = 1 << 20  # a compact workspace's tile a budget tries first (bytes)


def budget_tiles(batch: int, compact: bool) -> list[Tiles]:
    """The tiles a --memory-budget tries for what it trains, the fastest first:
    the kernels' fastest layouts (unless `compact`), then a compact workspace's
    large tile, then its tile for `batch` (tile_bytes), then also the least fused
    tile.  The leanest (last) chooses what trains; the first that fits trains it."""
    lean, fused = tile_bytes(batch), fused_tile(batch)
    ladder = [Tiles(None, fused), Tiles(LARGE_SCRATCH_TILE, fused), Tiles(lean, fused),
              Tiles(lean, FUSED_TILE)]
    return list(dict.fromkeys(t for t in ladder if not (compact and t.scratch is None)
                              and (t.scratch is None or t.scratch >= lean)))


@dataclass
class Built:
    """The three files of one choice of trainable weights, in memory, and the
    artifacts the runtime would load from them."""
    frozen: bytes
    wof: bytes
    backprop: bytes
    art: Artifacts
    rows: dict[int, tuple[int, int]]
    tiles: Tiles
    arena_without: int | None = None  # the arena without recomputation (bytes, as peak counts)

    def peak(self, batch: int, optimizer: str, accum_steps: int = 1,
             embedding_update: str = DEFAULT_EMBEDDING_UPDATE,
             loss_scale: str = DEFAULT_LOSS_SCALE) -> dict:
        files = {"frozen": len(self.frozen), "wof": len(self.wof), "backprop": len(self.backprop)}
        return peak(self.art, batch, optimizer, files, accum_steps, embedding_update,
                    loss_scale=loss_scale)


def load_prepared(model_path: Path, types: dict, quant: QuantSpec = QuantSpec()):
    """The model and its forward graph with a symbolic batch, folded, typed,
    its activations fake-quantized as `quant` and the model ask, and the
    model's own batch (see make_batch_symbolic)."""
    model = load_model(model_path)
    record = from_integer(model, quant)
    resolve_constants(model)
    untie_weights(model)
    unroll_loops(model)  # after untying: one loop's steps share its weights
    lower_recurrent(model)  # likewise the steps of a fused recurrent layer
    read_sequences_batch_major(model)  # a batch-1 Keras RNN's steps, so it trains batched
    hoist_input_projections(model)  # then its steps' input projections are one product
    g, batch = make_batch_symbolic(model, graph_of(model))
    check_dataflow(g, model_path, set())
    set_activation_dtype(model, g, dtype_of(types.activations))
    return model, prepare(model, g, quant, record, batch), batch


def build(model_path: Path, choose, loss, reduction, types, batch_size: int,
          parameters: TrainingParameters | None = None, ignore_index: int | None = None,
          from_logits: bool = False, lora: LoraSpec | None = None, scheme: str = "",
          tiles: Tiles | None = None, recompute: int | None = None,
          quant: QuantSpec = QuantSpec(), planned_for: PlannedRun | None = None) -> Built:
    """Split the model at `model_path`; `choose(graph)` returns the trainable
    tensors (in execution order) and the rows {tensor: (lo, hi)} of those that
    train only some of their rows; `scheme` is the --trainable text it follows;
    `tiles` (default: the fastest kernels, fused_tile(batch_size)): the scratch
    tile is recorded for the runtime's kernels, the fused tile planned.
    The kernel scratch is measured at batch 1 and `batch_size`.  `parameters` are recorded for microtrain run; `lora`
    adds adapters that train beside the chosen tensors.  With `recompute` (an
    arena target in bytes, 0: the least arena) the backward pass recomputes
    the forward activations trainconf.recompute chooses; `quant` fake-quantizes;
    `planned_for` is recorded as what the memory plan assumes of the run."""
    tiles = tiles or Tiles(None, fused_tile(batch_size))
    model, g, model_batch = load_prepared(model_path, types, quant)
    check_forward(g)
    remove_metadata(model, CIRCLE_PLUS)  # its operator indices predate the folding
    weights, rows = choose(g)
    if lora is not None:
        g, adapters = add_adapters(model, g, lora, model_batch)
        set_activation_dtype(model, g, dtype_of(types.activations))
        weights = in_first_use_order(g, weights + adapters)
    record = record_of(model)
    if record is not None:
        g = fake_quantize_weights(model, g, record, weights, model_batch,
                                  quant.weight_scales == "track")
        g = store_levels(model)
    loss = loss or default_loss(g)
    chosen = LossSpec(loss, reduction, ignore_index, from_logits)
    check_loss(g, chosen)
    grad_dtype = dtype_of(types.gradients)
    bp = build_backprop(g, weights, chosen, grad_dtype=grad_dtype)
    slice_rows(bp, g, rows, grad_dtype)
    recomputed, arena_without = None, None
    if recompute is not None:
        bp, recomputed, arena_without = recompute_backprop(g, bp, weights, batch_size, recompute)
    arrays = cut_weights(model, weights)
    last = g.producers().get(g.outputs[0])
    training = TrainingMeta(version=TrainingMeta.VERSION, loss=loss, reduction=reduction,
                            trainable=list(weights), precision=types, batch=model_batch,
                            stable_logits_loss=last is not None and LOSS_KINDS[loss].logits_of == last.type,
                            ignore_index=ignore_index, from_logits=from_logits,
                            rows=dict(rows), vocab=id_inputs(g), scheme=scheme,
                            scratch_tile=tiles.scratch,
                            parameters=parameters or TrainingParameters(),
                            planned_for=planned_for)
    set_metadata(model, TrainingMeta.NAME, training.to_json())
    frozen_bytes = model_to_bytes(model)
    for t in weights:  # as the runtime reads the frozen model
        g.tensors[t].data = None
    links = _graph_links(bp, frozen_bytes)
    links.recomputed = recomputed or None
    links.memory = plan_memory(g, bp.graph, links, weights, tiles.fused)
    art = Artifacts(model_path, model_path, None, g, training, arrays, bp.graph, links)
    links.memory = replace(links.memory, kernel_scratch=tuple(measure_scratch(art, batch_size)),
                           kernel_scratch_measured_at=scratch_points(batch_size))
    backprop_model = graph_to_model(bp.graph, "microtrain backprop graph",
                                    {GraphLinks.NAME: links.to_json()})
    return Built(frozen_bytes, wof_to_bytes(len(g.tensors), arrays),
                 seal(model_to_bytes(backprop_model)), art, rows, tiles, arena_without)


def slice_rows(bp: Backprop, g: Graph, rows: dict, grad_dtype) -> None:
    """Make the gradient of each weight trained only in rows lo..hi hold just
    those rows: its weight-gradient operator reads only those output channels of
    the incoming gradient, cut by a SLICE inserted right before it."""
    b = Builder(g, grad_dtype)
    b.tensors, b.ops = bp.graph.tensors, bp.graph.ops  # append to the built graph
    producers = bp.graph.producers()
    for grad, w in bp.gradients:
        if w not in rows:
            continue
        op = producers.get(grad)
        fake_quant = op if op is not None and op.type == "FakeQuantPerChannelGrad" else None
        if fake_quant is not None:  # a quantized weight: its rows' grids are sliced too
            op = producers.get(fake_quant.inputs[0])
            _slice_leading_rows(b, fake_quant, rows[w])
        if op is None or op.type not in ROW_GRADS:
            raise UserError(None, f"tensor {w} ({g.tensors[w].name}) can train only some rows "
                                  "when one operator whose weight gradient has rows reads it")
        (lo, hi), dz = rows[w], op.inputs[0]
        shape = b.shape_of(dz)
        begin = np.array([0] * (len(shape) - 1) + [lo], np.int32)
        size = np.array([-1 if d < 0 else d for d in shape[:-1]] + [hi - lo], np.int32)
        (part,) = b.emit_many("SLICE", [dz, b.const(begin, "begin"), b.const(size, "size")],
                              [shape[:-1] + (hi - lo,)], [f"{b.tensors[dz].name}/rows"])
        b.ops.insert(b.ops.index(op), b.ops.pop())
        op.inputs[0] = part
        for t in {grad, op.outputs[0]}:
            b.tensors[t].shape = (hi - lo,) + b.tensors[t].shape[1:]
    for i, op in enumerate(b.ops):
        op.index = i


def _slice_leading_rows(b: Builder, op, rows: tuple[int, int]) -> None:
    """Make `op` (a FakeQuantPerChannelGrad of output channels along axis 0) read
    rows lo..hi of its weight and scales, cut by SLICEs inserted right before it."""
    lo, hi = rows
    for position in range(1, len(op.inputs)):  # the weight, and its scales unless tracked
        t = op.inputs[position]
        shape = b.shape_of(t)
        begin = np.array([lo] + [0] * (len(shape) - 1), np.int32)
        size = np.array([hi - lo] + list(shape[1:]), np.int32)
        (part,) = b.emit_many("SLICE", [t, b.const(begin, "begin"), b.const(size, "size")],
                              [(hi - lo,) + tuple(shape[1:])], [f"{b.tensors[t].name}/rows"],
                              [b.tensors[t].dtype])
        b.ops.insert(b.ops.index(op), b.ops.pop())
        op.inputs[position] = part


def check_weights_kept(model: dict, model_path: Path, out_dir, new_wof: bytes | None) -> None:
    """Refuse to replace a STEM.wof whose weights are not the `model`'s (by tensor name:
    trained since the split that wrote it), or that cannot be read with its frozen model
    and is not `new_wof`, the .wof this split writes.  Before the split's work
    (`new_wof` None) only the weights the model holds itself are judged; what it cannot
    tell yet (adapters, an unreadable set) is judged after, against the new .wof."""
    frozen_path, wof_path, _ = output_paths(model_path, out_dir)
    if not replaces_weights(model_path, out_dir):
        return
    if new_wof is not None and wof_path.read_bytes() == new_wof:
        return
    try:
        old = load_artifacts(frozen_path, wof_path, with_backprop=False)
        held = {old.forward.tensors[t].name: w for t, w in old.weights.items()}
    except UserError:  # another set, torn or damaged: its weights cannot be told apart
        held = {None: None}
    if new_wof is None:
        held = {name: w for name, w in held.items() if name in model}
    if not all(model.get(name) is not None and np.array_equal(model[name], w)
               for name, w in held.items()):
        raise UserError(wof_path, f"holds weights that differ from {model_path.name}'s (trained "
                                  "by microtrain run?); give --force to replace them, or -o "
                                  "another folder")


def replaces_weights(model_path: Path, out_dir) -> bool:
    """Whether the split would replace a STEM.wof that holds weights."""
    wof_path = output_paths(model_path, out_dir)[1]
    return wof_path.is_file() and wof_path.stat().st_size > 0


def model_weights(model_path: Path, types, quant: QuantSpec = QuantSpec()) -> dict:
    """The model's constants by tensor name, as the split prepares them."""
    model = load_prepared(model_path, types, quant)[0]
    tensors = model.subgraphs[0].tensors
    return {t.name: w for t in tensors if (w := buffer_array(model, t)) is not None}


def write(built: Built, model_path: Path, out_dir, setup: Setup, budget: dict | None,
          accum_steps: int = 1, embedding_update: str = DEFAULT_EMBEDDING_UPDATE,
          loss_scale: str = DEFAULT_LOSS_SCALE, recompute: str = "none") -> SplitResult:
    frozen_path, wof_path, backprop_path = output_paths(model_path, out_dir)
    frozen_path.parent.mkdir(parents=True, exist_ok=True)
    # the frozen model last: until it is renamed, the old one is not the new
    # backprop graph's (frozen_sha256), and the marker says the set is torn
    atomic_write_set({wof_path: built.wof, backprop_path: built.backprop,
                      frozen_path: built.frozen}, frozen_path.with_name(model_path.stem + PENDING))
    art = built.art
    info = []
    for t in art.training.trainable:
        shape = art.weights[t].shape
        lo, hi = built.rows.get(t, (0, shape[0] if shape else 1))
        info.append({"index": t, "name": art.forward.tensors[t].name, "shape": list(shape),
                     "rows": [lo, hi], "parameters": int(np.prod(shape[1:])) * (hi - lo)})
    params = setup.resolved.parameters
    memory = built.peak(params.batch_size, params.optimizer, accum_steps, embedding_update,
                        loss_scale)
    memory["recompute"] = recompute_summary(art)
    mode = {"mode": recompute}
    if built.arena_without is not None:
        mode["arena_without"] = built.arena_without
    if budget:
        memory["budget"] = budget
    return SplitResult(frozen_path, wof_path, backprop_path, info, len(art.backprop.ops),
                       art.training.loss, art.training.reduction, art.training.precision.to_dict(),
                       memory, setup.resolved.report(), mode)
