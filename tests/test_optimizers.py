"""Optimizers against Keras 3's recorded steps, plus the conventions Keras fixes."""
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.step.optimizers import DEFAULTS, OPTIMIZERS, make_optimizer

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "keras_optimizer_steps.json").read_text())
RUNS = {run["optimizer"]: run for run in FIXTURE["runs"]}
RNG = np.random.default_rng(7)


def test_fixture_covers_every_optimizer():
    assert set(RUNS) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_steps_match_keras(name):
    run = RUNS[name]
    lr = run["optimizer_config"]["learning_rate"]
    opt = make_optimizer(name, len(FIXTURE["initial"]), learning_rate=lr)
    params = np.array(FIXTURE["initial"], np.float32)
    for step, (grad, expected) in enumerate(zip(FIXTURE["gradients"], run["values"])):
        opt.apply(params, np.array(grad, np.float32), lr)
        np.testing.assert_allclose(params, expected, rtol=1e-6, atol=0, err_msg=f"step {step}")
    assert opt.iterations == len(run["values"])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_defaults_are_keras_defaults(name):
    # The fixture was recorded with Keras's defaults for everything but the learning rate.
    keras_config = RUNS[name]["optimizer_config"]
    ours = {k: v for k, v in DEFAULTS[name].items() if k != "learning_rate"}
    assert ours == {k: keras_config[k] for k in ours}
    assert DEFAULTS[name]["learning_rate"] == (0.01 if OPTIMIZERS[name].__name__ == "SGD" else 0.001)


def test_momentum_sign_convention():
    # Keras keeps velocity = momentum * velocity - lr * g (negative for a positive
    # gradient) and adds it; nesterov adds momentum * velocity - lr * g.
    lr, g, w0 = 0.1, np.float32(2.0), 1.0
    for name, first_step, second_step in [
            ("momentum", -lr * g, -(0.9 * lr * g + lr * g)),
            ("nesterov", -1.9 * lr * g, 0.9 * -(1.9 * lr * g) - lr * g)]:
        opt = make_optimizer(name, 1, learning_rate=lr)
        w = np.array([w0], np.float32)
        opt.apply(w, np.array([g]), lr)
        np.testing.assert_allclose(w, w0 + first_step, rtol=1e-6)
        assert opt.state()["momentum"][0] == pytest.approx(-lr * g, rel=1e-6)
        before = w.copy()
        opt.apply(w, np.array([g]), lr)
        np.testing.assert_allclose(w - before, second_step, rtol=1e-5)


@pytest.mark.parametrize("plain, decayed", [("sgd", "sgd"), ("adam", "adamw")])
def test_weight_decay_applies_before_the_update(plain, decayed):
    lr, wd = 0.1, 0.5
    w0 = RNG.standard_normal(5).astype(np.float32)
    g = RNG.standard_normal(5).astype(np.float32)
    without, with_decay = w0.copy(), w0.copy()
    make_optimizer(plain, 5, weight_decay=0.0).apply(without, g.copy(), lr)  # apply may
    make_optimizer(decayed, 5, weight_decay=wd).apply(with_decay, g.copy(), lr)  # overwrite g
    # The first step's update does not depend on w (SGD: lr g; Adam: ~lr sign(g)),
    # so decay first shifts the result by exactly -w0 * wd * lr.
    np.testing.assert_allclose(with_decay - without, -w0 * wd * lr, rtol=1e-5, atol=1e-7)
    decay_after = (without - without * wd * lr) - without
    assert not np.allclose(with_decay - without, decay_after, rtol=1e-3)


def _keras_formula_reference(name, config, w, grads, lr):
    """float64 transcriptions of the Keras update rules for variants the fixture lacks."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    a = np.zeros_like(w)
    v_hat = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        if name == "adam":   # amsgrad
            m += (g - m) * (1 - config["beta_1"])
            v += (g * g - v) * (1 - config["beta_2"])
            v_hat = np.maximum(v_hat, v)
            alpha = lr * np.sqrt(1 - config["beta_2"] ** t) / (1 - config["beta_1"] ** t)
            w -= m * alpha / (np.sqrt(v_hat) + config["epsilon"])
        else:                # rmsprop, centered and with momentum
            rho = config["rho"]
            v = rho * v + (1 - rho) * g * g
            a = rho * a + (1 - rho) * g
            m = config["momentum"] * m + lr * g / np.sqrt(v - a * a + config["epsilon"])
            w -= m
    return w


@pytest.mark.parametrize("name, given", [
    ("adam", dict(amsgrad=True)),
    ("rmsprop", dict(centered=True, momentum=0.5)),
])
def test_variants_follow_keras_formulas(name, given):
    w = RNG.standard_normal(50).astype(np.float32)
    # Shrinking gradients make amsgrad's max(v_hat, v) differ from v.
    grads = [RNG.standard_normal(50).astype(np.float32) / (1 + 3 * k) for k in range(8)]
    opt = make_optimizer(name, 50, **given)
    expected = _keras_formula_reference(name, opt.config(), w, grads, 0.01)
    for g in grads:
        opt.apply(w, g.copy(), 0.01)
    # float32 steps on weights of size ~1 leave absolute errors of a few 1e-7.
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=2e-6)
    state = opt.state()
    if "velocity_hat" in state:
        assert (state["velocity_hat"] > state["velocity"]).any()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_round_trip_resumes_exactly(name):
    w0 = RNG.standard_normal(20).astype(np.float32)
    grads = RNG.standard_normal((6, 20)).astype(np.float32)
    straight, resumed = w0.copy(), w0.copy()
    opt = make_optimizer(name, 20)
    for g in grads:
        opt.apply(straight, g.copy(), 0.01)
    first = make_optimizer(name, 20)
    for g in grads[:3]:
        first.apply(resumed, g.copy(), 0.01)
    second = make_optimizer(name, 20)
    second.load_state(first.state())
    second.iterations = first.iterations
    for g in grads[3:]:
        second.apply(resumed, g.copy(), 0.01)
    np.testing.assert_array_equal(resumed, straight)


def test_load_state_rejects_a_foreign_state():
    adam = make_optimizer("adam", 4)
    with pytest.raises(ValueError, match="needs"):
        adam.load_state(make_optimizer("rmsprop", 4).state())
    with pytest.raises(ValueError, match="shape"):
        adam.load_state(make_optimizer("adam", 5).state())


def test_apply_allocates_nothing_per_call():
    size = 100_000
    w = np.zeros(size, np.float32)
    g = RNG.standard_normal(size).astype(np.float32)
    for name in OPTIMIZERS:
        opt = make_optimizer(name, size, weight_decay=0.01)
        grads = g.copy()
        opt.apply(w, grads, 0.001)
        tracemalloc.start()
        for _ in range(5):
            opt.apply(w, grads, 0.001)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < size, f"{name} allocated {peak} bytes in apply"


def test_make_optimizer_fills_defaults_and_takes_given_values():
    opt = make_optimizer("rmsprop", 3, rho=0.8, momentum=None)   # None: not given
    assert opt.config() == {**DEFAULTS["rmsprop"], "rho": 0.8}
    assert make_optimizer("nesterov", 3).config()["nesterov"] is True
    assert make_optimizer("adamw", 3).config()["weight_decay"] == 0.004


@pytest.mark.parametrize("name, given, message", [
    ("adagard", {}, r"unknown optimizer 'adagard' \(choose from sgd, momentum"),
    ("adam", dict(momentum=0.9), r"optimizer adam has no momentum \(it takes"),
    ("adam", dict(beta_1=1.0), r"beta_1: must be a number in \[0, 1\), got 1.0"),
    ("sgd", dict(learning_rate=float("nan")), "learning_rate: must be a number > 0"),
    ("sgd", dict(nesterov="yes"), "nesterov: must be true or false"),
    ("adamw", dict(weight_decay=-1.0), "weight_decay: must be a number >= 0"),
])
def test_make_optimizer_rejects_bad_requests(name, given, message):
    with pytest.raises(UserError, match=message):
        make_optimizer(name, 3, **given)
