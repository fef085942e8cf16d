"""The `trainconf` command line: one function per command, each a thin layer
over the Python API that does the work."""
from pathlib import Path

import click

from microtrain.cli_common import CommandGroup, print_json
from microtrain.format.model import load_model

from .importer import import_tflite
from .inspect import describe, render_text

MODEL = click.Path(dir_okay=False, path_type=Path)


@click.group(cls=CommandGroup)
@click.version_option(package_name="trainconf-microtrain", prog_name="trainconf")
def main():
    """trainconf: prepare a .circle or .tflite model for training on a device
    with microtrain."""


@main.command("import")
@click.argument("model", type=MODEL)
@click.option("-o", "--output", type=MODEL,
              help="Where to write the circle model  [default: MODEL with the suffix .circle]")
def import_command(model: Path, output: Path | None):
    """Convert MODEL.tflite to a .circle model (same graph, weights and signatures)."""
    output = output or model.with_suffix(".circle")
    import_tflite(model, output)
    click.echo(f"wrote {output}")


@main.command("inspect")
@click.argument("model", type=MODEL)
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document instead of text  [default: text]")
def inspect_command(model: Path, as_json: bool):
    """Show MODEL (.circle or .tflite): subgraphs, inputs and outputs (with a
    dynamic or fixed batch), every operator, constant tensors and totals."""
    desc = describe(load_model(model))
    if as_json:
        print_json(desc)
    else:
        click.echo(render_text(desc))
