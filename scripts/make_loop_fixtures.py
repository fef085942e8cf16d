"""Regenerate the small models of tests/fixtures/loops/: Keras 3 recurrent layers,
which the TFLite converter lowers to WHILE loops (cond and body subgraphs).

Run from the repository root with a TensorFlow venv (never used by the tests or CI):

    /opt/venvs/tf/bin/python scripts/make_loop_fixtures.py

  lstm.tflite     LSTM(4) over 5 steps of 3 features -> Dense(3, softmax)
  gru.tflite      GRU(4), the same around it
  bilstm.tflite   Bidirectional(LSTM(3)): two loops, one over the reversed sequence
  stacked.tflite  LSTM(4, return_sequences) -> GRU(3): the second loop reads the first's outputs

Batch-1 builds (with a dynamic batch the converter refuses Keras 3 RNNs), float
inputs, converted from a SavedModel export as a user would.  Seeded.
"""
import os
import tempfile
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers  # noqa: E402

OUT = Path("tests/fixtures/loops")
STEPS, FEATURES = 5, 3


def convert(model: keras.Model) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        spec = tf.TensorSpec((1, STEPS, FEATURES), tf.float32)
        model.export(d, input_signature=[spec], verbose=False)
        return tf.lite.TFLiteConverter.from_saved_model(d).convert()


def classifier(*recurrent) -> keras.Model:
    return keras.Sequential([keras.Input((STEPS, FEATURES)), *recurrent,
                             layers.Dense(3, activation="softmax")])


def main() -> None:
    keras.utils.set_random_seed(3)
    models = {"lstm": classifier(layers.LSTM(4)),
              "gru": classifier(layers.GRU(4)),
              "bilstm": classifier(layers.Bidirectional(layers.LSTM(3))),
              "stacked": classifier(layers.LSTM(4, return_sequences=True), layers.GRU(3))}
    OUT.mkdir(parents=True, exist_ok=True)
    for name, model in models.items():
        (OUT / f"{name}.tflite").write_bytes(convert(model))


if __name__ == "__main__":
    main()
