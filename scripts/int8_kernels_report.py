"""How far LiteRT's default kernels (XNNPACK, and its optimized builtins) are from its
reference kernels (BUILTIN_REF) on the full-integer int8 models, and microtrain's
integer kernels from the reference: the largest difference of an output in steps of
its scale (LSB), and the fraction of samples with any difference.  A measurement for
docs/quantization.md, not a test.

    TRAINCONF_REAL_MODELS=/work/cache/real_models python scripts/int8_kernels_report.py [--samples N]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_int8_models import MODELS, batch_of, litert_output, sample_inputs  # noqa: E402
from microtrain.files.format.model import load_model  # noqa: E402
from microtrain.files.graph import graph_of  # noqa: E402
from microtrain.trainer import Trainer  # noqa: E402


def step(model: Path) -> float:
    """The output's step: 1 for an int8 output, the scale of the int8 tensor a final
    DEQUANTIZE reads for a float one."""
    g = graph_of(load_model(model))
    last = g.producers()[g.outputs[0]]
    return float(g.tensors[last.inputs[0]].quantization.scale[0]) if last.type == "DEQUANTIZE" \
        else 1.0


def differences(a: np.ndarray, b: np.ndarray, lsb: float) -> tuple[int, float]:
    """(largest |a - b| in steps of lsb, fraction of samples where they differ)."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64)).reshape(len(a), -1)
    return round(d.max() / lsb), float((d.max(axis=1) > 0).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    n = parser.parse_args().samples
    print("| model | samples | XNNPACK vs reference: max LSB | samples differing "
          "| microtrain vs reference: max LSB | samples differing |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        xs = sample_inputs(model, n)
        reference, default = (litert_output(model, xs, reference) for reference in (True, False))
        batch = batch_of(model, 64)
        ours = Trainer(model, with_backprop=False, plain=True, batch_size=batch).predict(xs)[0]
        lsb = step(model)
        (dmax, dfrac), (omax, ofrac) = (differences(default, reference, lsb),
                                        differences(ours, reference, lsb))
        print(f"| {model.stem} | {n} | {dmax} | {dfrac:.1%} | {omax} | {ofrac:.1%} |")


if __name__ == "__main__":
    main()
