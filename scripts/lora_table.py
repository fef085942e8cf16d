"""LoRA against full fine-tuning on a transfer task: docs/lora.md's table.

Three Keras 3 models (a dense net and a CNN on scikit-learn's 8x8 digits, a
transformer encoder on a synthetic token task) are pretrained in Keras on
classes 0-4 only, converted with TFLiteConverter (from a SavedModel), then
fine-tuned with microtrain on all ten classes: every weight (`trainconf split`)
against low-rank adapters (`trainconf split --lora R`, the other weights
frozen).  Reported: the .wof bytes, the planned peak memory of a training step
(Adam, batch 32) and the test accuracy before and after fine-tuning.

    python scripts/lora_table.py --out /tmp/lora_table \
        --tf-python /opt/venvs/tf/bin/python

The token task: a sample is 16 ids drawn uniformly from a vocabulary of VOCAB,
some replaced by keywords at random positions (token_data): classes 0-4 by 3
keywords of their own set of 8, the new classes 5-9 by pairs of those sets.  The vocabulary is that of a small BERT
(BERT-tiny: 30522 ids, width 128), of which the task uses a few.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SEED = 0
CLASSES, PRETRAIN_CLASSES = 10, 5
VOCAB, SEQ, WIDTH, KEYWORDS = 30522, 16, 128, 8
BATCH = 32
# model: (Keras pretraining epochs, microtrain fine-tuning epochs)
EPOCHS = {"dense": (40, 20), "cnn": (30, 20), "transformer": (4, 3),
          "transformer, new words": (4, 3)}
# model: the adapters tried, (rank, --lora-targets); the transformer's dense layers
# (not its embedding table, whose adapter alone would hold VOCAB x rank values)
RUNS = {"dense": [(4, "all"), (8, "all")], "cnn": [(4, "all"), (8, "all")],
        "transformer": [(8, "FULLY_CONNECTED")],
        "transformer, new words": [(8, "FULLY_CONNECTED"), (8, "all")]}
LEARNING_RATES = {"full": 1e-3, "lora": 2e-3}


def token_data(n: int, rng: np.random.Generator, new_words: bool) -> tuple[np.ndarray, np.ndarray]:
    """Classes 0-4: 3 keywords of the class's own set of 8 among random ids.  The
    new classes 5+k: 2 keywords of set k and 2 of set k+1 (mod 5), so that they
    reuse what the pretrained classes taught, as new digits reuse strokes; with
    `new_words`, 3 keywords of a set of their own, ids the pretraining never
    taught."""
    keywords = np.random.default_rng(99).choice(np.arange(1, VOCAB), (CLASSES, KEYWORDS),
                                                replace=False)
    y = rng.integers(0, CLASSES, n)
    x = rng.integers(1, VOCAB, (n, SEQ))
    for i, c in enumerate(y):
        sets = [c] * 3 if c < PRETRAIN_CLASSES or new_words else \
            [c - 5, c - 5, (c - 4) % 5, (c - 4) % 5]
        x[i, rng.choice(SEQ, len(sets), replace=False)] = [rng.choice(keywords[k]) for k in sets]
    return x.astype(np.int32), y.astype(np.int32)


def datasets() -> dict:
    """name -> (x_train, y_train, x_test, y_test)."""
    rng = np.random.default_rng(SEED)
    order = rng.permutation(1797)
    train, test = order[:1200], order[1200:]
    y = np.load(FIXTURES / "digits_y.npy")
    out = {}
    for name, f in (("dense", "digits_x"), ("cnn", "digits_images")):
        x = np.load(FIXTURES / f"{f}.npy")
        out[name] = x[train], y[train], x[test], y[test]
    for name, new_words in (("transformer", False), ("transformer, new words", True)):
        out[name] = token_data(4000, rng, new_words) + token_data(1000, rng, new_words)
    return out


def slug(name: str) -> str:
    return name.replace(", ", "_").replace(" ", "_")


# ------------------------------------------------------------- pretraining (TensorFlow worker)

def pretrain(out: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from fetch_real_models import convert_saved_model, tf_imports
    keras, tf = tf_imports()
    L = keras.layers

    def stack(shape, *layers, dtype="float32"):
        x = inputs = keras.Input(shape, dtype=dtype)
        for layer in layers:
            x = layer(x)
        return keras.Model(inputs, x)

    def encoder():
        ids = keras.Input((SEQ,), dtype="int32", name="token_ids")
        x = L.Embedding(VOCAB, WIDTH)(ids) + L.Embedding(SEQ, WIDTH)(np.arange(SEQ)[None])
        for _ in range(2):
            attention = L.MultiHeadAttention(num_heads=2, key_dim=WIDTH // 2)(x, x)
            x = L.LayerNormalization()(x + attention)
            ffn = L.Dense(WIDTH)(L.Dense(4 * WIDTH, activation="relu")(x))
            x = L.LayerNormalization()(x + ffn)
        x = L.GlobalAveragePooling1D()(x)
        return keras.Model(ids, L.Dense(CLASSES, activation="softmax")(x))

    builders = {
        "dense": lambda: stack((64,), L.Dense(128, activation="relu"),
                               L.Dense(64, activation="relu"),
                               L.Dense(CLASSES, activation="softmax")),
        "cnn": lambda: stack((8, 8, 1), L.Conv2D(32, 3, activation="relu", padding="same"),
                             L.MaxPooling2D(), L.Conv2D(64, 3, activation="relu"),
                             L.Flatten(), L.Dense(CLASSES, activation="softmax")),
        "transformer": encoder,
        "transformer, new words": encoder,
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, (x, y, _, _) in datasets().items():
        keras.utils.set_random_seed(SEED)
        model = builders[name]()
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
        seen = y < PRETRAIN_CLASSES
        model.fit(x[seen], y[seen], batch_size=BATCH, epochs=EPOCHS[name][0], verbose=0)
        signature = [tf.TensorSpec((None,) + x.shape[1:], model.input.dtype)]
        convert_saved_model(tf, lambda d: model.export(d, input_signature=signature,
                                                       verbose=False), out / f"{slug(name)}.tflite")


# ------------------------------------------------------------- fine-tuning (microtrain)

def finetune(model: Path, out: Path, data, epochs: int, rank: int | None, targets: str,
             trainable: str | None = None) -> dict:
    from microtrain.trainer import Trainer
    from trainconf.lora import LoraSpec
    from trainconf.split import split
    lora = None if rank is None else LoraSpec(rank, 2.0 * rank, targets, SEED)
    result = split(model, out, trainable, lora=lora, batch_size=BATCH, optimizer="adam",
                   force=True)
    x, y, x_test, y_test = data
    onehot = np.eye(CLASSES, dtype=np.float32)
    lr = LEARNING_RATES["full" if rank is None else "lora"]
    trainer = Trainer(result.frozen, batch_size=BATCH, optimizer="adam", learning_rate=lr)
    before = trainer.evaluate([x_test], [onehot[y_test]])["accuracy"]
    trainer.fit([x], [onehot[y]], epochs=epochs, seed=SEED)
    after = trainer.evaluate([x_test], [onehot[y_test]])["accuracy"]
    summary = result.summary()
    return {"wof": summary["files"]["wof"]["bytes"], "memory": summary["memory"]["total"],
            "parameters": summary["trainable_parameters"], "before": before, "after": after}


def table(results: dict) -> str:
    rows = ["| model | trains | parameters | .wof bytes | planned memory (Adam, batch 32) "
            "| test accuracy (pretrained → fine-tuned) |", "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        full = runs["full"]
        for how, r in runs.items():
            wof, memory = (f"{r[k]}" + ("" if how == "full" else f" ({100 * r[k] / full[k]:.1f}%)")
                           for k in ("wof", "memory"))
            rows.append(f"| {name} | {how} | {r['parameters']} | {wof} | {memory} "
                        f"| {r['before']:.3f} → {r['after']:.3f} |")
    return "\n".join(rows)


def table_parser(doc: str, out: Path) -> argparse.ArgumentParser:
    """The options every transfer-table script takes: where its models go, the
    TensorFlow interpreter that pretrains them, and the hidden worker flag."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--tf-python", default=sys.executable,
                        help="interpreter with TensorFlow and Keras 3, for the pretraining")
    parser.add_argument("--pretrain", action="store_true", help=argparse.SUPPRESS)  # the worker
    return parser


def main() -> None:
    parser = table_parser(__doc__, Path("/tmp/lora_table"))
    parser.add_argument("--models", default=";".join(EPOCHS), help="a ;-list of models")
    args = parser.parse_args()
    if args.pretrain:
        pretrain(args.out)
        return
    if not all((args.out / f"{slug(m)}.tflite").exists() for m in args.models.split(";")):
        subprocess.run([args.tf_python, __file__, "--pretrain", "--out", str(args.out)], check=True)
    sys.path.insert(0, str(ROOT))
    data = datasets()
    results = {}
    for name in args.models.split(";"):
        model, epochs = args.out / f"{slug(name)}.tflite", EPOCHS[name][1]
        runs = {"full": finetune(model, args.out / slug(name) / "full", data[name], epochs, None,
                                 "")}
        for rank, targets in RUNS[name]:
            label = f"LoRA r={rank}" + ("" if targets == "all" else f" ({targets})")
            runs[label] = finetune(model, args.out / slug(name) / f"r{rank}-{targets}",
                                   data[name], epochs, rank, targets)
        results[name] = runs
        print(json.dumps({name: runs}), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
