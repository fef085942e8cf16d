"""Learning-rate schedules against Keras 3's recorded rates."""
import json
from pathlib import Path

import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.step.schedules import DEFAULTS, SCHEDULES, make_schedule

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "keras_schedules.json").read_text())


@pytest.mark.parametrize("case", FIXTURE["cases"],
                         ids=lambda c: f"{c['schedule']}@{c['base_lr']}")
def test_rates_match_keras(case):
    schedule = make_schedule(case["schedule"], case["base_lr"], **case["params"])
    ours = np.array([schedule(step) for step in case["steps"]], np.float32)
    # Keras computes in float32: near the end of a cosine its rate carries the
    # rounding of the base rate's scale, so the absolute tolerance is relative to it.
    np.testing.assert_allclose(ours, case["lr"], rtol=1e-6, atol=1e-6 * case["base_lr"])


def test_fixture_covers_every_decaying_schedule():
    assert {case["schedule"] for case in FIXTURE["cases"]} == set(SCHEDULES) - {"constant"}


def test_constant_and_step_edges():
    assert make_schedule("constant", 0.3)(10**6) == 0.3
    step = make_schedule("step", 1.0, decay_steps=10, decay_rate=0.5)
    assert [step(s) for s in (0, 9, 10, 19, 20)] == [1.0, 1.0, 0.5, 0.5, 0.25]


def test_linear_warmup_ramps_then_holds_or_decays():
    hold = make_schedule("linear-warmup", 0.1, warmup_steps=4)
    assert [hold(s) for s in (0, 2, 4, 1000)] == pytest.approx([0.0, 0.05, 0.1, 0.1])
    decay = make_schedule("linear-warmup", 0.1, warmup_steps=4, decay_steps=8, alpha=0.5)
    assert decay(4) == pytest.approx(0.1)
    assert decay(8) == pytest.approx(0.1 * (0.5 * 0.5 + 0.5))   # halfway down the cosine
    assert decay(12) == decay(10**6) == pytest.approx(0.05)


def test_defaults_fill_missing_parameters():
    assert make_schedule("cosine", 1.0).keywords == {"base_lr": 1.0, **DEFAULTS["cosine"]}
    assert make_schedule("step", 1.0, decay_rate=None).keywords["decay_rate"] == 0.1


@pytest.mark.parametrize("name, params, message", [
    ("exp", {}, r"unknown learning-rate schedule 'exp' \(choose from constant, step"),
    ("constant", dict(decay_steps=5), r"schedule constant has no parameter decay_steps"),
    ("cosine", dict(warmup_steps=5), r"\(it takes decay_steps, alpha\)"),
    ("step", dict(decay_steps=0), "decay_steps: must be a whole number > 0, got 0"),
    ("step", dict(decay_steps=2.5), "decay_steps: must be a whole number > 0"),
    ("cosine", dict(alpha=-0.1), "alpha: must be a number >= 0"),
])
def test_bad_requests_are_user_errors(name, params, message):
    with pytest.raises(UserError, match=message):
        make_schedule(name, 0.01, **params)
