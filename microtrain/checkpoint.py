"""Checkpoint files: everything a run needs to continue exactly where it stopped.

A checkpoint is a zip archive that numpy reads as an .npz: `params.npy`, one
`optimizer/<slot>.npy` per optimizer state array, and `meta.json` with the rest.
The layout is documented in schemas/checkpoint.md.
"""
import io
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic import atomic_write
from .errors import UserError
from .shuffle import Shuffler

FORMAT = "microtrain-checkpoint"
VERSION = 1
_STATE_PREFIX = "optimizer/"
# Bit generators a saved RNG state may name (numpy's own).
# What reading a damaged archive, JSON document or .npy member can raise.
_DAMAGE = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError,
           TypeError, AttributeError)


@dataclass
class Checkpoint:
    params: np.ndarray                      # the flat float32 trainable parameters
    optimizer: str                          # the optimizer's CLI name, e.g. "adam"
    optimizer_config: dict                  # its hyperparameters (Optimizer.config())
    optimizer_state: dict[str, np.ndarray]  # Optimizer.state()
    iterations: int                         # Optimizer.iterations
    epoch: int                              # epochs completed
    rng_state: dict                         # Shuffler.state(): {"seed", "draws"}
    model_sha256: str                       # sha256 of the frozen model file
    loss_scale: dict = field(default_factory=dict)   # loss-scale state, JSON values
    step: int = 0                           # training steps completed
    extra: dict = field(default_factory=dict)        # the trainer's own JSON values

    def rng(self) -> Shuffler:
        """A Shuffler continuing from the saved state."""
        return Shuffler(**self.rng_state)


def save_checkpoint(path, ckpt: Checkpoint) -> None:
    """Write `ckpt` to `path` atomically (built in memory, then one atomic write)."""
    params = np.ascontiguousarray(ckpt.params, np.float32).reshape(-1)
    if not np.isfinite(params).all():
        raise ValueError("refusing to checkpoint non-finite parameters")
    meta = {
        "format": FORMAT, "version": VERSION, "model_sha256": ckpt.model_sha256,
        "optimizer": {"name": ckpt.optimizer, "config": ckpt.optimizer_config,
                      "iterations": int(ckpt.iterations),
                      "state": sorted(ckpt.optimizer_state)},
        "epoch": int(ckpt.epoch), "step": int(ckpt.step),
        "rng_state": ckpt.rng_state, "loss_scale": ckpt.loss_scale, "extra": ckpt.extra,
    }
    arrays = {"params": params,
              **{_STATE_PREFIX + k: np.asarray(v, np.float32) for k, v in ckpt.optimizer_state.items()}}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("meta.json", json.dumps(meta, indent=1))
        for name, array in arrays.items():
            with archive.open(name + ".npy", "w") as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    atomic_write(path, buf.getvalue())


def load_checkpoint(path, expected_model_sha: str | None) -> Checkpoint:
    """Read a checkpoint; UserError if the file is not one, is damaged, has another
    format version, or belongs to a model other than `expected_model_sha` (None: any)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(path, "no such checkpoint file")
    try:
        with zipfile.ZipFile(path) as archive:
            meta = _read_meta(path, archive)
            _check_model(path, meta, expected_model_sha)
            arrays = {name: _read_array(archive, name)
                      for name in ["params", *(_STATE_PREFIX + k for k in meta["optimizer"]["state"])]}
        ckpt = _from_parts(meta, arrays)
        ckpt.rng()   # a state that does not make a Shuffler is damage too
    except _DAMAGE as e:
        raise UserError(path, f"damaged checkpoint ({type(e).__name__}: {e})") from None
    params = ckpt.params
    if params.dtype != np.float32 or params.ndim != 1 or not np.isfinite(params).all():
        raise UserError(path, "damaged checkpoint (parameters are not a finite float32 vector)")
    return ckpt


def _read_meta(path: Path, archive: zipfile.ZipFile) -> dict:
    if "meta.json" not in archive.namelist():
        raise UserError(path, "not a microtrain checkpoint (no meta.json)")
    meta = json.loads(archive.read("meta.json"))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(path, "not a microtrain checkpoint")
    if meta.get("version") != VERSION:
        raise UserError(path, f"checkpoint format version {meta.get('version')}; "
                              f"this microtrain reads version {VERSION}")
    return meta


def _check_model(path: Path, meta: dict, expected: str | None) -> None:
    if expected is not None and meta["model_sha256"] != expected:
        raise UserError(path, f"checkpoint of another model (sha256 {meta['model_sha256'][:12]}..., "
                              f"this model is {expected[:12]}...)")


def _read_array(archive: zipfile.ZipFile, name: str) -> np.ndarray:
    with archive.open(name + ".npy") as member:   # zipfile checks the CRC as it reads
        return np.lib.format.read_array(io.BytesIO(member.read()), allow_pickle=False)


def _from_parts(meta: dict, arrays: dict[str, np.ndarray]) -> Checkpoint:
    opt = meta["optimizer"]
    counters = [opt["iterations"], meta["epoch"], meta["step"]]
    if not all(isinstance(c, int) and c >= 0 for c in counters):
        raise ValueError(f"counters must be whole numbers >= 0, got {counters}")
    if set(meta["rng_state"]) != {"seed", "draws"}:
        raise ValueError(f"the shuffler state has fields {sorted(meta['rng_state'])}, "
                         "expected seed and draws")
    return Checkpoint(
        params=arrays["params"], optimizer=opt["name"], optimizer_config=opt["config"],
        optimizer_state={k: arrays[_STATE_PREFIX + k] for k in opt["state"]},
        iterations=opt["iterations"], epoch=meta["epoch"], step=meta["step"],
        rng_state=meta["rng_state"], model_sha256=meta["model_sha256"],
        loss_scale=meta["loss_scale"], extra=meta["extra"])
