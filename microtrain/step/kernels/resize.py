"""Image resizing (NHWC) with TFLite's sampling rules, and its gradients.

Both resizes are separable: rows are resampled first, then columns.  The
source positions of every output row and column are worked out once, in
float32 as TFLite computes them.  Gradients spread each output element back
onto the inputs it read; along one axis those inputs never decrease as the
output index grows, so the spreading is a segment sum (np.add.reduceat).
"""
import numpy as np

from microtrain.step.kernels import kernel
from microtrain.step.kernels.workspace import scratch


def _scale(n_in, n_out, align_corners):
    if align_corners and n_out > 1:
        return np.float32(n_in - 1) / np.float32(n_out - 1)
    return np.float32(n_in) / np.float32(n_out)


def bilinear_taps(n_in, n_out, align_corners=False, half_pixel_centers=False):
    """(lower, upper, weight of upper) source indices of each output index."""
    out = np.arange(n_out, dtype=np.float32)
    scale = _scale(n_in, n_out, align_corners)
    pos = (out + np.float32(0.5)) * scale - np.float32(0.5) if half_pixel_centers else out * scale
    lower = np.maximum(np.floor(pos), 0).astype(np.intp)
    upper = np.minimum(np.ceil(pos), n_in - 1).astype(np.intp)
    return lower, upper, pos - lower


def nearest_taps(n_in, n_out, align_corners=False, half_pixel_centers=False):
    """The source index of each output index."""
    out = np.arange(n_out, dtype=np.float32)
    pos = (out + np.float32(0.5 if half_pixel_centers else 0)) * _scale(n_in, n_out, align_corners)
    index = np.floor(pos + np.float32(0.5)) if align_corners else np.floor(pos)  # round half up
    return np.clip(index, 0, n_in - 1).astype(np.intp)


def _along(axis, values):
    """values shaped to broadcast along `axis` of an NHWC array."""
    return values.reshape((-1,) + (1,) * (3 - axis))


def _resample(src, dst, axis, taps):
    """A step writing dst = Σ over taps (index, weight) of src taken at index
    along axis, times weight (None: 1)."""
    (first, w0), *rest = taps
    extra = scratch(dst.shape, dst.dtype) if rest else None

    def step():
        np.take(src, first, axis=axis, out=dst, mode="clip")
        if w0 is not None:
            np.multiply(dst, w0, out=dst)
        for index, weight in rest:
            np.take(src, index, axis=axis, out=extra, mode="clip")
            np.multiply(extra, weight, out=extra)
            np.add(dst, extra, out=dst)
    return step


def _target_view(out, axis, targets):
    """out's entries at the increasing indices `targets` along axis, as a view
    when they are evenly spaced (always so when resizing by an integer factor)."""
    lead = (slice(None),) * axis
    steps = np.diff(targets)
    if len(targets) == 1 or (steps == steps[0]).all():
        step = int(steps[0]) if len(targets) > 1 else 1
        return out[lead + (slice(int(targets[0]), int(targets[-1]) + 1, step),)]
    return None


def _spread(src, dst, axis, taps):
    """A step writing dst = the transpose of _resample: each element of src
    added, times its weight, onto the dst element it was taken from."""
    parts = []
    for index, weight in taps:
        starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
        targets = index[starts]
        weighted = scratch(src.shape, src.dtype) if weight is not None else src
        sums = scratch(src.shape[:axis] + (len(starts),) + src.shape[axis + 1:], src.dtype)
        parts.append((weight, weighted, starts, sums, targets, _target_view(dst, axis, targets)))

    def step():
        dst.fill(0)
        for weight, weighted, starts, sums, targets, view in parts:
            if weight is not None:
                np.multiply(src, weight, out=weighted)
            np.add.reduceat(weighted, starts, axis=axis, out=sums)
            if view is not None:
                np.add(view, sums, out=view)
            else:  # unevenly spaced targets: a fancy-index add (indices are unique)
                at = (slice(None),) * axis + (targets,)
                dst[at] += sums
    return step


def _bilinear_axis(n_in, n_out, axis, dtype, options):
    lower, upper, frac = bilinear_taps(n_in, n_out, **options)
    return [(lower, _along(axis, (1 - frac).astype(dtype))), (upper, _along(axis, frac.astype(dtype)))]


def _nearest_axis(n_in, n_out, axis, dtype, options):
    return [(nearest_taps(n_in, n_out, **options), None)]


def _options(align_corners=False, half_pixel_centers=False, **_):
    return dict(align_corners=bool(align_corners), half_pixel_centers=bool(half_pixel_centers))


def _resize(taps_of, backward=False):
    """Rows then columns of x resampled into y, or (backward) dY spread back
    over the columns, then over the rows, into dX."""
    def factory(inputs, outputs, **options):
        src, (dst,) = inputs[0], outputs
        x, y = (dst, src) if backward else (src, dst)
        (n, h, w, c), (_, oh, ow, _) = x.shape, y.shape
        rows = taps_of(h, oh, 1, x.dtype, _options(**options))
        cols = taps_of(w, ow, 2, x.dtype, _options(**options))
        middle = scratch((n, oh, w, c), x.dtype)
        if backward:
            first, second = _spread(src, middle, 2, cols), _spread(middle, dst, 1, rows)
        else:
            first, second = _resample(src, middle, 1, rows), _resample(middle, dst, 2, cols)

        def step():
            first()
            second()
        return step
    return factory


# y[n,i,j,c] = bilinear interpolation of x at TFLite's source position of (i, j):
# (i + 1/2)·scale − 1/2 with half_pixel_centers, i·scale otherwise, scale =
# in/out or (in−1)/(out−1) with align_corners.  Nearest neighbour takes the
# source index floor((i + 1/2 if half_pixel_centers)·scale), rounded instead
# of floored with align_corners, clipped to the image.
kernel("RESIZE_BILINEAR")(_resize(_bilinear_axis))
kernel("ResizeBilinearGrad")(_resize(_bilinear_axis, backward=True))
kernel("RESIZE_NEAREST_NEIGHBOR")(_resize(_nearest_axis))
kernel("ResizeNearestNeighborGrad")(_resize(_nearest_axis, backward=True))
