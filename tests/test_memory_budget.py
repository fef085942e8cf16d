"""`trainconf split --memory-budget`: what trains fits the budget, a run stays
within it and still learns; partial updates (bias only, some output channels,
the biases of every layer beside whole last layers) train exactly those
parameters; sizes and bad budgets give clear errors."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.files.format.wof import read_wof
from microtrain.files.format.model import load_model
from microtrain.trainer import Trainer
from test_memory_plan import DATA, data
from trainconf.budget import Choice, parse_size, smallest
from trainconf.cli import main
from trainconf.select import layers, weighted_ops
from trainconf.split import budget_tiles, build, load_prepared, resolve_precision, split

FIXTURES = Path(__file__).parent / "fixtures"
TYPES = resolve_precision()


@pytest.mark.parametrize("text,size", [("65536", 65536), ("64KiB", 65536), ("1.5MB", 1500000),
                                       ("2 kb", 2000), (".5GiB", 2 ** 29), ("100B", 100)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["64Q", "", "-1", "1e3", "KiB", "1.5.2MB"])
def test_bad_sizes(text):
    with pytest.raises(Exception, match="is not a size"):
        parse_size(text)


def groups_of(path: Path, types=TYPES):
    g = load_prepared(path, types)[1]
    return g, layers(g, weighted_ops(g))


def peak_of(model: str, choice: Choice | None, batch: int, optimizer: str, types=TYPES) -> int:
    """The planned peak of `choice` (None: the smallest)."""
    path = FIXTURES / f"{model}.tflite"
    g, groups = groups_of(path, types)
    choice = choice or smallest(g, groups)
    built = build(path, lambda graph: choice.choose(graph, groups), None, "mean", types, batch,
                  scheme=choice.scheme(len(groups)),  # recorded in the frozen model: its bytes
                  tiles=budget_tiles(batch, False)[-1])  # as a budget chooses what trains
    return built.peak(batch, optimizer)["ram"]


def losses_before_and_after(frozen: Path, model: str, batch: int, optimizer: str):
    trainer = Trainer(frozen, batch_size=batch, optimizer=optimizer, learning_rate=0.01)
    x, t = data(model, 4 * batch)  # whole batches: the step the plan is for
    before = trainer.evaluate([x], [t])["loss"]
    trainer.fit([x], [t], epochs=3, shuffle=False)
    return before, trainer.evaluate([x], [t])["loss"], trainer


@pytest.mark.parametrize("model", list(DATA))
def test_a_budget_run_fits_and_learns(model, tmp_path):
    """A budget halfway between the smallest choice and training everything."""
    batch, optimizer = (8 if model == "mobilenetv2" else 32), "adam"
    least = peak_of(model, None, batch, optimizer)
    whole = split(FIXTURES / f"{model}.tflite", tmp_path / "all", batch_size=batch,
                  optimizer=optimizer).memory["ram"]
    budget = (least + whole) // 2
    result = split(FIXTURES / f"{model}.tflite", tmp_path, memory_budget=budget,
                   batch_size=batch, optimizer=optimizer)
    assert least <= result.memory["ram"] <= budget
    before, after, trainer = losses_before_and_after(result.frozen, model, batch, optimizer)
    assert trainer.memory_bytes() <= budget
    assert after < before


def test_everything_trains_when_it_fits(tmp_path):
    whole = split(FIXTURES / "cnn.tflite", tmp_path / "all")
    result = split(FIXTURES / "cnn.tflite", tmp_path, memory_budget=whole.memory["ram"])
    assert result.trainable == whole.trainable
    assert {d["part"] for d in result.memory["budget"]["trains"]} == {"all"}


def test_a_budget_takes_the_fastest_kernels_that_fit(tmp_path):
    """What trains is chosen with the leanest tiles; it trains with the fastest that
    fit: the kernels' fastest layouts when everything fits them, compact ones
    only when asked for."""
    whole = split(FIXTURES / "cnn.tflite", tmp_path / "all").memory["ram"]
    roomy = split(FIXTURES / "cnn.tflite", tmp_path / "roomy", memory_budget=whole)
    compact = split(FIXTURES / "cnn.tflite", tmp_path / "compact", memory_budget=whole,
                    compact_scratch=True)
    assert roomy.memory["ram"] == whole and roomy.memory["budget"]["scratch_tile"] is None
    assert compact.memory["budget"]["scratch_tile"] is not None
    assert compact.memory["ram"] <= whole and compact.memory["budget"]["scheme"] == "all"


def test_a_budget_with_a_trainable_set_chooses_only_how(tmp_path):
    """--trainable with --memory-budget trains that set, with the tiles and the
    recomputation that fit; a budget it cannot fit is refused in one line."""
    given = split(FIXTURES / "cnn.tflite", tmp_path / "given", trainable="last:2")
    leanest = split(FIXTURES / "cnn.tflite", tmp_path / "lean", trainable="last:2",
                    compact_scratch=True, recompute="auto").memory["ram"]
    fitted = split(FIXTURES / "cnn.tflite", tmp_path / "fitted", trainable="last:2",
                   memory_budget=leanest)
    assert fitted.trainable == given.trainable and fitted.memory["ram"] <= leanest
    with pytest.raises(Exception, match=r"--memory-budget \d+ bytes: --trainable last:2 needs "
                                        r"at least \d+ bytes at batch 32 with adam$"):
        split(FIXTURES / "cnn.tflite", tmp_path / "small", trainable="last:2",
              memory_budget=leanest // 2)


def test_bias_only(tmp_path):
    """The smallest choice trains the last layer's bias; its kernel stays as it was."""
    budget = peak_of("mlp", Choice(0, 1), 32, "adam")
    result = split(FIXTURES / "mlp.tflite", tmp_path, memory_budget=budget)
    (bias,) = [t["index"] for t in result.trainable]
    frozen = load_model(result.frozen)
    assert result.memory["budget"]["trains"][0]["part"] == "bias"
    before, after, trainer = losses_before_and_after(result.frozen, "mlp", 32, "adam")
    assert after < before
    assert not np.array_equal(trainer.weights()[bias], read_wof(result.wof, frozen)[bias])


def test_some_output_channels(tmp_path):
    """A budget for both biases and k rows of the last layer's kernel, less than
    k + 1 rows or the whole layer: the gradient is exactly those rows of the full
    gradient; training changes only them, and the .wof keeps the whole kernel."""
    k = 2
    budget = peak_of("mlp", Choice(0, 2, k), 32, "adam")
    assert budget < min(peak_of("mlp", c, 32, "adam") for c in (Choice(0, 2, k + 1), Choice(1, 1)))
    result = split(FIXTURES / "mlp.tflite", tmp_path / "part", memory_budget=budget)
    kernel, lo, hi = next((t["index"], *t["rows"]) for t in result.trainable if t["rows"][0])
    assert (lo, hi) == (10 - k, 10) and result.memory["budget"]["trains"][-1]["rows"] == [lo, hi]
    full = split(FIXTURES / "mlp.tflite", tmp_path / "full", trainable="last:1")
    x, t = data("mlp", 32)
    _, part_grads = Trainer(result.frozen, batch_size=32).gradients([x], [t])
    _, full_grads = Trainer(full.frozen, batch_size=32).gradients([x], [t])
    # float32 sums over a batch of 32 in another order (BLAS picks its kernel by
    # shape): equal up to a few ulps of the largest term, not to 1e-6 of each element
    expected = full_grads[kernel][lo:hi]
    np.testing.assert_allclose(part_grads[kernel], expected, rtol=0,
                               atol=32 * np.finfo(np.float32).eps * np.abs(expected).max())
    original = read_wof(result.wof, load_model(result.frozen))[kernel].copy()
    before, after, trainer = losses_before_and_after(result.frozen, "mlp", 32, "adam")
    assert after < before
    trainer.save_weights()
    saved = read_wof(result.wof, load_model(result.frozen))[kernel]
    assert saved.shape == original.shape
    np.testing.assert_array_equal(saved[:lo], original[:lo])
    assert np.all(np.any(saved[lo:] != original[lo:], axis=1))  # every trained row moved


def test_some_output_channels_with_fp16_weights(tmp_path):
    """The frozen rows are read rounded to fp16, like the trained ones."""
    path = FIXTURES / "cnn.tflite"
    types = resolve_precision("fp16")
    budget = peak_of("cnn", Choice(0, 2, 3), 32, "adam", types)
    result = split(path, tmp_path, precision="fp16", memory_budget=budget)
    assert result.memory["budget"]["trains"][-1]["rows"] == [7, 10]
    trainer = Trainer(result.frozen, batch_size=32)
    x, t = data("cnn", 64)
    trainer.fit([x], [t], epochs=1)
    assert abs(trainer.memory_bytes() - result.memory["ram"]) <= 0.1 * result.memory["ram"]
    kernel = trainer.art.training.trainable[0]
    lo = trainer.art.training.rows[kernel][0]
    working = trainer.memory.forward[kernel]
    np.testing.assert_array_equal(working, working.astype(np.float16))
    np.testing.assert_array_equal(trainer.memory.param_views[kernel][:lo],
                                  read_wof(result.wof, load_model(result.frozen))[kernel][:lo])


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_prints_the_choice_and_its_peak(tmp_path):
    run = invoke("split", FIXTURES / "mlp.tflite", "-o", tmp_path, "--memory-budget", "60KiB",
                 "--optimizer", "sgd", "--batch-size", 16)
    assert run.exit_code == 0, run.output
    lines = run.stdout.splitlines()
    assert re.fullmatch(r"memory budget 61440 bytes: trains (all|((biases(:last:\d+)?),?)?"
                        r"(last:\d+)?)( and kernel rows \d+\.\.\d+ of op \d+ \(.*\))?",
                        lines[1]), lines[1]
    peak = int(lines[2].split(": ")[1].split()[0])
    assert lines[2].startswith("planned peak at batch 16 with sgd: ") and peak <= 61440


@pytest.mark.parametrize("args,message", [
    (["--memory-budget", "1KiB"], "--memory-budget 1024 bytes: even the smallest trainable set "
                                  r"\(biases:last:1\) needs \d+ bytes at batch 32 with adam"),
    (["--memory-budget", "64Q"], "--memory-budget '64Q' is not a size"),
    (["--memory-budget", "20KB", "--trainable", "all"],
     r"--memory-budget 20000 bytes: --trainable all needs at least \d+ bytes at batch 32"),
])
def test_cli_errors(tmp_path, args, message):
    run = invoke("split", FIXTURES / "mlp.tflite", "-o", tmp_path, *args)
    assert run.exit_code != 0
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"Error: {FIXTURES / 'mlp.tflite'}: ")
    assert re.search(message, line), line


def test_all_biases_beside_the_last_layer(tmp_path):
    """MobileNetV2 at batch 1 with SGD, a budget that holds every bias and the
    last layer whole but not the last two layers: TTE's sparse update.  The run
    fits and learns, trains exactly those tensors; split and inspect report it."""
    path = FIXTURES / "mobilenetv2.tflite"
    g, groups = groups_of(path)
    budget = peak_of("mobilenetv2", Choice(1, len(groups)), 1, "sgd")
    assert budget < peak_of("mobilenetv2", Choice(2, 2), 1, "sgd")
    # without recomputation, which would free room for some rows of the next layer too
    run = invoke("split", path, "-o", tmp_path, "--memory-budget", budget, "--json",
                 "--batch-size", 1, "--optimizer", "sgd", "--recompute", "none")
    assert run.exit_code == 0, run.output
    chosen = json.loads(run.stdout)["memory"]["budget"]
    assert chosen["scheme"] == "biases,last:1" and chosen["text"] == "biases,last:1"
    assert [t["part"] for t in chosen["trains"]] == ["bias"] * (len(groups) - 1) + ["all"]
    frozen = tmp_path / "mobilenetv2.frozen.circle"
    inspected = invoke("inspect", frozen)
    assert f"trainable: biases,last:1 ({len(groups) + 1} tensors)" in inspected.stdout
    before, after, trainer = losses_before_and_after(frozen, "mobilenetv2", 1, "sgd")
    assert after < before and trainer.memory_bytes() <= budget
    biases = {u.bias for layer in groups for u in layer}
    assert set(trainer.weights()) == biases | {groups[-1][0].kernel}


@pytest.mark.parametrize("budget,trains", [("128KiB", "last:1"), ("384KiB", "biases,last:1")])
def test_mobilenetv2_targets_of_a_microcontroller_budget(tmp_path, budget, trains):
    """Issue 20's targets, MobileNetV2-0.35@32 at batch 1 with SGD: 128 KiB of RAM
    trains the whole last layer, 384 KiB every bias and the last layer's weights
    (and what more fits); a run holds no more than the budget."""
    result = split(FIXTURES / "mobilenetv2.tflite", tmp_path, memory_budget=budget,
                   batch_size=1, optimizer="sgd")
    chosen = result.memory["budget"]["scheme"]
    assert chosen == trains or chosen.startswith(trains + ","), chosen
    assert result.memory["ram"] <= parse_size(budget)
    _, after, trainer = losses_before_and_after(result.frozen, "mobilenetv2", 1, "sgd")
    assert trainer.memory_bytes() <= parse_size(budget)
