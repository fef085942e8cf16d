"""Loss scaling: keep small fp16 gradients from underflowing.

The loss gradient is multiplied by a scale before backpropagation; weight
gradients are divided by it again in fp32 before the optimizer.  Kinds:
  none      scale 1
  static    a fixed scale
  dynamic   as PyTorch's GradScaler / Keras's LossScaleOptimizer: back off on a
            non-finite gradient (the update is skipped), grow after
            `growth_interval` finite steps in a row
  adaptive  a scale per layer (Zhao et al., 2019) on top of a dynamic safety net
"""
import math

import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.graph import Graph, Op
from microtrain.step.kernels import prepare
from microtrain.files.loss_registry import LOSS_OPS

F16_TINY = 2.0 ** -24  # smallest fp16 subnormal
F16_SAFE_MAX = 65504.0 / 2  # headroom below fp16's largest value

DEFAULT_LOSS_SCALE = "none"
DYNAMIC_DEFAULTS = {"init": 2.0 ** 15, "growth_factor": 2.0, "backoff_factor": 0.5,
                    "growth_interval": 2000, "min_scale": 1.0, "max_scale": 2.0 ** 24}
ADAPTIVE_DEFAULTS = {"interval": 100, "threshold": 1e-3}


def _scale_by(a: np.ndarray, scaler: "LossScale"):
    """Multiply `a` by the scaler's seed as it is at each call."""
    def step():
        np.multiply(a, scaler.seed, out=a)
    return step


class LossScale:
    """No scaling; the base of the others."""

    kind = "none"

    def __init__(self):
        self.seed = np.float32(1)  # multiplies the loss gradient
        self.skipped = 0

    @property
    def scale(self) -> float:
        return float(self.seed)

    def bind(self, art, grad_offsets: dict[int, tuple[int, int]]) -> None:
        """Called once with the loaded artifacts and each gradient's place in the flat buffer."""

    def kernel(self, op: Op, inputs, outputs):
        """The op's closure (built within the scratch layout its caller began)."""
        return prepare(op.type, inputs, outputs, **op.options)

    def hooks(self, op: Op) -> bool:
        """Whether `kernel` or `after` do more for `op` than run its kernel (then
        the op reads and writes whole tensors: its statistics are over the batch)."""
        return op.type in LOSS_OPS and self.kind != "none"

    def after(self, op: Op, inputs, outputs) -> list:
        """Closures to run right after `op` of the backprop graph, before rounding."""
        if op.type in LOSS_OPS and self.kind != "none":
            return [_scale_by(outputs[1], self)]
        return []

    def closures(self, op: Op, inputs, outputs) -> list:
        """The closures of `op` of the backprop graph: its kernel and what follows it."""
        return [self.kernel(op, inputs, outputs), *self.after(op, inputs, outputs)]

    def unscale(self, grads: np.ndarray) -> None:
        if self.kind != "none":
            grads *= np.float32(1.0 / self.scale)

    def update(self, finite: bool) -> bool:
        """After the gradients of one (effective) batch: whether to apply them."""
        if not finite:
            self.skipped += 1
        return finite

    def report(self):
        return self.scale

    def layer_scales(self) -> dict[str, float]:
        """Scales per gradient tensor, by name (adaptive scaling only)."""
        return {}

    def state(self) -> dict:
        return {"kind": self.kind, "seed": self.scale, "skipped": self.skipped}

    def load_state(self, state: dict) -> None:
        self.seed = np.float32(state["seed"])
        self.skipped = state["skipped"]


class StaticScale(LossScale):
    kind = "static"

    def __init__(self, scale: float):
        super().__init__()
        self.seed = np.float32(scale)


class DynamicScale(LossScale):
    kind = "dynamic"

    def __init__(self, **params):
        super().__init__()
        unknown = set(params) - set(DYNAMIC_DEFAULTS)
        if unknown:
            raise UserError(None, f"unknown loss-scale parameters {sorted(unknown)}")
        p = {**DYNAMIC_DEFAULTS, **params}
        if not 0 < p["min_scale"] <= p["init"] <= p["max_scale"] or p["growth_factor"] < 1 \
                or not 0 < p["backoff_factor"] < 1:
            raise UserError(None, "loss scale: need 0 < min-scale <= initial scale <= max-scale, "
                                  "growth-factor >= 1 and 0 < backoff-factor < 1")
        self.seed = np.float32(p["init"])
        self.growth_factor, self.backoff_factor = p["growth_factor"], p["backoff_factor"]
        self.growth_interval = p["growth_interval"]
        self.min_scale, self.max_scale = p["min_scale"], p["max_scale"]
        self.good_steps = 0

    def update(self, finite: bool) -> bool:
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self._set(self.scale * self.growth_factor)
        else:
            self.skipped += 1
            self._set(self.scale * self.backoff_factor)
        return finite

    def _set(self, value: float) -> None:
        self.seed = np.float32(min(max(value, self.min_scale), self.max_scale))
        self.good_steps = 0

    def state(self) -> dict:
        return {**super().state(), "good_steps": self.good_steps}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.good_steps = state["good_steps"]


def erfinv(y: float) -> float:
    """Inverse error function by Newton's method on math.erf (|y| < 1)."""
    x = math.sqrt(math.pi) / 2 * y
    for _ in range(50):
        step = (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
        x -= step
        if abs(step) < 1e-15:
            break
    return x


def power_of_two_below(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x))


class AdaptiveScale(DynamicScale):
    """Per-layer scales (Zhao, Vogel, Ahmed, Luk: "Adaptive Loss Scaling for Mixed
    Precision Training", 2019).

    Every gradient tensor g of the backprop graph carries a total scale S(g).  The
    loss gradient and the input gradient of every weighted layer get the scale
    that keeps the modelled probability of underflow below `threshold`:
    S = u_min / (sqrt(2) * erfinv(T) * sigma), with sigma the standard deviation
    of the unscaled gradient -- for a layer modelled from its incoming gradient
    and its weights as sqrt(fan_out * E[dY^2] * E[W^2]) -- capped so the largest
    element stays below half of fp16's maximum, rounded down to a power of two.
    The scales are chosen during the step itself (each layer's statistics are
    known just before its input gradient is scaled) every `interval` steps and
    kept in between.  Other operators keep their input's scale; where branches
    meet (ADD_N) each contribution is brought to the smallest of their scales
    before the sum.  Each weight gradient is unscaled by its own S.  A dynamic
    factor <= 1 on top backs off on overflow, as the safety net.
    """

    kind = "adaptive"

    def __init__(self, interval=ADAPTIVE_DEFAULTS["interval"],
                 threshold=ADAPTIVE_DEFAULTS["threshold"], **dynamic):
        super().__init__(**{**dynamic, "init": 1.0, "max_scale": 1.0})
        self.interval, self.threshold = interval, threshold
        self.target = F16_TINY / (math.sqrt(2) * erfinv(threshold))
        self.steps = 0
        self.redo = True  # choose the scales in the next step

    def bind(self, art, grad_offsets) -> None:
        g: Graph = art.backprop
        self.graph = g
        # the layers' input-gradient operators, as trainconf marked them ([dY, W] -> dX)
        layer_grads = set(art.links.layers)
        self.layers = {op.index for op in g.ops if op.outputs[0] in layer_grads}
        # float32 factors by which each op's output is multiplied (a list per op, so
        # that closures see updates; numpy scalars, not arrays: no memory of their own)
        self.factors = {op.index: [np.float32(1)] * (len(op.inputs) if op.type == "ADD_N" else 1)
                        for op in g.ops
                        if op.index in self.layers or op.type in LOSS_OPS + ("ADD_N",)}
        self.source = self._scale_sources(g)
        self.scales: dict[int, float] = {}  # scale-setting tensor -> its total scale
        self.grad_offsets = {grad: grad_offsets[w] for grad, w in art.links.gradients}

    def _scale_sources(self, g: Graph) -> dict[int, int]:
        """For every gradient tensor, the tensor whose scale it carries: the output
        of a loss, a layer's input gradient or an ADD_N (the ops that set scales)."""
        source: dict[int, int] = {}
        for op in g.ops:
            if op.type in LOSS_OPS:
                source[op.outputs[1]] = op.outputs[1]
            elif op.index in self.layers and op.inputs[0] in source or \
                    op.type == "ADD_N" and all(t in source for t in op.inputs):
                source[op.outputs[0]] = op.outputs[0]
            else:
                incoming = [source[t] for t in op.inputs if t in source]
                if incoming:
                    source.update({t: incoming[0] for t in op.outputs})
        return source

    def scale_of(self, t: int) -> float:
        return self.scales.get(self.source.get(t, -1), 1.0)

    def kernel(self, op: Op, inputs, outputs):
        if op.type != "ADD_N" or op.outputs[0] not in self.source:
            return super().kernel(op, inputs, outputs)
        ratios, out = self.factors[op.index], outputs[0]

        def weighted_sum():
            if self.redo:
                scales = [self.scale_of(t) for t in op.inputs]
                common = min(scales)
                ratios[:] = [np.float32(common / s) for s in scales]
                self.scales[op.outputs[0]] = common
            np.multiply(inputs[0], ratios[0], out=out)
            for i in range(1, len(inputs)):
                np.add(out, inputs[i] * ratios[i], out=out)
        return weighted_sum

    def hooks(self, op: Op) -> bool:
        return op.index in self.factors

    def after(self, op: Op, inputs, outputs) -> list:
        if op.type in LOSS_OPS:
            return [self._chooser(op, outputs[1], outputs[1], None)]
        if op.index in self.layers and op.outputs[0] in self.source:
            return [self._chooser(op, inputs[0], outputs[0], inputs[1])]
        return []

    def _chooser(self, op: Op, incoming, out, weight):
        """Scale `out` by the op's factor, choosing the factor first on steps that do."""
        factor = self.factors[op.index]
        grad_out = op.outputs[1] if weight is None else op.outputs[0]

        def step():
            if self.redo:
                s_in = 1.0 if weight is None else self.scale_of(op.inputs[0])
                total = self._target_scale(op, incoming, out, weight, s_in)
                if weight is None:
                    total *= self.scale  # the dynamic safety factor, once, at the seed
                factor[0] = np.float32(total / s_in)
                self.scales[grad_out] = total
            np.multiply(out, factor, out=out)
        return step

    def _target_scale(self, op: Op, incoming, out, weight, s_in: float) -> float:
        """The scale `out` should carry, from the statistics of the unscaled gradients."""
        sigma_sq = float(np.mean(np.square(incoming, dtype=np.float64))) / s_in ** 2
        if weight is not None:
            strides = op.options.get("stride_w", 1) * op.options.get("stride_h", 1)
            fan = weight.size / out.shape[-1] / strides
            sigma_sq *= fan * float(np.mean(np.square(weight, dtype=np.float64)))
        # never below the incoming scale (each layer's factor is >= 1) unless
        # that is needed to keep the largest element finite
        wanted = max(self.target / math.sqrt(sigma_sq) if sigma_sq > 0 else 1.0, s_in)
        peak = float(np.max(np.abs(out))) / s_in if out.size else 0.0
        if peak > 0:
            wanted = min(wanted, F16_SAFE_MAX / peak)
        return power_of_two_below(max(wanted, F16_TINY))

    def unscale(self, grads: np.ndarray) -> None:
        for g, (lo, hi) in self.grad_offsets.items():
            grads[lo:hi] *= np.float32(1.0 / self.scale_of(g))

    def update(self, finite: bool) -> bool:
        before = self.scale
        apply = super().update(finite)
        self.steps += 1
        self.redo = self.steps % self.interval == 0 or self.scale != before
        return apply

    def layer_scales(self) -> dict[str, float]:
        """The total scale of the loss gradient and of each layer's input gradient."""
        return {self.graph.tensors[t].name: self.scales[t] for op in self.graph.ops
                if op.index in self.layers or op.type in LOSS_OPS
                for t in op.outputs if t in self.scales}

    def report(self):
        values = list(self.layer_scales().values()) or [self.scale]
        return {"min": min(values), "max": max(values)}

    def state(self) -> dict:
        return {**super().state(), "steps": self.steps, "redo": self.redo,
                "factors": {str(k): [float(f) for f in v] for k, v in self.factors.items()},
                "scales": {str(k): v for k, v in self.scales.items()}}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.steps, self.redo = state["steps"], state["redo"]
        for k, v in state["factors"].items():
            self.factors[int(k)][:] = [np.float32(f) for f in v]
        self.scales = {int(k): v for k, v in state["scales"].items()}


def make_loss_scale(spec: str = "none", **params) -> LossScale:
    """`none`, a number (static scale), `dynamic` or `adaptive`; `params` are the
    DynamicScale arguments (and, for adaptive, interval and threshold); None
    counts as not given."""
    params = {k: v for k, v in params.items() if v is not None}
    if spec == "none":
        return LossScale()
    if spec == "dynamic":
        params.pop("interval", None), params.pop("threshold", None)
        return DynamicScale(**params)
    if spec == "adaptive":
        params.pop("init", None), params.pop("max_scale", None)
        return AdaptiveScale(**params)
    try:
        value = float(spec)
    except ValueError:
        value = 0.0
    if not (math.isfinite(value) and value > 0):
        raise UserError(None, f"--loss-scale must be none, dynamic, adaptive or a number > 0, "
                              f"got {spec!r}")
    return StaticScale(value)
