"""MediaPipe's landmark operators (version 2): TransformTensorBilinear against
hand-derived crops and PyTorch's grid_sample, TransformLandmarks against known
matrices, Landmarks2TransformMatrix recovering the transform of a box it was
given; attributes and versions they do not know are refused."""
import numpy as np
import pytest
import torch

from kernel_check import run
from microtrain.files.errors import OperatorError, UserError
from microtrain.files.graph import Graph, Op, Tensor
from microtrain.step.kernels import version_problem
from trainconf.support import check_forward

rng = np.random.default_rng(5)


def matrix(linear, shift) -> np.ndarray:
    """The 4×4 matrix with `linear` (2×2) and `shift` acting on x, y."""
    m = np.eye(4)
    m[:2, :2], m[:2, 3] = linear, shift
    return m


def rotation(theta) -> np.ndarray:
    return np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])


def sample(x, m, oh, ow):
    return run("TransformTensorBilinear", [x, m], [(len(x), oh, ow, x.shape[3])],
               output_height=oh, output_width=ow)[0]


# -- TransformTensorBilinear -----------------------------------------------------------------------

def test_sampling_by_hand_derived_matrices():
    x = rng.normal(size=(2, 6, 6, 3))
    identity = np.stack([np.eye(4)] * 2)
    np.testing.assert_allclose(sample(x, identity, 6, 6), x, atol=1e-12)
    # pure translation by (+2, -1) pixels: y[i, j] = x[i - 1, j + 2], zero where that is outside
    moved = sample(x, np.stack([matrix(np.eye(2), [2, -1])] * 2), 6, 6)
    want = np.zeros_like(x)
    want[:, 1:, :4] = x[:, :5, 2:]
    np.testing.assert_allclose(moved, want, atol=1e-12)
    # scaling by 2 onto a 3×3 crop: each output pixel centre falls between four input
    # pixel centres, so the crop is the 2×2 average pooling of the map
    halved = sample(x, np.stack([matrix(2 * np.eye(2), [0, 0])] * 2), 3, 3)
    np.testing.assert_allclose(halved, x.reshape(2, 3, 2, 3, 2, 3).mean(axis=(2, 4)), atol=1e-12)
    # 90° about the centre: y[i, j] = x[j, 5 - i]
    turned = sample(x, np.stack([matrix([[0, -1], [1, 0]], [6, 0])] * 2), 6, 6)
    np.testing.assert_allclose(turned, x.transpose(0, 2, 1, 3)[:, ::-1], atol=1e-12)


def test_sampling_matches_grid_sample_inside_the_map():
    """A rotated, scaled, shifted crop per batch row, against PyTorch's bilinear
    sampler (align_corners=True: ±1 are the corner pixels' centres); MediaPipe's
    kernel returns zero for a whole sample outside the pixel centres' span."""
    n, h, w, c, oh, ow = 3, 9, 11, 4, 5, 7
    x = rng.normal(size=(n, h, w, c))
    ms = np.stack([matrix(s * rotation(t), shift) for s, t, shift in
                   ((1.3, 0.4, [3, 1]), (0.7, -2.0, [9, 6]), (1.9, 3.0, [12, 11]))])
    got = sample(x, ms, oh, ow)
    rows, cols = np.meshgrid(np.arange(oh) + 0.5, np.arange(ow) + 0.5, indexing="ij")
    at = np.stack([cols, rows, np.zeros_like(rows), np.ones_like(rows)], -1)  # (x, y, 0, 1)
    uv = np.einsum("bij,hwj->bhwi", ms[:, :2], at) - 0.5  # pixel-index coordinates
    grid = 2 * uv / np.array([w - 1, h - 1]) - 1
    want = torch.nn.functional.grid_sample(
        torch.tensor(x).permute(0, 3, 1, 2), torch.tensor(grid), mode="bilinear",
        padding_mode="zeros", align_corners=True).permute(0, 2, 3, 1).numpy()
    inside = ((uv >= 0) & (uv <= [w - 1, h - 1])).all(-1)
    assert 0.2 < inside.mean() < 0.95  # both cases occur
    np.testing.assert_allclose(got, want * inside[..., None], atol=1e-12)


def test_a_matrix_of_nan_samples_zeros():
    x = rng.normal(size=(1, 4, 4, 2))
    np.testing.assert_array_equal(sample(x, np.full((1, 4, 4), np.nan), 3, 3), 0)


def test_sampling_float32_and_one_matrix_for_the_batch():
    x = rng.normal(size=(2, 5, 5, 2)).astype(np.float32)
    m = matrix(rotation(0.3), [1, 0.5])[None].astype(np.float32)
    both = run("TransformTensorBilinear", [x, m], [(2, 4, 4, 2)], np.float32,
               output_height=4, output_width=4)[0]
    each = [sample(x[i:i + 1].astype(np.float64), m.astype(np.float64), 4, 4)[0] for i in (0, 1)]
    np.testing.assert_allclose(both, np.stack(each), atol=1e-5)


# -- TransformLandmarks ------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [2, 3])
def test_landmarks_move_by_the_matrix(dims):
    x = rng.normal(size=(2, 7, dims))
    ms = np.stack([matrix(1.5 * rotation(0.8), [4, -2]), matrix([[2, 0], [0, 0.5]], [1, 3])])
    ms[:, 0, 2] = 9  # the z column multiplies a zero z: it has no effect
    (y,) = run("TransformLandmarks", [x, ms], [x.shape])
    for b in range(2):
        want = x[b, :, :2] @ ms[b, :2, :2].T + ms[b, :2, 3]
        np.testing.assert_allclose(y[b, :, :2], want, atol=1e-12)
    if dims == 3:
        np.testing.assert_array_equal(y[..., 2], x[..., 2])


# -- Landmarks2TransformMatrix -----------------------------------------------------------------------

CROP = dict(output_width=16, output_height=12, scale_x=1.5, scale_y=1.5,
            target_rotation_radians=0.0)


@pytest.mark.parametrize("theta, scale, shift", [(0.0, 1.0, (0, 0)), (0.5, 2.0, (30, 40)),
                                                 (2.6, 0.25, (-5, 7)), (-1.2, 3.0, (100, 2))])
def test_matrix_recovers_the_transform_of_a_box(theta, scale, shift):
    """Landmarks = A·q + t of points q spanning the crop (less its 1.5× margin),
    the rotation landmarks on a horizontal line of q; the matrix must be [A | t]."""
    ow, oh = CROP["output_width"], CROP["output_height"]
    half = np.array([ow, oh]) / 2 / CROP["scale_x"]  # the box's half size in crop pixels
    box = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1], [0.2, -0.3], [-0.5, 0.9]]) * half
    q = np.concatenate([box, [[-3, 0.5], [3, 0.5]], [[40, 40]]]) + [ow / 2, oh / 2]
    a = scale * rotation(theta)
    landmarks = np.concatenate([q @ a.T + shift, rng.normal(size=(len(q), 1))], 1)[None]
    options = dict(CROP, subset_idxs=list(range(8)), left_rotation_idx=6, right_rotation_idx=7)
    (m,) = run("Landmarks2TransformMatrix", [landmarks], [(1, 4, 4)], **options)
    np.testing.assert_allclose(m[0], matrix(a, shift), atol=1e-9)
    # and TransformLandmarks with that matrix takes q back to the landmarks
    (back,) = run("TransformLandmarks", [q[None], m], [(1, len(q), 2)])
    np.testing.assert_allclose(back[0], landmarks[0, :, :2], atol=1e-9)


def test_matrix_turns_to_the_target_rotation():
    """With target_rotation_radians t, the crop's x axis runs at angle -t from the
    left→right line: for a horizontal line, the matrix rotates by -t."""
    landmarks = np.array([[[0, 0, 0], [4, 0, 0], [4, 2, 0], [0, 2, 0]]], np.float64)
    options = dict(CROP, target_rotation_radians=0.7, subset_idxs=[0, 1, 2, 3],
                   left_rotation_idx=0, right_rotation_idx=1)
    (m,) = run("Landmarks2TransformMatrix", [landmarks], [(1, 4, 4)], **options)
    linear = m[0, :2, :2]
    np.testing.assert_allclose(linear / np.linalg.norm(linear, axis=0), rotation(-0.7), atol=1e-9)


# -- what is refused ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, inputs, options, problem", [
    ("Landmarks2TransformMatrix", [np.zeros((1, 5, 3))],
     dict(CROP, subset_idxs=[0, 1], left_rotation_idx=0, right_rotation_idx=1, input_hw=[4, 4]),
     "unsupported attribute 'input_hw'"),
    ("Landmarks2TransformMatrix", [np.zeros((1, 5, 3))],
     dict(CROP, subset_idxs=[0, 9], left_rotation_idx=0, right_rotation_idx=1),
     "landmark index 9 is outside the 5 landmarks"),
    ("Landmarks2TransformMatrix", [np.zeros((1, 5, 3))], dict(CROP, subset_idxs=[0, 1]),
     "attribute 'left_rotation_idx' is missing"),
    ("TransformLandmarks", [np.zeros((1, 5, 2)), np.zeros((1, 4, 4))],
     dict(dimensions=2, scale=1.0), "unsupported attribute 'dimensions'"),
    ("TransformTensorBilinear", [np.zeros((1, 5, 5, 2)), np.zeros((1, 4, 4))],
     dict(output_height=4, output_width=4, align_corners=True),
     "unsupported attribute 'align_corners'"),
    ("TransformTensorBilinear", [np.zeros((1, 5, 5, 2)), np.zeros((1, 4, 4))],
     dict(output_height="4", output_width=4), "attribute 'output_height' is '4', not int"),
])
def test_unknown_attributes_are_refused(name, inputs, options, problem):
    shapes = {"Landmarks2TransformMatrix": (1, 4, 4), "TransformLandmarks": (1, 5, 2),
              "TransformTensorBilinear": (1, 4, 4, 2)}
    with pytest.raises(OperatorError, match=problem):
        run(name, inputs, [shapes[name]], **options)


def test_other_versions_are_refused():
    assert version_problem("TransformLandmarks", 2) is None
    assert version_problem("TransformLandmarks", 1) == \
        "is version 1; microtrain runs version 2 of it"
    assert version_problem("CONV_2D", 3) is None  # builtin kernels run every version
    tensors = [Tensor(0, "x", (-1, 5, 2), np.dtype(np.float32)),
               Tensor(1, "m", (-1, 4, 4), np.dtype(np.float32)),
               Tensor(2, "y", (-1, 5, 2), np.dtype(np.float32))]
    g = Graph(tensors, [Op(0, "TransformLandmarks", [0, 1], [2], {}, version=1)], [0, 1], [2])
    with pytest.raises(UserError, match=r"operator 0 \(TransformLandmarks\) is version 1; "
                                        "microtrain runs version 2 of it"):
        check_forward(g)
