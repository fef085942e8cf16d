"""What both command lines share: bad input becomes one `Error: <file>: <problem>`
line on stderr and exit status 1, never a traceback.  This is the only place an
error becomes text."""
import json

import click

from .errors import UserError


class CommandGroup(click.Group):
    """A click group whose commands report UserError and OSError as one line."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from None


def print_json(document) -> None:
    """Print one JSON document on one line of stdout, so that a stream of them
    (one per epoch, then a summary) is JSON Lines."""
    click.echo(json.dumps(document))
