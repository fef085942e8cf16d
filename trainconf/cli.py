"""The `trainconf` command line: one function per command, each a thin layer
over the Python API that does the work."""
from pathlib import Path

import click
from click.core import ParameterSource

from microtrain.commands.cli_common import (FORCE_OPTION, WAIT_OPTION, CommandGroup,
                                            divergence_snapshot_option, embedding_update_option,
                                            loss_scale_option, parameter_options, print_json)
from microtrain.files.contracts import REDUCTIONS
from microtrain.files.opening import check_output, made_folder
from microtrain.files.format.model import load_model
from microtrain.files.lock import locked
from microtrain.files.loss_registry import LOSS_NAMES

from .circle_plus import METADATA as CIRCLE_PLUS
from .export import LORA_EXPORTS, WEIGHT_TYPES, export
from .int8 import DEFAULT_IO, IO_TYPES
from .importer import import_tflite
from .inspect import describe, planned_memory, render_text, trained
from .memory import peak_text
from .recompute import MODES as RECOMPUTE_MODES
from .lora import LoraSpec
from .quantize import (DEFAULT_INT8_WEIGHTS, DEFAULT_QAS, DEFAULT_WEIGHT_SCALES, INT8_WEIGHTS,
                       QUANTIZE_CHOICES, WEIGHT_SCALES, QuantSpec)
from .split import (DEFAULT_REDUCTION, DEFAULT_TRAINABLE, PRECISIONS, check_outputs, output_paths,
                    split)

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
@FORCE_OPTION
def import_command(model: Path, output: Path | None, force: bool):
    """Convert MODEL.tflite to a .circle model (same graph, weights and signatures)."""
    output = check_output(output or model.with_suffix(".circle"), ("circle",), force,
                          reads=(("MODEL", model),))
    import_tflite(model, output)
    click.echo(f"wrote {output}")


JSON_OPTION = click.option("--json", "as_json", is_flag=True,
                           help="Print one JSON document instead of text  [default: text]")


def estimate_options(recorded: str, names: list[str], purpose: str):
    """The training parameters in `names` (see microtrain.commands.cli_common.parameter_options),
    --accum-steps, --embedding-update and --loss-scale: what a planned peak memory is
    estimated for."""
    def decorate(fn):
        fn = loss_scale_option(" in the memory estimate, as microtrain run's")(fn)
        fn = embedding_update_option(" in the memory estimate, as microtrain run's")(fn)
        fn = click.option("--accum-steps", type=click.IntRange(1), default=1, show_default=True,
                          help="Batches accumulated per update in the memory estimate (more "
                               "than 1 holds a second gradient vector), as microtrain run's.")(fn)
        return parameter_options(recorded, names, purpose)(fn)
    return decorate


@main.command("inspect")
@click.argument("model", type=MODEL)
@estimate_options("the split model's training parameters", ["optimizer", "batch_size"],
                  " of the memory estimate")
@divergence_snapshot_option(", in the memory estimate as in microtrain run")
@JSON_OPTION
def inspect_command(model: Path, as_json: bool, optimizer: str | None, batch_size: int | None,
                    accum_steps: int, embedding_update: str, divergence_snapshot: str,
                    loss_scale: str):
    """Show MODEL (.circle or .tflite): subgraphs, inputs and outputs (with a
    dynamic or fixed batch), every operator, constant tensors and totals; for a
    STEM.frozen.circle beside its .wof and backprop graph, the planned peak
    memory of a training step (--accum-steps, --embedding-update and --loss-scale
    not given: as the split's plan assumed them)."""
    loaded = load_model(model)
    desc = describe(loaded)
    given = _given(accum_steps=accum_steps, embedding_update=embedding_update,
                   loss_scale=loss_scale)
    memory = planned_memory(model, loaded, batch_size, optimizer, divergence_snapshot=
                            divergence_snapshot, **given)
    if memory:
        desc["memory"] = memory
    trains = trained(model, loaded)
    if trains:
        desc["trainable"] = trains
    if as_json:
        print_json(desc)
    else:
        click.echo(render_text(desc))


def _given(**values) -> dict:
    """`values` of the current command's options, None for those left at their default."""
    ctx = click.get_current_context()
    return {name: None if ctx.get_parameter_source(name) is ParameterSource.DEFAULT else value
            for name, value in values.items()}


def parameters_text(report: dict) -> str:
    """One line: the recorded training parameters, and where those not defaulted came from."""
    p = {k: v["value"] for k, v in report.items()}
    by_source: dict[str, list[str]] = {}
    for name, entry in report.items():
        by_source.setdefault(entry["source"], []).append(name)
    sources = "; ".join(f"{source}: {', '.join(names)}" for source, names in by_source.items()
                        if source != "default")
    sources = f"{sources}; the rest: default" if sources else "all default"
    return (f"recorded for microtrain run: {p['optimizer']} (learning rate {p['learning_rate']}), "
            f"batch size {p['batch_size']}, {p['epochs']} epochs  [{sources}]")


@main.command("split")
@click.argument("model", type=MODEL)
@click.option("-o", "--outdir", type=click.Path(file_okay=False, path_type=Path),
              help="Folder for the three files  [default: MODEL's folder]")
@click.option("--trainable",
              help="What trains, a comma list whose terms add up: all; last:N (the last N "
                   "layers, counted from the output); biases (the biases of all layers); "
                   "biases:last:K (those of the last K); weighted-op output names or weight "
                   "tensor names. E.g. biases,last:2: all biases and the last 2 layers"
                   f"  [default: {CIRCLE_PLUS}'s trainable_ops when MODEL has it, else "
                   f"{DEFAULT_TRAINABLE}]")
@click.option("--freeze-bias", is_flag=True,
              help="Train the kernels of the chosen ops but not their biases.")
@click.option("--loss", type=click.Choice(LOSS_NAMES),
              help="Loss: cce (categorical cross-entropy), sparse_cce, bce, mse or mae  "
                   f"[default: {CIRCLE_PLUS}'s, else cce when the model ends in SOFTMAX, "
                   "else mse]")
@click.option("--reduction", type=click.Choice(REDUCTIONS),
              help="mean: the sum of per-sample losses divided by the batch size (Keras); "
                   f"sum: their sum  [default: {CIRCLE_PLUS}'s, else {DEFAULT_REDUCTION}]")
@click.option("--ignore-index", type=int, metavar="ID",
              help="cce/sparse_cce: tokens whose target is class ID (an id equal to ID, e.g. a "
                   "padding id or -100; a one-hot row of ID) count in neither the loss nor a "
                   "mean's denominator (torch's ignore_index, Keras's ignore_class)")
@click.option("--from-logits", is_flag=True,
              help="cce/sparse_cce: the model's outputs are logits (a language model's "
                   "per-token scores); the loss is taken of their softmax, from the logits")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default="fp32",
              show_default=True, help="Preset for the three types below.")
@click.option("--weight-dtype", type=click.Choice(list(PRECISIONS)),
              help="Type the graphs compute with for weights (the .wof keeps an fp32 master "
                   "copy)  [default: --precision]")
@click.option("--activation-dtype", type=click.Choice(list(PRECISIONS)),
              help="Type of activations  [default: --precision]")
@click.option("--grad-dtype", type=click.Choice(list(PRECISIONS)),
              help="Type of gradients in the backprop graph  [default: --precision]")
@click.option("--memory-budget", metavar="SIZE",
              help="Choose what trains so that the planned peak RAM fits SIZE (bytes, or "
                   "e.g. 64KiB, 1.5MB; the model files, read in place, are not RAM): the most "
                   "whole layers from the output, then the biases of as many layers as fit, "
                   "then output channels of the next layer (chosen with the leanest kernels), "
                   "trained with the fastest kernel tiles that fit. With --trainable, that set "
                   "trains, with the fastest tiles and the least recomputation that fit.")
@click.option("--compact-scratch", is_flag=True,
              help="The kernels bound their scratch memory (no index arrays or constants the "
                   "size of an activation), at some cost in speed; with --memory-budget, only "
                   "such kernels are tried (by default it tries the fastest first).")
@click.option("--recompute", type=click.Choice(RECOMPUTE_MODES),
              help="auto: drop forward activations after the forward pass and recompute them "
                   "in the backward pass from kept ones where that lowers the planned peak "
                   "(the least arena, then the least extra forward work; under "
                   "--memory-budget only as much as the budget needs, before training fewer "
                   "layers); none: keep every activation the backward pass reads  "
                   "[default: auto with --memory-budget, else none]")
@click.option("--lora", "lora_rank", type=click.IntRange(1), metavar="RANK",
              help="Train low-rank adapters of rank RANK beside the frozen weights of the "
                   "--lora-targets operators (LoRA): W stays in the frozen model, the .wof holds "
                   "only the adapters and what --trainable names  [default: no adapters; with "
                   "--lora, --trainable defaults to nothing more]")
@click.option("--lora-alpha", type=click.FloatRange(min=0, min_open=True), metavar="A",
              help="Adapters add (A/RANK)·B·A(x)  [default: RANK, a scale of 1]")
@click.option("--lora-targets", default="all", show_default=True, metavar="SPEC",
              help="The FULLY_CONNECTED, BATCH_MATMUL (constant weight), CONV_2D, GATHER and "
                   "EMBEDDING_LOOKUP operators that get adapters: chosen as --trainable chooses, "
                   "or by operator type (e.g. FULLY_CONNECTED,CONV_2D)")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the adapters' initial A (Kaiming-uniform; B starts at zero)")
@click.option("--quantize", type=click.Choice(QUANTIZE_CHOICES),
              help="Train a float model quantization-aware: activations through FAKE_QUANT "
                   "with ranges from --calibration, weights rounded per channel (symmetric "
                   "int8) each step, as the int8 model they export to computes  [default: "
                   "train in float; an int8 model always trains through its own scales]")
@click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), metavar="X.npy",
              help="With --quantize: samples of the model's input whose activations' min and "
                   "max set their int8 ranges")
@click.option("--qas", type=click.Choice(["on", "off"]), default="on" if DEFAULT_QAS else "off",
              show_default=True,
              help="Quantized weights: off scales each weight's gradient by its channel's "
                   "scale squared, as training the int8 weight itself without quantization-"
                   "aware scaling would (docs/quantization.md); on trains the fp32 master with "
                   "its own gradient, which is what QAS restores")
@click.option("--int8-weights", type=click.Choice(INT8_WEIGHTS), default=DEFAULT_INT8_WEIGHTS,
              show_default=True,
              help="A dynamic-range model (int8 weights, float activations): keep trains its "
                   "weights on their int8 grids, as deployed; dequantize trains them in float")
@click.option("--weight-scales", type=click.Choice(WEIGHT_SCALES), default=DEFAULT_WEIGHT_SCALES,
              show_default=True,
              help="Quantized weights that train: track rounds each to its channels' "
                   "max|w|/127 of the moment (the scales export writes); fixed keeps the "
                   "model's (or calibration's) scales, clamping a weight that outgrows them")
@estimate_options(f"MODEL's circle+ {CIRCLE_PLUS}",
                  ["optimizer", "hyperparameters", "batch_size", "epochs"],
                  " (recorded for microtrain run; also the memory estimate's)")
@FORCE_OPTION
@WAIT_OPTION
@JSON_OPTION
def split_command(model: Path, outdir: Path | None, as_json: bool, wait: bool,
                  lora_rank: int | None, lora_alpha: float | None, lora_targets: str, seed: int,
                  quantize: str | None, calibration: Path | None, qas: str, int8_weights: str,
                  weight_scales: str, **options):
    """Write STEM.frozen.circle (the forward graph, trainable weights cut out),
    STEM.wof (those weights) and STEM.backprop.circle (the gradient graph) for
    MODEL (.circle or .tflite)."""
    lora = None if lora_rank is None else LoraSpec(lora_rank, lora_alpha, lora_targets, seed)
    frozen, wof, _ = output_paths(model, outdir)
    check_outputs(Path(model), outdir, options["force"])  # before a folder is made for the locks
    with made_folder(frozen.parent), locked([frozen, wof], wait):  # as a run of the set locks them
        quant = QuantSpec(quantize, calibration, qas == "on", int8_weights, weight_scales)
        summary = split(model, outdir, lora=lora, quant=quant, **options).summary()
    if as_json:
        print_json(summary)
        return
    click.echo(f"trainable: {summary['trainable_tensors']} tensors, "
               f"{summary['trainable_parameters']} parameters; loss {summary['loss']} "
               f"({summary['reduction']}); backprop graph: {summary['backprop_ops']} operators")
    budget = summary["memory"].get("budget")
    if budget:
        click.echo(f"memory budget {budget['bytes']} bytes: trains {budget['text']}")
    click.echo(peak_text(summary["memory"]))
    if "arena_without" in summary["recompute"]:
        click.echo(f"recompute auto: the arena would be {summary['recompute']['arena_without']} "
                   "bytes without recomputation")
    click.echo(parameters_text(summary["parameters"]))
    for name, f in summary["files"].items():
        click.echo(f"  {name:9} {f['path']}  {f['bytes']} bytes")


@main.command("export")
@click.argument("frozen", type=MODEL)
@click.option("--wof", type=MODEL,
              help="The trained weights  [default: STEM.wof beside FROZEN]")
@click.option("-o", "--output", required=True, type=MODEL,
              help="OUT.circle (for onert) or OUT.tflite (identifier TFL3, for LiteRT and "
                   "onert); the suffix chooses the format.")
@click.option("--weights", type=click.Choice(WEIGHT_TYPES), default="fp32", show_default=True,
              help="fp16: every float32 constant stored as float16 and read through a "
                   "DEQUANTIZE operator, as MediaPipe ships its models (half the bytes; "
                   "LiteRT runs it, onert 0.1.0 does not).")
@click.option("--lora", type=click.Choice(LORA_EXPORTS), default="merge", show_default=True,
              help="A model split with --lora: merge folds (alpha/r)·B·A into each adapted "
                   "weight and writes the original operators; keep writes the adapters as "
                   "operators of their own.")
@click.option("--traininfo", is_flag=True,
              help=f"Write the training setup (optimizer and its arguments, loss, reduction, "
                   f"batch size, epochs, trainable operators) as circle+ {CIRCLE_PLUS} "
                   "metadata, which onert reads; refused when the setup uses what circle+ "
                   "cannot hold (see schemas/circle_plus.md).")
@click.option("--int8/--float", "int8", default=None,
              help="Write a full-integer int8 model (int8 activations, per-channel int8 "
                   "weights, int32 biases; TFLite's int8 spec), or a float one  [default: "
                   "int8 for a model that records int8 ranges (split --quantize int8, an int8 "
                   "model), float otherwise]")
@click.option("--calibration", "calibration", multiple=True, metavar="X.npy",
              help="Samples (one file per model input, as --input of microtrain) run through "
                   "the float model to set each activation's int8 range (min and max over "
                   "them); they replace the model's recorded ranges  [default: the record]")
@click.option("--io", type=click.Choice(IO_TYPES),
              help="The int8 model's input and output: int8 tensors, or float32 ones "
                   "quantized and dequantized inside the model (QUANTIZE/DEQUANTIZE), as "
                   "the TFLite converter's inference_input_type/inference_output_type  "
                   f"[default: {DEFAULT_IO}]")
@FORCE_OPTION
@JSON_OPTION
def export_command(frozen: Path, as_json: bool, **options):
    """Write FROZEN (a STEM.frozen.circle) with the trained weights of its .wof
    as a model for inference.  The training metadata and the tensors only the
    split needed are dropped; activations get back float32 and the batch
    dimension the split model had (dynamic, or a fixed 1); shape chains stay
    folded (a dynamic-batch Flatten is a RESHAPE to a constant shape with -1 as
    its batch; another shape holding a dynamic batch is computed at run time).
    Recurrent layers and loops stay unrolled, as split wrote them; operators
    onert lacks or misreads (EMBEDDING_LOOKUP, SELECT on integers,
    FULLY_CONNECTED keeping dims) are written as ones that compute the same
    values in both runtimes.  A .tflite holds only what TFLite's schema has: a
    model with a circle-only operator, options table or tensor type is refused.
    --int8 writes the model full-integer (docs/quantization.md)."""
    summary = export(frozen, **options).summary()
    if as_json:
        print_json(summary)
    else:
        click.echo(f"wrote {summary['path']} ({summary['format']}, {summary['weights']} weights, "
                   f"{summary['activations']} activations, {summary['io']} input and output, "
                   f"batch {summary['batch']}): {summary['operators']} operators, "
                   f"{summary['tensors']} tensors, {summary['trained_tensors']} trained tensors "
                   f"from the .wof, {summary['bytes']} bytes"
                   + (f", with circle+ {CIRCLE_PLUS}" if summary["traininfo"] else ""))


if __name__ == "__main__":
    main()
