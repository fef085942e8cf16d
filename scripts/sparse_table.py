"""Sparse update schemes on a transfer task: docs/memory.md's accuracy-against-memory table.

MobileNetV2-0.35 at 32x32 (the test fixture's architecture, scripts/make_fixtures.py) is
pretrained in Keras on scikit-learn's 8x8 digits of classes 0-4 (each pixel a 4x4 block, in
three channels; the split of scripts/lora_table.py), converted with TFLiteConverter (its
BatchNorms folded into biases), then fine-tuned with microtrain on all ten classes under each
`--trainable` scheme (Adam, batch 32, lr 5e-3, 4 epochs).  Reported: the trained parameters,
the planned RAM of a training step (with --compact-scratch, as a budget chooses what trains)
of a split for batch 1 with SGD (issue 20's setting; the bytes of the files read in place
beside it) and of one for the fine-tuning's batch 32 with Adam, and the test accuracy before
and after fine-tuning.

    python scripts/sparse_table.py --out /tmp/sparse_table --tf-python /opt/venvs/tf/bin/python
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from lora_table import (BATCH, CLASSES, PRETRAIN_CLASSES, SEED, datasets,  # noqa: E402
                        table_parser)

PRETRAIN_EPOCHS, FINETUNE_EPOCHS, LEARNING_RATE = 30, 4, 5e-3
SCHEMES = ("last:1", "last:2", "biases:last:16,last:1", "biases,last:1", "biases")


def digits() -> tuple:
    """(x_train, y_train, x_test, y_test): the digits as 32x32x3 images."""
    x, y, x_test, y_test = datasets()["cnn"]
    def big(a): return np.repeat(np.repeat(np.repeat(a, 4, 1), 4, 2), 3, 3)
    return big(x), y, big(x_test), y_test


def pretrain(path: Path) -> None:
    """The TensorFlow worker: the fixture's MobileNetV2, trained on classes 0-4."""
    import os
    os.chdir(ROOT)  # make_fixtures' paths are the repository's
    import keras
    from make_fixtures import build, convert
    x, y, _, _ = digits()
    model = build("mobilenetv2")
    for layer in model.layers:  # Keras's 0.999 leaves the moving statistics of a few
        if isinstance(layer, keras.layers.BatchNormalization):  # hundred steps at their start
            layer.momentum = 0.9
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    seen = y < PRETRAIN_CLASSES
    model.fit(x[seen], y[seen], batch_size=BATCH, epochs=PRETRAIN_EPOCHS, verbose=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(convert(model))


def finetune(model: Path, out: Path, scheme: str, data) -> dict:
    from microtrain.trainer import Trainer
    from trainconf.split import split

    def planned(folder: Path, batch: int, optimizer: str):  # as a budget chooses what trains
        return split(model, folder, scheme, batch_size=batch, optimizer=optimizer, force=True,
                     compact_scratch=True)
    result = planned(out, BATCH, "adam")
    small = planned(out / "batch1", 1, "sgd").memory  # its fused tiles are batch 1's
    x, y, x_test, y_test = data
    onehot = np.eye(CLASSES, dtype=np.float32)
    trainer = Trainer(result.frozen, batch_size=BATCH, optimizer="adam",
                      learning_rate=LEARNING_RATE)
    before = trainer.evaluate([x_test], [onehot[y_test]])["accuracy"]
    trainer.fit([x], [onehot[y]], epochs=FINETUNE_EPOCHS, seed=SEED)
    after = trainer.evaluate([x_test], [onehot[y_test]])["accuracy"]
    return {"parameters": sum(p["parameters"] for p in result.trainable),
            "sgd1": small["ram"], "read_only": small["read_only"],
            "adam32": result.memory["ram"], "before": before, "after": after}


def table(results: dict) -> str:
    rows = ["| --trainable | parameters | planned RAM, batch 1 SGD (files read in place) "
            "| planned RAM, batch 32 Adam | test accuracy (pretrained → fine-tuned) |",
            "|---|---|---|---|---|"]
    rows += [f"| `{s}` | {r['parameters']:,} | {r['sgd1']:,} ({r['read_only']:,}) "
             f"| {r['adam32']:,} | {r['before']:.3f} → {r['after']:.3f} |"
             for s, r in results.items()]
    return "\n".join(rows)


def main() -> None:
    parser = table_parser(__doc__, Path("/tmp/sparse_table"))
    args = parser.parse_args()
    model = args.out / "mobilenetv2.tflite"
    if args.pretrain:
        pretrain(model)
        return
    if not model.exists():
        subprocess.run([args.tf_python, __file__, "--pretrain", "--out", str(args.out)], check=True)
    sys.path.insert(0, str(ROOT))
    data = digits()
    results = {}
    for i, scheme in enumerate(SCHEMES):
        results[scheme] = finetune(model, args.out / str(i), scheme, data)
        print(json.dumps({scheme: results[scheme]}), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
