"""The kernels' shared scratch (microtrain/step/kernels/workspace.py): one kernel's
temporaries never overlap each other, different kernels' do; kernels built over
one workspace, run in turn with the workspace overwritten by garbage before
every call, give bit-identical results to kernels with scratch of their own;
whole training runs too (partial last batch included); and the step's scratch
costs the largest kernel's need, not the sum."""
from pathlib import Path

import numpy as np
import pytest

import microtrain.trainer
from microtrain.step.arena import held_bytes
from microtrain.step.kernels import build
from microtrain.step.kernels.workspace import (ALIGN, TILE_BYTES, Workspace, begin_kernel, scratch,
                                               sharing)
from microtrain.step.precision import round_in_place
from microtrain.trainer import Trainer
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
GARBAGE = (0xFF, 0x41)  # bytes: NaN and 12.07 as float32, True as bool


def test_one_kernels_temporaries_are_disjoint_and_the_next_kernel_starts_over():
    ws = Workspace(4096)
    with sharing(ws):
        begin_kernel()
        a, b = scratch((3, 5), np.float32), scratch((7,), bool)
        begin_kernel()
        c = scratch((2, 2), np.float64)
    assert not np.shares_memory(a, b)
    assert np.shares_memory(a, c)
    for x in (a, b, c):
        assert x.ctypes.data % ALIGN == 0 and np.shares_memory(x, ws.buffer)
    assert ws.need == 64 + 7  # b starts at the cache line after a's 60 bytes


def test_a_workspace_too_small_grows_by_doubling_then_to_the_need():
    ws = Workspace()
    with sharing(ws):
        begin_kernel()
        small = scratch((4,), np.float32)
        big = scratch((1000,), np.float32)
    assert not np.shares_memory(small, big)  # each in the buffer of its moment
    assert np.shares_memory(big, ws.buffer) and not np.shares_memory(small, ws.buffer)
    assert ws.grow() and ws.buffer.nbytes == 64 + 4000
    assert not ws.grow()
    assert not np.shares_memory(scratch((4,), np.float32), ws.buffer)  # none in use


# -- kernels taking turns on one workspace -------------------------------------------------------

def _specs():
    """(name, input shapes, output shapes, options): every kernel that takes
    scratch, over padded and unpadded windows, both gathers, multipliers 1 and 2."""
    same = dict(padding=0, stride_h=1, stride_w=1)
    strided = dict(padding=0, stride_h=2, stride_w=2)
    pool = dict(padding=0, stride_h=2, stride_w=2, filter_height=3, filter_width=3)
    x, y = (2, 7, 6, 3), (2, 7, 6, 4)
    return [
        ("CONV_2D", [x, (4, 3, 3, 3), (4,)], [y], dict(same, fused_activation_function=3)),
        ("CONV_2D", [(2, 7, 6, 16), (4, 3, 3, 16)], [y], same),  # strided-copy gather
        ("CONV_2D", [x, (4, 1, 1, 3)], [y], same),  # 1x1: the image is the matrix
        ("Conv2DInputGrad", [(2, 4, 3, 4), (4, 3, 3, 3)], [x], strided),
        ("Conv2DWeightGrad", [(2, 4, 3, 4), x], [(4, 3, 3, 3)], strided),
        ("DEPTHWISE_CONV_2D", [x, (1, 3, 3, 6), (6,)], [(2, 7, 6, 6)], dict(same, depth_multiplier=2)),
        ("DepthwiseConv2DInputGrad", [(2, 4, 3, 6), (1, 3, 3, 6)], [x], strided),
        ("DepthwiseConv2DWeightGrad", [(2, 4, 3, 6), x], [(1, 3, 3, 6)], strided),
        ("MAX_POOL_2D", [x], [(2, 4, 3, 3)], pool),
        ("AVERAGE_POOL_2D", [x], [(2, 4, 3, 3)], pool),
        ("MaxPool2DGrad", [(2, 4, 3, 3), x], [x], pool),
        ("AveragePool2DGrad", [(2, 4, 3, 3)], [x], pool),
        *[("ActivationGrad", [y, y], [y], dict(activation=a, alpha=0.2))
          for a in ("relu", "relu6", "tanh", "logistic", "leaky_relu")],
        ("SOFTMAX", [(5, 7)], [(5, 7)], dict(beta=1.5)),
        ("SoftmaxGrad", [(5, 7), (5, 7)], [(5, 7)], {}),
    ]


def _arrays(specs, rng):
    return [([rng.standard_normal(s) for s in ins], [np.zeros(s) for s in outs])
            for _, ins, outs, _ in specs]


def _closures(specs, arrays, workspace):
    """The kernels built as the executor does: a measuring pass, then over the grown workspace."""
    with sharing(workspace):
        steps = [build(name, ins, outs, **opts)
                 for (name, _, _, opts), (ins, outs) in zip(specs, arrays)]
        if workspace is not None and workspace.grow():
            return _closures(specs, arrays, workspace)
    return steps


def test_kernels_taking_turns_on_one_workspace_match_private_scratch():
    specs, rng = _specs(), np.random.default_rng(0)
    private, shared = _arrays(specs, rng), _arrays(specs, rng)
    ws = Workspace()
    own_steps, shared_steps = _closures(specs, private, None), _closures(specs, shared, ws)
    for call in range(2):  # fresh inputs on the second call
        for i, (own, common) in enumerate(zip(own_steps, shared_steps)):
            for a, b in zip(private[i][0], shared[i][0]):
                a[...] = b[...] = rng.standard_normal(a.shape)
            ws.buffer.fill(GARBAGE[call])
            common()
            own()
        for (name, *_), (_, outs), (_, outs_shared) in zip(specs, private, shared):
            for a, b in zip(outs, outs_shared):
                np.testing.assert_array_equal(a, b, err_msg=name)


X = (2, 7, 6, 3)
# Outputs [N, OH, OW, C] over X and options: every kind of border: SAME and VALID,
# strides 1 and 2 (SAME padding only after), dilation 2
BORDERS = [((2, 7, 6, 3), dict(padding=0, stride_h=1, stride_w=1)),
           ((2, 4, 3, 3), dict(padding=0, stride_h=2, stride_w=2)),
           ((2, 5, 4, 3), dict(padding=1, stride_h=1, stride_w=1)),
           ((2, 7, 6, 3), dict(padding=0, stride_h=1, stride_w=1, dilation_h_factor=2,
                               dilation_w_factor=2)),
           ((2, 2, 1, 3), dict(padding=1, stride_h=2, stride_w=2, dilation_h_factor=2,
                               dilation_w_factor=2))]


def _depthwise_specs():
    """Depthwise convolutions and their gradients over BORDERS, multipliers 1 and 2."""
    specs = []
    for ((n, oh, ow, c), opts), m in zip(BORDERS, (1, 1, 2, 2, 1)):
        y, w = (n, oh, ow, c * m), (1, 3, 3, c * m)
        specs += [("DEPTHWISE_CONV_2D", [X, w, (c * m,)], [y],
                   dict(opts, depth_multiplier=m, fused_activation_function=3)),
                  ("DepthwiseConv2DInputGrad", [y, w], [X], opts),
                  ("DepthwiseConv2DWeightGrad", [y, X], [w], opts)]
    return specs


def _conv_specs():
    """CONV_2D and its weight gradient over BORDERS."""
    specs = []
    for (n, oh, ow, _), opts in BORDERS:
        y, w = (n, oh, ow, 5), (5, 3, 3, X[3])
        specs += [("CONV_2D", [X, w, (5,)], [y], dict(opts, fused_activation_function=3)),
                  ("Conv2DWeightGrad", [y, X], [w], opts)]
    return specs


GEMMS = {"CONV_2D", "Conv2DWeightGrad"}  # BLAS rounds a product of fewer rows differently


@pytest.mark.parametrize("tile", [TILE_BYTES, 4096, 1])
def test_a_compact_workspace_gives_the_same_results_with_less_scratch(tile):
    """Kernels built over a compact workspace (no index arrays, scalar clip
    bounds, depthwise convolutions over padded copies of as many images as a
    tile holds (4096: one image a chunk) or else without padded copies, a tile of
    output rows at a time (tile_bytes 1: one row a tile), convolutions a tile of
    output rows at a time) give the results of the others, bit for bit, and with
    tiles smaller than an image need less of the workspace; but for the products
    of window matrices in several tiles, which BLAS rounds differently: the same
    within rounding."""
    specs, rng = _specs() + _depthwise_specs() + _conv_specs(), np.random.default_rng(1)
    fast, small = _arrays(specs, rng), _arrays(specs, rng)
    ws, compact = Workspace(), Workspace(tile=tile)
    fast_steps, small_steps = _closures(specs, fast, ws), _closures(specs, small, compact)
    for i, (one, other) in enumerate(zip(fast_steps, small_steps)):
        for a, b in zip(fast[i][0], small[i][0]):
            a[...] = b[...] = rng.standard_normal(a.shape)
        compact.buffer.fill(GARBAGE[0])
        one()
        other()
    for (name, _, _, opts), (_, outs), (_, outs_small) in zip(specs, fast, small):
        for a, b in zip(outs, outs_small):
            if name in GEMMS:
                np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12 * np.abs(a).max())
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{name} {opts}")
    depthwise = _depthwise_specs()
    needs = []
    for workspace in (Workspace(), Workspace(tile=1)):
        _closures(depthwise, _arrays(depthwise, rng), workspace)
        needs.append(workspace.need)
    assert needs[1] < needs[0]


@pytest.mark.parametrize("size", [100, 5000])
def test_fp16_rounding_with_shared_scratch(size):
    """Both rounders (numpy's cast below 4096 elements, arithmetic above)."""
    rng = np.random.default_rng(size)
    a = (rng.standard_normal(size) * 2.0 ** rng.integers(-30, 10, size)).astype(np.float32)
    want = a.astype(np.float16).astype(np.float32)
    ws = Workspace(1 << 16)
    with sharing(ws):
        step = round_in_place(a)
    ws.buffer.fill(0xFF)
    step()
    np.testing.assert_array_equal(a, want)


def test_scratch_costs_the_largest_kernels_need():
    """The workspace is as large as the largest kernel's scratch (measured on
    a workspace of its own), not their sum, and the kernels no longer
    hold that scratch themselves."""
    specs = _specs()
    arrays = _arrays(specs, np.random.default_rng(0))
    needs = []
    for spec, io in zip(specs, arrays):
        alone = Workspace()
        _closures([spec], [io], alone)
        needs.append(alone.need)
    ws = Workspace()
    shared = held_bytes(_closures(specs, arrays, ws), exclude=(arrays, ws))
    private = held_bytes(_closures(specs, arrays, None), exclude=arrays)
    assert ws.buffer.nbytes == max(needs) < sum(needs)
    assert private - shared > 0.9 * sum(needs)


# -- whole training runs ------------------------------------------------------------------------

def _poisoning(monkeypatch):
    """Make every plan the trainer compiles overwrite its workspace with
    garbage before each closure, alternating two patterns."""
    compile_plan = microtrain.trainer.compile_plan

    def poisoned(art, mem, rows, wrappers):
        plan = compile_plan(art, mem, rows, wrappers)
        calls = iter(range(1 << 62))

        def wrap(step):
            def run():
                mem.workspace.buffer.fill(GARBAGE[next(calls) % 2])
                step()
            return run
        for steps in (plan.forward, plan.backward, plan.loss_ops):
            steps[:] = [wrap(s) for s in steps]
        return plan
    monkeypatch.setattr(microtrain.trainer, "compile_plan", poisoned)


@pytest.mark.parametrize("model,precision", [("cnn", "fp32"), ("depthwise", "fp32"),
                                             ("residual_mlp", "fp32"), ("cnn", "fp16"),
                                             ("depthwise", "fp16")])
def test_training_with_shared_scratch_is_bit_identical(tmp_path, monkeypatch, model, precision):
    """300 samples in batches of 32: the partial last batch compiles a second
    plan over the same workspace."""
    frozen = split(FIXTURES / f"{model}.tflite", tmp_path, precision=precision).frozen
    images = "digits_x" if model == "residual_mlp" else "digits_images"
    x, t = np.load(FIXTURES / f"{images}.npy")[:300], np.load(FIXTURES / "digits_onehot.npy")[:300]
    runs = []
    for mode in ("private", "shared", "poisoned"):
        if mode == "poisoned":
            _poisoning(monkeypatch)
        trainer = Trainer(frozen, batch_size=32, optimizer="adam")
        if mode == "private":
            trainer.memory.workspace = None
        trainer.check_data([x], [t])  # compiles the whole batches' plan
        buffer = trainer.memory.workspace and trainer.memory.workspace.buffer
        history = trainer.fit([x], [t], epochs=2, shuffle=False)
        runs.append(([r["loss"] for r in history], trainer.memory.params.copy()))
        if mode == "shared":  # the partial batch's plan fitted in the same workspace
            assert trainer.memory.workspace.buffer is buffer and buffer.size > 0
    for losses, weights in runs[1:]:
        assert losses == runs[0][0]
        np.testing.assert_array_equal(weights, runs[0][1])


# -- constants ------------------------------------------------------------------------------------

LARGE_CASES = [("RELU", {}), ("RELU6", {}), ("RELU_N1_TO_1", {}), ("LOGISTIC", {}),
               ("LEAKY_RELU", {"alpha": 0.2})] + \
              [("ActivationGrad", {"activation": a, "alpha": 0.2})
               for a in ("relu", "relu6", "relu_n1_to_1", "tanh", "logistic", "leaky_relu")]


@pytest.mark.parametrize("name,options", LARGE_CASES, ids=[str(c) for c in LARGE_CASES])
def test_large_activations_keep_no_constant_arrays_and_match_small_ones(name, options):
    """From 2^17 elements on, every activation uses scalar constants (np.clip
    for the clips); results equal those of the small-array path, chunk by
    chunk, kinks, signed zeros, infinities and NaN included."""
    rng = np.random.default_rng(1)
    size, chunk = 1 << 17, 1 << 10
    special = np.array([0.0, -0.0, 6.0, -1.0, 1.0, np.inf, -np.inf, np.nan], np.float32)
    x = rng.standard_normal(size).astype(np.float32) * 4
    x[:special.size] = special
    # a gradient op reads dY and the activation's output Y (for relu, Y >= 0)
    inputs = [x] if name != "ActivationGrad" else \
        [x[::-1].copy(), np.abs(x) if options["activation"] == "relu" else x]
    out, ws = np.empty(size, np.float32), Workspace(1 << 20)
    with sharing(ws):
        step = build(name, inputs, [out], **options)
    assert held_bytes(step, exclude=(inputs, out, ws)) < chunk
    with np.errstate(invalid="ignore"):
        step()
        for lo in range(0, size, chunk):
            small = np.empty(chunk, np.float32)
            build(name, [a[lo:lo + chunk].copy() for a in inputs], [small], **options)()
            np.testing.assert_array_equal(out[lo:lo + chunk], small)
