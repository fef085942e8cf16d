"""The planned RAM of training a full-integer model with its fake-quantized activations
and weights (FAKE_QUANT and FakeQuantPerChannel outputs) stored as int8 levels (what
split writes) against storing them in float32 (as before), by batch size: the table of
docs/quantization.md's "Memory".  A measurement, not a test.

    python scripts/int8_storage_table.py [MODEL] [--batch 1 --batch 32]

MODEL defaults to the real-model cache's keras/mobilenet_v2_int8.tflite
($TRAINCONF_REAL_MODELS, else /work/cache/real_models); the split's defaults (Adam).
"""
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from microtrain.files.graph import graph_of  # noqa: E402
from trainconf.split import split  # noqa: E402

CACHE = Path(os.environ.get("TRAINCONF_REAL_MODELS", "/work/cache/real_models"))


def planned(model: Path, batch: int, levels: bool) -> dict:
    """split's `memory` at `batch`; `levels` False: fake-quantized tensors left float32."""
    as_float = mock.patch("trainconf.split.store_levels", graph_of)
    with tempfile.TemporaryDirectory() as out, contextlib.nullcontext() if levels else as_float:
        return split(model, out, batch_size=batch).memory


@click.command()
@click.argument("model", type=click.Path(exists=True, path_type=Path),
                default=CACHE / "keras" / "mobilenet_v2_int8.tflite")
@click.option("--batch", "batches", type=int, multiple=True, default=(1, 32))
def main(model: Path, batches: tuple[int, ...]) -> None:
    print("| batch | float32 storage | int8 storage | arena | kernel scratch |")
    print("|---|---|---|---|---|")
    for batch in batches:
        before, after = planned(model, batch, False), planned(model, batch, True)
        print(f"| {batch} | {before['ram']:,} | {after['ram']:,} | "
              f"{before['arena']:,} → {after['arena']:,} | "
              f"{before['kernel_scratch']:,} → {after['kernel_scratch']:,} |")


if __name__ == "__main__":
    main()
