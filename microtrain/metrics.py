"""Metrics as Keras computes them, accumulated over batches as (total, count)."""
import numpy as np

HIGHER_IS_BETTER = {"accuracy": True, "mae": False, "mse": False, "loss": False}


def accuracy(y: np.ndarray, t: np.ndarray, loss: str) -> tuple[float, int]:
    if loss == "sparse_cce":
        hits = np.argmax(y, axis=-1) == t.reshape(y.shape[:-1]).astype(np.int64)
    elif loss == "bce" or y.shape[-1] == 1:
        hits = (y > 0.5) == (t > 0.5)
    else:
        hits = np.argmax(y, axis=-1) == np.argmax(t, axis=-1)
    return float(np.count_nonzero(hits)), hits.size


def mae(y: np.ndarray, t: np.ndarray, loss: str) -> tuple[float, int]:
    return float(np.abs(y - t.reshape(y.shape)).sum()), y.size


def mse(y: np.ndarray, t: np.ndarray, loss: str) -> tuple[float, int]:
    return float(np.square(y - t.reshape(y.shape)).sum()), y.size


METRICS = {"accuracy": accuracy, "mae": mae, "mse": mse}


def default_metric(loss: str) -> str:
    return "accuracy" if loss in ("cce", "sparse_cce", "bce") else loss
