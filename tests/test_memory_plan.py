"""The memory plan of `trainconf split` and the arena microtrain runs the step in:
replaying a step over the planned bytes, no tensor is overwritten before its
last read, for several batch sizes; the arena needs no more than the live bytes
of the busiest step; training in the arena is bit-identical to training with an
array per tensor; the planned peak agrees with the bytes microtrain holds."""
import itertools
import json
import shutil
from math import prod
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.step.arena import linear
from microtrain.files.artifacts import BACKPROP_META, UNSEALED, fingerprint, load_artifacts, seal
from microtrain.files.contracts import TrainingMeta
from microtrain.files.errors import UserError
from microtrain.files.format.model import get_metadata, load_model, model_to_bytes, set_metadata
from microtrain.files.graph import concrete_shape
from microtrain.step.kernels import OVERWRITES
from microtrain.run_config import DIVERGENCE_SNAPSHOTS
from microtrain.trainer import Trainer
from trainconf.cli import main
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
DATA = {"mlp": ("digits_x", "digits_onehot"), "residual_mlp": ("digits_x", "digits_onehot"),
        "cnn": ("digits_images", "digits_onehot"), "depthwise": ("digits_images", "digits_onehot"),
        "regression": ("diabetes_x", "diabetes_y"), "mobilenetv2": None}
MODELS = list(DATA)


def data(model: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    if DATA[model] is None:  # random images for the network without a data set of its own
        rng = np.random.default_rng(3)
        return (rng.random((n, 32, 32, 3), dtype=np.float32),
                np.eye(10, dtype=np.float32)[rng.integers(0, 10, n)])
    x, t = DATA[model]
    return np.load(FIXTURES / f"{x}.npy")[:n], np.load(FIXTURES / f"{t}.npy")[:n]


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """split(model, **options) once per set of options."""
    made = {}

    def get(model: str, **options):
        key = (model, tuple(sorted(options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(model)
            made[key] = split(FIXTURES / f"{model}.tflite", out, **options)
        return made[key]
    return get


# -- replaying a step over the planned bytes -----------------------------------------------------

def _ranges(art, batch: int) -> tuple[dict, dict]:
    """(graph, tensor) -> its 4-byte words [lo, hi) in the arena at `batch`; and
    -> its bytes with each sample's share rounded up to the plan's alignment."""
    ranges, sizes, align = {}, {}, art.links.memory.align
    for graph, g in (("forward", art.forward), ("backprop", art.backprop)):
        for t, a, c in getattr(art.links.memory, graph):
            tensor = g.tensors[t]
            itemsize = 4 if tensor.dtype.kind == "f" else tensor.dtype.itemsize
            shape = concrete_shape(tensor.shape, batch)
            lo = linear((a, c), batch)
            hi = lo + prod(shape) * itemsize
            ranges[graph, t] = (lo // 4, -(-hi // 4))
            rows = shape[0] if tensor.shape and tensor.shape[0] == -1 else 1
            sizes[graph, t] = rows * -(-prod(shape) * itemsize // rows // align) * align
    return ranges, sizes


def replay(art, batch: int) -> int:
    """Run one step's writes and reads over the arena's words, each word
    remembering which write it holds; every read must find its tensor's own
    write.  Returns the live bytes of the busiest step (a lower bound on the
    arena for these lives and this alignment)."""
    (ranges, sizes), links = _ranges(art, batch), art.links
    alias = {b: f for b, f in links.forward}
    words = np.full(1 + max(hi for _, hi in ranges.values()), -1)
    version, lives, counter = {}, {}, itertools.count()

    def key(graph, t):
        return ("forward", alias[t]) if graph == "backprop" and t in alias else (graph, t)

    def write(k, step, same_as=None):
        if k in ranges:
            version[k] = version[same_as] if same_as else next(counter)
            words[slice(*ranges[k])] = version[k]
            lives.setdefault(version[k], [step, step, sizes[k]])

    def read(k, step):
        if k in ranges:
            assert (words[slice(*ranges[k])] == version[k]).all(), f"{k} overwritten before step {step}"
            lives[version[k]][1] = step

    for t in art.forward.inputs:
        write(("forward", t), 0)
    for t in links.targets:
        write(("backprop", t), 0)
    step = 0
    for graph, g in (("forward", art.forward), ("backprop", art.backprop)):
        for op in g.ops:
            step += 1
            ins = [key(graph, t) for t in op.inputs if t >= 0]
            for k in ins:
                read(k, step)
            outs = [key(graph, t) for t in op.outputs]
            in_place = op.type in ("RESHAPE", "SQUEEZE") and outs[0] in ranges and \
                ranges[outs[0]] == ranges.get(ins[0])
            if op.type in OVERWRITES and outs[0] in ranges and ranges[outs[0]] == ranges.get(ins[0]):
                lives[version[ins[0]]][1] = step - 1  # its bytes are the output's now: a
                # later read of it finds the output's write and fails
            for k in outs:
                write(k, step, ins[0] if in_place else None)
    for k in [("forward", t) for t in art.forward.outputs] + \
             [("backprop", t) for t in links.targets + [links.loss]]:
        read(k, step + 1)
    live = np.zeros(step + 2, np.int64)
    for first, last, size in lives.values():
        live[first:last + 1] += size
    return int(live.max())


@pytest.mark.parametrize("trainable", ["all", "last:1"])
@pytest.mark.parametrize("model", MODELS)
def test_no_tensor_is_overwritten_before_its_last_read(splits, model, trainable):
    art = load_artifacts(splits(model, trainable=trainable).frozen)
    for batch in (1, 5, 32):
        busiest = replay(art, batch)
        # greedy packing reaches the busiest step's live bytes (up to alignment)
        assert busiest <= linear(art.links.memory.arena, batch) <= 1.01 * busiest + 64


def test_activations_below_the_trained_layers_are_not_kept(splits):
    whole = load_artifacts(splits("mobilenetv2").frozen).links.memory.arena
    last = load_artifacts(splits("mobilenetv2", trainable="last:1").frozen).links.memory.arena
    assert linear(last, 32) < linear(whole, 32) / 3


def test_a_reshape_shares_its_input_memory(splits):
    """cnn flattens its pooled features with a RESHAPE: both lie at one offset."""
    art = load_artifacts(splits("cnn").frozen)
    offsets = {t: (a, c) for t, a, c in art.links.memory.forward}
    reshape = next(op for op in art.forward.ops if op.type == "RESHAPE")
    assert offsets[reshape.inputs[0]] == offsets[reshape.outputs[0]]


# -- the runtime in the arena --------------------------------------------------------------------

def edit_plan(frozen: Path, folder: Path, change) -> Path:
    """A copy of the split files in `folder` whose backprop metadata went through `change`."""
    for f in frozen.parent.glob(frozen.name.replace(".frozen.circle", ".*")):
        shutil.copy(f, folder / f.name)
    _edit_links(folder / frozen.name, change)
    return folder / frozen.name


def _edit_links(frozen: Path, change) -> None:
    """Put the backprop metadata beside `frozen` through `change`, sealed again."""
    path = frozen.with_name(frozen.name.replace(".frozen.circle", ".backprop.circle"))
    model = load_model(path)
    meta = json.loads(get_metadata(model, BACKPROP_META))
    change(meta)
    meta["backprop_sha256"] = UNSEALED  # sealed again, as trainconf would
    set_metadata(model, BACKPROP_META, json.dumps(meta).encode())
    path.write_bytes(seal(model_to_bytes(model)))


def without_plan(frozen: Path, folder: Path) -> Path:
    return edit_plan(frozen, folder, lambda meta: meta.pop("memory"))


@pytest.mark.parametrize("model,precision", [("mlp", "fp32"), ("residual_mlp", "fp32"),
                                             ("cnn", "fp32"), ("depthwise", "fp32"),
                                             ("regression", "fp32"), ("mlp", "fp16"),
                                             ("cnn", "fp16")])
def test_training_in_the_arena_is_bit_identical(splits, tmp_path, model, precision):
    """300 samples in batches of 32: the last batch is partial (its own views)."""
    frozen = splits(model, precision=precision).frozen
    x, t = data(model, 300)
    runs = []
    for path in (frozen, without_plan(frozen, tmp_path)):
        trainer = Trainer(path, batch_size=32, optimizer="adam")
        history = trainer.fit([x], [t], epochs=2, shuffle=False)
        runs.append((trainer.memory.arena is not None, [r["loss"] for r in history],
                     trainer.memory.params.copy()))
    (planned, losses, weights), (unplanned, losses_own, weights_own) = runs
    assert planned and not unplanned
    assert losses == losses_own
    np.testing.assert_array_equal(weights, weights_own)


CASES = [(m, "fp32", "adam", 8 if m == "mobilenetv2" else 32, "all") for m in MODELS] + \
        [("mlp", "fp32", "sgd", 32, "all"), ("cnn", "fp32", "momentum", 16, "all"),
         ("mlp", "fp16", "adam", 32, "all"), ("cnn", "fp16", "adam", 32, "all"),
         ("depthwise", "fp16", "sgd", 8, "all"), ("mobilenetv2", "fp16", "sgd", 8, "all"),
         ("cnn", "bf16", "adam", 32, "all"), ("mobilenetv2", "fp32", "sgd", 1, "last:1"),
         ("mobilenetv2", "fp32", "sgd", 1, "last:2")]


def assert_plan_is_held(memory: dict, trainer: Trainer) -> None:
    """The RAM the trainer holds is at most the planned RAM and at least 98% of it;
    the files it reads in place are the planned ones, to the byte."""
    held = trainer.memory_bytes()
    assert 0.98 * memory["ram"] <= held <= memory["ram"], (held, memory)
    assert trainer.mapped_bytes() == memory["read_only"], (trainer.mapped_bytes(), memory)
    assert memory["ram"] + memory["read_only"] == memory["total"]


@pytest.mark.parametrize("model,precision,optimizer,batch,trainable", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_planned_peak_agrees_with_the_bytes_microtrain_holds(splits, model, precision,
                                                             optimizer, batch, trainable):
    result = splits(model, precision=precision, optimizer=optimizer, batch_size=batch,
                    trainable=trainable)
    trainer = Trainer(result.frozen, batch_size=batch, optimizer=optimizer)
    x, t = data(model, 2 * batch)
    trainer.fit([x], [t], epochs=1)
    assert_plan_is_held(result.memory, trainer)


def test_the_frozen_model_is_read_in_place(splits):
    """Training the last layer of MobileNetV2, the rest of the network is constants:
    they are views of a read-only map of the frozen model, not RAM."""
    result = splits("mobilenetv2", trainable="last:1", optimizer="sgd", batch_size=1)
    trainer = Trainer(result.frozen, batch_size=1, optimizer="sgd")
    constants = [trainer.memory.forward[t.index] for t in trainer.art.forward.tensors
                 if t.data is not None]
    assert constants and not any(c.flags.writeable for c in constants)
    assert result.memory["read_only"] == result.frozen.stat().st_size
    assert result.memory["ram"] < result.memory["read_only"] / 3


def budget_between(model: Path, folder: Path, lower: str, upper: str, **options) -> int:
    """A --memory-budget halfway between the planned RAM of two --trainable choices,
    each planned as a budget's split plans them (compact scratch) and without
    recomputation: a split under it without recomputation trains more than `lower`
    and less than `upper`, e.g. some rows of a layer between last:1 and last:2."""
    return sum(split(model, folder / f"plan {choice}", trainable=choice, compact_scratch=True,
                     recompute="none", **options).memory["ram"] for choice in (lower, upper)) // 2


def partial_rows(frozen: Path) -> tuple[int, int]:
    """(tensor, first trained row) of the weight of which a split trains some rows."""
    ((kernel, (lo, _)),) = load_artifacts(frozen).training.rows.items()
    return kernel, lo


@pytest.mark.parametrize("model,lower,upper", [("mlp", "biases", "last:1"),
                                               ("mlp", "last:1", "last:2"),
                                               ("cnn", "last:1", "last:2")])
def test_frozen_rows_are_read_in_place(tmp_path, model, lower, upper):
    """A budget that trains some output channels of a kernel: its other rows stay
    in the .wof, mapped (only the trained elements are RAM), and still read as the
    file holds them after training."""
    path = FIXTURES / f"{model}.tflite"
    result = split(path, tmp_path, memory_budget=budget_between(path, tmp_path, lower, upper),
                   recompute="none")
    trainer = Trainer(result.frozen, batch_size=32)
    kernel, lo = partial_rows(result.frozen)
    frozen_bytes = trainer.weights()[kernel][:lo].nbytes
    original = load_artifacts(result.frozen).weights[kernel][:lo].copy()
    x, t = data(model, 64)
    trainer.fit([x], [t], epochs=1)
    assert_plan_is_held(result.memory, trainer)
    assert trainer.mapped_bytes() - result.frozen.stat().st_size >= frozen_bytes
    np.testing.assert_array_equal(trainer.weights()[kernel][:lo], original)


def test_inspect_reports_the_planned_peak_at_any_batch(splits):
    result = splits("cnn")
    run = CliRunner().invoke(main, ["inspect", str(result.frozen), "--json", "--batch-size", "32"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["memory"] == result.memory
    for snapshot in DIVERGENCE_SNAPSHOTS:
        run = CliRunner().invoke(main, ["inspect", str(result.frozen), "--batch-size", "5",
                                        "--optimizer", "sgd", "--divergence-snapshot", snapshot])
        line = run.stdout.splitlines()[-1]
        assert line.startswith("planned peak at batch 5 with sgd")
        trainer = Trainer(result.frozen, batch_size=5, optimizer="sgd",
                          divergence_snapshot=snapshot)
        x, t = data("cnn", 5)
        trainer.check_data([x], [t])  # prepares the step at batch 5
        planned = int(line.split(": ")[1].split()[0])
        assert line.split(": ")[1].startswith(f"{planned} bytes of RAM")
        assert abs(trainer.memory_bytes() - planned) <= 0.1 * planned


def test_a_plan_outside_the_arena_is_refused(splits, tmp_path):
    frozen = edit_plan(splits("mlp").frozen, tmp_path,
                       lambda meta: meta["memory"].update(arena=[0, 16]))
    with pytest.raises(UserError, match=r"mlp\.backprop\.circle: memory plan: .* does not fit"):
        Trainer(frozen, batch_size=4)


# -- planned = held in every configuration the CLI allows ----------------------------------------

FILES = {"mlp": ("digits_x", "digits_onehot"), "cnn": ("digits_images", "digits_onehot")}
RUNS = {  # name: (model, split options, run options); the digits data have 1797 samples
    "whole-data": ("mlp", {}, {}),
    "test-set": ("mlp", {}, {"test_inputs": ["digits_x"], "test_targets": ["digits_onehot"]}),
    "validation-split": ("mlp", {}, {"validation_split": 0.2}),
    "partial-batch": ("mlp", {"batch_size": 7}, {}),
    "accumulation": ("mlp", {"accum_steps": 3}, {"accum_steps": 3}),
    "sgd": ("mlp", {"optimizer": "sgd"}, {}),
    "budget": ("mlp", {"memory_budget": "100KB"}, {"validation_split": 0.2}),
    "fp16-adaptive": ("mlp", {"precision": "fp16", "loss_scale": "adaptive"},
                      {"loss_scale": "adaptive", "validation_split": 0.2}),
    "fp16-weights-only": ("mlp", {"weight_dtype": "fp16", "loss_scale": "dynamic"},
                          {"loss_scale": "dynamic"}),
    "fp16-static": ("mlp", {"precision": "fp16", "loss_scale": "1024"}, {"loss_scale": "1024"}),
    "cnn-validation-split": ("cnn", {}, {"validation_split": 0.1}),
    "cnn-fp16-accumulation": ("cnn", {"precision": "fp16", "accum_steps": 2},
                              {"accum_steps": 2, "validation_split": 0.1}),
    "bf16-test-set": ("mlp", {"precision": "bf16"}, {"test_inputs": ["digits_x"],
                                                     "test_targets": ["digits_onehot"]}),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_planned_peak_is_what_a_run_holds(tmp_path, name):
    """`microtrain run` after `trainconf split` with the same batch size, optimizer,
    accumulation and loss scale: the run holds at most the planned peak, and at
    least 98% of it, whatever test set or partial batches it uses."""
    from microtrain.commands import session
    from microtrain.run_config import RunConfig
    model, split_options, run_options = RUNS[name]
    result = split(FIXTURES / f"{model}.tflite", tmp_path, **split_options)
    x, t = (str(FIXTURES / f"{f}.npy") for f in FILES[model])
    options = {k: [str(FIXTURES / f"{v[0]}.npy")] if k.startswith("test_") else v
               for k, v in run_options.items()}
    summary = session.run(RunConfig(frozen=str(result.frozen), inputs=[x], targets=[t],
                                    epochs=1, batch_size=split_options.get("batch_size", 32),
                                    optimizer=split_options.get("optimizer", "adam"),
                                    save="never", **options))
    planned, held = result.memory["ram"], summary["memory_bytes"]
    assert 0.98 * planned <= held <= planned, (held, result.memory)
    if "memory_budget" in split_options:
        assert held <= 100_000


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_failing_step_is_named_by_its_own_operator(failing):
    """_run finds the index of the step that raised (it runs without enumerate)."""
    from types import SimpleNamespace

    from microtrain.step.executor import _run

    def step(i):
        def run():
            if i == failing:
                raise ValueError("shapes do not fit")
        return run
    owners = [("model.circle", SimpleNamespace(index=10 + i, type=f"OP{i}")) for i in range(3)]
    with pytest.raises(UserError, match=rf"operator {10 + failing} \(OP{failing}\).*shapes"):
        _run([step(i) for i in range(3)], owners)


# -- no second copy of the weights ---------------------------------------------------------------

def _diverge(trainer: Trainer, x, t) -> str:
    """Train an epoch, then one whose learning rate sends the weights to inf;
    returns the error's message."""
    trainer.fit([x], [t], epochs=1, shuffle=False)
    trainer.schedule = lambda step: np.float32(np.inf)
    with pytest.raises(UserError, match="training diverged in epoch 2") as error:
        trainer.fit([x], [t], epochs=2, shuffle=False)
    return str(error.value)


@pytest.mark.parametrize("some_rows", [False, True])
def test_a_diverged_run_restores_the_saved_weights_from_the_file(tmp_path, some_rows):
    """By default no copy of the weights is held: a run whose weights became
    inf gets back those of the .wof last saved (or read), also when it trains
    some rows of a kernel and reads the others in place."""
    path = FIXTURES / "mlp.tflite"
    budget = budget_between(path, tmp_path, "biases", "last:1", optimizer="sgd") \
        if some_rows else None
    result = split(path, tmp_path, memory_budget=budget, optimizer="sgd", recompute="none")
    assert bool(load_artifacts(result.frozen).training.rows) == some_rows
    x, t = data("mlp", 64)
    trainer = Trainer(result.frozen, batch_size=32)
    in_ram = Trainer(result.frozen, batch_size=32, divergence_snapshot="ram")
    assert in_ram.memory_bytes() - trainer.memory_bytes() == trainer.memory.params.nbytes
    message = _diverge(trainer, x, t)
    assert f"kept the weights of {result.wof}" in message
    saved = load_artifacts(result.frozen).weights
    for tensor, weights in trainer.weights().items():
        np.testing.assert_array_equal(weights, saved[tensor])
    trainer.schedule, trainer.epoch = (lambda step: 0.01), 0
    trainer.fit([x], [t], epochs=1, shuffle=False)
    trainer.save_weights(tmp_path / "trained.wof")
    trained = {k: v.copy() for k, v in trainer.weights().items()}
    assert not all(np.array_equal(trained[k], saved[k]) for k in saved)
    assert f"kept the weights of {tmp_path / 'trained.wof'}" in _diverge(trainer, x, t)
    for tensor, weights in trainer.weights().items():
        np.testing.assert_array_equal(weights, trained[tensor])


def test_the_snapshot_in_ram_restores_the_epochs_start(tmp_path):
    result = split(FIXTURES / "mlp.tflite", tmp_path, optimizer="sgd")
    x, t = data("mlp", 64)
    trainer = Trainer(result.frozen, batch_size=32, divergence_snapshot="ram")
    trainer.fit([x], [t], epochs=1, shuffle=False)
    after_one = {k: v.copy() for k, v in trainer.weights().items()}
    trainer.epoch = 0  # _diverge trains this epoch again, from these weights
    trainer.set_params(np.concatenate([after_one[k].ravel() for k in after_one]))
    message = _diverge(trainer, x, t)
    assert "kept the weights of the epoch's start" in message
    assert not np.array_equal(trainer.weights()[next(iter(after_one))],
                              load_artifacts(result.frozen).weights[next(iter(after_one))])


def test_a_snapshot_in_ram_is_planned(tmp_path):
    """`microtrain run --divergence-snapshot ram` holds what `inspect` plans for it:
    4 bytes per trained weight more than the split's plan."""
    from microtrain.commands import session
    from microtrain.run_config import RunConfig
    from trainconf.inspect import planned_memory
    result = split(FIXTURES / "mlp.tflite", tmp_path)
    memory = planned_memory(result.frozen, load_model(result.frozen), None, None,
                            divergence_snapshot="ram")
    trained = sum(p["parameters"] for p in result.trainable)
    assert memory["ram"] - result.memory["ram"] == 4 * trained
    x, t = (str(FIXTURES / f"{f}.npy") for f in FILES["mlp"])
    summary = session.run(RunConfig(frozen=str(result.frozen), inputs=[x], targets=[t],
                                    epochs=1, save="never", divergence_snapshot="ram"))
    assert 0.98 * memory["ram"] <= summary["memory_bytes"] <= memory["ram"], (summary, memory)


def test_a_wof_replaced_while_loading_is_refused(tmp_path):
    """The frozen rows are mapped by name after the .wof was read: a file put in
    its place in between is refused, not trained on."""
    from microtrain.step.executor import Memory
    from microtrain.files.format.wof import write_wof
    path = FIXTURES / "mlp.tflite"
    result = split(path, tmp_path, memory_budget=budget_between(path, tmp_path, "biases", "last:1"),
                   recompute="none")
    partial_rows(result.frozen)
    art = load_artifacts(result.frozen)
    write_wof(result.wof, len(art.forward.tensors), {t: w * 2 for t, w in art.weights.items()})
    with pytest.raises(UserError, match=r"mlp\.wof: was replaced while it was being loaded"):
        Memory(art, 32)
# -- updates as gradients complete (operator reordering) -----------------------------------------

SHARED = {"lstm": FIXTURES / "keras_sequence" / "lstm.tflite",  # an unrolled recurrent kernel
          "transformer": FIXTURES / "keras_sequence" / "transformer.tflite"}


def _split_any(splits, tmp_path, model):
    if model in SHARED:
        return split(SHARED[model], tmp_path).frozen
    return splits(model).frozen


@pytest.mark.parametrize("model", ["mobilenetv2", "residual_mlp", "lstm", "transformer"])
def test_each_update_follows_every_use_of_its_weight_and_gradient(splits, tmp_path, model):
    """Replaying the backward pass over the gradient buffer: an update comes after
    every operator that writes or reads its gradient or reads its weight (so a
    later input gradient never sees an updated kernel), and no gradient is
    overwritten before its update reads it."""
    art = load_artifacts(_split_any(splits, tmp_path, model))
    plan, links = art.links.memory, art.links
    grad_of = {w: g for g, w in links.gradients}
    weight_as = {b: f for b, f in links.forward}
    points = dict(plan.updates)
    assert sorted(points) == sorted(grad_of.values())
    placed = dict(plan.gradients)
    words = np.full(plan.gradient_bytes // 4, -1)
    span = {g: slice(o // 4, o // 4 + prod(art.backprop.tensors[g].shape)) for g, o in placed.items()}
    after = {}
    for g, i in points.items():
        after.setdefault(i, []).append(g)
    shared = 0
    for op in art.backprop.ops:
        used = [t for t in op.inputs + op.outputs if t in points] + \
            [grad_of[weight_as[t]] for t in op.inputs if weight_as.get(t) in grad_of]
        for g in used:
            assert op.index <= points[g], (op.index, g)
        for t in op.inputs:
            if t in placed:
                assert (words[span[t]] == t).all(), f"gradient {t} overwritten before op {op.index}"
        for t in op.outputs:
            if t in placed:
                words[span[t]] = t
        for g in after.get(op.index, []):
            if g in placed:
                assert (words[span[g]] == g).all(), f"gradient {g} overwritten before its update"
        shared += sum(1 for t in op.inputs if weight_as.get(t) in grad_of)
    # the buffer holds less than all gradients at once (they share bytes)
    total = sum(prod(art.backprop.tensors[g].shape) * 4 for g in placed)
    assert plan.gradient_bytes < total
    if model == "lstm":  # the unrolled steps read each weight: several reads a weight
        assert shared > len(grad_of)


def test_a_layers_kernel_and_bias_update_in_one_optimizer_call(splits):
    """Every element updates once a step, and each layer whose kernel gradient
    is not fused (those update a tile of rows at a time) has its kernel and bias
    updated by one call of the optimizer's rule over both."""
    trainer = Trainer(splits("mobilenetv2").frozen, batch_size=8, optimizer="adam")
    base = trainer.memory.params.ctypes.data
    calls = []
    rule = trainer.optimizer._update

    def counted(params, *rest):
        lo = (params.ctypes.data - base) // 4
        calls.append((lo, lo + params.size))
        rule(params, *rest)
    trainer.optimizer._update = counted
    trainer.fit(*[[a] for a in data("mobilenetv2", 8)], epochs=1, shuffle=False)
    covered = np.zeros(trainer.memory.params.size, int)
    for lo, hi in calls:
        covered[lo:hi] += 1
    assert (covered == 1).all()
    art, offsets = trainer.art, trainer.memory.offsets
    grad_of = {w: g for g, w in art.links.gradients}
    fused = dict(art.links.memory.fused)
    layers = [op.inputs[1:3] for op in art.forward.ops if len(op.inputs) >= 3
              and all(t in offsets for t in op.inputs[1:3]) and grad_of[op.inputs[1]] not in fused]
    assert len(layers) > 30
    for kernel, bias in layers:
        assert any(lo <= offsets[kernel][0] and offsets[bias][1] <= hi for lo, hi in calls)
    assert len(calls) < len(offsets)


def without_updates(frozen: Path, folder: Path) -> Path:
    """The split files with a plan that says nothing of updates: every gradient
    is held until the backward pass ends (the path loss scaling takes)."""
    def change(meta):
        meta["memory"].update(updates=[], gradients=[], gradient_bytes=0)
    return edit_plan(frozen, folder, change)


@pytest.mark.parametrize("optimizer,schedule,accum", [
    ("sgd", "constant", 1), ("momentum", "cosine", 1), ("adamw", "constant", 1),
    ("nadam", "constant", 1), ("rmsprop", "step", 1), ("adam", "constant", 3),
    ("nadam", "cosine", 2)])
@pytest.mark.parametrize("model", ["residual_mlp", "cnn"])
def test_updating_as_gradients_complete_is_bit_identical(splits, tmp_path, model, optimizer,
                                                          schedule, accum):
    """Weight decay, schedules and the iteration counter see one step per batch
    whatever the order of the weights' updates, and accumulating, each
    gradient added to the sum as it completes sums as the whole vector does:
    losses and weights equal those of holding every gradient until the
    backward pass ends."""
    frozen = splits(model).frozen
    x, t = data(model, 100)
    runs = []
    for path in (frozen, without_updates(frozen, tmp_path)):
        trainer = Trainer(path, batch_size=16, optimizer=optimizer, lr_schedule=schedule,
                          schedule_params={"decay_steps": 5} if schedule != "constant" else None,
                          accum_steps=accum)
        history = trainer.fit([x], [t], epochs=2, shuffle=False)
        runs.append((trainer.reorder, [r["loss"] for r in history], trainer.memory.params.copy(),
                     trainer.optimizer.iterations))
    (reordered, losses, weights, steps), (whole, losses_whole, weights_whole, steps_whole) = runs
    assert reordered and not whole
    assert losses == losses_whole and steps == steps_whole == 2 * -(-7 // accum)
    np.testing.assert_array_equal(weights, weights_whole)


@pytest.mark.parametrize("model,batch", [("mobilenetv2", 1), ("mobilenetv2", 8),
                                         ("residual_mlp", 16)])
def test_a_fused_gradient_is_the_whole_products_rows(splits, tmp_path, model, batch):
    """A gradient computed a tile of rows at a time (the plan's `fused`), each
    tile updated as it is complete, equals the whole product's (each row's sum
    is the same sum; BLAS may block it otherwise, so within a float32 rounding),
    in the gradients and in the weights after training.  Planned at batch 1
    (the smallest tiles: fused_tile), run at any batch."""
    frozen = splits(model, batch_size=1).frozen
    assert load_artifacts(frozen).links.memory.fused
    x, t = data(model, 2 * batch)
    runs = []
    for path in (frozen, without_plan(frozen, tmp_path)):
        trainer = Trainer(path, batch_size=batch, optimizer="adam")
        loss, grads = trainer.gradients([x[:batch]], [t[:batch]])
        history = trainer.fit([x], [t], epochs=2, shuffle=False)
        runs.append((trainer.reorder, loss, grads, [r["loss"] for r in history],
                     trainer.memory.params.copy()))
    (fused, loss, grads, losses, weights), (reordered, *whole) = runs
    assert fused and not reordered
    assert loss == whole[0] and grads.keys() == whole[1].keys()
    for w, g in grads.items():
        np.testing.assert_allclose(g, whole[1][w], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(losses, whole[2], rtol=1e-5)
    np.testing.assert_allclose(weights, whole[3], rtol=1e-4, atol=1e-6)


def test_a_step_with_a_non_finite_loss_updates_nothing(splits):
    """The first update checks the loss: a diverged step leaves every weight as it was."""
    from microtrain.trainer import Diverged, Totals
    trainer = Trainer(splits("mlp").frozen, batch_size=8, optimizer="sgd")
    assert trainer.reorder
    x, t = data("mlp", 8)
    x[3, 5] = np.inf  # past check_data, which train_batch leaves to its callers
    before = trainer.memory.params.copy()
    with pytest.raises(Diverged), np.errstate(invalid="ignore"):
        trainer.train_batch([x], [t], np.arange(8), Totals())
    np.testing.assert_array_equal(trainer.memory.params, before)


@pytest.mark.parametrize("run,reordered", [({}, True), ({"loss_scale": "1024"}, False),
                                           ({"loss_scale": "dynamic"}, False),
                                           ({"loss_scale": "adaptive"}, False),
                                           ({"accum_steps": 2}, True),
                                           ({"accum_steps": 2, "loss_scale": "dynamic"}, True)])
def test_the_plan_holds_every_gradient_where_a_step_needs_them(splits, run, reordered):
    """Every gradient at once with a loss scale; accumulating, their running sum
    and the buffer each run's gradients pass through, where a fused gradient
    (the Dense's and each 1x1 convolution's larger than the largest gradient
    not fused) holds a tile of rows no larger than that one."""
    result = splits("mobilenetv2", trainable="all")
    built = load_artifacts(result.frozen)
    from trainconf.memory import fused_tile, peak
    memory = peak(built, 1, "sgd", {"frozen": 0, "wof": 0, "backprop": 0}, **run)
    all_gradients = 4 * sum(w.size for w in built.weights.values())
    weight_of, fused = dict(built.links.gradients), dict(built.links.memory.fused)
    whole = max(built.weights[t].size for g, t in weight_of.items() if g not in fused)
    assert {weight_of[g] for g in fused} == {t for t, w in built.weights.items()
                                             if w.ndim > 1 and w.size > whole
                                             and w.shape[1:3] != (3, 3)}
    tiles = {g: fused[g] * built.weights[weight_of[g]][0].size for g in fused}
    assert all(n <= max(whole, fused_tile(32)) or fused[g] == 1 for g, n in tiles.items())
    largest = 4 * max(whole, *tiles.values())  # the split's batch 32 takes 16384-element tiles
    assert memory["gradients_reordered"] is reordered
    assert memory["gradients"] == (largest if reordered else all_gradients) + \
        (all_gradients if run.get("accum_steps") else 0)


@pytest.mark.parametrize("change,error", [
    (lambda m: m.update(gradient_bytes=2 ** 39), r"needs \d+ bytes of tensors, more than"),
    (lambda m: m.update(gradient_bytes=8), r"memory plan: gradient \d+ does not fit the 8-byte"),
    (lambda m: m.update(updates=[[m["updates"][0][0], 10 ** 6]]),
     r"memory plan: the update of gradient \d+ after operator 1000000 names no"),
    (lambda m: m.update(fused=[[m["fused"][0][0], 0]]), r"gradient \d+ is fused in tiles of 0"),
    (lambda m: m.update(fused=m["fused"] + [[m["backprop"][0][0], 1]]),
     r"memory plan: fused tensor \d+ is no weight gradient"),
])
def test_a_damaged_gradient_plan_is_refused(splits, tmp_path, change, error):
    frozen = edit_plan(splits("mlp", batch_size=1).frozen,  # batch 1: a fused gradient
                       tmp_path, lambda meta: change(meta["memory"]))
    x, t = data("mlp", 4)
    with pytest.raises(UserError, match=error):
        Trainer(frozen, batch_size=4).gradients([x], [t])


# -- what the plan assumed of the run -------------------------------------------------------------

def _without_planned_for(frozen: Path, folder: Path) -> Path:
    """A copy of the split files as written before the plan's assumptions were recorded."""
    copy = edit_plan(frozen, folder, lambda meta: None)
    model = load_model(copy)
    training = json.loads(get_metadata(model, TrainingMeta.NAME))
    del training["planned_for"]
    set_metadata(model, TrainingMeta.NAME, json.dumps(training).encode())
    data = model_to_bytes(model)
    copy.write_bytes(data)
    _edit_links(copy, lambda meta: meta.update(frozen_sha256=fingerprint(data)))
    return copy


def _run(frozen: Path, *options: str):
    x, t = (str(FIXTURES / f"{f}.npy") for f in FILES["mlp"])
    from microtrain.commands.cli import main as microtrain_main
    return CliRunner().invoke(microtrain_main, [
        "run", str(frozen), "--input", x, "--target", t, "--epochs", "1", "--seed", "0",
        "--json", "--output-wof", str(frozen.with_name("out.wof")), *options])


def test_a_run_other_than_planned_says_so_in_one_line(tmp_path):
    from microtrain.files.contracts import PlannedRun
    result = split(FIXTURES / "mlp.tflite", tmp_path, loss_scale="128", accum_steps=2)
    assert load_artifacts(result.frozen).training.planned_for == PlannedRun("static", 2, "dense")
    inspected = json.loads(CliRunner().invoke(main, ["inspect", str(result.frozen),
                                                      "--json"]).stdout)
    assert inspected["trainable"]["planned_for"] == \
        {"loss_scale": "static", "accum_steps": 2, "embedding_update": "dense"}
    # inspect estimates what the split planned, unless told otherwise
    assert inspected["memory"]["ram"] == result.memory["ram"]
    other_plan = json.loads(CliRunner().invoke(main, ["inspect", str(result.frozen), "--json",
                                                      "--accum-steps", "1"]).stdout)
    assert other_plan["memory"]["ram"] < result.memory["ram"]
    as_planned = _run(result.frozen, "--loss-scale", "512", "--accum-steps", "2")
    assert as_planned.exit_code == 0 and as_planned.stderr == ""
    other = _run(result.frozen, "--accum-steps", "1")
    assert other.exit_code == 0, other.output
    assert other.stderr == (f"warning: {result.frozen}: the plan assumed --loss-scale N (a static "
                            f"scale) and --accum-steps 2; held memory will differ from the "
                            f"planned peak\n")
    held = json.loads(other.stdout.splitlines()[-1])["memory_bytes"]
    assert held < 0.98 * result.memory["ram"]  # the warning is no false alarm


def test_files_without_the_plans_assumptions_load_and_run_quietly(tmp_path):
    result = split(FIXTURES / "mlp.tflite", tmp_path / "split")
    (tmp_path / "old").mkdir()
    old = _without_planned_for(result.frozen, tmp_path / "old")
    assert load_artifacts(old).training.planned_for is None
    inspected = CliRunner().invoke(main, ["inspect", str(old), "--json"])
    assert json.loads(inspected.stdout)["trainable"]["planned_for"] is None
    run = _run(old, "--accum-steps", "2")
    assert run.exit_code == 0 and run.stderr == "", run.output
