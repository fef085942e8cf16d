"""Checkpoint files: everything a run needs to continue exactly where it stopped.

A checkpoint is a zip archive that numpy reads as an .npz: `params.npy`, one
`optimizer/<slot>.npy` per optimizer state array, and `meta.json` with the rest.
The layout is documented in schemas/checkpoint.md.
"""
import io
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from microtrain.files.atomic import atomic_write
from microtrain.files.contracts import CHECKPOINT_FORMAT, CheckpointMeta, OptimizerState, RunState
from microtrain.files.errors import UserError
from microtrain.files.opening import read_npy, read_zip_member, regular_file
from microtrain.trainer import TrainerState

_STATE_PREFIX = "optimizer/"
MAX_META_BYTES = 1 << 20  # meta.json is a few hundred bytes; adaptive scaling adds a few per layer
# What reading a damaged archive or .npy member can raise.
_DAMAGE = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError)


@dataclass
class Checkpoint:
    state: TrainerState                     # where training stands (its data order given)
    model_sha256: str                       # sha256 of the frozen model file
    run: RunState                           # the run's own values
    step: int = 0                           # training steps completed


def save_checkpoint(path, ckpt: Checkpoint) -> None:
    """Write `ckpt` to `path` atomically (built in memory, then one atomic write)."""
    state = ckpt.state
    params = np.ascontiguousarray(state.params, np.float32).reshape(-1)
    if not np.isfinite(params).all():
        raise ValueError("refusing to checkpoint non-finite parameters")
    meta = CheckpointMeta(
        format=CHECKPOINT_FORMAT, version=CheckpointMeta.VERSION, model_sha256=ckpt.model_sha256,
        optimizer=OptimizerState(state.optimizer, state.optimizer_config, int(state.iterations),
                                 sorted(state.optimizer_state)),
        epoch=int(state.epoch), step=int(ckpt.step), rng_state=state.data_order,
        loss_scale=state.loss_scale, extra=ckpt.run)
    arrays = {"params": params, **{_STATE_PREFIX + k: np.asarray(v, np.float32)
                                   for k, v in state.optimizer_state.items()}}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("meta.json", meta.to_json())
        for name, array in arrays.items():
            with archive.open(name + ".npy", "w") as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    atomic_write(path, buf.getvalue())


def load_checkpoint(path, expected_model_sha: str | None) -> Checkpoint:
    """Read a checkpoint; UserError if the file is not one, is damaged, has another
    format version, or belongs to a model other than `expected_model_sha` (None: any)."""
    path = Path(path)
    regular_file(path, "checkpoint")
    try:
        with zipfile.ZipFile(path) as archive:
            meta = _read_meta(path, archive)
            _check_model(path, meta, expected_model_sha)
            arrays = {name: _read_array(archive, name, path)
                      for name in ["params", *(_STATE_PREFIX + k for k in meta.optimizer.state)]}
        ckpt = _from_parts(meta, arrays)
    except _DAMAGE as e:
        raise UserError(path, f"damaged checkpoint ({type(e).__name__}: {e})") from None
    params = ckpt.state.params
    if params.dtype != np.float32 or params.ndim != 1 or not np.isfinite(params).all():
        raise UserError(path, "damaged checkpoint (parameters are not a finite float32 vector)")
    return ckpt


def _read_meta(path: Path, archive: zipfile.ZipFile) -> CheckpointMeta:
    if "meta.json" not in archive.namelist():
        raise UserError(path, "not a microtrain checkpoint (no meta.json)")
    member = archive.getinfo("meta.json")
    if member.file_size > MAX_META_BYTES:
        raise UserError(path, f"meta.json of {member.file_size} bytes: damaged checkpoint")
    return CheckpointMeta.from_json(archive.read("meta.json"), path)


def _check_model(path: Path, meta: CheckpointMeta, expected: str | None) -> None:
    if expected is not None and meta.model_sha256 != expected:
        raise UserError(path, f"checkpoint of another model (sha256 {meta.model_sha256[:12]}..., "
                              f"this model is {expected[:12]}...)")


def _read_array(archive: zipfile.ZipFile, name: str, path: Path) -> np.ndarray:
    # zipfile checks the CRC as it reads; members are stored, so none is larger than the file
    return read_npy(read_zip_member(archive, name + ".npy", path, path.stat().st_size),
                    path, f"member {name}.npy")


def _from_parts(meta: CheckpointMeta, arrays: dict[str, np.ndarray]) -> Checkpoint:
    opt = meta.optimizer
    state = TrainerState(
        params=arrays["params"], optimizer=opt.name, optimizer_config=opt.config,
        optimizer_state={k: arrays[_STATE_PREFIX + k] for k in opt.state},
        iterations=opt.iterations, epoch=meta.epoch, loss_scale=meta.loss_scale,
        data_order=meta.rng_state)
    return Checkpoint(state, meta.model_sha256, meta.extra, meta.step)
