"""The `microtrain` command line: a thin layer over microtrain.commands.session."""
import sys

import click

from microtrain.commands import session
from microtrain.commands.cli_common import FORCE_OPTION, WAIT_OPTION, CommandGroup, print_json
from microtrain.commands.federated.settings import RUN_OPTIONS, FederatedSettings
from microtrain.files.opening import check_output
from microtrain.files.lock import locked
from microtrain.run_config import (SWEEP_REPLACES, SWEEPABLE, RunConfig, SweepSettings,
                                   option_fields, options)

JSON_LINES = click.option("--json", "as_json", is_flag=True,
                          help="Print JSON only on stdout: one object per line (JSON Lines), "
                               "the summary last.")
JSON_ONE = click.option("--json", "as_json", is_flag=True,
                        help="Print the result as one JSON object on stdout.")
# the run options of `eval`: the model, its data, how it is batched and judged
EVAL_OPTIONS = ("frozen", "wof", "backprop", "inputs", "input_shapes", "batch_size", "targets",
                "target_shapes", "metric")


@click.group(cls=CommandGroup)
@click.version_option(package_name="trainconf-microtrain")
def main():
    """microtrain: train on the device from the files written by `trainconf split`
    (STEM.frozen.circle, STEM.wof, STEM.backprop.circle)."""


@main.command()
@options()
@JSON_LINES
@FORCE_OPTION
@WAIT_OPTION
def run(as_json, force, wait, **fields):
    """Train FROZEN with its .wof and backprop graph; write the improved weights back."""
    config = RunConfig(**fields)
    with locked([config.frozen, session.check_run_outputs(config, force)], wait):
        summary = session.run(config, on_epoch=_epoch_printer(as_json), force=force,
                              progress=_progress if sys.stderr.isatty() and not as_json else None,
                              warn=lambda line: click.echo(f"warning: {line}", err=True))
    if as_json:
        print_json(summary)
    else:
        click.echo(summary["message"])


MIXED_PRECISION_KEYS = ("loss_scale", "skipped_steps", "grad_underflow", "grad_underflow_all")


def _epoch_line(record: dict) -> str:
    """onert_train-like: epoch, ms/step, loss and metrics; the mixed-precision
    diagnostics only when something was scaled, skipped or lost."""
    quiet = record["loss_scale"] == 1.0 and not record["skipped_steps"] \
        and not record["grad_underflow_all"]
    parts = [f"Epoch {record['epoch']}/{record['epochs']}", f"{record['ms_per_step']:.3f} ms/step"]
    for key, value in record.items():
        if key in ("epoch", "epochs", "ms_per_step", "loss_scale_by_tensor",
                   "grad_underflow_by_tensor") or \
                (quiet and key in MIXED_PRECISION_KEYS):
            continue
        if isinstance(value, dict):
            value = "–".join(f"{v:g}" for v in value.values())
        parts.append(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return " - ".join(parts)


def _epoch_printer(as_json: bool):
    def show(record: dict) -> None:
        if as_json:
            print_json(record)
        else:
            click.echo(_epoch_line(record))
    return show


def _progress(length: int, label: str):
    return click.progressbar(length=length, label=label, file=sys.stderr)


@main.command()
@options(exclude=SWEEP_REPLACES + ("seed",))  # the sweep's --seed is its own
@JSON_LINES
@FORCE_OPTION
@WAIT_OPTION
@click.option("--grid", "grid_texts", multiple=True, required=True,
              help="Values to try, 'NAME=V1,V2,... NAME=LOW:HIGH ...' (repeatable): NAME is an "
                   "option of `microtrain run` without its dashes; one value fixes it for every "
                   "trial (as giving the option itself does: every option of `run` is also "
                   "an option of sweep, fixed for every trial); LOW:HIGH is a range sampled "
                   "log-uniformly (--random, --search tpe). "
                   "Sweepable: " + ", ".join(SWEEPABLE) + ".")
@options(record=SweepSettings)
def sweep(grid_texts, as_json, force, wait, **fields):
    """Train FROZEN with every combination of --grid (or a sample of them) from the same
    starting weights and data order, rank the trials by the test metric, and write the best
    trial's weights to the .wof if they beat the starting weights."""
    from microtrain.commands.sweep import Sweep, table
    settings = SweepSettings(**{f.name: fields.pop(f.name) for f in option_fields(SweepSettings)})
    config = RunConfig(**fields)
    with locked([config.frozen, session.check_run_outputs(config, force)], wait):
        job = Sweep(config, grid_texts, settings)
        summary = job.run(on_trial=print_json) if as_json else _sweep_with_progress(job)
    if as_json:
        print_json(summary)
    else:
        click.echo(table(summary, [a.key for a in job.axes]))
        click.echo(_sweep_message(summary))
    if summary["best"] is None:
        raise click.ClickException(f"no trial finished; see {job.log_path}")


def _sweep_with_progress(job) -> dict:
    if not sys.stderr.isatty():
        return job.run()
    with click.progressbar(length=job.expected_records(), label="trials", file=sys.stderr) as bar:
        bar.update(len(job.log.trials))
        return job.run(on_trial=lambda record: bar.update(1))


def _sweep_message(summary: dict) -> str:
    best = summary["best"]
    if best is None:
        return ""
    on = f"{summary['judged_on']} {summary['metric']}"
    verdict = (f"improved on the starting weights ({summary['initial']:.4f}); weights written "
               f"to {summary['wof']}" if summary["saved"] else
               f"did not improve on the starting weights ({summary['initial']:.4f}); "
               f"weights not written")
    return (f"best: trial {best['trial']}, {on} {best['value']:.4f}: {verdict}\n"
            f"reproduce it from the starting weights:\n  {summary['command']}")


@main.command()
@click.argument("logs", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The figure: FILE.png or FILE.svg.")
@click.option("--width", default=960, show_default=True, type=click.IntRange(100, 10000),
              help="Width in pixels (in points in an SVG).")
@click.option("--height", default=640, show_default=True, type=click.IntRange(100, 10000),
              help="Height in pixels (in points in an SVG).")
@click.option("--json", "as_json", is_flag=True, help="Print what was drawn as JSON.")
def plot(logs, output, width, height, as_json):
    """Draw LOGS: the outputs of `microtrain run --json` (loss and metric per epoch, train
    and test; loss scale and fp16 underflow for mixed precision) or one sweep log (the
    metric against each swept option, and the best trials' curves). Needs the optional
    extra [plot] (matplotlib)."""
    from microtrain.commands.plot import plot as draw
    check_output(output, None, reads=[("LOGS", log) for log in logs])
    result = draw(logs, output, width, height)
    if as_json:
        print_json(result)
    else:
        click.echo(f"wrote {result['kind']} ({width}x{height}) to {result['output']}")


@main.command(name="eval")
@options(EVAL_OPTIONS)
@JSON_ONE
def evaluate(as_json, **fields):
    """Loss and metric of FROZEN + .wof on a data set.  FROZEN may also be a .tflite or
    .circle model no split wrote (as infer runs it): its outputs, dequantized when
    integer, are judged by cce after a final SOFTMAX (one-hot targets), else mse."""
    result = session.evaluate(RunConfig(**fields))
    if as_json:
        print_json(result)
    else:
        click.echo(" - ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}"
                              for k, v in result.items()))


@main.command()
@options(("frozen", "wof", "inputs", "input_shapes", "batch_size"))
@JSON_ONE
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Where to write the outputs: OUT.npy (one output) or OUT.npz (several).")
@FORCE_OPTION
def infer(as_json, output, force, **fields):
    """Run FROZEN + .wof forward on the inputs and save the outputs.  FROZEN may also
    be a .tflite or .circle model no split wrote: it runs as it is (a full-integer int8
    model on integer kernels, as LiteRT's reference kernels compute it)."""
    result = session.infer(RunConfig(**fields), output, force)
    if as_json:
        print_json(result)
    else:
        click.echo(f"wrote {result['samples']} outputs to {result['output']}")


@main.command()
@options(RUN_OPTIONS)
@JSON_LINES
@options(record=FederatedSettings)
@click.option("--workers", type=click.IntRange(1),
              help="Worker processes training devices side by side. Default: the cores.")
@click.option("--write-app", type=click.Path(file_okay=False),
              help="Instead of simulating, write a Flower app (pyproject.toml) with these "
                   "settings to this folder, for `flwr run FOLDER SUPERLINK`.")
@FORCE_OPTION
@WAIT_OPTION
def federated(as_json, force, wait, workers, write_app, **fields):
    """Federated fine-tuning of FROZEN's trainable weights with Flower: the training
    data is split across --clients simulated devices that train locally each round;
    the server aggregates their weights, evaluates them on the held-out set and writes
    the best to the .wof if they beat the starting weights. Needs the [federated] extra."""
    run = RunConfig(**{name: fields.pop(name) for name in RUN_OPTIONS})
    settings = FederatedSettings(run, **fields)
    target = None if write_app else session.check_run_outputs(run, force)
    try:
        if write_app:
            from microtrain.commands.federated.deployment import write_app as write_app_files
        else:
            from microtrain.commands.federated.simulation import simulate
    except ImportError as e:
        raise click.ClickException(
            f"microtrain federated needs Flower ({e.name.split('.')[0]} is missing): "
            "pip install 'trainconf-microtrain[federated]'") from None
    if write_app:
        path = write_app_files(write_app, settings)
        click.echo(f"wrote {path}; run it with: flwr run {write_app} SUPERLINK")
        return
    with locked([run.frozen, target], wait):
        summary = simulate(settings, on_round=_round_printer(as_json, settings.rounds),
                           workers=workers)
    if as_json:
        print_json(summary)
    else:
        click.echo(summary["message"])


def _round_printer(as_json: bool, rounds: int):
    def show(record: dict) -> None:
        if as_json:
            print_json(record)
            return
        parts = [f"Round {record['round']}/{rounds}",
                 f"clients: {record['clients']}" + (f" ({record['failed']} failed)"
                                                    if record["failed"] else "")]
        parts += [f"{k}: {v:.4f}" for k, v in record.items()
                  if isinstance(v, float) and k not in ("round",)]
        parts += [f"sent: {record['bytes_down']} B", f"received: {record['bytes_up']} B"]
        click.echo(" - ".join(parts))
    return show


if __name__ == "__main__":
    main()
