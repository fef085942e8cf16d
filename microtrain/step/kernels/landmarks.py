"""MediaPipe's landmark custom operators (version 2), forward only.

MediaPipe's face mesh with attention crops regions of a feature map around the
landmarks it has found and refines them there:

- Landmarks2TransformMatrix turns landmarks [B, N, 3] into a 4×4 matrix [B, 4, 4]
  that maps the pixel (x, y) of an output_width × output_height crop to the
  landmark space: the crop is centred on a subset of the landmarks' bounding box,
  rotated so that the line from landmark `left_rotation_idx` to
  `right_rotation_idx` lies at `target_rotation_radians`, and scaled so the box
  times (scale_x, scale_y) fills it;
- TransformTensorBilinear samples a feature map [B, H, W, C] bilinearly at the
  positions such a matrix gives for the output's pixel centres (zero where the
  position falls outside the pixel centres of the map);
- TransformLandmarks applies such a matrix to landmarks [B, N, 2|3] (x, y; z is
  copied).

Only the first two rows of a matrix act on x and y: column 2 multiplies a zero z
and rows 2-3 are not read.  The attributes are the operator's FlexBuffer
custom_options (read at load, microtrain/files/format/model.py), checked here into a
typed record when the kernel is prepared; an attribute another version of the
operator has is refused.  The semantics follow MediaPipe's CPU kernels
(mediapipe/util/tflite/operations/*.cc), batch row by batch row.
"""
from dataclasses import dataclass, fields

import numpy as np

from microtrain.files.errors import OperatorError
from microtrain.step.kernels import kernel
from microtrain.step.kernels.workspace import scratch


def _record(cls, options: dict):
    """A typed record of the op's attributes: each field of `cls`, no other."""
    if "custom_options" in options:
        raise OperatorError(None, "custom options are not a FlexBuffer map of attributes")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise OperatorError(None, f"unsupported attribute {unknown[0]!r} (version 2 has "
                                  f"{', '.join(names) if names else 'none'})")
    values = {}
    for f in fields(cls):
        if f.name not in options:
            raise OperatorError(None, f"attribute {f.name!r} is missing")
        values[f.name] = _typed(f.name, f.type, options[f.name])
    return cls(**values)


def _typed(name, kind, value):
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          tuple: lambda v: isinstance(v, (list, tuple)) and all(
              isinstance(i, int) and not isinstance(i, bool) for i in v)}[kind]
    if not ok(value):
        raise OperatorError(None, f"attribute {name!r} is {value!r}, not {kind.__name__}")
    return tuple(value) if kind is tuple else kind(value)


@dataclass(frozen=True)
class CropParams:
    """Landmarks2TransformMatrix's attributes (version 2)."""
    left_rotation_idx: int
    right_rotation_idx: int
    subset_idxs: tuple  # landmarks whose rotated bounding box the crop covers
    target_rotation_radians: float
    output_height: int
    output_width: int
    scale_x: float
    scale_y: float

    def check(self, n_landmarks: int) -> None:
        indices = (self.left_rotation_idx, self.right_rotation_idx, *self.subset_idxs)
        bad = [i for i in indices if not 0 <= i < n_landmarks]
        if bad or not self.subset_idxs:
            raise OperatorError(None, f"landmark index {bad[0] if bad else 'list'} is outside "
                                      f"the {n_landmarks} landmarks (or subset_idxs is empty)")
        if min(self.output_height, self.output_width) <= 0 or min(self.scale_x, self.scale_y) <= 0:
            raise OperatorError(None, "output_height, output_width, scale_x and scale_y must "
                                      "be positive")


@dataclass(frozen=True)
class SampleParams:
    """TransformTensorBilinear's attributes (version 2)."""
    output_height: int
    output_width: int


@dataclass(frozen=True)
class NoParams:
    """TransformLandmarks version 2 has no attributes."""


def _check_matrix(m, batch: int) -> None:
    """One matrix per batch row, or one for them all."""
    if m.shape not in ((batch, 4, 4), (1, 4, 4)):
        raise OperatorError(None, f"the matrix is {list(m.shape)}, expected [{batch}, 4, 4]")


def _rotation(angle) -> np.ndarray:
    """[B, 2, 2] matrices rotating by each angle (radians, counter-clockwise in x, y)."""
    c, s = np.cos(angle), np.sin(angle)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)


@kernel("Landmarks2TransformMatrix", versions=(2,))
def landmarks_to_transform_matrix(inputs, outputs, **options):
    """y maps a crop pixel p to centre + rotate(-r) · diag(box size · scale / output
    size) · (p - output size / 2): r rotates the left→right landmark line to
    target_rotation_radians, the box is the subset's bounding box in that
    rotated frame, the centre is the box's, rotated back."""
    (x,), (y,) = inputs, outputs
    p = _record(CropParams, options)
    if x.ndim != 3 or x.shape[2] != 3:
        raise OperatorError(None, f"landmarks are {list(x.shape)}, expected [batch, N, 3]")
    p.check(x.shape[1])
    _check_matrix(y, x.shape[0])
    subset = np.asarray(p.subset_idxs, np.intp)
    half = np.array([p.output_width, p.output_height], np.float64) / 2
    scale = np.array([p.scale_x, p.scale_y]) / (2 * half)

    def step():
        xy = x[..., :2].astype(np.float64)
        line = xy[:, p.right_rotation_idx] - xy[:, p.left_rotation_idx]
        r = p.target_rotation_radians - np.arctan2(line[:, 1], line[:, 0])
        turned = xy[:, subset] @ _rotation(r).transpose(0, 2, 1)  # rows rotated by r
        low, high = turned.min(axis=1), turned.max(axis=1)
        back = _rotation(-r)
        centre = (back @ ((low + high) / 2)[..., None])[..., 0]
        linear = back * ((high - low) * scale)[:, None, :]  # back · diag(...)
        y.fill(0)
        y[:, :2, :2] = linear
        y[:, :2, 3] = centre - linear @ half
        y[:, 2, 2] = y[:, 3, 3] = 1
    return step


@kernel("TransformTensorBilinear", versions=(2,))
def transform_tensor_bilinear(inputs, outputs, **options):
    """y[b, i, j] = x[b] sampled bilinearly at (u, v) - ½, (u, v) = the matrix's
    first two rows applied to (j + ½, i + ½, 0, 1); zero where (u, v) - ½ lies
    outside [0, W-1] × [0, H-1]."""
    (x, m), (y,) = inputs, outputs
    p = _record(SampleParams, options)
    if x.ndim != 4 or y.shape != (x.shape[0], p.output_height, p.output_width, x.shape[3]):
        raise OperatorError(None, f"input {list(x.shape)} and output {list(y.shape)} do not "
                                  f"make a {p.output_height}×{p.output_width} crop of the input")
    _check_matrix(m, x.shape[0])
    batch, height, width, channels = x.shape
    rows, cols = np.meshgrid(np.arange(p.output_height), np.arange(p.output_width), indexing="ij")
    centres = np.stack([cols.ravel(), rows.ravel()], -1) + 0.5  # [P, 2] as (x, y)
    first = (np.arange(batch) * height * width)[:, None]  # each batch row's first pixel
    pixels = x.reshape(-1, channels)
    out = y.reshape(-1, channels)
    corner = scratch(out.shape, out.dtype)
    limit = np.array([width - 1, height - 1])

    def step():
        a = m[:, :2, :2].astype(np.float64)
        uv = centres @ a.transpose(0, 2, 1) + m[:, None, :2, 3] - 0.5  # [B, P, 2]
        inside = ((uv >= 0) & (uv <= limit)).all(-1)  # False for NaN too
        uv = np.where(inside[..., None], uv, 0)  # outside: any index, weighted 0
        low = np.floor(uv)
        frac = uv - low
        low = np.clip(low, 0, limit).astype(np.intp)
        high = np.minimum(low + 1, limit)
        out.fill(0)
        for (cx, wx) in ((low[..., 0], 1 - frac[..., 0]), (high[..., 0], frac[..., 0])):
            for (cy, wy) in ((low[..., 1], 1 - frac[..., 1]), (high[..., 1], frac[..., 1])):
                np.take(pixels, (first + cy * width + cx).ravel(), axis=0, out=corner)
                weight = np.broadcast_to(wx * wy * inside, (batch, len(centres)))
                np.multiply(corner, weight.reshape(-1, 1), out=corner, casting="unsafe")
                np.add(out, corner, out=out)
    return step


@kernel("TransformLandmarks", versions=(2,))
def transform_landmarks(inputs, outputs, **options):
    """(x, y) of each landmark → the matrix's first two rows applied to (x, y, 0, 1);
    z (a third coordinate) is copied."""
    (x, m), (y,) = inputs, outputs
    _record(NoParams, options)
    if x.ndim != 3 or x.shape[2] not in (2, 3) or y.shape != x.shape:
        raise OperatorError(None, f"landmarks {list(x.shape)} → {list(y.shape)}: expected "
                                  "[batch, N, 2 or 3] both")
    _check_matrix(m, x.shape[0])

    def step():
        np.matmul(x[..., :2], m[:, :2, :2].transpose(0, 2, 1), out=y[..., :2])
        y[..., :2] += m[:, None, :2, 3]
        if x.shape[2] == 3:
            y[..., 2] = x[..., 2]
    return step
