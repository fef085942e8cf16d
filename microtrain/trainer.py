"""The Python API of the device runtime: a Trainer over the three split files."""
import functools
import math
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Sequence

import numpy as np

from microtrain.step.arena import held_bytes
from microtrain.files.contracts import LossScaleState, PlannedRun, ShufflerState
from microtrain.files.artifacts import load_artifacts
from microtrain.data import Holding, batch_indices, check_ids, check_values, hold
from microtrain.files.errors import UserError
from microtrain.step.executor import Memory, Plan, Wrappers, check_supported, compile_plan, reorders
from microtrain.files.graph import symbolic_batch
from microtrain.files.format.wof import write_wof
from microtrain.step.kernels.workspace import sharing
from microtrain.step.lazy import (DEFAULT_EMBEDDING_UPDATE, RowSum, check_embedding_update,
                                  check_lazy, lazy_tables)
from microtrain.step.loss_scale import LossScale, make_loss_scale
from microtrain.step.precision import Underflow
from microtrain.files.quantization import quantize
from microtrain.metrics import HIGHER_IS_BETTER, METRICS, bind, default_metric
from microtrain.step.optimizers import make_optimizer
from microtrain.step.output_loss import OutputLoss
from microtrain.parameters import FROZEN_MODEL, resolve
from microtrain.step.schedules import make_schedule
from microtrain.shuffle import Shuffler
from microtrain.run_config import DEFAULT_DIVERGENCE_SNAPSHOT, DIVERGENCE_SNAPSHOTS, RunConfig
from microtrain.step.update_order import UpdateOrder


def quiet(method):
    """Run `method` with numpy's overflow/invalid/divide warnings off: overflow is
    part of the numerics here (fp16 rounds to inf, runs diverge) and is checked
    for explicitly where it matters."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return method(*args, **kwargs)
    return run


class Diverged(Exception):
    """The loss became NaN or infinite."""


class TrainingDiverged(UserError):
    """A training run stopped because its loss became NaN or infinite."""


@dataclass
class Totals:
    """Running sums over the batches of one pass through a data set.  The loss is
    averaged weighting each step by its batch size, as Keras 3 does (its loss
    tracker is a Mean with sample_weight = batch size), so a partial last batch
    counts for its rows.  A language model's cross-entropy is also summed per
    counted token, for its perplexity."""
    loss: float = 0.0
    samples: int = 0
    metric: list = field(default_factory=lambda: [0.0, 0])
    token_loss: list = field(default_factory=lambda: [0.0, 0])

    def add(self, loss: float, rows: int, metric: tuple[float, int],
            tokens: tuple[float, int] | None = None) -> None:
        self.loss += loss * rows
        self.samples += rows
        self.metric[0] += metric[0]
        self.metric[1] += metric[1]
        if tokens:
            self.token_loss[0] += tokens[0]
            self.token_loss[1] += tokens[1]

    def report(self, metric: str, prefix: str = "") -> dict:
        """The mean loss, the metric and, for a language model, the perplexity."""
        result = {f"{prefix}loss": self.mean_loss(), f"{prefix}{metric}": self.metric_value()}
        if self.token_loss[1]:
            mean = self.token_loss[0] / self.token_loss[1]
            result[f"{prefix}perplexity"] = math.exp(min(mean, 709.0))  # finite, for JSON
        return result

    def mean_loss(self) -> float:
        return self.loss / self.samples

    def metric_value(self) -> float:
        return self.metric[0] / max(self.metric[1], 1)


@dataclass
class TrainerState:
    """Where a Trainer's training stands: what checkpoints, resumed runs and
    federated devices keep between runs (Trainer.state / Trainer.restore)."""
    params: np.ndarray  # the flat fp32 master weights
    optimizer: str  # the update rule's name, e.g. "adam"
    optimizer_config: dict  # its hyperparameters (Optimizer.config())
    optimizer_state: dict[str, np.ndarray]  # its moment vectors (Optimizer.state())
    iterations: int  # updates applied: the learning-rate schedule's step
    epoch: int  # epochs completed
    loss_scale: LossScaleState
    data_order: ShufflerState | None  # the shuffling's state (None: not trained yet)


class Trainer:
    """Trains the weights of a split model in place; see `fit`."""

    def __init__(self, frozen, wof=None, backprop=None, *, batch_size: int | None = None,
                 optimizer: str | None = None, epochs: int | None = None,
                 lr_schedule: str = "constant",
                 schedule_params: dict | None = None, metric: str | None = None,
                 loss_scale: LossScale | None = None, accum_steps: int = 1,
                 with_backprop: bool = True, embedding_update: str = DEFAULT_EMBEDDING_UPDATE,
                 divergence_snapshot: str = DEFAULT_DIVERGENCE_SNAPSHOT, plain: bool = False,
                 **hyperparameters):
        """`batch_size`, `optimizer`, `epochs` (of `fit`) and the optimizer's
        hyperparameters default to the training parameters recorded in the frozen
        model (see microtrain.parameters).  `embedding_update`: how embedding
        tables update (microtrain/step/lazy.py).  `divergence_snapshot`: where the
        weights a diverged run restores come from (DIVERGENCE_SNAPSHOTS).  `plain`:
        a model no split wrote runs as it is (load_artifacts)."""
        self.art = load_artifacts(frozen, wof, backprop, with_backprop, plain)
        check_supported(self.art)
        self.resolved = resolve(self.art.training.parameters, FROZEN_MODEL, optimizer, batch_size,
                                epochs, **hyperparameters)
        batch_size, optimizer = self.resolved.parameters.batch_size, self.resolved.parameters.optimizer
        if batch_size < 1:
            raise UserError(None, f"--batch-size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        # a model that keeps a fixed batch of 1 (its graph works across the batch axis,
        # see trainconf/batch.py) runs a batch one sample at a time, adding up the
        # samples' gradients before the update
        self.run_rows = batch_size if symbolic_batch(self.art.forward) else 1
        self.scaler = loss_scale or LossScale()
        check_embedding_update(embedding_update)
        self.embedding_update = embedding_update
        lazy = {}
        if embedding_update == "lazy" and self.art.backprop is not None:
            check_lazy(self.art, self.scaler.kind)
            lazy = lazy_tables(self.art, self.run_rows)
        if accum_steps < 1:
            raise UserError(None, f"--accum-steps must be at least 1, got {accum_steps}")
        accumulating = accum_steps > 1 or self.run_rows < batch_size
        self.reorder = reorders(self.art, accumulating, self.scaler.kind)
        self.memory = Memory(self.art, batch_size, lazy, self.reorder)
        # the .wof's arrays (views of the file's bytes) are copied: read the runtime's instead
        self.art.weights = dict(self.memory.param_views)
        self.loss_name = self.art.training.loss
        self.metric = metric or default_metric(self.loss_name)
        if self.metric not in METRICS:
            raise UserError(None, f"unknown metric {self.metric!r} (choose from {', '.join(METRICS)})")
        self.accum_steps = accum_steps
        self._accum = np.zeros(self.memory.dense_size, np.float32) if accumulating else None
        self._run_weight = np.float32(1)  # the running run's share, accumulating
        # a lazy table's touched rows summed over the runs of an effective batch
        runs = accum_steps * -(-batch_size // self.run_rows)
        self._row_accum = {t: RowSum(table.capacity(runs), table.width, table.rows)
                           for t, table in lazy.items()} if accumulating else {}
        self.optimizer_name = optimizer
        row_grads = self._row_accum or self.memory.row_grads
        self.optimizer = make_optimizer(
            optimizer, self.memory.params.size, dense=self.memory.dense_size,
            lazy_rows=max((g.values.size for g in row_grads.values()), default=0),
            **self.resolved.parameters.hyperparameters)
        self._tables = [(*self.memory.offsets[t], g) for t, g in row_grads.items()]
        self.schedule = make_schedule(lr_schedule, self.optimizer.learning_rate,
                                      **(schedule_params or {}))
        if self.art.backprop is not None:
            self.scaler.bind(self.art, self.memory.grad_offsets)
        self.underflow = Underflow()
        self.wrappers = Wrappers(self.scaler, self.underflow,
                                 UpdateOrder(self.art, self._update_now if self.reorder else None))
        self._begun = False  # whether this step's updates have begun (reordering)
        self._flat_grads = {t: g.reshape(-1) for t, g in self.memory.grad_views.items()}
        # weight t, or a fused tile's (lo, hi) in the weights -> its update, cut once
        self._updaters: dict = {}
        # the weights updated at one point -> their runs (_update_runs), cut once
        self._runs: dict[tuple, list | None] = {}
        self._collect: np.ndarray | None = None  # gradients() collects here instead
        if divergence_snapshot not in DIVERGENCE_SNAPSHOTS:
            raise UserError(None, f"unknown --divergence-snapshot {divergence_snapshot!r} "
                                  f"(choose from {', '.join(DIVERGENCE_SNAPSHOTS)})")
        # the weights at an epoch's start, restored if the run diverges: a second copy in RAM
        self._snapshot = np.empty_like(self.memory.params) if divergence_snapshot == "ram" else None
        self.saved_wof = self.art.wof_path  # the weights on disk, restored otherwise
        self._accum_weight, self._accum_count = 0, 0
        self.epoch = 0
        self.data_order: Shuffler | None = None  # the last fit's, continued by the next
        # FedProx: (mu, global weights); adds the gradient of mu/2 * ||w - global||^2
        self.proximal: tuple[float, np.ndarray] | None = None
        self._plans: dict[int, Plan] = {}
        self._output_losses: dict[int, OutputLoss] = {}  # a model no split wrote: _judged
        self._meters: dict[int, Callable[[], tuple[float, int]]] = {}

    @classmethod
    def from_config(cls, config: RunConfig, with_backprop: bool = True,
                    plain: bool = False) -> "Trainer":
        """The trainer of `microtrain run`'s options: the files `config` names, with
        its training options (its data and --epochs are for `fit`; --epochs is
        `fit`'s default).  `plain`: as for __init__."""
        return cls(config.frozen, config.wof, config.backprop, batch_size=config.batch_size,
                   optimizer=config.optimizer, epochs=config.epochs,
                   lr_schedule=config.lr_schedule, schedule_params=config.schedule_params(),
                   metric=config.metric,
                   loss_scale=make_loss_scale(config.loss_scale, **config.loss_scale_params()),
                   accum_steps=config.accum_steps, embedding_update=config.embedding_update,
                   divergence_snapshot=config.divergence_snapshot, with_backprop=with_backprop,
                   plain=plain, **config.hyperparameters())

    # -- data ---------------------------------------------------------------------------------
    def plan(self, rows: int) -> Plan:
        """The compiled step (forward, backward and loss closures, input and output
        views) of a run of the graph on `rows` rows; compiled once, then kept."""
        if rows not in self._plans:
            self._plans[rows] = compile_plan(self.art, self.memory, rows, self.wrappers)
        return self._plans[rows]

    def _judged(self, rows: int):
        """What evaluation runs and reads on `rows` rows: the plan, or for a model no
        split wrote (it trains nothing and has no backprop graph) an OutputLoss of it."""
        if self.art.training.trainable:
            return self.plan(rows)
        if rows not in self._output_losses:
            self._output_losses[rows] = OutputLoss(self.plan(rows), self.art.forward,
                                                   self.loss_name)
        return self._output_losses[rows]

    def _expect(self, arrays: Sequence[np.ndarray], views: list[np.ndarray], what: str,
                names: Sequence[str] | None, quantized: Sequence = ()) -> list:
        """`quantized`: the Quantization (or None) of each view's tensor: float data for a
        quantized tensor is quantized as the model's own QUANTIZE would."""
        arrays = [np.asarray(a) for a in arrays]
        if len(arrays) != len(views):
            raise UserError(None, f"the model has {len(views)} {what}(s), got {len(arrays)}")
        for i, (a, v) in enumerate(zip(arrays, views)):
            where = names[i] if names else f"{what} {i}"
            want, got = v.shape[1:], a.shape[1:]
            if what == "target" and got == want + (1,):
                arrays[i] = a = a.reshape(a.shape[:-1])  # class ids given as [N, 1]
                got = want
            if a.ndim == 0 or got != want:
                hint = ("; they look like class ids: split the model with --loss sparse_cce, "
                        "or give one-hot targets") if what == "target" and want and \
                    got in (want[:-1], want[:-1] + (1,)) and self.loss_name == "cce" else ""
                raise UserError(where, f"expected {what} samples of shape {want}, found "
                                       f"{got} (array of shape {a.shape}){hint}")
            check_values(where, a)
            if i < len(quantized) and quantized[i] is not None and a.dtype.kind == "f":
                arrays[i] = a = quantize(a, quantized[i], v.dtype)
            elif v.dtype.kind in "biu":  # ids and masks: integers the tensor's type holds
                arrays[i] = a = hold(Holding(where, v.dtype), a)
        if len({len(a) for a in arrays}) > 1:
            raise UserError(None, f"the {what}s have different sample counts")
        return arrays

    def data_types(self) -> tuple[list[np.dtype], list[np.dtype]]:
        """The types of the arrays each batch of inputs and of targets is loaded
        into (load_array's `dtype`: float data for fp16 inputs is held as float16)."""
        inputs = [np.dtype(np.float32) if q is not None else self.memory.forward[i].dtype
                  for i, q in zip(self.art.forward.inputs, self._input_quantization())]
        if self.memory.backprop is None:
            return inputs, []
        return inputs, [self.memory.backprop[t].dtype for t in self.art.links.targets]

    def _input_quantization(self) -> list:
        """Each input's Quantization (None: not quantized): a quantized input is loaded as
        the data holds it, floats (quantized then) or integers."""
        return [self.art.forward.tensors[t].quantization for t in self.art.forward.inputs]

    def check_data(self, inputs, targets=None, names: tuple | None = None) -> tuple[list, list]:
        """Inputs and targets as arrays that fit the model; `names` (input names, target
        names) name them in errors, e.g. their files."""
        names = names or (None, None)
        plan = self.plan(self.run_rows)
        xs = self._expect(inputs, plan.inputs, "input", names[0], self._input_quantization())
        for i, t in enumerate(self.art.forward.inputs):
            if t in self.art.training.vocab:
                check_ids(names[0][i] if names[0] else f"input {i}", xs[i],
                          self.art.training.vocab[t])
        ts = [] if targets is None else self._expect(targets, self._judged(self.run_rows).targets,
                                                     "target", names[1])
        if ts and len(ts[0]) != len(xs[0]):
            if names[0] and names[1]:
                raise UserError(names[1][0], f"holds {len(ts[0])} samples but the input "
                                             f"{names[0][0]} holds {len(xs[0])}")
            raise UserError(None, f"{len(xs[0])} input samples but {len(ts[0])} target samples")
        return xs, ts

    @staticmethod
    def _load(plan: Plan, xs, ts, idx) -> None:
        for src, dst in zip(xs, plan.inputs):
            np.take(src, idx, axis=0, out=dst) if dst.dtype == src.dtype else \
                np.copyto(dst, src[idx], casting="unsafe")
        for src, dst in zip(ts, plan.targets):
            np.copyto(dst, src[idx], casting="unsafe")

    def _measure(self, totals: Totals, loss: float, rows: int) -> None:
        """Add the batch of `rows` rows now in its plan to `totals`: its loss, metric
        and, for a language model, its cross-entropy summed over counted tokens."""
        if rows not in self._meters:
            plan = self._judged(rows)
            with sharing(self.memory.workspace):
                self._meters[rows] = bind(self.metric, plan.outputs, plan.targets,
                                          self.art.training)
        measure, count = self._meters[rows]
        tokens = None
        if count is not None:
            n = count()
            tokens = (loss * n if self.art.training.reduction == "mean" else loss, n)
        totals.add(loss, rows, measure(), tokens)

    # -- training -----------------------------------------------------------------------------
    def _forward_backward(self, plan: Plan) -> float:
        plan.run_forward()
        self._begun = False
        plan.run_backward()
        return self._finite_loss(plan.loss)

    @staticmethod
    def _finite_loss(loss: np.ndarray) -> float:
        value = float(loss[0])
        if not math.isfinite(value):
            raise Diverged(value)
        return value

    def _update_runs(self, weights: tuple) -> list | None:
        """Dense `weights` in runs that lie one after another both in the
        weights and in the gradient buffer (the plan places a layer's kernel and
        bias so): (update, flat gradient) of each, one optimizer call a run."""
        if any(t in self.memory.lazy for t in weights):
            return None
        runs = []  # [lo, hi, start in the gradient buffer, weight]
        for t in sorted(weights, key=lambda t: self.memory.offsets[t]):
            (lo, hi), at = self.memory.offsets[t], self.memory.grad_at.get(t)
            last = runs[-1] if runs else None
            if last and last[1] == lo and at is not None and last[2] == at - (lo - last[0]):
                last[1] = hi
            else:
                runs.append([lo, hi, at, t])
        return [(self.optimizer.updater(self.memory.params, lo, hi), self._flat_grads[t]
                 if at is None else self.memory.grad_buffer[at:at + hi - lo])
                for lo, hi, at, t in runs]

    def _update_now(self, weights: tuple, loss: np.ndarray,
                    rows: tuple[int, int] | None = None) -> None:
        """Update `weights` in the backward pass, their gradients complete and
        their values read no more (operator reordering; the plan's `updates`),
        or, accumulating, add their gradients to the running sum; unless the
        step's `loss` is not finite.  `rows`: only rows lo:hi of the one weight,
        whose gradient is the tile the gradient buffer holds (the plan's `fused`)."""
        if self._collect is None and not self._begun:  # the loss is known by now
            self._finite_loss(loss)
            if self._accum is None:
                self.optimizer.begin(self.schedule(self.optimizer.iterations))
            self._begun = True
        plain = rows is None and self._collect is None and self._accum is None \
            and self.proximal is None
        if plain and weights not in self._runs:
            self._runs[weights] = self._update_runs(weights)
        runs = self._runs[weights] if plain else None
        if runs is not None:
            for update, grad in runs:
                update(grad)
            return
        for t in weights:
            self._update_weight(t, rows)

    def _update_weight(self, t: int, rows: tuple[int, int] | None) -> None:
        """_update_now of weight t alone (or, gradients() collecting, its gradient copied out)."""
        if self._collect is not None:
            if t in self.memory.grad_offsets:  # a lazy table's rows are in its RowGrad
                lo, hi = self._span(t, self.memory.grad_offsets[t], rows)
                self._collect[lo:hi] = self._flat_grads[t][:hi - lo]
            return
        if self._accum is not None:
            self._add_to_sum(t, rows)
            return
        lo, hi = self._span(t, self.memory.offsets[t], rows)
        if t in self.memory.lazy:
            self._check_proximal()
            self.optimizer.update_rows(self.memory.params, lo, hi, self.memory.row_grads[t])
            return
        grad = self._flat_grads[t][:hi - lo]
        if self.proximal is not None:
            mu, anchor = self.proximal
            grad += np.float32(mu) * (self.memory.params[lo:hi] - anchor[lo:hi])
        key = t if rows is None else (lo, hi)
        if key not in self._updaters:
            self._updaters[key] = self.optimizer.updater(self.memory.params, lo, hi)
        self._updaters[key](grad)

    def _span(self, t: int, span: tuple[int, int], rows: tuple[int, int] | None) -> tuple:
        """Elements lo:hi of weight t's `span` (in its weights or gradients): all, or `rows`'."""
        if rows is None:
            return span
        width = self.memory.grad_views[t][0].size
        return span[0] + rows[0] * width, span[0] + rows[1] * width

    def _add_to_sum(self, t: int, rows: tuple[int, int] | None = None) -> None:
        """Add weight t's gradient (or its `rows`) of the running run to the running sum."""
        if t in self.memory.lazy:
            self._row_accum[t].add(self.memory.row_grads[t], self._run_weight)
        else:
            lo, hi = self._span(t, self.memory.grad_offsets[t], rows)
            self._accum[lo:hi] += self._flat_grads[t][:hi - lo] * self._run_weight

    def _end_step(self) -> None:
        """After a reordered step's backward pass: the step's end for the
        optimizer and the weights' working copy."""
        self.optimizer.end()
        self.memory.refresh_weights()
        self.scaler.update(True)

    def _parts(self, idx: np.ndarray) -> list[np.ndarray]:
        """The samples `idx` in the runs of the graph that take them."""
        return [idx[i:i + self.run_rows] for i in range(0, len(idx), self.run_rows)]

    def _weight(self, rows: int) -> int:
        """A run's share of a batch: the gradients of a mean loss are averaged over
        the effective batch's rows, those of a summed loss added."""
        return rows if self.art.training.reduction == "mean" else 1

    def train_batch(self, xs, ts, idx: np.ndarray, totals: Totals) -> None:
        """Forward and backward on the samples `idx`, then the update (or,
        accumulating, the update once every `accum_steps` batches); their loss and
        metric go into `totals`."""
        for part in self._parts(idx):
            plan = self.plan(len(part))
            self._load(plan, xs, ts, part)
            weight = self._weight(len(part))
            self._run_weight = np.float32(weight)
            loss = self._forward_backward(plan)
            if self._accum is not None:
                if not self.reorder:  # reordered, each gradient was added as it completed
                    self._accum += self.memory.grads * np.float32(weight)
                    for t, rows in self._row_accum.items():
                        rows.add(self.memory.row_grads[t], np.float32(weight))
                self._accum_weight += weight
            elif self.reorder:
                self._end_step()
            else:
                self._update(self.memory.grads)
            self._measure(totals, loss, len(part))
        if self._accum is not None:
            self._accum_count += 1
            if self._accum_count == self.accum_steps:
                self.flush()

    def flush(self) -> None:
        """Apply accumulated gradients (at the end of an effective batch or epoch)."""
        if not self._accum_count:
            return
        if self.art.training.reduction == "mean":
            self._accum /= np.float32(self._accum_weight)
            for rows in self._row_accum.values():
                rows.touched()[1][...] /= np.float32(self._accum_weight)
        self._update(self._accum)
        self._accum[...] = 0
        for rows in self._row_accum.values():
            rows.clear()
        self._accum_weight = self._accum_count = 0

    def _update(self, grads: np.ndarray) -> None:
        """Unscale and apply `grads` (and the lazy tables' touched rows) unless
        they hold inf/NaN (then the loss scale decides)."""
        finite = self.scaler.kind == "none" or bool(np.isfinite(grads).all())
        if finite:
            self.scaler.unscale(grads)
            if self.proximal is not None:
                self._check_proximal()
                mu, anchor = self.proximal
                grads += np.float32(mu) * (self.memory.params - anchor)
            self.optimizer.apply(self.memory.params, grads, self.schedule(self.optimizer.iterations),
                                 self.memory.dense_spans, self._tables)
            self.memory.refresh_weights()
        self.scaler.update(finite)

    def _check_proximal(self) -> None:
        if self.proximal is not None and self._tables:
            raise UserError(None, "FedProx's proximal term moves every row of a table: "
                                  "train with --embedding-update dense")

    def train_epoch(self, xs, ts, shuffle: bool, rng: Shuffler,
                    tick: Callable[[int], None] | None = None) -> dict:
        totals, busy, steps = Totals(), 0.0, 0
        skipped = self.scaler.skipped
        for idx in batch_indices(len(xs[0]), self.batch_size, shuffle, rng):
            start = time.perf_counter()
            self.train_batch(xs, ts, idx, totals)
            busy += time.perf_counter() - start
            steps += 1
            if tick:
                tick(len(idx))
        self.flush()
        self.epoch += 1
        return {"epoch": self.epoch, **totals.report(self.metric),
                "ms_per_step": 1000 * busy / steps,
                "loss_scale": self.scaler.report(),
                "loss_scale_by_tensor": self.scaler.layer_scales(),
                "skipped_steps": self.scaler.skipped - skipped,
                **self._underflow_report()}

    def _underflow_report(self) -> dict:
        counts = self.underflow.take()
        names = self.art.forward.tensors
        return {"grad_underflow": counts["weights"], "grad_underflow_all": counts["all"],
                "grad_underflow_by_tensor": {names[t].name: v for t, v in counts["by_tensor"].items()}}

    @quiet
    def fit(self, inputs, targets, epochs: int | None = None, shuffle: bool = True,
            seed: int | None = None,
            test: tuple | None = None, on_epoch: Callable[[dict], None] | None = None,
            rng: Shuffler | None = None, progress=None) -> list[dict]:
        """Train until `epochs` epochs are done (counting those already done);
        returns one record per epoch trained now.  `epochs` defaults to the
        trainer's (see __init__).  `progress(length, label)`, if given, makes a
        progress bar (a context manager with `update(n)`)."""
        epochs = self.resolved.parameters.epochs if epochs is None else epochs
        xs, ts = self.check_data(inputs, targets)
        if self.batch_size > len(xs[0]):
            raise UserError(None, f"--batch-size {self.batch_size} is larger than the data set "
                                  f"({len(xs[0])} samples)")
        test_data = self.check_data(*test) if test else None
        if rng is None:
            rng = self.data_order if seed is None and self.data_order else Shuffler(seed)
        self.data_order = rng
        history = []
        while self.epoch < epochs:
            if self._snapshot is not None:
                np.copyto(self._snapshot, self.memory.params)
            try:
                record = self._epoch_with_progress(xs, ts, shuffle, rng, progress)
                record = {"epoch": record["epoch"], "epochs": epochs, **record}
            except Diverged as e:
                kept = "the last finite weights"
                if not np.all(np.isfinite(self.memory.params)):
                    kept = self._restore()
                raise TrainingDiverged(self.art.frozen_path,
                                       f"training diverged in epoch {self.epoch + 1}: the loss "
                                       f"became {e.args[0]}; kept {kept} (a smaller "
                                       "--learning-rate may help)") from None
            if test_data:
                result = self.evaluate(*test_data, checked=True)
                record.update({f"test_{k}": v for k, v in result.items() if k != "samples"})
            history.append(record)
            if on_epoch:
                on_epoch(record)
        return history

    def _restore(self) -> str:
        """Put back the weights of the snapshot in RAM or, without one, of the .wof
        last saved (or read); says which."""
        if self._snapshot is not None:
            self.memory.params[...] = self._snapshot
            return "the weights of the epoch's start"
        saved = load_artifacts(self.art.frozen_path, self.saved_wof, with_backprop=False).weights
        for t, (lo, hi) in self.memory.offsets.items():  # the trained elements only
            first = self.memory.spans[t][0]
            self.memory.params[lo:hi] = saved[t].reshape(-1)[first:first + hi - lo]
        self.memory.refresh_weights()
        return f"the weights of {self.saved_wof}"

    def _epoch_with_progress(self, xs, ts, shuffle, rng, progress) -> dict:
        if progress is None:
            return self.train_epoch(xs, ts, shuffle, rng)
        with progress(len(xs[0]), f"epoch {self.epoch + 1}") as bar:
            return self.train_epoch(xs, ts, shuffle, rng, bar.update)

    @quiet
    def gradients(self, inputs, targets) -> tuple[float, dict[int, np.ndarray]]:
        """Loss and gradients of every trainable tensor on one batch, without an update."""
        xs, ts = self.check_data(inputs, targets)
        if len(xs[0]) > self.batch_size:
            raise UserError(None, f"{len(xs[0])} samples do not fit one batch of {self.batch_size}")
        loss, grads, total = 0.0, np.zeros(self.memory.dense_size, np.float32), 0
        tables = {t: np.zeros_like(self.memory.param_views[t]) for t in self.memory.lazy}
        for part in self._parts(np.arange(len(xs[0]))):
            plan = self.plan(len(part))
            self._load(plan, xs, ts, part)
            plan.run_forward()
            # reordered, each gradient is copied out where its update would run
            self._collect = np.empty_like(grads) if self.reorder else None
            try:
                plan.run_backward()
            finally:
                step_grads, self._collect = self._collect, None
            weight = self._weight(len(part))
            loss += float(plan.loss[0]) * weight
            grads += (self.memory.grads if step_grads is None else step_grads) * np.float32(weight)
            for t, table in tables.items():
                ids, values = self.memory.row_grads[t].touched()
                table[ids] += values.reshape((-1,) + table.shape[1:]) * np.float32(weight)
            total += weight
        if self.art.training.reduction == "mean":
            loss, grads = loss / total, grads / np.float32(total)
            for table in tables.values():
                table /= np.float32(total)
        return loss, {**{t: grads[lo:hi].reshape((-1,) + self.memory.grad_views[t].shape[1:])
                         for t, (lo, hi) in self.memory.grad_offsets.items()}, **tables}

    # -- evaluation ---------------------------------------------------------------------------
    def _batches(self, n: int):
        """The samples of a data set, a graph run at a time."""
        step = min(self.batch_size, self.run_rows)
        for start in range(0, n, step):
            yield np.arange(start, min(start + step, n))

    @quiet
    def evaluate(self, inputs, targets, checked: bool = False) -> dict:
        """Loss and metric over a whole data set, in batches of the training batch size."""
        xs, ts = (inputs, targets) if checked else self.check_data(inputs, targets)
        if self.art.backprop is None and self.art.training.trainable:
            raise UserError(self.art.frozen_path, "evaluation needs the backprop graph (its loss)")
        totals = Totals()
        for idx in self._batches(len(xs[0])):
            plan = self._judged(len(idx))
            self._load(plan, xs, ts, idx)
            plan.run_forward()
            plan.run_loss()
            self._measure(totals, float(plan.loss[0]), len(idx))
        return {**totals.report(self.metric), "samples": totals.samples}

    @quiet
    def predict(self, inputs) -> list[np.ndarray]:
        xs, _ = self.check_data(inputs)
        n = len(xs[0])
        plan = self.plan(self.run_rows)
        outs = [np.empty((n,) + o.shape[1:], o.dtype if o.dtype.kind in "biu" else np.float32)
                for o in plan.outputs]
        for idx in self._batches(n):
            plan = self.plan(len(idx))
            self._load(plan, xs, [], idx)
            plan.run_forward()
            for out, o in zip(outs, plan.outputs):
                out[idx] = o
        return outs

    def improved(self, before: dict, after: dict) -> bool:
        key = self.metric
        return after[key] > before[key] if HIGHER_IS_BETTER[key] else after[key] < before[key]

    def unplanned(self) -> list[str]:
        """The options this trainer runs with that differ from those the split's
        memory plan assumed, as the plan's values (e.g. "--accum-steps 1"): the
        memory held then differs from the plan.  [] when they agree, or for files
        that do not record them."""
        planned = self.art.training.planned_for
        if planned is None:
            return []
        ours = PlannedRun(self.scaler.kind, self.accum_steps, self.embedding_update)
        return [f"--{f.name.replace('_', '-')} " + ("N (a static scale)" if value == "static"
                                                    else str(value))
                for f in fields(planned)
                if (value := getattr(planned, f.name)) != getattr(ours, f.name)]

    # -- state --------------------------------------------------------------------------------
    def state(self) -> TrainerState:
        """A copy of where training stands; `restore` continues from it exactly."""
        opt = self.optimizer
        return TrainerState(
            self.memory.params.copy(), self.optimizer_name, opt.config(), opt.state(),
            opt.iterations, self.epoch, LossScaleState.from_dict(self.scaler.state(), None),
            ShufflerState(**self.data_order.state()) if self.data_order else None)

    def restore(self, state: TrainerState) -> None:
        """Continue from `state` (of a trainer of the same model, optimizer settings
        and loss scaling); UserError, naming no file, if it does not fit."""
        if state.optimizer != self.optimizer_name or state.params.shape != self.memory.params.shape:
            raise UserError(None, f"holds {state.optimizer} state for {state.params.size} "
                                  f"parameters; this run uses {self.optimizer_name} on "
                                  f"{self.memory.params.size}")
        if state.optimizer_config != self.optimizer.config():
            raise UserError(None, f"was saved with {state.optimizer} settings "
                                  f"{state.optimizer_config}; this run uses {self.optimizer.config()}")
        if state.loss_scale.kind != self.scaler.kind:
            raise UserError(None, f"was saved with loss scaling {state.loss_scale.kind!r}; "
                                  f"this run uses {self.scaler.kind!r}")
        try:
            self.optimizer.load_state(state.optimizer_state)
        except ValueError as e:
            raise UserError(None, str(e)) from None
        try:
            self.scaler.load_state(state.loss_scale.to_dict())
        except (KeyError, ValueError, IndexError) as e:
            raise UserError(None, f"does not fit this model's loss scaling ({e})",
                            "loss_scale") from None
        self.set_params(state.params)
        self.optimizer.iterations = state.iterations
        self.epoch = state.epoch
        self.data_order = Shuffler(**state.data_order.to_dict()) if state.data_order else None

    # -- weights ------------------------------------------------------------------------------
    def set_params(self, flat: np.ndarray) -> None:
        """Replace the flat fp32 master weights (e.g. from a checkpoint) and the
        working copy the graphs read."""
        self.plan(self.run_rows)  # the fp16 working copy is rounded by the plan's closures
        self.memory.params[...] = flat
        self.memory.refresh_weights()

    def weights(self) -> dict[int, np.ndarray]:
        return dict(self.memory.param_views)

    def save_weights(self, path=None) -> None:
        """Write the current weights as a .wof (atomically); refuses non-finite weights."""
        if not np.all(np.isfinite(self.memory.params)):
            raise UserError(path or self.art.wof_path, "weights hold NaN or inf; not saved")
        write_wof(path or self.art.wof_path, len(self.art.forward.tensors), self.weights())
        self.saved_wof = path or self.art.wof_path

    def memory_bytes(self) -> int:
        """Bytes of RAM the trainer's arrays hold: arena, weights, gradients,
        optimizer state, kernel scratch (each memory block once)."""
        return held_bytes(self)

    def mapped_bytes(self) -> int:
        """Bytes of the files the trainer reads in place through read-only maps:
        the models' constants and the frozen rows of the .wof."""
        return held_bytes(self, read_only=True)

