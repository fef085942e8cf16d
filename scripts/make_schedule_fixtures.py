"""Record Keras 3's learning rates for the schedules microtrain offers.

Run with the TensorFlow venv (not part of CI):
    TFENV/bin/python scripts/make_schedule_fixtures.py   # TFENV: a venv with tensorflow==2.21.*
writes tests/fixtures/keras_schedules.json: for each case, microtrain's schedule
name, base_lr and parameters, the Keras object that defines it, and the rate
Keras gives at each listed step.
"""
import json
from pathlib import Path

import keras
from keras.optimizers.schedules import CosineDecay, ExponentialDecay

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "keras_schedules.json"
STEPS = list(range(25)) + [99, 100, 101, 999, 1000, 1001, 2500, 10000]


def warmup_keras(base_lr, warmup_steps, warmup_start, decay_steps, alpha):
    # With no decay, the rate stays at base_lr after warmup: alpha = 1 makes
    # CosineDecay's decay factor (1 - alpha) * cos(...) + alpha equal to 1.
    if decay_steps is None:
        decay_steps, alpha = 1, 1.0
    return CosineDecay(warmup_start, decay_steps, alpha=alpha, warmup_target=base_lr,
                       warmup_steps=warmup_steps)


# (microtrain schedule, base_lr, microtrain parameters, Keras schedule)
CASES = [
    ("step", 0.1, dict(decay_steps=3, decay_rate=0.5),
     lambda: ExponentialDecay(0.1, 3, 0.5, staircase=True)),
    ("step", 0.01, dict(decay_steps=1000, decay_rate=0.1),
     lambda: ExponentialDecay(0.01, 1000, 0.1, staircase=True)),
    ("cosine", 0.1, dict(decay_steps=10, alpha=0.0),
     lambda: CosineDecay(0.1, 10, alpha=0.0)),
    ("cosine", 0.001, dict(decay_steps=20, alpha=0.25),
     lambda: CosineDecay(0.001, 20, alpha=0.25)),
    ("linear-warmup", 0.1, dict(warmup_steps=5, warmup_start=0.0, decay_steps=None, alpha=0.0),
     lambda: warmup_keras(0.1, 5, 0.0, None, 0.0)),
    ("linear-warmup", 0.05, dict(warmup_steps=4, warmup_start=0.01, decay_steps=10, alpha=0.1),
     lambda: warmup_keras(0.05, 4, 0.01, 10, 0.1)),
    ("linear-warmup", 0.002, dict(warmup_steps=100, warmup_start=0.0, decay_steps=1000, alpha=0.0),
     lambda: warmup_keras(0.002, 100, 0.0, 1000, 0.0)),
]


def record(name, base_lr, params, make):
    schedule = make()
    return {
        "schedule": name,
        "base_lr": base_lr,
        "params": params,
        "keras": {"class": type(schedule).__name__, "config": schedule.get_config()},
        "steps": STEPS,
        "lr": [float(schedule(step)) for step in STEPS],
    }


def main():
    cases = [record(*case) for case in CASES]
    # One case per line keeps the file short and its diffs readable.
    lines = ",\n  ".join(json.dumps(case) for case in cases)
    OUT.write_text(f'{{"keras_version": "{keras.__version__}",\n "cases": [\n  {lines}\n]}}\n')
    print(f"wrote {OUT} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
