"""One runtime training one model, driven by scripts/bench.py over stdin/stdout.

    python scripts/bench_worker.py microtrain|onert|torch|keras

It imports only the standard library, numpy and its own runtime, so its resident
memory is that runtime's (keras runs in the interpreter that has TensorFlow).  The
protocol is one JSON object per line each way:
  {"model", "frozen", "x", "y", "optimizer", "learning_rate", "batch", "loss"[, "loss_scale"]
   [, "arch", "threads"]}  (torch and keras: the sequence architecture and the thread count;
   keras reads its `model` from a .keras file)
      -> {"baseline_kib", "refused"}  (the peak RSS after the imports; a refusal reason or null)
  {"epochs": n} -> {"epoch_ms": [...], "compute_ms_per_step": [...]}
  {"finish": true} -> {"peak_kib", "anon_kib", "file_kib", "final_loss"[, "data_bytes",
      "held_bytes", "mapped_bytes"]}, then the worker exits (anonymous and file-backed
      resident memory at the end of training; microtrain also says how many bytes its data
      and its trainer hold, and how many of the split's files it reads in place).
"""
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def peak_kib() -> int:
    """The process's peak resident memory so far, in KiB: Linux's VmHWM.  Not
    getrusage's ru_maxrss, which keeps the peak of the parent at fork across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def resident_kib() -> dict:
    """The process's resident memory now, in KiB, as /proc/self/smaps_rollup splits
    it: anonymous pages (the heap, arrays, the written pages of private file maps)
    and file-backed ones (library code, and files read in place such as a split's
    models: pages the system may drop and read again)."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return {"anon_kib": fields["Anonymous"], "file_kib": fields["Rss"] - fields["Anonymous"]}


class Microtrain:
    def __init__(self, spec: dict):
        """Loads the data as `microtrain run` does: into arrays of the types of the
        tensors it is loaded into (float16 for an fp16 model's input)."""
        from microtrain.step.loss_scale import make_loss_scale
        from microtrain.commands.session import load_data
        from microtrain.shuffle import Shuffler
        from microtrain.trainer import Trainer
        self.trainer = Trainer(spec["frozen"], batch_size=spec["batch"],
                               optimizer=spec["optimizer"], learning_rate=spec["learning_rate"],
                               loss_scale=make_loss_scale(spec.get("loss_scale", "none")))
        inputs, targets = self.trainer.data_types()
        self.xs, self.ts = self.trainer.check_data(load_data([spec["x"]], dtypes=inputs),
                                                   load_data([spec["y"]], dtypes=targets))
        self.rng = Shuffler(0)  # unused: batches in order, as onert's DataLoader

    def epochs(self, n: int) -> dict:
        walls, computes = [], []
        for _ in range(n):
            start = time.perf_counter()
            record = self.trainer.train_epoch(self.xs, self.ts, False, self.rng)
            walls.append(1000 * (time.perf_counter() - start))
            computes.append(record["ms_per_step"])
        return {"epoch_ms": walls, "compute_ms_per_step": computes}

    def final_loss(self) -> float:
        return self.trainer.evaluate(self.xs, self.ts, checked=True)["loss"]

    def held(self) -> dict:
        """Bytes of the loaded data, of the RAM the trainer's arrays hold (the plan's
        `ram`) and of the files it reads in place (`read_only`)."""
        return {"data_bytes": sum(a.nbytes for a in self.xs + self.ts),
                "held_bytes": self.trainer.memory_bytes(),
                "mapped_bytes": self.trainer.mapped_bytes()}


@contextlib.contextmanager
def stderr_to(path: str):
    """Send file descriptor 2 to `path`: onert's C++ core explains a refusal there."""
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def refusal_reason(log: str) -> str | None:
    """The text after the last 'Error during nnfw_session::...:' line onert printed."""
    lines = [line for line in log.splitlines() if line.startswith("Error during")]
    return lines[-1].split(" : ", 1)[-1].strip() if lines else None


class Refused(Exception):
    pass


class Onert:
    def __init__(self, spec: dict):
        from onert.experimental.train import DataLoader, losses, optimizer, session
        opt = {"sgd": optimizer.SGD, "adam": optimizer.Adam}[spec["optimizer"]]
        loss = {"cce": losses.CategoricalCrossentropy, "mse": losses.MeanSquaredError}[spec["loss"]]
        with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
            try:
                with stderr_to(log.name):
                    self.session = session(spec["model"])
                    self.session.compile(optimizer=opt(learning_rate=spec["learning_rate"]),
                                         loss=loss(), batch_size=spec["batch"])
            except Exception as e:  # onert raises OnertError with only a status code
                raise Refused(refusal_reason(log.read()) or repr(e)) from None
        self.loader = DataLoader([np.load(spec["x"])], [np.load(spec["y"])],
                                 batch_size=spec["batch"])
        self.phases = []  # what train() computes per epoch but only prints
        run_phase = self.session._run_phase

        def recording(*args, **kwargs):
            self.phases.append(run_phase(*args, **kwargs))
            return self.phases[-1]
        self.session._run_phase = recording

    def epochs(self, n: int) -> dict:
        """EPOCH_TIMES, and the time of session.train() alone (forward, backward and
        update in onert's core) per step: (loss, io ms/step, train ms/step) per epoch."""
        del self.phases[:]
        epoch_ms = self.session.train(self.loader, n)["EPOCH_TIMES"]
        return {"epoch_ms": epoch_ms, "compute_ms_per_step": [p[2] for p in self.phases]}

    def held(self) -> dict:
        return {}

    def final_loss(self) -> float:
        batch_losses = [self.session.eval_step(xb, yb)["loss"][0] for xb, yb in self.loader]
        return float(np.mean(batch_losses))


def _timed_epochs(n: int, epoch, steps: int) -> dict:
    """Wall times of n calls of epoch(), and per step (all of it is compute)."""
    walls = []
    for _ in range(n):
        start = time.perf_counter()
        epoch()
        walls.append(1000 * (time.perf_counter() - start))
    return {"epoch_ms": walls, "compute_ms_per_step": [w / steps for w in walls]}


class Torch:
    """PyTorch eager: the architecture of scripts/bench_sequence.py rebuilt with torch.nn,
    Adam with Keras's epsilon, cross-entropy on the logits against the one-hot targets."""

    def __init__(self, spec: dict):
        import torch
        from bench_sequence import torch_model
        torch.set_num_threads(spec["threads"])
        torch.manual_seed(0)
        self.torch = torch
        self.model = torch_model(spec["arch"])
        params = list(self.model.parameters())
        self.optimizer = {"adam": lambda: torch.optim.Adam(params, spec["learning_rate"], eps=1e-7),
                          "sgd": lambda: torch.optim.SGD(params, spec["learning_rate"])}[
            spec["optimizer"]]()
        self.x = torch.from_numpy(np.load(spec["x"]).astype(np.int64))
        self.y = torch.from_numpy(np.load(spec["y"]))
        self.batch = spec["batch"]
        self.steps = -(-len(self.x) // self.batch)

    def epoch(self) -> None:
        for i in range(0, len(self.x), self.batch):
            self.optimizer.zero_grad()
            loss = self.torch.nn.functional.cross_entropy(
                self.model(self.x[i:i + self.batch]), self.y[i:i + self.batch])
            loss.backward()
            self.optimizer.step()

    def epochs(self, n: int) -> dict:
        return _timed_epochs(n, self.epoch, self.steps)

    def held(self) -> dict:
        return {"trainable_parameters": sum(p.numel() for p in self.model.parameters())}

    def final_loss(self) -> float:
        with self.torch.no_grad():
            return float(self.torch.nn.functional.cross_entropy(self.model(self.x), self.y))


class Keras:
    """Keras 3 `fit` (its defaults: compiled train function) on the .keras model."""

    def __init__(self, spec: dict):
        import keras
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
        tf.config.threading.set_inter_op_parallelism_threads(spec["threads"])
        self.model = keras.models.load_model(spec["model"])
        opt = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}[spec["optimizer"]]
        self.model.compile(optimizer=opt(spec["learning_rate"]), loss="categorical_crossentropy")
        self.x, self.y, self.batch = np.load(spec["x"]), np.load(spec["y"]), spec["batch"]
        self.steps = -(-len(self.x) // self.batch)
        self.walls = []
        walls, clock = self.walls, {}

        class EpochTimes(keras.callbacks.Callback):  # the epochs alone, not fit's set-up
            def on_epoch_begin(self, epoch, logs=None):
                clock["start"] = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                walls.append(1000 * (time.perf_counter() - clock["start"]))
        self.callback = EpochTimes()

    def epochs(self, n: int) -> dict:
        del self.walls[:]
        self.model.fit(self.x, self.y, batch_size=self.batch, epochs=n, shuffle=False,
                       verbose=0, callbacks=[self.callback])
        return {"epoch_ms": list(self.walls),
                "compute_ms_per_step": [w / self.steps for w in self.walls]}

    def held(self) -> dict:
        return {"trainable_parameters": int(sum(np.prod(w.shape)
                                                for w in self.model.trainable_weights))}

    def final_loss(self) -> float:
        return float(self.model.evaluate(self.x, self.y, batch_size=self.batch, verbose=0))


RUNTIMES = {"microtrain": ("microtrain.trainer", Microtrain),
            "onert": ("onert.experimental.train", Onert),
            "torch": ("torch", Torch),
            "keras": ("keras", Keras)}


def serve(runtime: str) -> None:
    module, make = RUNTIMES[runtime]
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # onert prints its progress on stdout
    __import__(module)
    baseline = peak_kib()

    def send(message: dict) -> None:
        reply.write(json.dumps(message) + "\n")

    spec = json.loads(sys.stdin.readline())
    try:
        runner = make(spec)
    except Refused as e:
        send({"baseline_kib": baseline, "refused": str(e)})
        return
    send({"baseline_kib": baseline, "refused": None})
    for line in sys.stdin:
        request = json.loads(line)
        if "epochs" in request:
            send(runner.epochs(request["epochs"]))
        else:  # finish: the peak before the evaluation below can raise it
            peak = peak_kib()
            send({"peak_kib": peak, **resident_kib(), **runner.held(),
                  "final_loss": runner.final_loss()})
            return


if __name__ == "__main__":
    serve(sys.argv[1])
