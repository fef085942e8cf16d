"""The options of `microtrain run` as one typed, validated record.

Each field states its option once: the help text, the default and what click
needs (flag, type, repeatable, on/off pair).  The commands' click options are
generated from the fields (`options`), `session` and `sweep` pass the record,
and a record writes itself back as a `microtrain run` command line (`argv`).
The training parameters recorded in the frozen model (optimizer, its
hyperparameters, batch size, epochs) default to None here: microtrain/parameters.py
takes them from the model then.

Help texts may hold `{purpose}` (where the option applies, for `trainconf`'s
memory estimates) and `{recorded}` (the record the training parameters come from).

The same fields (`option`) and functions (`options`, `check_options`,
`command_line`, `parse`) serve the records of the commands' own options:
`federated`'s FederatedSettings and `sweep`'s SweepSettings (here, as sweep.py is an
optional extra that the command line does not import).
"""
import os
import re
from dataclasses import MISSING, dataclass, field, fields

import click

from microtrain.files.contracts import MAX_INDEX, TrainingParameters
from microtrain.files.errors import UserError
from microtrain.step.lazy import DEFAULT_EMBEDDING_UPDATE, EMBEDDING_UPDATES
from microtrain.step.loss_scale import ADAPTIVE_DEFAULTS, DEFAULT_LOSS_SCALE, DYNAMIC_DEFAULTS
from microtrain.metrics import METRICS
from microtrain.step.optimizers import DEFAULTS as OPTIMIZER_DEFAULTS, OPTIMIZERS
from microtrain.step.schedules import DEFAULTS as SCHEDULE_DEFAULTS, SCHEDULES

RECORDED = "the frozen model's training parameters (recorded by trainconf split)"
HYPERPARAMETER, SCHEDULE, LOSS_SCALE = "hyperparameter", "schedule", "loss scale"
FILE = click.Path(dir_okay=False, path_type=str)

# Where a diverged run's weights are restored from (--divergence-snapshot)
DIVERGENCE_SNAPSHOTS = {
    "file": "those of the .wof last saved (or the one the run read), from disk: no copy of "
            "the weights in RAM",
    "ram": "those of the epoch's start, from a copy kept in RAM (4 bytes more per trained "
           "weight)"}
DEFAULT_DIVERGENCE_SNAPSHOT = "file"


class Shape(click.ParamType):
    """One sample's shape, written 8,8,1 (or 8x8x1)."""
    name = "shape"

    def convert(self, value, param, ctx):
        if isinstance(value, (tuple, list)):
            text = ",".join(map(str, value))
        else:
            text = str(value)
        try:
            return tuple(int(d) for d in re.split("[,x]", text))
        except ValueError:
            self.fail(f"{value!r} is not a shape like 8,8,1", param, ctx)


def defaults_text(table: dict) -> str:
    return "; ".join(f"{name}: " + (", ".join(f"{k}={v}" for k, v in opts.items()) or "-")
                     for name, opts in table.items())


def option(help: str, default=None, type=None, flag: str | None = None, off: str | None = None,
           multiple: bool = False, required: bool = False, group: str | None = None,
           param: str | None = None, argument: bool = False):
    """A field that is an option of `microtrain run`: `flag` (default: --the-name),
    `off` the flag that turns an on/off option off, `group` and `param` where the
    Trainer takes it (an optimizer hyperparameter, a schedule or loss-scale
    parameter, and under which name)."""
    meta = {"help": help, "type": type, "flag": flag, "off": off, "multiple": multiple,
            "required": required, "group": group, "param": param, "argument": argument}
    if argument:
        return field(metadata=meta)
    return field(default=() if multiple else default, metadata=meta)


def _recorded(value) -> str:
    return "  [default: {recorded}, else " + str(value) + "]"


_TRAINING = TrainingParameters()


def _hyperparameter(text: str, flag: str | None = None):
    return option(text + "  [default: {recorded} when it names the same optimizer, else the "
                         "optimizer's]", type=float, flag=flag, group=HYPERPARAMETER)


def _schedule(text: str, type=float):
    return option(f"Schedule {text}. Default: the schedule's (see --lr-schedule).", type=type,
                  group=SCHEDULE)


def _loss_scale(text: str, param: str, type=float, shown=None):
    default = DYNAMIC_DEFAULTS.get(param, ADAPTIVE_DEFAULTS.get(param))
    return option(f"{text} Default: {default:g}{shown or ''}.", type=type, group=LOSS_SCALE,
                  param=param)


@dataclass(frozen=True)
class RunConfig:
    """How `microtrain run` trains: the model's files, the data and every option."""
    frozen: str = option("The frozen forward graph, STEM.frozen.circle.", type=FILE,
                         argument=True)
    wof: str | None = option("Weights file. Default: STEM.wof beside the frozen model.",
                             type=FILE)
    backprop: str | None = option(
        "Backprop graph. Default: STEM.backprop.circle beside the frozen model.", type=FILE)
    inputs: tuple[str, ...] = option(
        "Input samples: X.npy, X.npz:KEY or raw float32 X.bin. Repeat for a model with several "
        "inputs, in the model's input order.", flag="--input", multiple=True, required=True)
    input_shapes: tuple[tuple[int, ...], ...] = option(
        "Shape of one sample of a raw .bin input, e.g. 8,8,1 (one per --input). Default: "
        "none (.npy and .npz files hold their shapes).", type=Shape(), flag="--input-shape",
        multiple=True)
    batch_size: int | None = option(
        "Samples per step{purpose}; a partial last batch is used, not dropped."
        + _recorded(_TRAINING.batch_size), type=click.IntRange(1))
    targets: tuple[str, ...] = option(
        "Target samples, same formats as --input; one per model output.", flag="--target",
        multiple=True, required=True)
    target_shapes: tuple[tuple[int, ...], ...] = option(
        "Shape of one sample of a raw .bin target (one per --target). Default: none.",
        type=Shape(), flag="--target-shape", multiple=True)
    test_inputs: tuple[str, ...] = option(
        "Test-set inputs (formats as --input); used for the test loss and to decide whether "
        "the weights improved. Default: none.", flag="--test-input", multiple=True)
    test_targets: tuple[str, ...] = option("Test-set targets. Default: none.",
                                           flag="--test-target", multiple=True)
    validation_split: float | None = option(
        "Hold out this last fraction of the training data as the test set (as Keras). "
        "Default: none.", type=click.FloatRange(0, 1, min_open=True, max_open=True))
    # at most what circle+ records (an int32, schemas/circle_traininfo.fbs)
    epochs: int | None = option("Epochs to train." + _recorded(_TRAINING.epochs),
                                type=click.IntRange(1, MAX_INDEX))
    shuffle: bool = option("Shuffle the training samples every epoch.", True, type=bool,
                           off="--no-shuffle")
    seed: int | None = option("Seed of the shuffling order. Default: random.", type=int)
    optimizer: str | None = option(
        "Update rule, as Keras 3's{purpose}." + _recorded(_TRAINING.optimizer)
        + " Its hyperparameters' defaults: " + defaults_text(OPTIMIZER_DEFAULTS),
        type=click.Choice(list(OPTIMIZERS)))
    learning_rate: float | None = _hyperparameter("Base learning rate.")
    momentum: float | None = _hyperparameter("Momentum (sgd, momentum, nesterov, rmsprop).")
    beta_1: float | None = _hyperparameter("First-moment decay (adam, adamw, adamax, nadam).",
                                           "--beta1")
    beta_2: float | None = _hyperparameter("Second-moment decay (adam, adamw, adamax, nadam).",
                                           "--beta2")
    epsilon: float | None = _hyperparameter("Numerical-stability epsilon.")
    rho: float | None = _hyperparameter("Squared-gradient decay (rmsprop).")
    weight_decay: float | None = _hyperparameter(
        "Decoupled weight decay, w -= w * weight_decay * lr before each update.")
    lr_schedule: str = option("Learning-rate schedule over optimizer steps. Parameter "
                              "defaults: " + defaults_text(SCHEDULE_DEFAULTS), "constant",
                              type=click.Choice(SCHEDULES))
    decay_steps: int | None = _schedule(": steps per decay / cosine length",
                                        type=click.IntRange(1))
    decay_rate: float | None = _schedule("step: factor applied every decay-steps")
    alpha: float | None = _schedule("cosine/linear-warmup: final fraction of the lr")
    warmup_steps: int | None = _schedule("linear-warmup: warm-up steps", type=click.IntRange(1))
    warmup_start: float | None = _schedule("linear-warmup: lr at step 0")
    metric: str | None = option(
        "Metric to report, over every output together. Default: accuracy for cross-entropy "
        "losses, else the loss kind.", type=click.Choice(list(METRICS)))
    loss_scale: str = option(
        "Loss scaling against fp16 gradient underflow{purpose}: none, a number (static "
        "scale), dynamic (grow/back off) or adaptive (a scale per layer).  Any scale holds "
        "every gradient of a step until all are known finite; none updates each weight as "
        "soon as its gradient is complete.", DEFAULT_LOSS_SCALE, type=str)
    loss_scale_init: float | None = _loss_scale("dynamic: initial scale.", "init",
                                                shown=" (2^15)")
    growth_factor: float | None = _loss_scale("dynamic/adaptive: scale growth.", "growth_factor")
    backoff_factor: float | None = _loss_scale(
        "dynamic/adaptive: scale back-off on inf/NaN gradients.", "backoff_factor")
    growth_interval: int | None = _loss_scale(
        "dynamic/adaptive: finite steps in a row before growing.", "growth_interval",
        type=click.IntRange(1))
    min_scale: float | None = _loss_scale("dynamic: smallest scale.", "min_scale")
    max_scale: float | None = _loss_scale("dynamic: largest scale.", "max_scale",
                                          shown=" (2^24)")
    adaptive_interval: int | None = _loss_scale(
        "adaptive: steps between choosing the per-layer scales.", "interval",
        type=click.IntRange(1))
    adaptive_threshold: float | None = _loss_scale(
        "adaptive: allowed probability of underflow per layer.", "threshold",
        type=click.FloatRange(0, 1, min_open=True, max_open=True))
    accum_steps: int = option("Accumulate the gradients of this many batches before each "
                              "update.", 1, type=click.IntRange(1))
    embedding_update: str = option(
        "How embedding tables (GATHER/EMBEDDING_LOOKUP on a trained table) update{purpose}: "
        + "; ".join(f"{k}: {v}" for k, v in EMBEDDING_UPDATES.items())
        + ". lazy holds a table's gradient as the touched rows only; it needs fp32 and "
          "no loss scaling; a table also read as a dense layer's weight stays dense.",
        DEFAULT_EMBEDDING_UPDATE, type=click.Choice(list(EMBEDDING_UPDATES)))
    divergence_snapshot: str = option(
        "When a run's loss and weights become NaN or inf, the weights it puts back{purpose}: "
        + "; ".join(f"{k}: {v}" for k, v in DIVERGENCE_SNAPSHOTS.items()) + ".",
        DEFAULT_DIVERGENCE_SNAPSHOT, type=click.Choice(list(DIVERGENCE_SNAPSHOTS)))
    checkpoint: str | None = option(
        "Save weights, optimizer and RNG state here after every epoch. Default: none.",
        type=FILE)
    resume: bool = option("Continue from --checkpoint. Default: start afresh.", False, type=bool)
    output_wof: str | None = option(
        "Write the trained weights here. Default: overwrite the input .wof.", type=FILE)
    save: str = option(
        "improved: write the weights only if the test metric (the training metric without a "
        "test set) is better than with the starting weights.", "improved",
        type=click.Choice(["improved", "always", "never"]))

    def __post_init__(self):
        check_options(self)
        if bool(self.test_inputs) != bool(self.test_targets):
            raise UserError(None, "give --test-input and --test-target together")
        if self.validation_split and self.test_inputs:
            raise UserError(None, "give either --validation-split or --test-input, not both")
        if self.resume and not self.checkpoint:
            raise UserError(None, "--resume needs --checkpoint PATH")

    def hyperparameters(self) -> dict:
        """The optimizer's hyperparameters given (by Keras's names)."""
        return self._given(HYPERPARAMETER)

    def schedule_params(self) -> dict:
        """The learning-rate schedule's parameters given."""
        return self._given(SCHEDULE)

    def loss_scale_params(self) -> dict:
        """The loss scaling's parameters given (by make_loss_scale's names)."""
        return self._given(LOSS_SCALE)

    def _given(self, group: str) -> dict:
        return {f.metadata["param"] or f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata["group"] == group and getattr(self, f.name) is not None}

    def argv(self) -> list[str]:
        """The arguments of `microtrain run` that give this record (defaults left out)."""
        return command_line(self)

    @classmethod
    def from_argv(cls, argv) -> "RunConfig":
        """The record a `microtrain run` command line gives (its options only)."""
        return cls(**parse(cls, argv))


def option_fields(record) -> list:
    """The fields of a record (class or instance) that are command-line options."""
    return [f for f in fields(record) if "help" in f.metadata]


def check_options(record) -> None:
    """Convert every option field of `record` (frozen or not) to the type it holds;
    a bad value is a UserError naming the option."""
    for f in option_fields(record):
        object.__setattr__(record, f.name, _checked(f, getattr(record, f.name)))


def command_line(record) -> list[str]:
    """The arguments that give `record`'s option fields (defaults left out)."""
    args = []
    for f in option_fields(record):
        value, meta = getattr(record, f.name), f.metadata
        if value == f.default or value is None:
            continue
        if meta["argument"]:
            args.append(value)
        elif meta["type"] is bool:
            args.append(flag(f) if value else meta["off"])
        else:
            for item in value if meta["multiple"] else [value]:
                args += [flag(f), _text(item)]
    return args


def parse(record_type, argv) -> dict:
    """The option fields' values that the command line `argv` gives, by field name."""
    command = options(record=record_type)(click.Command("parse", callback=lambda **kw: kw))
    try:
        with command.make_context("parse", list(argv)) as ctx:
            return ctx.params
    except click.ClickException as e:
        raise UserError(None, e.format_message()) from None


def flag(f) -> str:
    """A field's option as typed, e.g. --learning-rate."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


# Fields that `microtrain sweep` takes as they are: the model, the data and how trials are
# judged.  Every other field can be swept (SWEEPABLE, by grid name), except those the sweep
# replaces with its own log and saving rule.  Here, not in sweep.py (an optional extra),
# since the command line states the sweep's options.
SWEEP_FIXED = ("frozen", "wof", "backprop", "inputs", "input_shapes", "targets", "target_shapes",
               "test_inputs", "test_targets", "validation_split", "metric", "output_wof")
SWEEP_REPLACES = ("checkpoint", "resume", "save")
SWEEPABLE = {flag(f)[2:]: f for f in fields(RunConfig)
             if f.name not in SWEEP_FIXED + SWEEP_REPLACES}


@dataclass(frozen=True)
class SweepSettings:
    """How `microtrain sweep` searches: its own options (the run's are a RunConfig)."""
    random: int | None = option("Sample this many combinations (seeded by --seed). Default: "
                                "the full grid.", type=click.IntRange(1))
    search: str = option(
        "grid: every combination (or --random's sample); tpe: Optuna's model-based search of "
        "--trials trials, pruning hopeless ones after each epoch (optional extra [search]).",
        "grid", type=click.Choice(["grid", "tpe"]))
    trials: int = option("Trials of --search tpe.", 20, type=click.IntRange(1))
    halving: bool = option(
        "Successive halving: every combination trains a few epochs, the better half goes on "
        "(from its checkpoint) to twice as many, until the full --epochs. Default: every trial "
        "trains the full --epochs.", False, type=bool)
    seed: int = option("Seed of the sampling and of every trial's data order (unless seed is "
                       "swept).", 0, type=int)
    jobs: int = option("Trials run at once, in worker processes, each with its share of the "
                       "cores for BLAS (optional extra [parallel]).", 1, type=click.IntRange(1))
    log: str | None = option("The sweep's JSON Lines log; a sweep given an existing log resumes "
                             "it. Default: STEM.sweep.jsonl beside the frozen model.", type=FILE)

    def __post_init__(self):
        check_options(self)
        if self.random and self.search == "tpe":
            raise UserError(None, "give either --random N or --search tpe")
        if self.search == "tpe" and (self.jobs > 1 or self.halving):
            raise UserError(None, "--search tpe runs one trial at a time and prunes it epoch "
                                  "by epoch itself: leave out --jobs and --halving")

    @property
    def method(self) -> str:
        """grid, random or tpe, as the log records it."""
        return "random" if self.random else self.search


def _text(value) -> str:
    """A value as the option parses it back: floats exactly (repr), shapes as 8,8,1."""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def convert(f, value):
    """`value` (text from a command line, or a Python value) as field `f` holds it;
    a bad one is a UserError naming the option."""
    kind = f.metadata["type"]
    if kind is None or value is None:
        return value
    if kind is bool:
        kind = click.BOOL
    elif not isinstance(kind, click.ParamType):
        kind = click.types.convert_type(kind)
    try:
        return kind.convert(value, None, None)
    except click.BadParameter as e:
        raise UserError(None, e.message.rstrip("."), flag(f)) from None


def _checked(f, value):
    if not f.metadata["multiple"]:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        return convert(f, value)
    if isinstance(value, (str, bytes, os.PathLike)) or not hasattr(value, "__iter__"):
        raise UserError(None, f"expected a list of values, got {value!r}", flag(f))
    return tuple(convert(f, os.fspath(v) if isinstance(v, os.PathLike) else v) for v in value)


def _param_decorator(f, purpose: str, recorded: str):
    meta = f.metadata
    if meta["argument"]:
        return click.argument(f.name, type=meta["type"])
    text = meta["help"].format(purpose=purpose, recorded=recorded)
    decls = [flag(f) + (f"/{meta['off']}" if meta["off"] else ""), f.name]
    shown = f.default not in (None, (), MISSING) and f.default is not False  # 0 is shown
    if meta["type"] is bool:
        return click.option(*decls, is_flag=True, default=f.default, show_default=shown,
                            help=text)
    return click.option(*decls, type=meta["type"], multiple=meta["multiple"],
                        required=meta["required"], show_default=shown, help=text,
                        default=None if f.default in (None, ()) else f.default)


def options(names=None, exclude=(), purpose: str = "", recorded: str = RECORDED,
            record=RunConfig):
    """Decorate a click command with the options (and FROZEN argument) of `record`'s
    option fields `names` (default: all) less `exclude`, in the record's order."""
    chosen = [f for f in option_fields(record) if (names is None or f.name in names)
              and f.name not in exclude]

    def decorate(fn):
        for f in reversed(chosen):
            fn = _param_decorator(f, purpose, recorded)(fn)
        return fn
    return decorate


def group(name: str) -> list[str]:
    """The fields of a group (e.g. HYPERPARAMETER)."""
    return [f.name for f in fields(RunConfig) if f.metadata["group"] == name]
