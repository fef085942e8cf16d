"""Training data for the command line: loading arrays, validation split, batches.

A data spec is `path.npy`, `path.npz:key` (the key may be left out when the
archive holds one array) or `path.bin`: raw little-endian float32 samples, as
onert_train's raw files, which needs the shape of one sample.
"""
import math
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.opening import (MAX_INPUT_BYTES, read_npy, read_npy_file, read_zip_member,
                                      regular_file)
from microtrain.step.precision import reduced
from microtrain.shuffle import Shuffler

# Array kinds that are numbers: bool, signed and unsigned integers, floats.
_NUMERIC_KINDS = "biuf"


def load_array(spec: str, sample_shape: Sequence[int] | None = None,
               dtype=None) -> np.ndarray:
    """Load the array named by `spec`; every problem is a UserError naming the file.

    `sample_shape` is required for `.bin` files, whose sample count is inferred.
    `dtype`: the type of the tensor the data is loaded into (see Holding); floats
    are then held in it if it is narrower.
    """
    path, key = _split_spec(spec)
    regular_file(path, "data file")
    suffix = path.suffix.lower()
    holding = Holding(spec, dtype) if dtype is not None else None
    try:
        if suffix == ".npy":
            array = read_npy_file(path, holding=holding)
        elif suffix == ".npz":
            array = _load_npz(path, key)
        elif suffix == ".bin":
            array = _load_raw(path, sample_shape)
        else:
            raise UserError(path, "unknown data format (expected .npy, .npz[:key] or .bin)")
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise UserError(path, f"cannot read it as {suffix} ({e})") from None
    if holding is not None:  # read whole (.npz, .bin): convert now
        array = hold(holding, array)
    check_values(spec, array)
    return array


def hold(holding: "Holding", array: np.ndarray) -> np.ndarray:
    """`array` in the type `holding` chooses for it (itself when that is its own)."""
    if array.dtype == holding(array.dtype):
        return array
    held = np.empty(array.shape, holding(array.dtype))
    holding.convert(array.reshape(-1), held.reshape(-1), 0)
    return held


class Holding:
    """The type loaded data is held in, given the `tensor` type the step loads it
    into: floats wider than a float tensor (float32 data for an fp16 input) are
    held in the tensor's type, rounded as the step would round them when loading
    each batch; data for an integer or bool tensor (token ids, masks, segment
    ids) in the tensor's type, refused if it is not integers (or bools) that the
    type holds; anything else as stored (e.g. uint8 images stay one byte)."""

    def __init__(self, spec, tensor):
        self.spec, self.tensor = spec, np.dtype(tensor)

    def __call__(self, stored: np.dtype) -> np.dtype:
        if self.tensor.kind in "biu":
            if stored.kind not in ("b" if self.tensor.kind == "b" else "biu"):
                raise UserError(self.spec, f"holds {stored} data, but the model reads it into a "
                                           f"{self.tensor} tensor: give {self.tensor} values")
            return self.tensor
        floats = stored.kind == "f" and (self.tensor.kind == "f" or reduced(self.tensor))
        return self.tensor if floats and self.tensor.itemsize < stored.itemsize else stored

    def convert(self, src: np.ndarray, dst: np.ndarray, start: int) -> None:
        """Store the flat chunk `src` (elements start.. of the array, in its
        order) into `dst`, refusing values that overflow the narrower type
        (NaN and inf stay, for check_values to report)."""
        with np.errstate(over="ignore"):
            np.copyto(dst, src, casting="unsafe")
        if dst.dtype.kind in "iu":
            overflow = np.flatnonzero(dst != src)
        elif not np.isfinite(dst).all():
            overflow = np.flatnonzero(~np.isfinite(dst) & np.isfinite(src))
        else:
            return
        if overflow.size:
            raise UserError(self.spec, f"holds {src[overflow[0]]} (element {start + overflow[0]}"
                                       f"), beyond the range of the {self.tensor} tensor the "
                                       "model loads it into")


def check_ids(spec, array: np.ndarray, rows: int) -> None:
    """Token ids must index a table of `rows` rows: one outside 0..rows-1 is
    refused naming the sample (it is never wrapped or clipped)."""
    flat = array.reshape(len(array), -1)
    bad = (flat < 0) | (flat >= rows)
    if bad.any():
        sample, at = np.argwhere(bad)[0]
        raise UserError(spec, f"sample {sample} holds id {flat[sample, at]}, outside the "
                              f"{rows} rows of the embedding table it indexes")


def _split_spec(spec: str) -> tuple[Path, str | None]:
    """'data.npz:x' -> (data.npz, 'x'); anything else is a path without a key."""
    head, sep, key = str(spec).rpartition(":")
    if sep and head.lower().endswith(".npz"):
        return Path(head), key
    return Path(spec), None


def spec_file(spec: str) -> Path:
    """The file a data spec names ('data.npz:x' -> data.npz)."""
    return _split_spec(spec)[0]


def _load_npz(path: Path, key: str | None) -> np.ndarray:
    with zipfile.ZipFile(path) as archive:
        keys = [n[:-4] for n in archive.namelist() if n.endswith(".npy")]
        if not keys:
            raise UserError(path, "holds no arrays")
        if key is None:
            if len(keys) != 1:
                raise UserError(path, f"holds {len(keys)} arrays; name one as "
                                      f"{path.name}:KEY (keys: {', '.join(keys)})")
            key = keys[0]
        if key not in keys:
            raise UserError(path, f"has no array {key!r} (keys: {', '.join(keys)})")
        return read_npy(read_zip_member(archive, key + ".npy", path, MAX_INPUT_BYTES),
                        f"{path}:{key}")


def _load_raw(path: Path, sample_shape: Sequence[int] | None) -> np.ndarray:
    if sample_shape is None:
        raise UserError(path, "raw .bin data needs the shape of one sample")
    sample_shape = tuple(int(d) for d in sample_shape)
    if any(d <= 0 for d in sample_shape):
        raise UserError(path, f"sample shape {sample_shape} has a dimension <= 0")
    sample_bytes = 4 * math.prod(sample_shape)
    size = path.stat().st_size
    if size % sample_bytes:
        raise UserError(path, f"{size} bytes is not a whole number of float32 samples of "
                              f"shape {sample_shape} ({sample_bytes} bytes each)")
    return np.fromfile(path, dtype="<f4").reshape(-1, *sample_shape)


def check_values(spec, array: np.ndarray) -> None:
    """Numbers, at least one sample, no NaN or inf; else a UserError naming `spec`."""
    floats = array.dtype.kind == "f" or reduced(array.dtype)  # bfloat16's kind is "V"
    if array.dtype.kind not in _NUMERIC_KINDS and not floats:
        raise UserError(spec, f"holds {array.dtype} data; expected numbers")
    if array.ndim == 0:
        raise UserError(spec, "holds a single value; expected an array of samples")
    if array.shape[0] == 0:
        raise UserError(spec, f"holds no samples (shape {array.shape})")
    # a float64 sum of finite float32/float16 values is finite; numpy sums in small
    # buffers, so only a failed check (or float64 data) builds a mask of the whole array
    if floats and not np.isfinite(array.sum(dtype=np.float64)):
        bad = ~np.isfinite(array)
        if bad.any():
            nan = int(np.isnan(array).sum())
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise UserError(spec, f"holds {nan} NaN and {int(bad.sum()) - nan} inf values; "
                                  f"the first at index {list(first)}")


def validation_split(arrays: Sequence[np.ndarray], fraction: float
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split every array into (training, validation) parts, the validation part
    being the last `fraction` of the samples, before any shuffling (as Keras's
    fit(validation_split=...), including its rounding)."""
    if not 0 < fraction < 1:
        raise UserError(None, f"validation split must be between 0 and 1, got {fraction}")
    n = _sample_count(arrays)
    split_at = math.floor(n * (1.0 - fraction))
    if split_at in (0, n):
        raise UserError(None, f"a validation split of {fraction} of {n} samples leaves "
                              f"{'no training' if split_at == 0 else 'no validation'} samples")
    return [a[:split_at] for a in arrays], [a[split_at:] for a in arrays]


def _sample_count(arrays: Sequence[np.ndarray]) -> int:
    counts = {len(a) for a in arrays}
    if len(counts) != 1:
        raise UserError(None, f"inputs and targets have different numbers of samples: "
                              f"{', '.join(str(len(a)) for a in arrays)}")
    return counts.pop()


def batch_indices(n: int, batch_size: int, shuffle: bool,
                  rng: Shuffler) -> Iterator[np.ndarray]:
    """Index arrays of one epoch's batches over `n` samples; the last may be partial.

    The permutation is drawn from `rng` at the call, not lazily, so the generator's
    state right after the call is the state a checkpoint must save to replay
    the following epochs.
    """
    order = rng.permutation(n) if shuffle else np.arange(n)
    return (order[i:i + batch_size] for i in range(0, n, batch_size))
