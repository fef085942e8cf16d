"""Record Keras 3's training of an embedding table, the parity reference of
tests/test_embedding_keras.py: an Embedding -> GlobalAveragePooling1D -> Dense
softmax classifier trained by Adam, SGD with momentum and RMSprop, each twice:

- `fit`: model.fit(shuffle=False).  TensorFlow hands Keras the table's gradient
  as IndexedSlices, one row per id occurrence; Keras sums them where it adds the
  gradient to a dense state (every row updated: an untouched row's moments decay
  and Adam, momentum and RMSprop keep moving it), but squares them before that
  sum, so Adam's and RMSprop's second moment of an id that occurs k times in a
  batch holds the sum of k squares, not the square of the sum.
- `dense`: the same steps with the gradient made dense first (the sum of the
  occurrences, as PyTorch's nn.Embedding gives it): the textbook update.

Some ids occur only in the first batch, so their rows move afterwards by the
optimizers' state alone.

Run with the TensorFlow environment (Keras 3):
    /opt/venvs/tf/bin/python scripts/make_embedding_fixtures.py
It writes tests/fixtures/keras_embedding.json: the data, the initial weights,
and per run the epoch losses and the final table."""
import json
from pathlib import Path

import numpy as np

import keras

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "keras_embedding.json"
VOCAB, STEPS, DIM, CLASSES = 20, 6, 4, 3
SAMPLES, BATCH, EPOCHS = 48, 8, 3
OPTIMIZERS = {"adam": dict(learning_rate=0.05),
              "momentum": dict(learning_rate=0.1, momentum=0.9),
              "rmsprop": dict(learning_rate=0.01)}


def make_data():
    rng = np.random.default_rng(18)
    ids = rng.integers(0, VOCAB - 4, (SAMPLES, STEPS)).astype(np.int32)
    ids[:BATCH, 0] = rng.integers(VOCAB - 4, VOCAB, BATCH)  # rows touched by batch 1 alone
    labels = rng.integers(0, CLASSES, SAMPLES)
    return ids, np.eye(CLASSES, dtype=np.float32)[labels]


def make_model():
    keras.utils.set_random_seed(1)
    ids = keras.Input((STEPS,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM)(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(ids, out)


def optimizer(name):
    cls = keras.optimizers.Adam if name == "adam" else \
        keras.optimizers.SGD if name == "momentum" else keras.optimizers.RMSprop
    return cls(**OPTIMIZERS[name])


def fit(name, initial, x, y):
    model = make_model()
    model.set_weights(initial)
    model.compile(optimizer=optimizer(name), loss="categorical_crossentropy")
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return [float(v) for v in history.history["loss"]], model.get_weights()[0]


def dense(name, initial, x, y):
    """fit's steps with every gradient densified before the update."""
    import tensorflow as tf
    model, opt = make_model(), optimizer(name)
    model.set_weights(initial)
    loss_fn, losses = keras.losses.CategoricalCrossentropy(), []
    for _ in range(EPOCHS):
        for i in range(0, SAMPLES, BATCH):
            with tf.GradientTape() as tape:
                loss = loss_fn(y[i:i + BATCH], model(x[i:i + BATCH]))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
            losses.append(float(loss))
    return [float(v) for v in np.mean(np.reshape(losses, (EPOCHS, -1)), 1)], \
        model.get_weights()[0]


def main():
    x, y = make_data()
    initial = make_model().get_weights()  # table [V, D], kernel [D, C], bias [C]
    runs = []
    for name in OPTIMIZERS:
        for mode, train in (("fit", fit), ("dense", dense)):
            losses, table = train(name, initial, x, y)
            runs.append({"optimizer": name, "mode": mode, "hyperparameters": OPTIMIZERS[name],
                         "epoch_loss": losses, "table": table.tolist()})
    record = {"keras": keras.__version__, "batch_size": BATCH, "epochs": EPOCHS,
              "ids": x.tolist(), "targets": y.tolist(),
              "weights": [w.tolist() for w in initial], "runs": runs}
    FIXTURE.write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
