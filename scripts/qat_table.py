"""Fine-tuning full-integer int8 models, with and without quantization-aware
scaling, against fp32 fine-tuning of the float model: docs/quantization.md's table.

Two Keras models are pretrained on classes 0-4 of scikit-learn's 8x8 digits
(the CNN of scripts/lora_table.py on the 8x8 images; Keras's MobileNetV2, width
0.35, on the images upsampled to 32x32x3), then converted twice with
TFLiteConverter: float, and full-integer int8 (int8 input and output,
calibrated on 200 pretraining images, classes 0-4, as the representative
dataset).  Each is then fine-tuned with microtrain on all ten classes, every
weight, SGD with momentum 0.9 at a constant learning rate, on the same data,
once per seed (the seed shuffles the data order):

  fp32           the float model, trained in float
  int8, QAS      the int8 model (trainconf split: fp32 master on the model's own scales)
  int8, no QAS   the same with --qas off
  QAT            the float model with --quantize int8 --calibration (200 fine-tuning images)

Reported: test accuracy before and after fine-tuning (the int8 rows computed
through the int8 rounding, as the deployed model would), as the mean, spread and
values over the seeds, and of the trained model as `trainconf export` writes it
(full-integer for the int8 and QAT rows) run in LiteRT.

    python scripts/qat_table.py --out /tmp/qat_table --tf-python /opt/venvs/tf/bin/python --jobs 2
"""
import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from lora_table import (BATCH, CLASSES, PRETRAIN_CLASSES, SEED, datasets,  # noqa: E402
                        table_parser)

SEEDS = (0, 1, 2)  # the fine-tuning's data orders: the table reports their mean and spread
# model: (Keras pretraining epochs, microtrain fine-tuning epochs, learning rate)
MODELS = {"cnn": (30, 15, 0.01), "mobilenet_v2": (30, 15, 0.002)}
OPTIMIZER = "momentum"  # SGD with momentum 0.9, as TTE trains
REPRESENTATIVE = 200


def data(name: str):
    """(x_train, y_train, x_test, y_test) of the model: the 8x8 images, or
    upsampled to 32x32 with three equal channels for MobileNetV2."""
    x, y, x_test, y_test = datasets()["cnn"]
    if name == "mobilenet_v2":
        x, x_test = (np.repeat(np.repeat(np.repeat(a, 4, 1), 4, 2), 3, 3) for a in (x, x_test))
    return x.astype(np.float32), y, x_test.astype(np.float32), y_test


# ------------------------------------------------------------- pretraining (TensorFlow worker)

def pretrain(out: Path, names: list[str]) -> None:
    import tempfile
    from fetch_real_models import tf_imports
    keras, tf = tf_imports()
    L = keras.layers
    builders = {
        "cnn": lambda shape: keras.Sequential([
            keras.Input(shape), L.Conv2D(32, 3, activation="relu", padding="same"),
            L.MaxPooling2D(), L.Conv2D(64, 3, activation="relu"), L.Flatten(),
            L.Dense(CLASSES, activation="softmax")]),
        "mobilenet_v2": lambda shape: keras.applications.MobileNetV2(
            input_shape=shape, alpha=0.35, weights=None, classes=CLASSES),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        x, y, _, _ = data(name)
        keras.utils.set_random_seed(SEED)
        model = builders[name](x.shape[1:])
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
        seen = y < PRETRAIN_CLASSES
        model.fit(x[seen], y[seen], batch_size=BATCH, epochs=MODELS[name][0], verbose=0)
        settle_batch_norms(keras, model, x[seen])

        def int8(c, seen_x=x[seen]):
            c.optimizations = [tf.lite.Optimize.DEFAULT]
            c.representative_dataset = lambda: ([seen_x[i:i + 1]] for i in range(REPRESENTATIVE))
            c.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            c.inference_input_type = c.inference_output_type = tf.int8
        with tempfile.TemporaryDirectory() as tmp:
            signature = [tf.TensorSpec((None,) + x.shape[1:], tf.float32)]
            model.export(tmp, input_signature=signature, verbose=False)
            for suffix, configure in (("", None), ("_int8", int8)):
                converter = tf.lite.TFLiteConverter.from_saved_model(tmp)
                if configure:
                    configure(converter)
                (out / f"{name}{suffix}.tflite").write_bytes(converter.convert())


def settle_batch_norms(keras, model, x) -> None:
    """Every batch norm's moving statistics set to those of all of x (momentum 0):
    a few hundred steps at Keras's momentum 0.99 leave them far from the data's,
    and the converter folds them into the weights."""
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    for layer in norms:
        layer.momentum = 0.0
    if norms:
        model(x, training=True)


# ------------------------------------------------------------- fine-tuning (microtrain)

def finetune(model: Path, out: Path, name: str, quant, seed: int) -> dict:
    from microtrain.trainer import Trainer
    from trainconf.split import split
    x, y, x_test, y_test = data(name)
    _, epochs, learning_rate = MODELS[name]
    result = split(model, out, batch_size=BATCH, optimizer=OPTIMIZER,
                   learning_rate=learning_rate, force=True, quant=quant)
    onehot = np.eye(CLASSES, dtype=np.float32)
    trainer = Trainer(result.frozen)
    before = trainer.evaluate([x_test], [onehot[y_test]])["accuracy"]
    trainer.fit([x], [onehot[y]], epochs=epochs, seed=seed)
    after = trainer.evaluate([x_test], [onehot[y_test]])["accuracy"]
    trainer.save_weights()
    return {"seed": seed, "before": before, "after": after,
            "memory": result.summary()["memory"]["ram"],
            "litert": litert_accuracy(result.frozen, out / "exported.tflite", x_test, y_test)}


def litert_accuracy(frozen: Path, exported: Path, x_test, y_test) -> float:
    """Test accuracy of the trained model as `trainconf export` writes it (the
    full-integer model for a fake-quantized split, float input and output), in LiteRT."""
    from int8_table import litert_classes
    from trainconf.export import export
    export(frozen, exported, force=True, io="float" if _records_int8(frozen) else None)
    return float(np.mean(litert_classes(exported, x_test) == y_test))


def _records_int8(frozen: Path) -> bool:
    from microtrain.files.format.model import load_model
    from trainconf.int8 import has_record
    return has_record(load_model(frozen))


def plan(out: Path, name: str) -> dict:
    """The model's four fine-tunings: how -> (model, QuantSpec)."""
    from trainconf.quantize import QuantSpec
    calibration = out / f"{name}_calibration.npy"  # written by runs()
    float_model, int8_model = out / f"{name}.tflite", out / f"{name}_int8.tflite"
    return {"fp32": (float_model, QuantSpec()), "int8, QAS": (int8_model, QuantSpec()),
            "int8, no QAS": (int8_model, QuantSpec(qas=False)),
            "QAT (float, --quantize int8)": (float_model, QuantSpec("int8", calibration))}


def _job(job) -> tuple:
    out, name, k, how, seed = job
    model, quant = plan(out, name)[how]
    result = finetune(model, out / name / f"{k}_{seed}", name, quant, seed)
    print(json.dumps({name: {how: result}}), flush=True)
    return name, how, result


def runs(out: Path, names: list[str], seeds: list[int], jobs: int) -> dict:
    """name -> how -> one result per seed, each printed as it ends."""
    for name in names:  # QAT's calibration: fine-tuning data, as the docs advise
        np.save(out / f"{name}_calibration.npy", data(name)[0][:REPRESENTATIVE])
    work = [(out, name, k, how, seed) for name in names
            for k, how in enumerate(plan(out, name)) for seed in seeds]
    results = {name: {how: [] for how in plan(out, name)} for name in names}
    with ProcessPoolExecutor(jobs) as pool:
        for name, how, result in pool.map(_job, work):
            results[name][how].append(result)
    return results


def table(results: dict) -> str:
    rows = ["| model | trains | pretrained | fine-tuned: mean ± sd (per seed) | vs fp32 "
            "| exported, in LiteRT (mean) | planned RAM (batch 32) |",
            "|---|---|---|---|---|---|---|"]
    for name, by_how in results.items():
        fp32 = np.mean([r["after"] for r in by_how["fp32"]])
        for how, per_seed in by_how.items():
            after = np.array([r["after"] for r in per_seed])
            rows.append(f"| {name} | {how} | {per_seed[0]['before']:.3f} "
                        f"| {after.mean():.3f} ± {after.std(ddof=1):.3f} "
                        f"({', '.join(f'{a:.3f}' for a in after)}) "
                        f"| {100 * (after.mean() - fp32):+.1f} pp "
                        f"| {np.mean([r['litert'] for r in per_seed]):.3f} "
                        f"| {per_seed[0]['memory']} |")
    return "\n".join(rows)


def main() -> None:
    parser = table_parser(__doc__, Path("/tmp/qat_table"))
    parser.add_argument("--models", default=",".join(MODELS), help="a comma list of models")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                        help="a comma list of the fine-tuning's shuffling seeds")
    parser.add_argument("--jobs", type=int, default=1, help="fine-tunings run at once")
    args = parser.parse_args()
    names = args.models.split(",")
    if args.pretrain:
        pretrain(args.out, names)
        return
    missing = [n for n in names if not all((args.out / f"{n}{s}.tflite").exists()
                                           for s in ("", "_int8"))]
    if missing:
        subprocess.run([args.tf_python, __file__, "--pretrain", "--out", str(args.out),
                        "--models", ",".join(missing)], check=True)
    sys.path.insert(0, str(ROOT))
    print(table(runs(args.out, names, [int(v) for v in args.seeds.split(",")], args.jobs)))


if __name__ == "__main__":
    main()
