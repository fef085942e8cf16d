"""What both command lines share: bad input becomes one `Error: <file>: <problem>`
line on stderr and exit status 1, never a traceback.  This is the only place an
error becomes text."""
import json

import click

from .contracts import TrainingParameters
from .errors import UserError
from .lazy import DEFAULT_EMBEDDING_UPDATE, EMBEDDING_UPDATES
from .optimizers import DEFAULTS as OPTIMIZER_DEFAULTS, OPTIMIZERS


class CommandGroup(click.Group):
    """A click group whose commands report UserError, OSError and click's own
    usage errors (a bad option value) as one line."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # click would print the usage block and a hint too
            raise click.ClickException(one_line(e.format_message())) from None
        except UserError as e:
            raise click.ClickException(one_line(str(e))) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(one_line(f"{where}{e.strerror or e}")) from None


def one_line(message: str) -> str:
    """The message with line breaks (e.g. in a file name) escaped, so it stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


FORCE_OPTION = click.option(
    "--force", is_flag=True,
    help="Write over output files that hold another kind of file (a model, weights, a "
         "checkpoint, an array). Default: refuse, naming the file.")


WAIT_OPTION = click.option(
    "--wait", is_flag=True,
    help="When another run or split holds these files (microtrain/lock.py), wait until it "
         "ends. Default: refuse, naming its process.")


def print_json(document) -> None:
    """Print one JSON document on one line of stdout, so that a stream of them
    (one per epoch, then a summary) is JSON Lines."""
    click.echo(json.dumps(document))


def defaults_text(table: dict) -> str:
    return "; ".join(f"{name}: " + (", ".join(f"{k}={v}" for k, v in opts.items()) or "-")
                     for name, opts in table.items())


def embedding_update_option(purpose: str = ""):
    """--embedding-update, as `microtrain run` and the memory estimates offer it."""
    return click.option(
        "--embedding-update", type=click.Choice(list(EMBEDDING_UPDATES)),
        default=DEFAULT_EMBEDDING_UPDATE, show_default=True,
        help=f"How embedding tables (GATHER/EMBEDDING_LOOKUP on a trained table) update{purpose}: "
             + "; ".join(f"{k}: {v}" for k, v in EMBEDDING_UPDATES.items())
             + ". lazy holds a table's gradient as the touched rows only; it needs fp32 and "
               "no loss scaling; a table also read as a dense layer's weight stays dense.")


# The training parameters' options, as both command lines offer them; unset they
# are None, so the caller can take each from a record (microtrain.parameters).
_HYPERPARAMETERS = [
    ("--learning-rate", "learning_rate", "Base learning rate."),
    ("--momentum", "momentum", "Momentum (sgd, momentum, nesterov, rmsprop)."),
    ("--beta1", "beta_1", "First-moment decay (adam, adamw, adamax, nadam)."),
    ("--beta2", "beta_2", "Second-moment decay (adam, adamw, adamax, nadam)."),
    ("--epsilon", "epsilon", "Numerical-stability epsilon."),
    ("--rho", "rho", "Squared-gradient decay (rmsprop)."),
    ("--weight-decay", "weight_decay",
     "Decoupled weight decay, w -= w * weight_decay * lr before each update."),
]


def parameter_options(recorded: str, names=("optimizer", "hyperparameters", "batch_size",
                                             "epochs"), purpose: str = ""):
    """Options for the training parameters in `names`, each defaulting to the
    value `recorded` names (e.g. "the frozen model's"), else the default."""
    defaults = TrainingParameters()

    def default(value) -> str:
        return f"  [default: {recorded}, else {value}]"
    options = {
        "optimizer": [click.option(
            "--optimizer", type=click.Choice(list(OPTIMIZERS)),
            help=f"Update rule, as Keras 3's{purpose}." + default(defaults.optimizer)
                 + " Its hyperparameters' defaults: " + defaults_text(OPTIMIZER_DEFAULTS))],
        "hyperparameters": [click.option(flag, dest, type=float,
                                         help=text + f"  [default: {recorded} when it names the "
                                                     "same optimizer, else the optimizer's]")
                            for flag, dest, text in _HYPERPARAMETERS],
        "batch_size": [click.option("--batch-size", type=click.IntRange(1),
                                    help=f"Samples per step{purpose}; a partial last batch is "
                                         "used, not dropped." + default(defaults.batch_size))],
        "epochs": [click.option("--epochs", type=click.IntRange(1),
                                help="Epochs to train." + default(defaults.epochs))],
    }

    def decorate(fn):
        for name in reversed(names):
            for option in reversed(options[name]):
                fn = option(fn)
        return fn
    return decorate
