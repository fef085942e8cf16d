"""Models that refine landmarks in crops, as MediaPipe's face mesh with attention
does (Landmarks2TransformMatrix → TransformTensorBilinear → layers →
TransformLandmarks): a small model of that shape, built here, splits with
last:1/last:2 and trains, and `all` is refused in one line; the real model (from
the real-model cache, when it is there) puts its refined lips and eyes where its
mesh has them, and trains with last:1/last:2."""
import hashlib
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.files.format.model import load_model
from microtrain.trainer import Trainer
from test_split_gradients import GraphMaker
from trainconf.inspect import describe
from trainconf.split import split

ROOT = Path(__file__).resolve().parent.parent
FACE = ROOT / "tests" / "fixtures" / "real" / "astronaut_face_192.png"
# MediaPipe's own outputs on FACE, mirrored and turned 90° (scripts/record_face_mesh_reference.py)
REFERENCE = ROOT / "tests" / "fixtures" / "real" / "face_mesh_attention_reference.npz"
RNG = np.random.default_rng(3)


def _two_epochs_lower_the_loss(frozen, xs, ts) -> tuple[float, float]:
    """Two SGD steps on one batch, each lowering the loss by about 0.1% to first
    order: (loss before, loss after)."""
    probe = Trainer(frozen, batch_size=len(xs[0]))
    before, grads = probe.gradients(xs, ts)
    norm2 = sum(float(np.vdot(g, g)) for g in grads.values())
    trainer = Trainer(frozen, batch_size=len(xs[0]), optimizer="sgd",
                      learning_rate=1e-3 * before / norm2)
    history = trainer.fit(xs, ts, epochs=2, shuffle=False)
    after = trainer.evaluate(xs, ts)["loss"]
    assert np.isfinite([r["loss"] for r in history] + [after]).all()
    return before, after


def _custom(m: GraphMaker, name, inputs, shape, **attributes) -> int:
    out = m.op(name, inputs, shape, **attributes)
    m.ops[-1].version = 2  # the version microtrain runs
    return out


def refinement_model(m: GraphMaker):
    """conv → features; fc → 6 landmarks → matrix of a 4×4 crop around them; the crop
    of the features → fc → 4 refined points moved back by the matrix; fc → a flag."""
    x = m.tensor((-1, 8, 8, 2))
    features = m.op("CONV_2D", [x, m.weight(4, 3, 3, 2), m.weight(4)], (-1, 8, 8, 4), padding=0,
                    stride_w=1, stride_h=1, dilation_w_factor=1, dilation_h_factor=1)
    flat = m.op("RESHAPE", [features, m.tensor((2,), [-1, 256], np.int32)], (-1, 256))
    mesh = m.op("FULLY_CONNECTED", [flat, m.weight(18, 256), m.weight(18)], (-1, 18))
    points = m.op("RESHAPE", [mesh, m.tensor((3,), [-1, 6, 3], np.int32)], (-1, 6, 3))
    turn = _custom(m, "Landmarks2TransformMatrix", [points], (-1, 4, 4), subset_idxs=[0, 2, 3, 5],
                   left_rotation_idx=0, right_rotation_idx=1, target_rotation_radians=0.0,
                   output_height=4, output_width=4, scale_x=1.5, scale_y=1.5)
    crop = _custom(m, "TransformTensorBilinear", [features, turn], (-1, 4, 4, 4),
                   output_height=4, output_width=4)
    crop_flat = m.op("RESHAPE", [crop, m.tensor((2,), [-1, 64], np.int32)], (-1, 64))
    refined = m.op("FULLY_CONNECTED", [crop_flat, m.weight(8, 64), m.weight(8)], (-1, 8))
    pairs = m.op("RESHAPE", [refined, m.tensor((3,), [-1, 4, 2], np.int32)], (-1, 4, 2))
    moved = _custom(m, "TransformLandmarks", [pairs, turn], (-1, 4, 2))
    lips = m.op("RESHAPE", [moved, m.tensor((2,), [-1, 8], np.int32)], (-1, 8))
    flag = m.op("FULLY_CONNECTED", [flat, m.weight(1, 256), m.weight(1)], (-1, 1))
    return [x], [mesh, lips, flag]


def test_a_refinement_model_trains_above_the_crop(tmp_path):
    m = GraphMaker()
    inputs, outputs = refinement_model(m)
    path = m.save(tmp_path / "refine.circle", inputs, outputs)
    training = {op["type"]: op["training"]
                for op in describe(load_model(path))["subgraphs"][0]["operators"]}
    assert [training[t] for t in ("Landmarks2TransformMatrix", "TransformTensorBilinear",
                                  "TransformLandmarks")] == ["forward only", "forward only",
                                                             "gradient"]
    with pytest.raises(UserError, match=r": operator 9 \(TransformLandmarks\): its transform matrix "
                                        r"\(input 1\) is on the gradient path"):
        split(path, tmp_path / "all", loss="mse")
    xs = [RNG.uniform(0, 1, (4, 8, 8, 2)).astype(np.float32)]
    ts = [RNG.normal(0, 1, (4,) + m.tensors[t].shape[1:]).astype(np.float32) for t in outputs]
    for spec in ("last:1", "last:2"):
        files = split(path, tmp_path / spec.replace(":", ""), loss="mse", trainable=spec)
        before, after = _two_epochs_lower_the_loss(files.frozen, xs, ts)
        assert after < before, spec


# -- the real model ------------------------------------------------------------------------------

def _cache() -> Path:
    """The real-model cache: $TRAINCONF_REAL_MODELS, else scripts/fetch_real_models.py's default."""
    if "TRAINCONF_REAL_MODELS" in os.environ:
        return Path(os.environ["TRAINCONF_REAL_MODELS"])
    spec = importlib.util.spec_from_file_location("fetch", ROOT / "scripts" / "fetch_real_models.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    return fetch.default_cache()


MODEL = _cache() / "mediapipe" / "face_landmark_with_attention.tflite"
needs_model = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} is not there "
                                 "(scripts/fetch_real_models.py fetches it)")
# The outputs in order: mesh (468 × x, y, z), lips (80 × x, y), left eye (71), right eye
# (71), left iris (5), right iris (5), face flag.  The refined lips and eyes are the
# landmarks whose box each Landmarks2TransformMatrix crops (its subset_idxs), in order.
LIPS, LEFT_EYE, RIGHT_EYE = 1, 2, 3


@pytest.fixture(scope="module")
def face_mesh(tmp_path_factory):
    """(output directory, the frozen model of a last:2 split, the face, its mirror
    image and the face turned by 25°, where a crop turned the wrong way shows)."""
    import matplotlib.image
    from PIL import Image  # matplotlib's own dependency

    out = tmp_path_factory.mktemp("face_mesh")
    files = split(MODEL, out / "last2", trainable="last:2")
    face = matplotlib.image.imread(FACE)  # float32 in [0, 1], as MediaPipe feeds it
    turned = Image.fromarray((face * 255).round().astype(np.uint8)).rotate(25, Image.BILINEAR)
    return out, files.frozen, np.stack([face, face[:, ::-1], np.asarray(turned, np.float32) / 255])


@needs_model
def test_outputs_equal_mediapipes(face_mesh):
    """Every output, the refined lips, eyes and irises included, as MediaPipe's
    runtime computes them (its kernels of the landmark operators, XNNPACK for the
    rest): float32 sums in another order, 1e-5 of the output's scale."""
    import matplotlib.image

    reference = np.load(REFERENCE)
    assert str(reference["model_sha256"]) == hashlib.sha256(MODEL.read_bytes()).hexdigest(), \
        f"{MODEL} is not the model the reference was recorded with"
    face = matplotlib.image.imread(FACE)
    faces = np.stack([face, face[:, ::-1], np.rot90(face)])
    _, frozen, _ = face_mesh
    outputs = Trainer(frozen, batch_size=len(faces)).predict([faces])
    for i, mine in enumerate(outputs):
        theirs = reference[f"output_{i}"]
        assert np.abs(mine.reshape(theirs.shape) - theirs).max() <= 1e-5 * np.abs(theirs).max(), i


@needs_model
def test_refined_landmarks_lie_on_the_mesh(face_mesh):
    """A wrong crop or a wrong way back would put them tens of pixels off."""
    _, frozen, faces = face_mesh
    trainer = Trainer(frozen, batch_size=len(faces))
    outputs = trainer.predict([faces])
    crops = [op.options["subset_idxs"] for op in trainer.art.forward.ops
             if op.type == "Landmarks2TransformMatrix"]
    for sample in range(len(faces)):
        mesh = outputs[0][sample].reshape(468, 3)[:, :2]
        for output, subset in zip((LIPS, LEFT_EYE, RIGHT_EYE), crops):
            refined = outputs[output][sample].reshape(-1, 2)
            distance = np.linalg.norm(refined - mesh[subset], axis=1)
            # the refinement moves points by a few pixels of the 192-pixel image
            assert distance.mean() < 4 and distance.max() < 8, \
                (sample, output, distance.mean(), distance.max())


@needs_model
@pytest.mark.parametrize("spec", ["last:1", "last:2"])
def test_the_face_mesh_trains_above_its_crops(face_mesh, spec):
    """Targets: the model's own outputs with the face flag lowered by 2 and the right
    iris moved 2 px right (last:1 trains the flag's layer, last:2 the iris's too)."""
    out, frozen, faces = face_mesh
    if spec == "last:1":
        frozen = split(MODEL, out / "last1", trainable=spec).frozen
    targets = Trainer(frozen, batch_size=len(faces)).predict([faces])
    targets[-1] = targets[-1] - 2
    targets[-2] = targets[-2] + np.tile(np.float32([2, 0]), 5).reshape(targets[-2].shape[1:])
    before, after = _two_epochs_lower_the_loss(frozen, [faces], targets)
    assert after < before
