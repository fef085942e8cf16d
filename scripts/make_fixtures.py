"""Regenerate tests/fixtures/: small real data sets, float32 .tflite models and Keras references.

Run from the repository root with the TensorFlow venv (never used by the tests or CI):

    TFENV/bin/python scripts/make_fixtures.py   # TFENV: a venv with tensorflow==2.21.*

Everything is seeded and TF runs on CPU with deterministic ops, so a rerun reproduces the
committed files. Each model is built once, converted, checked (op list, weights bit-exact in
the .tflite, outputs with a dynamic batch), and the Keras trajectories are trained from those
same initial weights.
"""

import json
import os
import tempfile
import warnings
from pathlib import Path

# Must be set before TensorFlow loads: oneDNN reorders float sums, CUDA is never wanted.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tflite  # noqa: E402
from keras import layers  # noqa: E402
from sklearn.datasets import load_diabetes, load_digits  # noqa: E402

FIXTURES = Path("tests/fixtures")
N_TRAIN, BATCH_SIZE, EPOCHS = 300, 32, 5
OPT_STEPS_SEED, OPT_STEPS, OPT_SIZE = 7, 6, 7


# ---------------------------------------------------------------- data sets


def make_data():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    diabetes = load_diabetes(scaled=False)
    dx = diabetes.data
    dy = diabetes.target
    return {
        "digits_x": x,
        "digits_images": x.reshape(-1, 8, 8, 1),
        "digits_y": y,
        "digits_onehot": np.eye(10, dtype=np.float32)[y],
        "diabetes_x": ((dx - dx.mean(0)) / dx.std(0)).astype(np.float32),
        "diabetes_y": ((dy - dy.min()) / (dy.max() - dy.min())).astype(np.float32)[:, None],
    }


# ---------------------------------------------------------------- models


def mlp():
    x = keras.Input((64,), name="x")
    h = layers.Dense(32, activation="relu", name="hidden")(x)
    return keras.Model(x, layers.Dense(10, activation="softmax", name="probs")(h), name="mlp")


def residual_mlp():
    x = keras.Input((64,), name="x")
    h1 = layers.Dense(32, activation="relu", name="hidden1")(x)
    h2 = layers.Dense(32, activation="relu", name="hidden2")(h1)
    h = layers.Add(name="residual")([h2, h1])
    y = layers.Dense(10, activation="softmax", name="probs")(h)
    return keras.Model(x, y, name="residual_mlp")


def cnn():
    x = keras.Input((8, 8, 1), name="x")
    h = layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(x)
    h = layers.MaxPool2D(2, name="pool")(h)
    h = layers.Conv2D(8, 3, padding="valid", activation="relu", name="conv2")(h)
    h = layers.Flatten(name="flatten")(h)
    return keras.Model(x, layers.Dense(10, activation="softmax", name="probs")(h), name="cnn")


def depthwise():
    x = keras.Input((8, 8, 1), name="x")
    h = layers.Conv2D(8, 3, strides=2, padding="same", activation="relu6", name="conv")(x)
    h = layers.DepthwiseConv2D(
        3, depth_multiplier=2, padding="same", activation="relu6", name="dwconv"
    )(h)
    h = layers.GlobalAveragePooling2D(name="gap")(h)
    y = layers.Dense(10, activation="softmax", name="probs")(h)
    return keras.Model(x, y, name="depthwise")


def regression(out_init="glorot_uniform", name="regression"):
    x = keras.Input((10,), name="x")
    h = layers.Dense(16, activation="tanh", name="hidden1")(x)
    h = layers.Dense(8, activation="tanh", name="hidden2")(h)
    y = layers.Dense(1, activation="sigmoid", kernel_initializer=out_init, name="out")(h)
    return keras.Model(x, y, name=name)


def regression_small():
    # A near-zero last kernel makes every backpropagated gradient tiny (mixed-precision tests).
    init = keras.initializers.RandomNormal(stddev=1e-4, seed=11)
    return regression(init, name="regression_small")


def mlp_784():
    x = keras.Input((784,), name="x")
    h = layers.Dense(256, activation="relu", name="hidden1")(x)
    h = layers.Dense(128, activation="relu", name="hidden2")(h)
    return keras.Model(x, layers.Dense(10, activation="softmax", name="probs")(h), name="mlp_784")


def mobilenetv2():
    return keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10,
        classifier_activation="softmax",
    )


FC, SOFTMAX = "FULLY_CONNECTED", "SOFTMAX"
# name: (builder, seed, expected op list with fused activations; None = only printed)
MODELS = {
    "mlp": (mlp, 1, [f"{FC}:RELU", FC, SOFTMAX]),
    "residual_mlp": (residual_mlp, 2, [f"{FC}:RELU", f"{FC}:RELU", "ADD", FC, SOFTMAX]),
    "cnn": (cnn, 3, ["CONV_2D:RELU", "MAX_POOL_2D", "CONV_2D:RELU", "SHAPE", "STRIDED_SLICE",
                     "PACK", "RESHAPE", FC, SOFTMAX]),
    "depthwise": (depthwise, 4, ["CONV_2D:RELU6", "DEPTHWISE_CONV_2D:RELU6", "MEAN", FC,
                                 SOFTMAX]),
    "regression": (regression, 5, [FC, "TANH", FC, "TANH", FC, "LOGISTIC"]),
    "regression_small": (regression_small, 5, [FC, "TANH", FC, "TANH", FC, "LOGISTIC"]),
    "mlp_784": (mlp_784, 6, [f"{FC}:RELU", f"{FC}:RELU", FC, SOFTMAX]),
    "mobilenetv2": (mobilenetv2, 7, None),
}


def build(name):
    builder, seed, _ = MODELS[name]
    keras.utils.set_random_seed(seed)
    model = builder()
    fill_zero_weights(model, np.random.default_rng(seed))
    return model


def fill_zero_weights(model, rng):
    """Replace all-zero initial weights (biases, BatchNorm beta and mean) by small random values.

    The converter drops an all-zero bias from FULLY_CONNECTED/CONV_2D (its input becomes -1),
    which would leave nothing in the .tflite for those Keras weights to be trained from.
    """
    for var in model.weights:
        value = var.numpy()
        if not value.any():
            var.assign(rng.normal(0.0, 0.05, value.shape).astype(value.dtype))


def convert(model):
    """Float32 .tflite with a dynamic batch: export a SavedModel, convert it unoptimised."""
    with tempfile.TemporaryDirectory() as tmp:
        model.export(tmp, verbose=False)
        return tf.lite.TFLiteConverter.from_saved_model(tmp).convert()


# ---------------------------------------------------------------- .tflite inspection

_OPTIONS_WITH_ACTIVATION = {
    "CONV_2D": tflite.Conv2DOptions,
    "DEPTHWISE_CONV_2D": tflite.DepthwiseConv2DOptions,
    "FULLY_CONNECTED": tflite.FullyConnectedOptions,
    "ADD": tflite.AddOptions,
    "MAX_POOL_2D": tflite.Pool2DOptions,
    "AVERAGE_POOL_2D": tflite.Pool2DOptions,
}
_ACTIVATIONS = {0: "", 1: "RELU", 2: "RELU_N1_TO_1", 3: "RELU6", 4: "TANH"}


def main_graph(buf):
    model = tflite.Model.GetRootAsModel(buf, 0)
    return model, model.Subgraphs(0)


def op_name(model, op):
    """'NAME', or 'NAME:ACT' when the op has a fused activation."""
    code = model.OperatorCodes(op.OpcodeIndex())
    name = tflite.opcode2name(max(code.BuiltinCode(), code.DeprecatedBuiltinCode()))
    if name not in _OPTIONS_WITH_ACTIVATION:
        return name
    table = op.BuiltinOptions()
    options = _OPTIONS_WITH_ACTIVATION[name]()
    options.Init(table.Bytes, table.Pos)
    act = _ACTIVATIONS[options.FusedActivationFunction()]
    return f"{name}:{act}" if act else name


def op_list(buf):
    """Op names of the main subgraph in execution order."""
    model, graph = main_graph(buf)
    return [op_name(model, graph.Operators(i)) for i in range(graph.OperatorsLength())]


def constants(buf):
    """Every constant float32 tensor of the main subgraph, in its stored shape."""
    model, graph = main_graph(buf)
    tensors = [graph.Tensors(i) for i in range(graph.TensorsLength())]
    data = [model.Buffers(t.Buffer()).DataAsNumpy() for t in tensors]
    return [d.view(np.float32).reshape(t.ShapeAsNumpy()) for t, d in zip(tensors, data)
            if t.Type() == tflite.TensorType.FLOAT32 and not isinstance(d, int)]


def tflite_layout(layer, weight):
    """A Keras weight in the layout TFLite stores it (see the kernel interface in the brief)."""
    w = np.asarray(weight)
    if w.ndim == 1:
        return w
    if isinstance(layer, layers.Dense):
        return w.T
    if isinstance(layer, layers.DepthwiseConv2D):
        kh, kw, cin, mult = w.shape
        return w.reshape(1, kh, kw, cin * mult)
    if isinstance(layer, layers.Conv2D):
        return w.transpose(3, 0, 1, 2)
    raise TypeError(f"no TFLite layout known for {type(layer).__name__}")


def check_weights(model, buf):
    """The converted file must hold every Keras weight bit for bit: tests start from it."""
    stored = constants(buf)
    for layer in model.layers:
        for var in layer.weights:
            want = tflite_layout(layer, var.numpy())
            if not any(s.shape == want.shape and np.array_equal(s, want) for s in stored):
                raise AssertionError(f"{model.name}: {var.path} not found bit-exact in .tflite")


def run_tflite(buf, x):
    """Run the .tflite at x's batch size, checking that the batch dimension is dynamic."""
    warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated")
    interpreter = tf.lite.Interpreter(model_content=buf)
    detail = interpreter.get_input_details()[0]
    assert detail["shape_signature"][0] == -1, "batch dimension is not dynamic"
    interpreter.resize_tensor_input(detail["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(detail["index"], x)
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def sample_input(model, data):
    shape = model.inputs[0].shape[1:]
    for array in (data["digits_x"], data["digits_images"], data["diabetes_x"]):
        if array.shape[1:] == tuple(shape):
            return array[:5]
    return np.random.default_rng(0).random((5, *shape), dtype=np.float32)


def make_models(data):
    """Write every NAME.tflite; return the Keras models, their initial weights and .tflite."""
    built = {}
    for name, (_, _, expected) in MODELS.items():
        model = build(name)
        buf = convert(model)
        ops = op_list(buf)
        print(f"{name}: {len(buf)} bytes, ops {ops}")
        if expected is not None and ops != expected:
            raise AssertionError(f"{name}: ops {ops}, expected {expected}")
        if {"QUANTIZE", "DEQUANTIZE"} & set(ops):
            raise AssertionError(f"{name}: converter emitted quantization ops")
        if name != "mobilenetv2":  # its BatchNorms are folded into the convolutions
            check_weights(model, buf)
        x = sample_input(model, data)  # 5 samples: not the batch size of the signature
        np.testing.assert_allclose(run_tflite(buf, x), model(x), rtol=1e-4, atol=1e-6)
        (FIXTURES / f"{name}.tflite").write_bytes(buf)
        built[name] = (model, [w.copy() for w in model.get_weights()], buf)
    return built


# ---------------------------------------------------------------- optimizers

OPTIMIZERS = {
    "sgd": keras.optimizers.SGD,
    "momentum": lambda **kw: keras.optimizers.SGD(momentum=0.9, **kw),
    "nesterov": lambda **kw: keras.optimizers.SGD(momentum=0.9, nesterov=True, **kw),
    "adam": keras.optimizers.Adam,
    "adamw": keras.optimizers.AdamW,
    "rmsprop": keras.optimizers.RMSprop,
}
EXTRA_OPTIMIZERS = {
    "adagrad": keras.optimizers.Adagrad,
    "adamax": keras.optimizers.Adamax,
    "nadam": keras.optimizers.Nadam,
}


def config(optimizer):
    cfg = optimizer.get_config()
    cfg.pop("name")
    return {k: float(v) if isinstance(v, (np.floating, np.ndarray)) else v for k, v in cfg.items()}


def floats(array):
    return np.asarray(array, dtype=np.float32).astype(float).tolist()


def optimizer_steps():
    """One [7] variable fed 6 fixed gradients per optimizer, at learning rate 0.01."""
    rng = np.random.default_rng(OPT_STEPS_SEED)
    initial = rng.standard_normal(OPT_SIZE).astype(np.float32)
    grads = rng.standard_normal((OPT_STEPS, OPT_SIZE)).astype(np.float32)
    runs = []
    for name, make in {**OPTIMIZERS, **EXTRA_OPTIMIZERS}.items():
        optimizer = make(learning_rate=0.01)
        var = keras.Variable(initial, name="w")
        values = []
        for g in grads:
            optimizer.apply_gradients([(tf.constant(g), var)])
            values.append(floats(var.numpy()))
        runs.append({"optimizer": name, "optimizer_config": config(optimizer), "values": values})
    return {"initial": floats(initial), "gradients": floats(grads), "runs": runs}


# ---------------------------------------------------------------- trajectories

KERAS_LOSSES = {
    "cce": "categorical_crossentropy",
    "sparse_cce": "sparse_categorical_crossentropy",
    "mse": "mean_squared_error",
    "mae": "mean_absolute_error",
}
DIGITS_X = {"mlp": "digits_x", "residual_mlp": "digits_x", "cnn": "digits_images",
            "depthwise": "digits_images"}
TARGETS = {"cce": "digits_onehot", "sparse_cce": "digits_y", "mse": "diabetes_y",
           "mae": "diabetes_y"}
RUNS = [("mlp", "cce"), ("mlp", "sparse_cce"), ("residual_mlp", "cce"), ("cnn", "cce"),
        ("depthwise", "cce"), ("regression", "mse"), ("regression", "mae"),
        ("regression_small", "mse")]


class LossTracker(keras.metrics.Mean):
    """Keras's epoch-loss tracker that also keeps the last step's loss.

    fit() only logs the running (batch-size weighted) mean; keeping the value train_step
    hands to update_state records each step's loss exactly, with nothing recomputed.
    """

    def __init__(self, name="loss"):
        super().__init__(name=name)
        self.last = self.add_variable(shape=(), initializer="zeros", dtype=self.dtype, name="last")

    def update_state(self, values, sample_weight=None):
        self.last.assign(keras.ops.cast(values, self.dtype))
        super().update_state(values, sample_weight)


class StepLosses(keras.callbacks.Callback):
    """Collects per-step losses and the running means Keras logs, epoch by epoch."""

    def on_train_begin(self, logs=None):
        self.steps, self.running = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append([])
        self.running.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1].append(float(self.model._loss_tracker.last.numpy()))
        self.running[-1].append(logs["loss"])


# Per-sample losses on probabilities, independent of Keras, to tie each run to its .tflite.
NUMPY_LOSSES = {
    "cce": lambda p, t: -(t * np.log(p)).sum(-1),
    "sparse_cce": lambda p, t: -np.log(p[np.arange(len(t)), t]),
    "mse": lambda p, t: ((p - t) ** 2).mean(-1),
    "mae": lambda p, t: np.abs(p - t).mean(-1),
}


def batch_sizes():
    return [min(BATCH_SIZE, N_TRAIN - start) for start in range(0, N_TRAIN, BATCH_SIZE)]


def check_step_losses(tag, steps, running, epoch_loss):
    """Recorded steps must reproduce Keras's logs under the batch-size weighted mean."""
    sizes = np.array(batch_sizes(), dtype=np.float64)
    for step, logged, epoch in zip(steps, running, epoch_loss):
        step = np.array(step)
        weighted = np.cumsum(step * sizes) / np.cumsum(sizes)
        np.testing.assert_allclose(logged, weighted, rtol=2e-6, err_msg=tag)
        np.testing.assert_allclose(epoch, weighted[-1], rtol=2e-6, err_msg=tag)


def check_first_step(tag, buf, x, y, loss, first):
    """The first step's loss must be that of the .tflite's own weights on the first batch."""
    want = NUMPY_LOSSES[loss](run_tflite(buf, x[:BATCH_SIZE]).astype(np.float64), y[:BATCH_SIZE])
    np.testing.assert_allclose(first, want.mean(), rtol=1e-5, err_msg=tag)


def trajectory(model, init, buf, data, model_name, loss, opt_name):
    x = data[DIGITS_X.get(model_name, "diabetes_x")][:N_TRAIN]
    y = data[TARGETS[loss]][:N_TRAIN]
    model.set_weights(init)
    optimizer = OPTIMIZERS[opt_name]()
    model.compile(optimizer=optimizer, loss=KERAS_LOSSES[loss], jit_compile=False)
    model._loss_tracker = LossTracker()
    recorder = StepLosses()
    history = model.fit(x, y, batch_size=BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[recorder])
    epoch_loss = [float(v) for v in history.history["loss"]]
    tag = f"{model_name}/{loss}/{opt_name}"
    check_step_losses(tag, recorder.steps, recorder.running, epoch_loss)
    check_first_step(tag, buf, x, y, loss, recorder.steps[0][0])
    print(f"{tag}: epoch loss {[round(v, 5) for v in epoch_loss]}")
    return {"model": model_name, "loss": loss, "optimizer": opt_name,
            "optimizer_config": config(optimizer), "epoch_loss": epoch_loss,
            "step_loss": recorder.steps}


def trajectories(built, data):
    runs = [trajectory(*built[m], data, m, loss, opt) for m, loss in RUNS for opt in OPTIMIZERS]
    inputs = {m: DIGITS_X.get(m, "diabetes_x") for m, _ in RUNS}
    return {
        "data": {"inputs": inputs, "targets": TARGETS, "n_train": N_TRAIN,
                 "batch_size": BATCH_SIZE, "epochs": EPOCHS, "steps_per_epoch": len(batch_sizes()),
                 "batch_sizes": batch_sizes()},
        "keras": {
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "step_loss": "mean over the batch of per-sample losses (partial last batch: mean of 12)",
            "epoch_loss": "sum(step_loss * batch_size) / n_train (keras Mean tracker weighted by "
                          "batch size, keras/src/backend/tensorflow/trainer.py train_step)",
            "softmax_crossentropy": "cce/sparse_cce after a softmax layer are computed by Keras "
                                    "from the cached logits (no probability clipping)",
        },
        "runs": runs,
    }


# ---------------------------------------------------------------- main


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=1) + "\n")


def main():
    tf.config.experimental.enable_op_determinism()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    data = make_data()
    for name, array in data.items():
        np.save(FIXTURES / f"{name}.npy", array)
    built = make_models(data)
    write_json(FIXTURES / "keras_optimizer_steps.json", optimizer_steps())
    write_json(FIXTURES / "keras_trajectories.json", trajectories(built, data))


if __name__ == "__main__":
    main()
