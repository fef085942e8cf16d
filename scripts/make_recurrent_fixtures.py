"""Regenerate tests/fixtures/recurrent/lstm_classifier.tflite: a tf_keras (Keras 2) LSTM text-style
classifier, as the TF converter writes it (UNIDIRECTIONAL_SEQUENCE_LSTM with variable state
tensors, then the last step's STRIDED_SLICE, a Dense and a softmax).

Run from the repository root with the TensorFlow venv (never used by the tests or CI):

    /opt/venvs/tf/bin/python scripts/make_recurrent_fixtures.py

TF 2.21's converter keeps tf_keras recurrent layers fused only at a fixed batch (a dynamic
batch fails with "TensorListReserve ... requires element_shape to be static"), so the model is
traced as a concrete function with input spec [1, T, D]; split makes the batch symbolic.
"""
import os
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/recurrent/lstm_classifier.tflite"
STEPS, FEATURES, UNITS, CLASSES = 10, 4, 8, 3


def convert(model: keras.Model, shape) -> bytes:
    traced = tf.function(lambda x: model(x, training=False))
    concrete = traced.get_concrete_function(tf.TensorSpec(shape, tf.float32))
    return tf.lite.TFLiteConverter.from_concrete_functions([concrete], model).convert()


def main() -> None:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((STEPS, FEATURES))
    hidden = keras.layers.LSTM(UNITS)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(hidden))
    OUT.write_bytes(convert(model, [1, STEPS, FEATURES]))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
