"""RunConfig: the options of `microtrain run` as one record, its command line and
its checks."""
import re
from dataclasses import fields
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from microtrain.commands.cli import main
from microtrain.files.errors import UserError
from microtrain.step.loss_scale import make_loss_scale
from microtrain.commands.federated.settings import FederatedSettings
from microtrain.run_config import (RunConfig, Shape, SweepSettings, command_line, flag,
                                   option_fields, parse)
from microtrain.shuffle import Shuffler
from microtrain.trainer import Trainer
from trainconf.split import split

BASE = dict(frozen="model.frozen.circle", inputs=("x.npy",), targets=("y.npy",))


def _other(f):
    """A valid value of field `f` other than its default."""
    kind = f.metadata["type"]
    if kind is bool:
        return not f.default
    if isinstance(kind, click.Choice):
        return next(c for c in kind.choices if c != f.default)
    if isinstance(kind, Shape):
        return ((8, 8, 1), (3,))
    if isinstance(kind, click.IntRange) or kind is int:
        return 3
    if isinstance(kind, click.FloatRange):
        return 0.25
    if kind is float:
        return 0.1 + 0.2  # not exact in decimal: written back by repr
    if f.metadata["multiple"]:
        return ("a.npy", "b.npz:KEY")
    if f.name == "loss_scale":
        return "dynamic"
    return "some file.wof"


def test_every_field_round_trips_through_its_command_line():
    for f in fields(RunConfig):
        if f.name in ("frozen", "inputs", "targets", "test_inputs", "test_targets",
                      "validation_split", "resume"):
            continue  # set below, with the fields they go with
        config = RunConfig(**BASE, **{f.name: _other(f)})
        assert RunConfig.from_argv(config.argv()) == config, f.name
    config = RunConfig("my model.circle", inputs=("x.npy", "x2.npy"), targets=("y.npz:T",),
                       test_inputs=("tx.npy",), test_targets=("ty.npy",), resume=True,
                       checkpoint="c.ckpt")
    assert RunConfig.from_argv(config.argv()) == config
    assert RunConfig.from_argv(RunConfig(**BASE, validation_split=0.2).argv()).validation_split \
        == 0.2


@pytest.mark.parametrize("values, message", [
    ({"batch_size": 0}, "--batch-size: 0 is not in the range x>=1"),
    ({"learning_rate": "fast"}, "--learning-rate: 'fast' is not a valid float"),
    ({"optimizer": "adamx"}, "--optimizer: 'adamx' is not one of"),
    ({"input_shapes": ["8,x,1"]}, "--input-shape: '8,x,1' is not a shape like 8,8,1"),
    ({"inputs": "x.npy"}, "--input: expected a list of values"),
    ({"validation_split": 1.0}, "--validation-split: 1.0 is not in the range 0<x<1"),
    ({"test_inputs": ["tx.npy"]}, "give --test-input and --test-target together"),
    ({"resume": True}, "--resume needs --checkpoint PATH"),
])
def test_a_bad_value_is_one_line_naming_the_option(values, message):
    with pytest.raises(UserError) as e:
        RunConfig(**{**BASE, **values})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_command_line_names_the_option_of_a_bad_value():
    result = CliRunner().invoke(main, ["run", "m.circle", "--input", "x.npy", "--target",
                                       "y.npy", "--test-input", "tx.npy"])
    assert result.exit_code == 1
    assert result.stderr == "Error: give --test-input and --test-target together\n"


def _help_entries(command: str) -> tuple[str, list[str]]:
    """`microtrain COMMAND --help` and its options' entries, each on one line."""
    text = CliRunner().invoke(main, [command, "--help"], terminal_width=10_000).output
    return text, [" ".join(e.split()) for e in re.split(r"\n  (?=-)", text)]


def _assert_explained(entries: list[str], f) -> None:
    """Field `f`'s option is offered with help that states its default."""
    line = next((e for e in entries if e.startswith(flag(f) + " ")), None)
    assert line is not None, flag(f)
    assert len(line) > len(flag(f)) + 20, line  # some help, beyond the flag and its type
    assert re.search(r"default|\[required\]", line, re.IGNORECASE), line
    if f.default not in (None, ()) and f.default is not False:
        shown = f.default if f.metadata["type"] is not bool else flag(f)[2:]
        assert f"[default: {shown}" in line, line


@pytest.mark.parametrize("command", ["run", "eval", "infer", "sweep", "federated"])
def test_help_explains_every_field_and_its_default(command):
    """run offers every field; the others those they take, each explained the same way."""
    text, entries = _help_entries(command)
    offered = {p.name for p in main.commands[command].params}
    for f in fields(RunConfig):
        if f.name == "frozen":
            assert "FROZEN" in text
            continue
        if command != "run" and (f.name not in offered or f.name == "seed"):
            continue  # sweep's and federated's --seed are their own
        _assert_explained(entries, f)


@pytest.mark.parametrize("command, record", [("sweep", SweepSettings),
                                             ("federated", FederatedSettings)])
def test_a_commands_own_options_come_from_its_record(command, record):
    """Every option field of sweep's and federated's records is an option of the command,
    explained with its default, and nothing else of theirs is hand-written beside them."""
    _, entries = _help_entries(command)
    own = option_fields(record)
    assert own
    for f in own:
        _assert_explained(entries, f)
    assert {f.name for f in fields(record)} - {f.name for f in own} <= {"run"}


def _settings(record, **changes):
    return FederatedSettings(RunConfig(**BASE, validation_split=0.2), **changes) \
        if record is FederatedSettings else record(**changes)


@pytest.mark.parametrize("record", [SweepSettings, FederatedSettings])
def test_a_commands_own_options_round_trip_through_its_command_line(record):
    for f in option_fields(record):
        value = "dirichlet:0.5" if f.name == "partition" else _other(f)
        settings = _settings(record, **{f.name: value})
        assert getattr(settings, f.name) != f.default, f.name
        assert _settings(record, **parse(record, command_line(settings))) == settings, f.name


def test_a_trainer_from_a_config_trains_as_one_given_the_same_options(tmp_path):
    fixtures = Path(__file__).parent / "fixtures"
    frozen = split(fixtures / "mlp.tflite", tmp_path).frozen
    x, y = np.load(fixtures / "digits_x.npy")[:96], np.load(fixtures / "digits_onehot.npy")[:96]
    config = RunConfig(frozen, batch_size=16, optimizer="sgd", momentum=0.5,
                       lr_schedule="cosine", decay_steps=4, loss_scale="dynamic",
                       loss_scale_init=256.0, accum_steps=2)
    by_keywords = Trainer(frozen, batch_size=16, optimizer="sgd", momentum=0.5,
                          lr_schedule="cosine", schedule_params={"decay_steps": 4},
                          loss_scale=make_loss_scale("dynamic", init=256.0), accum_steps=2)
    trainers = [Trainer.from_config(config), by_keywords]
    for trainer in trainers:
        trainer.fit([x], [y], epochs=2, rng=Shuffler(1))
    assert np.array_equal(trainers[0].memory.params, trainers[1].memory.params)
    assert trainers[0].resolved.report() == trainers[1].resolved.report()
