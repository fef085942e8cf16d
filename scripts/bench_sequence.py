"""Build the sequence models of scripts/bench.py's sequence rows with the official
converters (run with an interpreter that has TensorFlow, e.g. /opt/venvs/tf/bin/python):

    python scripts/bench_sequence.py OUT

writes, for each model NAME in SEQUENCE_MODELS, OUT/NAME.keras (the Keras model, dynamic
batch, that the Keras worker trains with `fit`) and OUT/NAME.tflite (TFLiteConverter's
output from a SavedModel, the file microtrain trains), and OUT/tokens.npy + OUT/labels.npy
(seeded random ids and one-hot classes).  Keras 3 converts an LSTM only at a static batch
(its WHILE loop's tensor lists need a static shape), so the LSTM's .tflite comes from a
batch-1 twin holding the same weights; the transformer converts with a dynamic batch.
OUT/lstm_fused.tflite is the same LSTM (same weights) built with tf_keras (Keras 2),
whose converter output is one fused UNIDIRECTIONAL_SEQUENCE_LSTM (also batch 1).
"""
import os
import sys
import tempfile
from pathlib import Path

VOCAB, SEQ, WIDTH, UNITS, HEADS, LAYERS, FFN, CLASSES = 2000, 32, 64, 64, 2, 2, 128, 10
SAMPLES, SEED = 512, 0
# name -> batch of the converted file (None: dynamic)
SEQUENCE_MODELS = {"lstm": 1, "transformer": None}


def build(keras, name: str, batch):
    L = keras.layers
    ids = keras.Input((SEQ,), batch_size=batch, dtype="int32", name="token_ids")
    if name == "lstm":
        x = L.LSTM(UNITS)(L.Embedding(VOCAB, WIDTH)(ids))
    else:  # a post-norm encoder, as torch's nn.TransformerEncoderLayer (relu, no dropout)
        x = L.Embedding(VOCAB, WIDTH)(ids) + L.Embedding(SEQ, WIDTH)(
            keras.ops.arange(SEQ)[None])
        for _ in range(LAYERS):
            x = L.LayerNormalization()(x + L.MultiHeadAttention(HEADS, WIDTH // HEADS)(x, x))
            x = L.LayerNormalization()(x + L.Dense(WIDTH)(L.Dense(FFN, activation="relu")(x)))
        x = L.GlobalAveragePooling1D()(x)
    return keras.Model(ids, L.Dense(CLASSES, activation="softmax")(x))


def torch_model(name: str):
    """The same architecture in torch.nn (PyTorch's initialisers): returns logits, the
    softmax being in the loss."""
    import torch
    from torch import nn

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            if name == "lstm":
                self.body = nn.LSTM(WIDTH, UNITS, batch_first=True)
            else:
                self.position = nn.Parameter(torch.randn(1, SEQ, WIDTH))
                self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(
                    WIDTH, HEADS, FFN, dropout=0.0, batch_first=True), LAYERS,
                    enable_nested_tensor=False)
            self.head = nn.Linear(UNITS if name == "lstm" else WIDTH, CLASSES)

        def forward(self, ids):
            x = self.embed(ids)
            if name == "lstm":
                return self.head(self.body(x)[1][0][0])  # the last hidden state
            return self.head(self.body(x + self.position).mean(1))

    return Classifier()


def main(out: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    np.save(out / "tokens.npy", rng.integers(0, VOCAB, (SAMPLES, SEQ), dtype=np.int32))
    np.save(out / "labels.npy", np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, SAMPLES)])
    for name, batch in SEQUENCE_MODELS.items():
        keras.utils.set_random_seed(SEED)
        model = build(keras, name, None)
        model.save(out / f"{name}.keras")
        twin = model if batch is None else build(keras, name, batch)
        twin.set_weights(model.get_weights())
        spec = [tf.TensorSpec((batch, SEQ), tf.int32, name="token_ids")]
        convert(tf, lambda d: twin.export(d, input_signature=spec, verbose=False),
                out / f"{name}.tflite")
        if name == "lstm":
            fused = fused_lstm(model.get_weights())
            convert(tf, lambda d: fused.save(d, save_format="tf"), out / "lstm_fused.tflite")


def convert(tf, export, path: Path) -> None:
    """export(dir) writes a SavedModel; TFLiteConverter turns it into `path`."""
    with tempfile.TemporaryDirectory() as tmp:
        export(tmp)
        path.write_bytes(tf.lite.TFLiteConverter.from_saved_model(tmp).convert())


def fused_lstm(weights: list):
    """The LSTM classifier in tf_keras at batch 1, holding `weights`."""
    import tf_keras
    L = tf_keras.layers
    ids = tf_keras.Input((SEQ,), batch_size=1, dtype="int32", name="token_ids")
    x = L.LSTM(UNITS)(L.Embedding(VOCAB, WIDTH)(ids))
    model = tf_keras.Model(ids, L.Dense(CLASSES, activation="softmax")(x))
    model.set_weights(weights)
    return model


if __name__ == "__main__":
    main(Path(sys.argv[1]))
