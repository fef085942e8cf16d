"""Optimizers over one flat float32 parameter vector, with Keras 3's update formulas.

The trainer keeps every trainable weight in one flat buffer, so an optimizer sees
one parameter vector.  Each optimizer allocates its state and scratch once; an
update then works only through ufuncs writing into those buffers, so a training
step allocates nothing here.  A step is `begin` (its scalars, `_coefficients`:
bias corrections of the global step, formed once), then `update` of spans of the
weights, each as soon as its gradient is complete (the trainer's operator
reordering), and `update_rows` of embedding tables that update lazily
(microtrain/step/lazy.py) in the rows their gradient touched, then `end`; `apply`
does all of it for one gradient vector.  Every span and set of rows goes
through the same per-element rule (`_update`), a tile of at most TILE elements
at a time, so the scratch vectors hold one tile, not a copy of the weights, and
the order or tiling of the updates never changes a result.

Formulas follow keras/src/optimizers/*.py (Keras 3): scalars are rounded to
float32 as Keras casts them to the variable's dtype, and weight decay, when set,
is applied first as `w -= w * weight_decay * lr` (Keras's decoupled decay, for
every optimizer; AdamW is Adam with a default decay of 0.004).
"""
import math

import numpy as np

from microtrain.files.errors import UserError

f32 = np.float32
TILE = 1 << 14  # elements of one scratch vector: an update runs a tile at a time


def _unit(v):
    return 0 <= v < 1


# What each numeric hyperparameter must be; anything else is rejected.
_VALID = {
    "learning_rate": (lambda v: v > 0, "a number > 0"),
    "momentum": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "beta_1": (_unit, "a number in [0, 1)"),
    "beta_2": (_unit, "a number in [0, 1)"),
    "rho": (_unit, "a number in [0, 1)"),
    "epsilon": (lambda v: v >= 0, "a number >= 0"),
    "weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "initial_accumulator_value": (lambda v: v >= 0, "a number >= 0"),
}
_FLAGS = {"nesterov", "amsgrad", "centered"}


def _check(name, value):
    if name in _FLAGS:
        if not isinstance(value, bool):
            raise UserError(None, f"must be true or false, got {value!r}", name)
        return
    if name == "weight_decay" and value is None:   # Keras's "no decay"
        return
    ok, what = _VALID[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and ok(value)):
        raise UserError(None, f"must be {what}, got {value!r}", name)


def _const(value) -> np.ndarray:
    """`value` as a 0-d float32 array: a ufunc takes it faster than a numpy
    scalar (about 0.2 us a call, of some 12 calls a weight a step), with the same value."""
    return np.array(value, f32)


def _moving_average(avg, x, rate, tmp):
    """avg += (x - avg) * rate (`rate` float32), Keras's form of an exponential moving average."""
    np.subtract(x, avg, out=tmp)
    tmp *= rate
    avg += tmp


class Optimizer:
    """Base: hyperparameters, state vectors, scratch, iteration counter, weight decay."""

    defaults: dict = {}
    scratch = 2   # number of scratch vectors the update needs

    def __init__(self, size: int, dense: int | None = None, lazy_rows: int = 0,
                 **hyperparameters):
        """`size` weights, of which at most `dense` (default: all) update densely
        and at most `lazy_rows` elements in the touched rows of lazy tables."""
        unknown = set(hyperparameters) - set(self.defaults)
        if unknown:   # make_optimizer reports these to users; here it is a bug
            raise TypeError(f"{type(self).__name__} got unknown hyperparameters {unknown}")
        self._config = {**self.defaults, **hyperparameters}
        for name, value in self._config.items():
            _check(name, value)
        self.size = size
        self.iterations = 0
        self._state: dict[str, np.ndarray] = {}
        self._slots: dict[str, np.ndarray] = {}  # the per-weight state arrays
        span = min(max(size if dense is None else dense, lazy_rows), TILE)
        self._tmp = [np.empty(span, f32) for _ in range(self._scratch_vectors())]
        self._lazy_rows = lazy_rows
        # a lazy table's touched rows of the weights and of each state array
        self._rows = {"weights": np.empty(lazy_rows, f32)}
        wd = self._config.get("weight_decay")
        self._weight_decay = _const(wd) if wd else None

    def _scratch_vectors(self) -> int:
        return self.scratch

    def _slot(self, name: str, fill: float = 0.0) -> None:
        """Allocate one named per-weight state array, and room for its lazy rows."""
        self._state[name] = self._slots[name] = np.full(self.size, fill, f32)
        self._rows[name] = np.empty(self._lazy_rows, f32)

    def _scalar(self, name: str, value: float) -> np.ndarray:
        """Allocate one named state scalar (updated once a step)."""
        self._state[name] = np.full((), value, f32)
        return self._state[name]

    def config(self) -> dict:
        return dict(self._config)

    @property
    def learning_rate(self) -> float:
        """The base learning rate; `apply` takes the (scheduled) rate of each step."""
        return self._config["learning_rate"]

    def begin(self, lr: float) -> None:
        """Start a step at learning rate `lr`: its scalars, formed once."""
        self._lr = _const(lr)
        self._c = self._coefficients(self._lr, self.iterations + 1)

    def update(self, params: np.ndarray, grads: np.ndarray, lo: int, hi: int) -> None:
        """Update params[lo:hi] (float32, in place) with `grads` (hi - lo
        elements, which may be overwritten), weight decay included."""
        self.updater(params, lo, hi)(grads)

    def updater(self, params: np.ndarray, lo: int, hi: int):
        """`update` of params[lo:hi] as a closure over its views (a step calls it
        with each gradient, so the views are cut once)."""
        part = params[lo:hi]
        slots = {name: a[lo:hi] for name, a in self._slots.items()}
        if part.size > TILE:
            return lambda grads: self._step(part, grads, slots, self._lr, self._c)
        tmp = [t[:part.size] for t in self._tmp]  # a small weight's: cut once
        return lambda grads: self._tile(part, grads, slots, self._lr, self._c, tmp)

    def update_rows(self, params: np.ndarray, lo: int, hi: int, grad) -> None:
        """Update the rows the RowGrad `grad` touched of the table at params[lo:hi]."""
        self._step_rows(params, lo, hi, grad, self._lr, self._c)

    def end(self) -> None:
        self.iterations += 1

    def apply(self, params: np.ndarray, grads: np.ndarray, lr: float, spans=None,
              tables=()) -> None:
        """One whole step of `params` at learning rate `lr`: params[lo:hi] with
        grads[at:at + hi - lo] for each (lo, hi, at) of `spans` (default: all
        with all), and each (lo, hi, RowGrad) of `tables` (see update_rows).
        `grads` and the RowGrads may be overwritten (the trainer's next step
        rewrites them)."""
        self.begin(lr)
        for lo, hi, at in [(0, self.size, 0)] if spans is None else spans:
            self.update(params, grads[at:at + hi - lo], lo, hi)
        for lo, hi, grad in tables:
            self.update_rows(params, lo, hi, grad)
        self.end()

    def _step_rows(self, params, lo: int, hi: int, grad, lr, c) -> None:
        """Gather the touched rows of the table at params[lo:hi] and of its
        state, update them with their gradient, scatter them back."""
        ids, values = grad.touched()
        width = values.shape[1]
        tables = {name: a[lo:hi].reshape(-1, width)
                  for name, a in {"weights": params, **self._slots}.items()}
        rows = {name: self._rows[name][:ids.size * width].reshape(-1, width) for name in tables}
        for name, table in tables.items():
            np.take(table, ids, axis=0, out=rows[name])
        state = {name: rows[name].reshape(-1) for name in self._slots}
        self._step(rows["weights"].reshape(-1), values.reshape(-1), state, lr, c)
        for name, table in tables.items():
            table[ids] = rows[name]

    def _step(self, params, grads, slots: dict, lr, c) -> None:
        """Weight decay and the update of the aligned vectors `params`, `grads`
        and `slots` (state arrays by name), a tile at a time."""
        for lo in range(0, params.size, TILE):
            hi = lo + TILE
            self._tile(params[lo:hi], grads[lo:hi], {n: a[lo:hi] for n, a in slots.items()}, lr, c)

    def _tile(self, params, grads, slots: dict, lr, c, tmp=None) -> None:
        tmp = tmp or [t[:params.size] for t in self._tmp]
        if self._weight_decay is not None:
            t = tmp[0]
            np.multiply(params, self._weight_decay, out=t)
            t *= lr
            params -= t
        self._update(params, grads, slots, tmp, lr, c)

    def _coefficients(self, lr, step) -> tuple:
        """The scalars of step `step` every span uses (advancing any state scalar)."""
        return ()

    def _update(self, params, grads, slots, tmp, lr, c):
        raise NotImplementedError

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the state arrays (the iteration count is `iterations`)."""
        return {name: a.copy() for name, a in self._state.items()}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore arrays saved by `state`; ValueError if they do not fit this optimizer."""
        if set(state) != set(self._state):
            raise ValueError(f"optimizer state holds {sorted(state)}, "
                             f"{type(self).__name__} needs {sorted(self._state)}")
        for name, a in state.items():
            if np.shape(a) != self._state[name].shape:
                raise ValueError(f"optimizer state {name} has shape {np.shape(a)}, "
                                 f"expected {self._state[name].shape}")
        for name, a in state.items():
            np.copyto(self._state[name], a)


class SGD(Optimizer):
    """velocity = momentum * velocity - lr * g;  w += velocity
    (nesterov: w += momentum * velocity - lr * g);  without momentum w -= lr * g."""

    defaults = dict(learning_rate=0.01, momentum=0.0, nesterov=False, weight_decay=None)

    def __init__(self, size, **kwargs):
        super().__init__(size, **kwargs)
        self._momentum = _const(self._config["momentum"])
        if self._momentum != 0:
            self._slot("momentum")

    def _scratch_vectors(self) -> int:
        """Plain SGD needs none (lr * g is formed in the gradient vector, which
        the step overwrites next); weight decay and Nesterov's look-ahead one."""
        nesterov = self._config["nesterov"] and self._config["momentum"] != 0
        return int(nesterov or bool(self._config.get("weight_decay")))

    def _update(self, params, grads, slots, tmp, lr, c):
        lr_g = grads
        np.multiply(grads, lr, out=lr_g)
        m = slots.get("momentum")
        if m is None:
            params -= lr_g
            return
        m *= self._momentum
        m -= lr_g
        if self._config["nesterov"]:
            t = tmp[0]
            np.multiply(m, self._momentum, out=t)
            t -= lr_g
            params += t
        else:
            params += m


class Adam(Optimizer):
    """m += (g - m)(1 - b1);  v += (g² - v)(1 - b2);  (amsgrad: v = max(v_hat, v))
    w -= m * lr * sqrt(1 - b2^t) / (1 - b1^t) / (sqrt(v) + eps)."""

    defaults = dict(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                    amsgrad=False, weight_decay=None)

    def __init__(self, size, **kwargs):
        super().__init__(size, **kwargs)
        c = self._config
        self._b1, self._b2, self._eps = f32(c["beta_1"]), f32(c["beta_2"]), _const(c["epsilon"])
        self._rates = _const(1 - c["beta_1"]), _const(1 - c["beta_2"])
        self._slot("momentum")
        self._slot("velocity")
        if c["amsgrad"]:
            self._slot("velocity_hat")

    def _coefficients(self, lr, step):
        t = f32(step)
        return _const(lr * np.sqrt(f32(1) - self._b2 ** t) / (f32(1) - self._b1 ** t))

    def _update(self, params, grads, slots, tmp, lr, alpha):
        s, d = tmp
        m, v = slots["momentum"], slots["velocity"]
        _moving_average(m, grads, self._rates[0], s)
        np.square(grads, out=s)
        _moving_average(v, s, self._rates[1], s)
        v_hat = slots.get("velocity_hat")
        if v_hat is not None:
            np.maximum(v_hat, v, out=v_hat)
            v = v_hat
        np.multiply(m, alpha, out=s)
        np.sqrt(v, out=d)
        d += self._eps
        s /= d
        params -= s


class RMSprop(Optimizer):
    """v = rho v + (1 - rho) g²;  (centered: a = rho a + (1 - rho) g, v - a² in the root)
    step = lr g / sqrt(v + eps);  momentum > 0: mom = momentum mom + step, w -= mom."""

    defaults = dict(learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7,
                    centered=False, weight_decay=None)

    def __init__(self, size, **kwargs):
        super().__init__(size, **kwargs)
        c = self._config
        self._rho, self._eps = _const(c["rho"]), _const(c["epsilon"])
        self._one_minus_rho = _const(1 - c["rho"])
        self._momentum = _const(c["momentum"])
        self._slot("velocity")
        if c["momentum"] > 0:
            self._slot("momentum")
        if c["centered"]:
            self._slot("average_gradient")

    def _decay(self, avg, x):
        avg *= self._rho
        x *= self._one_minus_rho
        avg += x

    def _update(self, params, grads, slots, tmp, lr, c):
        s, d = tmp
        v, avg, mom = slots["velocity"], slots.get("average_gradient"), slots.get("momentum")
        np.square(grads, out=s)
        self._decay(v, s)
        if avg is not None:
            np.copyto(s, grads)
            self._decay(avg, s)
            np.square(avg, out=s)
            np.subtract(v, s, out=d)
        else:
            np.copyto(d, v)
        d += self._eps
        np.sqrt(d, out=d)
        np.multiply(grads, lr, out=s)
        s /= d
        if mom is not None:
            mom *= self._momentum
            mom += s
            s = mom
        params -= s


class Adagrad(Optimizer):
    """acc += g²;  w -= lr g / sqrt(acc + eps), acc starting at initial_accumulator_value."""

    defaults = dict(learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7,
                    weight_decay=None)

    def __init__(self, size, **kwargs):
        super().__init__(size, **kwargs)
        self._eps = _const(self._config["epsilon"])
        self._slot("accumulator", self._config["initial_accumulator_value"])

    def _update(self, params, grads, slots, tmp, lr, c):
        s, d = tmp
        acc = slots["accumulator"]
        np.square(grads, out=s)
        acc += s
        np.add(acc, self._eps, out=d)
        np.sqrt(d, out=d)
        np.multiply(grads, lr, out=s)
        s /= d
        params -= s


class Adamax(Optimizer):
    """m += (g - m)(1 - b1);  u = max(b2 u, |g|);  w -= lr m / ((1 - b1^t)(u + eps))."""

    defaults = dict(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                    weight_decay=None)

    def __init__(self, size, **kwargs):
        super().__init__(size, **kwargs)
        c = self._config
        self._b1, self._b2, self._eps = f32(c["beta_1"]), _const(c["beta_2"]), _const(c["epsilon"])
        self._rate = _const(1 - c["beta_1"])
        self._slot("m")
        self._slot("u")

    def _coefficients(self, lr, step):
        return _const(f32(1) - self._b1 ** f32(step))

    def _update(self, params, grads, slots, tmp, lr, correction):
        s, d = tmp
        m, u = slots["m"], slots["u"]
        _moving_average(m, grads, self._rate, s)
        u *= self._b2
        np.abs(grads, out=s)
        np.maximum(u, s, out=u)
        np.add(u, self._eps, out=d)
        d *= correction
        np.multiply(m, lr, out=s)
        s /= d
        params -= s


class Nadam(Optimizer):
    """Adam with Nesterov momentum and Keras's momentum schedule
    u_t = b1 (1 - 0.5 * 0.96^t), whose running product is kept as state."""

    defaults = dict(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                    weight_decay=None)
    scratch = 3

    def __init__(self, size, **kwargs):
        super().__init__(size, **kwargs)
        c = self._config
        self._b1, self._b2, self._eps = f32(c["beta_1"]), f32(c["beta_2"]), _const(c["epsilon"])
        # Unlike Adam, Keras's Nadam forms 1 - beta from the float32 betas.
        self._rates = _const(f32(1) - self._b1), _const(f32(1) - self._b2)
        self._slot("momentum")
        self._slot("velocity")
        self._u_product = self._scalar("u_product", 1.0)

    def _mu(self, t):
        return self._b1 * (f32(1) - f32(0.5) * f32(0.96) ** f32(t))

    def _coefficients(self, lr, step):
        """(m_coef, g_coef, v_coef) of step `step`, advancing the schedule's product."""
        u_t, u_next = self._mu(step), self._mu(step + 1)
        self._u_product *= u_t
        u_product = self._u_product[()]
        return tuple(map(_const, (u_next / (f32(1) - u_product * u_next),
                                  (f32(1) - u_t) / (f32(1) - u_product),
                                  f32(1) / (f32(1) - self._b2 ** f32(step)))))

    def _update(self, params, grads, slots, tmp, lr, coefficients):
        s, d, e = tmp
        m, v = slots["momentum"], slots["velocity"]
        m_coef, g_coef, v_coef = coefficients
        _moving_average(m, grads, self._rates[0], s)
        np.square(grads, out=s)
        _moving_average(v, s, self._rates[1], s)
        np.multiply(v, v_coef, out=d)     # v_hat
        np.sqrt(d, out=d)
        d += self._eps
        np.multiply(m, m_coef, out=s)     # m_hat = m_coef m + g_coef g
        np.multiply(grads, g_coef, out=e)
        s += e
        s *= lr
        s /= d
        params -= s


# CLI name -> (class, defaults that differ from the class's Keras defaults).
_PRESETS = {
    "sgd": (SGD, {}),
    "momentum": (SGD, {"momentum": 0.9}),
    "nesterov": (SGD, {"momentum": 0.9, "nesterov": True}),
    "adam": (Adam, {}),
    "adamw": (Adam, {"weight_decay": 0.004}),   # keras.optimizers.AdamW
    "rmsprop": (RMSprop, {}),
    "adagrad": (Adagrad, {}),
    "adamax": (Adamax, {}),
    "nadam": (Nadam, {}),
}
OPTIMIZERS: dict[str, type[Optimizer]] = {name: cls for name, (cls, _) in _PRESETS.items()}
DEFAULTS: dict[str, dict] = {name: {**cls.defaults, **changed}
                             for name, (cls, changed) in _PRESETS.items()}


class UnknownHyperparameters(UserError):
    """An optimizer given hyperparameters it does not take, named as Python names them;
    a command line names them as its options instead (`named`)."""

    def __init__(self, optimizer: str, unknown: list[str], accepted: list[str]):
        super().__init__(None, f"optimizer {optimizer} has no {', '.join(unknown)} "
                               f"(it takes {', '.join(accepted)})")
        self.optimizer, self.unknown, self.accepted = optimizer, unknown, accepted

    def named(self, names: dict[str, str]) -> "UnknownHyperparameters":
        """The same error in other names (e.g. options); those without one are left out
        of what the optimizer takes (a setting no option reaches)."""
        return UnknownHyperparameters(self.optimizer, [names.get(u, u) for u in self.unknown],
                                      [names[a] for a in self.accepted if a in names])


def make_optimizer(name: str, size: int, dense: int | None = None, lazy_rows: int = 0,
                   **given) -> Optimizer:
    """The optimizer `name` over `size` parameters (`dense` and `lazy_rows`: see
    Optimizer); `given` overrides DEFAULTS[name].

    A given value of None counts as not given, so a CLI can pass unset options through.
    """
    if name not in OPTIMIZERS:
        raise UserError(None, f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})")
    given = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(given) - set(DEFAULTS[name]))
    if unknown:
        raise UnknownHyperparameters(name, unknown, list(DEFAULTS[name]))
    return OPTIMIZERS[name](size, dense=dense, lazy_rows=lazy_rows, **{**DEFAULTS[name], **given})
