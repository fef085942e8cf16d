"""Write tests/fixtures/int8_corpus/layers_int8.tflite: one small Keras 3 model of the
layers whose int8 forms the corpus's applications do not hold, converted to full
integer by TensorFlow's TFLiteConverter as fetch_real_models.py converts the corpus
(`full_int8`), batch 1 (a dynamic batch leaves run-time shapes of [-1, -1]).

Run from the repository root with the TensorFlow venv (never used by the tests or CI):

    TFENV/bin/python scripts/make_int8_layers_fixture.py

Its int8 operators: CONV_2D, PRELU, DEPTHWISE_CONV_2D + CONV_2D (separable), TRANSPOSE_CONV,
RESIZE_BILINEAR (half-pixel centres), AVERAGE_POOL_2D, TRANSPOSE, CONCATENATION, layer norm
(MEAN, SQUARED_DIFFERENCE, RSQRT, MUL, ADD), FULLY_CONNECTED, GELU (the exact, erf form),
LOGISTIC and MUL (swish), REDUCE_MAX, SOFTMAX.
"""
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from fetch_real_models import SEED, full_int8, tf_imports  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "int8_corpus"
INPUT, CLASSES = (16, 16, 3), 5


def model(keras):
    L = keras.layers
    inputs = keras.Input(INPUT, batch_size=1)
    x = L.PReLU(shared_axes=[1, 2])(L.Conv2D(8, 3, padding="same")(inputs))
    x = L.SeparableConv2D(8, 3, padding="same", activation="relu6")(x)
    x = L.Conv2DTranspose(8, 3, strides=2, padding="same", activation="relu")(x)
    x = L.AveragePooling2D(4)(L.UpSampling2D(interpolation="bilinear")(x))
    x = L.Concatenate()([x, L.Permute((2, 1, 3))(x)])
    x = L.LayerNormalization()(L.Reshape((-1, 16))(x))
    x = L.Dense(16, activation="swish")(L.Dense(16, activation="gelu")(x))
    return keras.Model(inputs, L.Dense(CLASSES, activation="softmax")(L.GlobalMaxPooling1D()(x)))


def main() -> None:
    keras, tf = tf_imports()
    keras.utils.set_random_seed(SEED)
    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        model(keras).export(tmp, input_signature=[tf.TensorSpec((1, *INPUT), tf.float32)],
                            verbose=False)
        converter = tf.lite.TFLiteConverter.from_saved_model(tmp)
        full_int8(tf, converter, lambda: ([rng.uniform(0, 1, (1, *INPUT)).astype(np.float32)]
                                          for _ in range(16)))
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "layers_int8.tflite").write_bytes(converter.convert())
    print(OUT / "layers_int8.tflite")


if __name__ == "__main__":
    main()
