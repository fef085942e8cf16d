"""Convolution and pooling kernels (NHWC) and their gradients.

All of them work on kernel windows: a 6-D strided view [N, OH, OW, KH, KW, C]
over a padded copy of an image, built once in the factory (_Windows).  CONV_2D
and its weight gradient gather the windows into a contiguous "cols" matrix for
one BLAS matmul.  Depthwise convolutions and pooling loop over the few kernel
taps, each step vectorised over all pixels.  Input gradients compute each
tap's gradient and scatter-add it onto the pixels that tap covered (col2im).
"""
import numpy as np
from numpy.lib.stride_tricks import as_strided

from microtrain.files.errors import OperatorError
from microtrain.step.kernels import in_sequence, kernel
from microtrain.step.kernels.activations import noop, then_activate
from microtrain.step.kernels.workspace import (compact, in_turn, kept, row_tile_bytes, row_tiles,
                                               scratch)

SAME, VALID = 0, 1


def _pads(n_in, n_out, k, stride, dilation, padding):
    """TFLite (before, after) padding of one spatial axis; checks n_out."""
    span = (k - 1) * dilation + 1
    if padding not in (SAME, VALID):
        raise OperatorError(None, f"unsupported padding {padding}")
    expected = -(-n_in // stride) if padding == SAME else -(-(n_in - span + 1) // stride)
    if n_out != expected:
        raise OperatorError(None, f"output size {n_out} does not match input size {n_in} "
                         f"(kernel {k}, stride {stride}, dilation {dilation}, padding {padding})")
    total = max((n_out - 1) * stride + span - n_in, 0)
    return total // 2, total - total // 2


def _per_tap(a, axis=3):
    """Views of `a` at each tap of its kernel axes (axis, axis + 1), row-major."""
    kh, kw = a.shape[axis:axis + 2]
    lead = (slice(None),) * axis
    return [a[lead + (i, j)] for i in range(kh) for j in range(kw)]


def _inside(n_in, outs, offset, stride):
    """(output slice, counted from outs.start, and input slice) of the outputs i
    in the range `outs` whose input i*stride + offset lies inside 0..n_in-1;
    None when none does."""
    lo = max(outs.start, -(offset // stride))
    hi = min(outs.stop, (n_in - 1 - offset) // stride + 1)
    if hi <= lo:
        return None
    return (slice(lo - outs.start, hi - outs.start),
            slice(lo * stride + offset, (hi - 1) * stride + offset + 1, stride))


def _tap_regions(image, out_hw, k_hw, tile=None, padding=SAME, stride_h=1, stride_w=1,
                 dilation_h_factor=1, dilation_w_factor=1, **_):
    """For each kernel tap (row-major, as _per_tap): the [N, OH, OW] index of the
    outputs whose window puts the tap inside the image and the [N, H, W] index
    of the pixels it reads there; None for a tap that only meets padding.  What
    a padded copy would add for the other outputs is zero.  With `tile`
    (images, output rows: two ranges) only those outputs, indexed from the
    tile's start."""
    n, h, w, _ = image.shape
    (oh, ow), (kh, kw) = out_hw, k_hw
    images, out_rows = tile or (range(n), range(oh))
    top = _pads(h, oh, kh, stride_h, dilation_h_factor, padding)[0]
    left = _pads(w, ow, kw, stride_w, dilation_w_factor, padding)[0]
    at, of = slice(0, len(images)), slice(images.start, images.stop)
    regions = []
    for p in range(kh):
        rows = _inside(h, out_rows, p * dilation_h_factor - top, stride_h)
        for q in range(kw):
            cols = _inside(w, range(ow), q * dilation_w_factor - left, stride_w)
            regions.append(None if rows is None or cols is None else
                           ((at, rows[0], cols[0]), (of, rows[1], cols[1])))
    return regions


def _output_tiles(n, oh, row_bytes):
    """The outputs [N, OH, ...] as tiles (images, output rows: two ranges) of at
    most TILE_BYTES at `row_bytes` an output row (or one row): whole images
    when one fits, else rows of one image, so each tile is consecutive in
    memory."""
    per_image = row_tiles(oh, row_bytes)
    if len(per_image) == 1:
        return [(images, range(oh)) for images in row_tiles(n, oh * row_bytes)]
    return [(range(i, i + 1), rows) for i in range(n) for rows in per_image]


def _tiled_regions(image, out, k_hw, opts):
    """Per tile of `out` [N, OH, OW, ...] (_output_tiles): its index into out
    and _tap_regions(tile); and the elements of out's largest tile."""
    n, oh = out.shape[:2]
    tiles = [((slice(images.start, images.stop), slice(rows.start, rows.stop)),
              _tap_regions(image, out.shape[1:3], k_hw, (images, rows), **opts))
             for images, rows in _output_tiles(n, oh, out[0, 0].nbytes)]
    return tiles, max(out[at].size for at, _ in tiles)


def _like(flat, a):
    """A view of the start of the flat buffer `flat` shaped as `a`."""
    return flat[:a.size].reshape(a.shape)


def _padded(image, pads, fill):
    """A scratch buffer for `image` with pads (top, bottom, left, right) around
    each image, its interior view, and a step setting its border to `fill`.

    Other kernels overwrite scratch between calls, so the border is set on
    every call.  In memory order the border is the equal gaps between each
    image's rows, and the gap from one image's last row to the next one's
    first row; with one gap of slack around the buffer (before image 0, after
    image N-1) each kind is one strided view, and two fills set them all."""
    n, h, w, c = image.shape
    top, bottom, left, right = pads
    width = left + w + right
    size = (top + h + bottom) * width * c  # elements of one padded image
    gap = ((top + bottom) * width + left + right) * c
    flat = scratch((n * size + gap,), image.dtype)
    before = (bottom * width + right) * c  # the slack before image 0
    buffer = flat[before:before + n * size].reshape(n, top + h + bottom, width, c)
    item = flat.itemsize
    between_images = as_strided(flat, (n + 1, gap), (size * item, item))
    first_gap = before + (top * width + left + w) * c
    between_rows = as_strided(flat[first_gap:], (n, h - 1, (left + right) * c),
                              (size * item, width * c * item, item))

    def fill_border():
        between_images.fill(fill)
        between_rows.fill(fill)
    return buffer, buffer[:, top:top + h, left:left + w], fill_border


class _Windows:
    """Kernel windows of an NHWC `image` as a view [N, OH, OW, KH, KW, C].

    The view lies over a padded copy in scratch memory, or over the image
    itself when no padding is needed.
    """

    def __init__(self, image, out_hw, k_hw, padding=SAME, stride_h=1, stride_w=1,
                 dilation_h_factor=1, dilation_w_factor=1, fill=0.0, pads=None, **_):
        n, h, w, c = image.shape
        (oh, ow), (kh, kw) = out_hw, k_hw
        pads = pads or (*_pads(h, oh, kh, stride_h, dilation_h_factor, padding),
                        *_pads(w, ow, kw, stride_w, dilation_w_factor, padding))
        self.image = image
        if any(pads):
            self.buffer, self.inner, self.fill_border = _padded(image, pads, fill)
        else:
            self.buffer = self.inner = image

        def windows(a):
            sn, sh, sw, sc = a.strides
            return as_strided(a, (a.shape[0], oh, ow, kh, kw, c),
                              (sn, sh * stride_h, sw * stride_w,
                               sh * dilation_h_factor, sw * dilation_w_factor, sc))
        self.windows = windows
        self.view = windows(self.buffer)
        self.taps = _per_tap(self.view)
        self.direct = (kh, kw, stride_h, stride_w) == (1, 1, 1, 1)
        self.run = c * (kw if dilation_w_factor == 1 else 1)  # contiguous elements per window row

    def load(self):
        """Copy the image into the padded buffer (no-op without padding)."""
        if self.buffer is not self.image:
            self.fill_border()
            np.copyto(self.inner, self.image)

    def columns(self):
        """(cols, gather): the windows as a contiguous [N*OH*OW, KH*KW*C]
        matrix in scratch memory and a step filling it from the image's current
        contents; for 1x1 kernels with stride 1, the image itself and no step."""
        n, oh, ow, kh, kw, c = self.view.shape
        if self.direct:
            return self.image.reshape(n * oh * ow, c), noop
        cols6 = scratch(self.view.shape, self.image.dtype)
        cols = cols6.reshape(n * oh * ow, kh * kw * c)
        # A strided copy pays a fixed cost per contiguous run of the windows;
        # when runs are short (few channels) an index gather is faster.  The
        # index of one image's windows serves every image (axis 1 below); it
        # takes twice the bytes of one image's cols, so a compact workspace
        # copies.
        if self.run >= 12 or compact():
            def gather():
                self.load()
                np.copyto(cols6, self.view)
            return cols, gather
        index = kept(("windows", self.buffer.shape[1:], self.view.shape[1:],
                      tuple(s // self.buffer.itemsize for s in self.view.strides[1:])),
                     (self.view[0].size,), np.intp, self._window_index)
        per_image, images = self.buffer.reshape(n, -1), cols.reshape(n, -1)

        def gather_by_index():  # indices are in range: "wrap" only skips raise mode's checks
            self.load()
            np.take(per_image, index, axis=1, out=images, mode="wrap")
        return cols, gather_by_index

    def _window_index(self, shape):
        """Where each element of one image's windows lies in its (padded) image."""
        one = np.arange(self.buffer[0].size).reshape(1, *self.buffer.shape[1:])
        return self.windows(one).reshape(shape)

    def scatter(self, tap_grad):
        """A step setting the image to the sum over taps k of tap_grad(k), an
        [N, OH, OW, C] array, added at the pixels tap k covers (col2im)."""
        def step():
            self.buffer.fill(0)
            # One tap's windows never share a pixel, so an in-place add on its
            # strided view is a correct scatter-add.
            for k, pixels in enumerate(self.taps):
                np.add(pixels, tap_grad(k), out=pixels)
            if self.buffer is not self.image:
                np.copyto(self.image, self.inner)
        return step


def _column_tiles(image, out_hw, k_hw, opts):
    """The window matrix [N*OH*OW, KH*KW*C] as a list of tiles (rows, cols,
    gather): a slice of its rows, those rows' matrix and a step filling it from
    the image's current contents.  One tile, _Windows.columns(), but in a
    compact workspace: then tiles of output rows share one buffer of at most
    TILE_BYTES, each gathered tap by tap straight from the image (no padded
    copy; zeros where a window meets the padding), so that the scratch does not
    grow with the batch or the image."""
    n, (oh, ow), (kh, kw), c = image.shape[0], out_hw, k_hw, image.shape[3]
    if not compact():
        return [(slice(None), *_Windows(image, out_hw, k_hw, **opts).columns())]
    if (kh, kw, oh, ow) == (1, 1, *image.shape[1:3]) and _tap_regions(image, out_hw, k_hw, **opts)[0]:
        return [(slice(None), image.reshape(n * oh * ow, c), noop)]  # 1x1 over every pixel: the image
    tiles = _output_tiles(n, oh, ow * kh * kw * c * image.itemsize)
    buffer = scratch((max(len(images) * len(rows) for images, rows in tiles) * ow, kh * kw * c),
                     image.dtype)
    return [_column_tile(image, out_hw, k_hw, tile, buffer, opts) for tile in tiles]


def _column_tile(image, out_hw, k_hw, tile, buffer, opts):
    """One tile of _column_tiles, its matrix at the start of `buffer`."""
    (images, rows), (oh, ow), (kh, kw) = tile, out_hw, k_hw
    cols6 = buffer[:len(images) * len(rows) * ow].reshape(len(images), len(rows), ow, kh, kw, -1)
    regions = _tap_regions(image, out_hw, k_hw, tile, **opts)
    whole = (slice(0, len(images)), slice(0, len(rows)), slice(0, ow))
    padding = any(r is None or r[0] != whole for r in regions)
    parts = [(cols6[out + (k // kw, k % kw)], image[pixels])
             for k, region in enumerate(regions) if region for out, pixels in [region]]

    def gather():
        if padding:
            cols6.fill(0)
        for window, pixels in parts:
            np.copyto(window, pixels)
    first, end = (images.start * oh + rows.start) * ow, ((images.stop - 1) * oh + rows.stop) * ow
    return slice(first, end), cols6.reshape(end - first, -1), gather


def _repeated(src, shape):
    """A scratch buffer of `shape` holding `src` broadcast once the step
    refreshing it ran.  Repeating a per-channel vector along the image width
    lets numpy's elementwise loops run over whole rows instead of C-element
    pieces (2x faster at C=16)."""
    rows = scratch(shape, src.dtype)
    return rows, lambda: np.copyto(rows, src)


def _bias_adder(y, b):
    """A step adding the optional bias b to y over its last axis."""
    if b is None:
        return noop
    rows, refresh = _repeated(b, y.shape[2:])

    def step():
        refresh()
        np.add(y, rows, out=y)
    return step


@kernel("CONV_2D", rows="each")
def conv_2d(inputs, outputs, fused_activation_function=0, **opts):
    """y[n,i,j,o] = act(b[o] + sum_{p,q,c} xpad[n, i*sh + p*dh, j*sw + q*dw, c] * w[o,p,q,c]),
    computed as y = cols(x) @ W.reshape(O, -1).T, a tile of cols' rows at a time."""
    x, w, b = (*inputs, None)[:3]  # the bias may be None or left off
    (y,) = outputs
    y2 = y.reshape(-1, w.shape[0])
    tiles = [(cols, gather, y2[rows])
             for rows, cols, gather in _column_tiles(x, y.shape[1:3], w.shape[1:3], opts)]
    w2t = w.reshape(w.shape[0], -1).T
    add_bias = _bias_adder(y, b)

    def step():
        for cols, gather, out in tiles:
            gather()
            np.matmul(cols, w2t, out=out)
        add_bias()
    return then_activate(step, fused_activation_function, y)


@kernel("Conv2DInputGrad", rows="each")
def conv_2d_input_grad(inputs, outputs, **opts):
    """dxpad[n, i*sh + p*dh, j*sw + q*dw, c] += sum_o dy[n,i,j,o] * w[o,p,q,c]:
    one matmul dY @ W[:, p, q, :] per tap, scatter-added onto the tap's pixels."""
    dy, w = inputs
    (dx,) = outputs
    win = _Windows(dx, dy.shape[1:3], w.shape[1:3], **opts)
    dy2 = dy.reshape(-1, w.shape[0])
    if win.direct:  # 1x1, stride 1: dX = dY @ W
        w2, dx2 = w.reshape(w.shape[0], -1), dx.reshape(-1, dx.shape[3])
        return lambda: np.matmul(dy2, w2, out=dx2)
    # Per-tap products land in one contiguous buffer, so the scatter's adds
    # run over whole rows when the stride is 1.
    return _col2im(win, dy2, dy.shape[:3], _per_tap(w, axis=1))


def _col2im(win, rows, pixels, w_taps):
    """A step scattering rows @ w_taps[k] (one product per tap, [N*OH*OW, C])
    onto the pixels tap k covers; `pixels` is (N, OH, OW)."""
    channels = win.image.shape[3]
    grad = scratch((rows.shape[0], channels), win.image.dtype)
    grad4 = grad.reshape(*pixels, channels)

    def tap_grad(k):
        np.matmul(rows, w_taps[k], out=grad)
        return grad4
    return win.scatter(tap_grad)


@kernel("Conv2DWeightGrad", rows="sum")
def conv_2d_weight_grad(inputs, outputs, **opts):
    """dW.reshape(O, -1) = dY.reshape(-1, O).T @ cols(X), summed over the tiles
    of cols' rows in order (several tiles round differently from one product)."""
    dy, x = inputs
    (dw,) = outputs
    dy2t = dy.reshape(-1, dw.shape[0]).T
    tiles = [(dy2t[:, rows], cols, gather)
             for rows, cols, gather in _column_tiles(x, dy.shape[1:3], dw.shape[1:3], opts)]
    dw2 = dw.reshape(dw.shape[0], -1)
    part = scratch(dw2.shape, dw.dtype) if len(tiles) > 1 else None

    def step():
        for k, (dy_rows, cols, gather) in enumerate(tiles):
            gather()
            np.matmul(dy_rows, cols, out=part if k else dw2)
            if k:
                np.add(dw2, part, out=dw2)
    return step


def _depthwise(image, out, w, opts):
    """For a depthwise conv of `image` giving `out`: the windows of image, the
    filter [1, KH, KW, C*M] repeated as per-tap rows [KH*KW, OW, C, M] with a
    step refreshing them from w, and out viewed as [N, OH, OW, C, M]."""
    win = _Windows(image, out.shape[1:3], w.shape[1:3], **opts)
    taps = w.reshape(-1, 1, image.shape[3], w.shape[3] // image.shape[3])
    rows, refresh = _repeated(taps, (taps.shape[0], out.shape[2], *taps.shape[2:]))
    return win, rows, refresh, out.reshape(*out.shape[:3], *taps.shape[2:])


def _image_chunks(image, out, k_hw) -> list[slice] | None:
    """For a compact workspace, the batch of `image` (giving `out`, kernel
    `k_hw`) in chunks of whole images whose padded copy and products fit the
    workspace's tile, so that a kernel's fast padded form runs a chunk at a time
    (few numpy calls, the same numbers); None when one image's do not fit."""
    (kh, kw), (_, h, w, c) = k_hw, image.shape  # a padded image: at most k - 1 more a side
    per_image = (h + kh - 1) * (w + kw - 1) * c * image.itemsize + out[0].nbytes
    if per_image > row_tile_bytes():
        return None
    return [slice(t.start, t.stop) for t in row_tiles(image.shape[0], per_image)]


def _chunked(chunks: list[slice], make, *arrays):
    """One step running make(*(a[chunk] for a in arrays)) for each chunk, the
    chunks' scratch laid out from the same start (they run one after another)."""
    return in_sequence(in_turn([lambda c=c: make(*(a[c] for a in arrays)) for c in chunks]))


@kernel("DEPTHWISE_CONV_2D", rows="each")
def depthwise_conv_2d(inputs, outputs, fused_activation_function=0, **opts):
    """y[n,i,j,c*M+m] = act(b[c*M+m] + sum_{p,q} xpad[n, i*sh + p*dh, j*sw + q*dw, c] * w[0,p,q,c*M+m]),
    accumulated tap by tap; the multiplier M comes from the shapes."""
    x, w, b = (*inputs, None)[:3]  # the bias may be None or left off
    (y,) = outputs
    if compact():
        chunks = _image_chunks(x, y, w.shape[1:3])
        step = _depthwise_in_place(x, y, w, b, opts) if chunks is None else \
            _chunked(chunks, lambda xc, yc: _depthwise_padded(xc, yc, w, b, opts), x, y)
        return then_activate(step, fused_activation_function, y)
    return then_activate(_depthwise_padded(x, y, w, b, opts), fused_activation_function, y)


def _depthwise_padded(x, y, w, b, opts):
    """DEPTHWISE_CONV_2D without its activation, over a padded copy of x."""
    win, rows, refresh, y5 = _depthwise(x, y, w, opts)
    pixels = [tap[..., None] for tap in win.taps]
    prod = scratch(y5.shape, y.dtype)
    add_bias = _bias_adder(y, b)

    def step():
        win.load()
        refresh()
        np.multiply(pixels[0], rows[0], out=y5)
        for k in range(1, len(pixels)):
            np.multiply(pixels[k], rows[k], out=prod)
            np.add(y5, prod, out=y5)
        add_bias()
    return step


def _depthwise_in_place(x, y, w, b, opts):
    """DEPTHWISE_CONV_2D for a compact workspace: a tile of output rows at a
    time, each tap adds its products over the outputs whose window it puts
    inside the image, read from x in place (no padded copy, no filter repeated
    along the width).  The same sums in the same order as the padded kernel's,
    less its products with padding (zeros)."""
    taps = w.reshape(-1, x.shape[3], w.shape[3] // x.shape[3])
    y5 = y.reshape(*y.shape[:3], *taps.shape[1:])
    tiles, size = _tiled_regions(x, y5, w.shape[1:3], opts)
    flat = scratch((size,), y.dtype)
    x5 = x[..., None]
    parts = [(y5[at][out], x5[pixels], taps[k], _like(flat, y5[at])[out])
             for at, regions in tiles
             for k, region in enumerate(regions) if region for out, pixels in [region]]
    add_bias = _bias_adder(y, b)

    def step():
        y5.fill(0)
        for out, pixels, tap, products in parts:
            np.multiply(pixels, tap, out=products)
            np.add(out, products, out=out)
        add_bias()
    return step


@kernel("DepthwiseConv2DInputGrad", rows="each")
def depthwise_conv_2d_input_grad(inputs, outputs, **opts):
    """dxpad[n, i*sh + p*dh, j*sw + q*dw, c] += sum_m dy[n,i,j,c*M+m] * w[0,p,q,c*M+m]."""
    dy, w = inputs
    (dx,) = outputs
    if compact():
        chunks = _image_chunks(dx, dy, w.shape[1:3])
        return _depthwise_input_grad_in_place(dy, dx, w, opts) if chunks is None else \
            _chunked(chunks, lambda dyc, dxc: _depthwise_input_grad_padded(dyc, dxc, w, opts),
                     dy, dx)
    return _depthwise_input_grad_padded(dy, dx, w, opts)


def _depthwise_input_grad_padded(dy, dx, w, opts):
    """DepthwiseConv2DInputGrad over a padded buffer of dx."""
    win, rows, refresh, dy5 = _depthwise(dx, dy, w, opts)
    prod = scratch(dy5.shape, dy.dtype)
    per_m = [prod[..., m] for m in range(rows.shape[3])]
    summed = per_m[0] if len(per_m) == 1 else scratch(dy5.shape[:4], dx.dtype)

    def tap_grad(k):
        np.multiply(dy5, rows[k], out=prod)
        if len(per_m) > 1:
            _fold(np.add, per_m, summed)
        return summed
    scatter = win.scatter(tap_grad)

    def step():
        refresh()
        scatter()
    return step


def _depthwise_input_grad_in_place(dy, dx, w, opts):
    """DepthwiseConv2DInputGrad for a compact workspace: each tap's gradient, a
    tile of dy's rows at a time, added straight onto the pixels of dx it read
    (no padded buffer, no filter repeated along the width), taps in the padded
    kernel's order (a pixel's sum runs over the taps)."""
    taps = w.reshape(-1, dx.shape[3], w.shape[3] // dx.shape[3])
    dy5 = dy.reshape(*dy.shape[:3], *taps.shape[1:])
    tiles, size = _tiled_regions(dx, dy5, w.shape[1:3], opts)
    flat = scratch((size,), dy.dtype)
    multiplier = taps.shape[2]
    summed = scratch((size // multiplier,), dx.dtype) if multiplier > 1 else None
    parts = []
    for k in range(len(taps)):
        for at, regions in tiles:
            if regions[k]:
                prod = _like(flat, dy5[at])
                total = prod[..., 0] if summed is None else _like(summed, prod[..., 0])
                per_m = [prod[..., m] for m in range(multiplier)]
                parts.append((dy5[at], taps[k], prod, per_m, total, dx[regions[k][1]],
                              total[regions[k][0]]))

    def step():
        dx.fill(0)
        for grad, tap, prod, per_m, total, pixels, part in parts:
            np.multiply(grad, tap, out=prod)
            if multiplier > 1:
                _fold(np.add, per_m, total)
            np.add(pixels, part, out=pixels)
    return step


@kernel("DepthwiseConv2DWeightGrad", rows="sum")
def depthwise_conv_2d_weight_grad(inputs, outputs, **opts):
    """dw[0,p,q,c*M+m] = sum_{n,i,j} xpad[n, i*sh + p*dh, j*sw + q*dw, c] * dy[n,i,j,c*M+m]."""
    dy, x = inputs
    (dw,) = outputs
    if compact():
        return _depthwise_weight_grad_in_place(dy, x, dw, opts)
    win = _Windows(x, dy.shape[1:3], dw.shape[1:3], **opts)
    pixels = [tap[..., None] for tap in win.taps]
    dy5 = dy.reshape(*dy.shape[:3], x.shape[3], -1)
    prod = scratch(dy5.shape, dy.dtype)
    # Summing over pixels in two stages, image rows first, keeps numpy's inner
    # loops long: one sum over [N*OH*OW, C*M] runs C-long pieces (4x slower at C=16).
    prod_rows = prod.reshape(-1, dy.shape[2] * dw.shape[3])
    row_sum = scratch(prod_rows.shape[1:], dw.dtype)
    row_sum2 = row_sum.reshape(dy.shape[2], dw.shape[3])
    dw2 = dw.reshape(len(pixels), dw.shape[3])

    def step():
        win.load()
        for k in range(len(pixels)):
            np.multiply(pixels[k], dy5, out=prod)
            np.sum(prod_rows, axis=0, out=row_sum)
            np.sum(row_sum2, axis=0, out=dw2[k])
    return step


def _depthwise_weight_grad_in_place(dy, x, dw, opts):
    """DepthwiseConv2DWeightGrad for a compact workspace: each tap's products, a
    tile of dy's rows at a time, read from x in place (zeros where the window
    meets the padding).  The padded kernel sums the products of all rows of
    pixels one after another; a tile's sum starts from the rows before it (held
    in the row above the tile's products), so the order is the same."""
    dy5 = dy.reshape(*dy.shape[:3], x.shape[3], -1)
    tiles, size = _tiled_regions(x, dy5, dw.shape[1:3], opts)
    width = dy[0, 0].size  # elements of one row of pixels
    rows = scratch((1 + size // width, width), dw.dtype)  # [the sum so far; the tile's products]
    total = scratch((width,), dw.dtype)
    dw2, total2 = dw.reshape(-1, dw.shape[3]), total.reshape(dy.shape[2], dw.shape[3])
    x5 = x[..., None]

    def tile_parts(k, first, at, regions):
        prod = _like(rows[1:].reshape(-1), dy5[at])
        summed = rows[int(first):1 + dy5[at].size // width]
        region = regions[k]
        whole = (slice(0, prod.shape[0]), slice(0, prod.shape[1]), slice(0, prod.shape[2]))
        products = () if region is None else (x5[region[1]], dy5[at][region[0]], prod[region[0]])
        return prod, region is None or region[0] != whole, products, summed
    per_tap = [[tile_parts(k, i == 0, *tile) for i, tile in enumerate(tiles)] for k in range(len(dw2))]

    def step():
        for k, parts in enumerate(per_tap):
            for prod, padding, products, summed in parts:
                if padding:
                    prod.fill(0)
                if products:
                    np.multiply(*products[:2], out=products[2])
                np.sum(summed, axis=0, out=total)
                np.copyto(rows[0], total)
            np.sum(total2, axis=0, out=dw2[k])
    return step


def _fold(ufunc, parts, out):
    """out = ufunc.reduce over a list of equally shaped arrays, elementwise."""
    np.copyto(out, parts[0])
    for part in parts[1:]:
        ufunc(out, part, out=out)


def _pool_windows(image, out, filter_height=1, filter_width=1, **opts):
    """Pooling windows of `image` for the output shape of `out`."""
    return _Windows(image, out.shape[1:3], (filter_height, filter_width), **opts)


def _inverse_counts(image, out, **opts):
    """1 / (number of non-padded pixels) of each pooling window, as a
    contiguous [OH, OW, C] array so that multiplying by it runs over whole rows."""
    ones = np.ones((1, *image.shape[1:3], 1), image.dtype)
    win = _pool_windows(ones, out, **opts)
    win.load()
    counts = np.empty((1, *out.shape[1:3], 1), image.dtype)
    _fold(np.add, win.taps, counts)
    return np.ascontiguousarray(np.broadcast_to(1 / counts[0], out.shape[1:]))


@kernel("MAX_POOL_2D", rows="each")
def max_pool_2d(inputs, outputs, fused_activation_function=0, **opts):
    """y[n,i,j,c] = act(max over the window's non-padded pixels of x)."""
    (x,) = inputs
    (y,) = outputs
    win = _pool_windows(x, y, fill=-np.inf, **opts)

    def step():
        win.load()
        _fold(np.maximum, win.taps, y)
    return then_activate(step, fused_activation_function, y)


@kernel("AVERAGE_POOL_2D", rows="each")
def average_pool_2d(inputs, outputs, fused_activation_function=0, **opts):
    """y[n,i,j,c] = act(mean over the window's non-padded pixels of x)."""
    (x,) = inputs
    (y,) = outputs
    win = _pool_windows(x, y, **opts)
    inverse = _inverse_counts(x, y, **opts)

    def step():
        win.load()
        _fold(np.add, win.taps, y)
        np.multiply(y, inverse, out=y)
    return then_activate(step, fused_activation_function, y)


@kernel("MaxPool2DGrad", rows="each")
def max_pool_2d_grad(inputs, outputs, **opts):
    """dx gets each dy at the first maximal pixel of its window (row-major
    tap order), summed over overlapping windows."""
    dy, x = inputs
    (dx,) = outputs
    xwin = _pool_windows(x, dy, fill=-np.inf, **opts)
    peak, grad = scratch(dy.shape, dy.dtype), scratch(dy.shape, dy.dtype)
    hit, taken = scratch(dy.shape, bool), scratch(dy.shape, bool)

    def tap_grad(k):
        np.equal(xwin.taps[k], peak, out=hit)
        np.greater(hit, taken, out=hit)  # hit and not taken: only the first maximum
        np.logical_or(taken, hit, out=taken)
        return np.multiply(dy, hit, out=grad)
    scatter = _pool_windows(dx, dy, **opts).scatter(tap_grad)

    def step():
        xwin.load()
        _fold(np.maximum, xwin.taps, peak)
        taken.fill(False)
        scatter()
    return step


@kernel("AveragePool2DGrad", rows="each")
def average_pool_2d_grad(inputs, outputs, **opts):
    """dx spreads dy / count evenly over each window's non-padded pixels."""
    (dy,) = inputs
    (dx,) = outputs
    inverse = _inverse_counts(dx, dy, **opts)
    share = scratch(dy.shape, dy.dtype)
    scatter = _pool_windows(dx, dy, **opts).scatter(lambda k: share)

    def step():
        np.multiply(dy, inverse, out=share)
        scatter()
    return step


# -- transposed convolution ---------------------------------------------------------------------
# TRANSPOSE_CONV (inputs: output shape, W [O, KH, KW, I], x, bias) and MediaPipe's
# Convolution2DTransposeBias (x, W, bias) compute the input gradient of a convolution
# from the output image y to x whose filter is W's transpose: each
# x[n,i,j,:] @ W[:, p, q, :].T is added at y[n, i*sh + p - pad_top, j*sw + q - pad_left].
# TFLite takes the padding of that convolution (SAME or VALID on y's size).


def _transposed_windows(image, small, w, padding=SAME, stride_h=1, stride_w=1, **_):
    """Windows of the large image (y, or its gradient) seen from `small` (x)."""
    (_, h, wd, _), (_, sh, sw, _), (kh, kw) = image.shape, small.shape, w.shape[1:3]
    tops = [_pads(n, -(-n // s) if padding == SAME else -(-(n - k + 1) // s), k, s, 1, padding)[0]
            for n, k, s in ((h, kh, stride_h), (wd, kw, stride_w))]
    bottom, right = ((m - 1) * s + k - n - top for m, k, s, n, top in
                     ((sh, kh, stride_h, h, tops[0]), (sw, kw, stride_w, wd, tops[1])))
    return _Windows(image, (sh, sw), (kh, kw), stride_h=stride_h, stride_w=stride_w,
                    pads=(tops[0], max(bottom, 0), tops[1], max(right, 0)))


def _transpose_conv(x, w, b, y, fused_activation_function=0, **opts):
    win = _transposed_windows(y, x, w, **opts)
    scatter = _col2im(win, x.reshape(-1, x.shape[3]), x.shape[:3],
                      [tap.T for tap in _per_tap(w, axis=1)])
    add_bias = _bias_adder(y, b)

    def step():
        scatter()
        add_bias()
    return then_activate(step, fused_activation_function, y)


@kernel("TRANSPOSE_CONV")
def transpose_conv(inputs, outputs, **opts):
    """y = act(transposed convolution of x (input 2) by W (input 1) + bias (input 3))."""
    _, w, x, b = (*inputs, None)[:4]
    return _transpose_conv(x, w, b, outputs[0], **opts)


@kernel("Convolution2DTransposeBias")
def convolution_2d_transpose_bias(inputs, outputs, **opts):
    """MediaPipe's TRANSPOSE_CONV with a bias: inputs x, W, bias."""
    x, w, b = inputs
    return _transpose_conv(x, w, b, outputs[0], **opts)


@kernel("TransposeConvInputGrad")
def transpose_conv_input_grad(inputs, outputs, **opts):
    """dX = the convolution of dY with W's transpose: dX2 = cols(dY) @ Wt,
    Wt[(p, q, o), i] = W[o, p, q, i] (copied from W on each call)."""
    dy, w = inputs
    (dx,) = outputs
    cols, gather = _transposed_windows(dy, dx, w, **opts).columns()
    wt = scratch((w.shape[1] * w.shape[2] * w.shape[0], w.shape[3]), w.dtype)
    wt4 = wt.reshape(w.shape[1], w.shape[2], w.shape[0], w.shape[3])
    dx2 = dx.reshape(-1, dx.shape[3])

    def step():
        np.copyto(wt4, w.transpose(1, 2, 0, 3))
        gather()
        np.matmul(cols, wt, out=dx2)
    return step


@kernel("TransposeConvWeightGrad")
def transpose_conv_weight_grad(inputs, outputs, **opts):
    """dW[o, p, q, i] = Σ_{n,i',j'} x[n,i',j',i] · dY at the pixel tap (p, q) of
    x[n,i',j'] reached: cols(dY).T @ X2, reordered from (p, q, o) to (o, p, q)."""
    dy, x = inputs
    (dw,) = outputs
    cols, gather = _transposed_windows(dy, x, dw, **opts).columns()
    x2 = x.reshape(-1, x.shape[3])
    taps = scratch((cols.shape[1], dw.shape[3]), dw.dtype)
    taps4 = taps.reshape(dw.shape[1], dw.shape[2], dw.shape[0], dw.shape[3])

    def step():
        gather()
        np.matmul(cols.T, x2, out=taps)
        np.copyto(dw, taps4.transpose(2, 0, 1, 3))
    return step
