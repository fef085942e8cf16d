"""What both command lines share: bad input becomes one `Error: <file>: <problem>`
line on stderr and exit status 1, never a traceback.  This is the only place an
error becomes text."""
import io
import json
import os
import sys
import warnings
from contextlib import contextmanager

import click

from microtrain.files.errors import UserError
from microtrain.step.optimizers import UnknownHyperparameters
from microtrain.run_config import HYPERPARAMETER, group, options as run_options


class CommandGroup(click.Group):
    """A click group whose commands report UserError, OSError, MemoryError and
    click's own usage errors (a bad option value) as one line, end quietly when
    their reader closes stdout (`| head -1`), keep library warnings off stderr
    unless --verbose, and name an option as the user types it (--learning-rate)."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        cmd.params.append(click.Option(
            ["--verbose"], is_flag=True, expose_value=False, callback=_show_warnings,
            help="Show the warnings of the libraries used (Ray, Flower, numpy...). Default: "
                 "hidden."))
        super().add_command(cmd, name)

    def parse_args(self, ctx, args):
        for arg in args:  # the OS refuses such a path; click's checks would raise ValueError
            if "\0" in arg:
                raise click.ClickException(one_line(f"{arg}: an argument cannot hold a NUL "
                                                    "character"))
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        saved = os.environ.get("PYTHONWARNINGS")
        ctx.meta[RESTORES_WARNINGS] = True  # a command's context shares it: see _show_warnings
        try:
            with warnings.catch_warnings(), _quiet_when_stdout_closes():
                return super().invoke(ctx)
        except click.UsageError as e:  # click would print the usage block and a hint too
            raise click.ClickException(one_line(e.format_message())) from None
        except UserError as e:
            raise click.ClickException(one_line(self._text(e))) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(one_line(f"{where}{e.strerror or e}")) from None
        except MemoryError as e:  # a size no check foresaw: still one line
            raise click.ClickException(one_line(f"out of memory: {e}")) from None
        finally:
            _restore_env("PYTHONWARNINGS", saved)

    def _text(self, e: UserError) -> str:
        """The error's line, its field given as the option that sets it when the
        error names no file (`learning_rate` -> `--learning-rate`)."""
        if isinstance(e, UnknownHyperparameters):
            return str(e.named(self.option_flags()))
        if e.path is None and e.field:
            flag = self.option_flags().get(e.field)
            if flag:
                return f"{flag}: {e.problem}"
        return str(e)

    def option_flags(self) -> dict[str, str]:
        """Parameter name -> its long option, over every command."""
        return {p.name: max(p.opts, key=len) for cmd in self.commands.values()
                for p in cmd.params if isinstance(p, click.Option)}


RESTORES_WARNINGS = "microtrain.restores_warnings"


def _show_warnings(ctx, param, verbose: bool) -> None:
    """Hide warnings (here and in the processes a command starts, e.g. Ray's
    workers) unless --verbose, when CommandGroup.invoke restores both afterwards:
    not when a command's options are parsed by the Python API (a sweep's trials)."""
    if not verbose and ctx.meta.get(RESTORES_WARNINGS):
        warnings.simplefilter("ignore")
        os.environ["PYTHONWARNINGS"] = "ignore"


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class _ClosedAware:
    """sys.stdout that, once its reader has gone (BrokenPipeError), sends the rest
    of the output nowhere, so the command finishes its work and exits 0."""

    def __init__(self, stream):
        self._stream, self._closed = stream, False

    def write(self, text):
        if not self._closed:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self):
        if not self._closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self._closed = True
        try:  # what is still buffered would fail again when Python exits
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def _quiet_when_stdout_closes():
    stdout = sys.stdout
    sys.stdout = _ClosedAware(stdout)
    try:
        yield
    finally:
        sys.stdout = stdout


def one_line(message: str) -> str:
    """The message with line breaks (e.g. in a file name) escaped, so it stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


FORCE_OPTION = click.option(
    "--force", is_flag=True,
    help="Write over output files that hold another kind of file (a model, weights, a "
         "checkpoint, an array). Default: refuse, naming the file.")


WAIT_OPTION = click.option(
    "--wait", is_flag=True,
    help="When another run or split holds these files (microtrain/files/lock.py), wait until it "
         "ends. Default: refuse, naming its process.")


def print_json(document) -> None:
    """Print one JSON document on one line of stdout, so that a stream of them
    (one per epoch, then a summary) is JSON Lines."""
    click.echo(json.dumps(document))


def loss_scale_option(purpose: str = ""):
    """--loss-scale, as `microtrain run` and the memory estimates offer it."""
    return run_options(["loss_scale"], purpose=purpose)


def embedding_update_option(purpose: str = ""):
    """--embedding-update, as `microtrain run` and the memory estimates offer it."""
    return run_options(["embedding_update"], purpose=purpose)


def divergence_snapshot_option(purpose: str = ""):
    """--divergence-snapshot, as `microtrain run` and the memory estimates offer it."""
    return run_options(["divergence_snapshot"], purpose=purpose)


def parameter_options(recorded: str, names=("optimizer", "hyperparameters", "batch_size",
                                             "epochs"), purpose: str = ""):
    """Options for the training parameters in `names` ("hyperparameters": the
    optimizer's), each defaulting to the value `recorded` names (e.g. "the frozen
    model's"), else the default."""
    fields = [n for name in names for n in (group(HYPERPARAMETER) if name == "hyperparameters"
                                              else [name])]
    return run_options(fields, purpose=purpose, recorded=recorded)
