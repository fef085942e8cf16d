"""Learning-rate schedules: pure functions of the 0-based optimizer step.

They follow Keras 3's keras.optimizers.schedules:
  step           ExponentialDecay(base_lr, decay_steps, decay_rate, staircase=True)
  cosine         CosineDecay(base_lr, decay_steps, alpha)
  linear-warmup  CosineDecay's warmup: linear from warmup_start to base_lr over
                 warmup_steps, then constant, or a cosine decay over decay_steps
                 when decay_steps is given (CosineDecay(warmup_start, decay_steps,
                 alpha, warmup_target=base_lr, warmup_steps)).
"""
import functools
import math
from typing import Callable

from microtrain.files.errors import UserError

Schedule = Callable[[int], float]


def constant(step: int, base_lr: float) -> float:
    return base_lr


def step_decay(step: int, base_lr: float, decay_steps: int, decay_rate: float) -> float:
    return base_lr * decay_rate ** (step // decay_steps)


def cosine(step: int, base_lr: float, decay_steps: int, alpha: float) -> float:
    fraction = min(step, decay_steps) / decay_steps
    return base_lr * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * fraction)) + alpha)


def linear_warmup(step: int, base_lr: float, warmup_steps: int, warmup_start: float,
                  decay_steps: int | None, alpha: float) -> float:
    if step < warmup_steps:
        return warmup_start + (base_lr - warmup_start) * step / warmup_steps
    if decay_steps is None:
        return base_lr
    return cosine(step - warmup_steps, base_lr, decay_steps, alpha)


_FUNCTIONS = {"constant": constant, "step": step_decay, "cosine": cosine,
              "linear-warmup": linear_warmup}

# Parameters and their defaults.  Keras has no defaults for decay_steps and
# decay_rate; ours decay tenfold (PyTorch StepLR's gamma) every 1000 steps.
DEFAULTS: dict[str, dict] = {
    "constant": {},
    "step": {"decay_steps": 1000, "decay_rate": 0.1},
    "cosine": {"decay_steps": 1000, "alpha": 0.0},
    "linear-warmup": {"warmup_steps": 100, "warmup_start": 0.0, "decay_steps": None,
                      "alpha": 0.0},
}
SCHEDULES = tuple(_FUNCTIONS)

_STEP_COUNTS = {"decay_steps", "warmup_steps"}


def _check(name: str, value) -> None:
    if name in _STEP_COUNTS:
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise UserError(None, f"must be a whole number > 0, got {value!r}", name)
    elif not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise UserError(None, f"must be a number >= 0, got {value!r}", name)


def make_schedule(name: str, base_lr: float, **params) -> Schedule:
    """The schedule `name` as a function step -> learning rate.

    `params` override DEFAULTS[name]; a value of None counts as not given
    (except that linear-warmup's decay_steps is None by default: no decay).
    """
    if name not in _FUNCTIONS:
        raise UserError(None, f"unknown learning-rate schedule {name!r} "
                              f"(choose from {', '.join(SCHEDULES)})")
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - set(DEFAULTS[name]))
    if unknown:
        raise UserError(None, f"schedule {name} has no parameter {', '.join(unknown)}"
                              + (f" (it takes {', '.join(DEFAULTS[name])})" if DEFAULTS[name]
                                 else " (it takes none)"))
    full = {**DEFAULTS[name], **given}
    for key, value in full.items():
        if value is not None:
            _check(key, value)
    _check("learning_rate", base_lr)
    return functools.partial(_FUNCTIONS[name], base_lr=base_lr, **full)
