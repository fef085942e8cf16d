"""Checkpoint files: round trip, exact resume, numpy-only reading, damage detection."""
import json
import zipfile

import numpy as np
import pytest

from microtrain.commands.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from microtrain.files.contracts import LossScaleState, RunState, ShufflerState
from microtrain.data import batch_indices
from microtrain.files.errors import UserError
from microtrain.step.optimizers import make_optimizer
from microtrain.shuffle import Shuffler
from microtrain.trainer import TrainerState

SHA = "5e" * 32
N = 12


def _checkpoint(opt, params, rng, epoch) -> Checkpoint:
    state = TrainerState(params.copy(), "nadam", opt.config(), opt.state(), opt.iterations, epoch,
                         LossScaleState("dynamic", 32768.0, 0, good_steps=7),
                         ShufflerState(**rng.state()))
    return Checkpoint(state, SHA, RunState(baseline={"loss": 0.5}), step=opt.iterations)


def _train_epoch(opt, params, rng, grads):
    """A stand-in for an epoch: shuffled batches pick the gradient of each step."""
    for idx in batch_indices(len(grads), 3, True, rng):
        opt.apply(params, grads[idx].mean(axis=0), 0.01)


@pytest.fixture
def saved(tmp_path):
    opt = make_optimizer("nadam", N)
    params = np.linspace(-1, 1, N, dtype=np.float32)
    rng = Shuffler(5)
    _train_epoch(opt, params, rng, np.random.default_rng(0).standard_normal((10, N)).astype(np.float32))
    path = tmp_path / "run.ckpt"
    ckpt = _checkpoint(opt, params, rng, epoch=1)
    save_checkpoint(path, ckpt)
    return path, ckpt


def test_round_trip(saved):
    path, ckpt = saved
    back = load_checkpoint(path, SHA)
    np.testing.assert_array_equal(back.state.params, ckpt.state.params)
    assert back.state.params.dtype == np.float32
    assert back.state.optimizer_state.keys() == ckpt.state.optimizer_state.keys()
    for name, array in ckpt.state.optimizer_state.items():
        np.testing.assert_array_equal(back.state.optimizer_state[name], array)
    for field in ("optimizer", "optimizer_config", "iterations", "epoch", "data_order",
                  "loss_scale"):
        assert getattr(back.state, field) == getattr(ckpt.state, field), field
    for field in ("step", "model_sha256", "run"):
        assert getattr(back, field) == getattr(ckpt, field), field


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    grads = np.random.default_rng(1).standard_normal((10, N)).astype(np.float32)
    start = np.linspace(-1, 1, N, dtype=np.float32)

    straight, opt, rng = start.copy(), make_optimizer("nadam", N), Shuffler(9)
    for _ in range(3):
        _train_epoch(opt, straight, rng, grads)

    first, opt, rng = start.copy(), make_optimizer("nadam", N), Shuffler(9)
    _train_epoch(opt, first, rng, grads)
    save_checkpoint(tmp_path / "c", _checkpoint(opt, first, rng, epoch=1))
    ckpt = load_checkpoint(tmp_path / "c", SHA)
    state = ckpt.state
    resumed, opt = state.params, make_optimizer("nadam", N, **state.optimizer_config)
    rng = Shuffler(**state.data_order.to_dict())
    opt.load_state(state.optimizer_state)
    opt.iterations = state.iterations
    for _ in range(2):
        _train_epoch(opt, resumed, rng, grads)
    np.testing.assert_array_equal(resumed, straight)


def test_readable_with_numpy_alone(saved):
    path, ckpt = saved
    with np.load(path) as archive:
        meta = json.loads(archive["meta.json"])
        np.testing.assert_array_equal(archive["params"], ckpt.state.params)
        np.testing.assert_array_equal(archive["optimizer/velocity"], ckpt.state.optimizer_state["velocity"])
        assert set(archive.keys()) == {"meta.json", "params", "optimizer/momentum",
                                       "optimizer/velocity", "optimizer/u_product"}
    assert meta["format"] == "microtrain-checkpoint" and meta["version"] == 1
    assert meta["optimizer"]["state"] == ["momentum", "u_product", "velocity"]


def _rewrite(path, meta_change=None, drop=None):
    """Copy the archive with its meta.json changed or a member left out."""
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    meta = json.loads(members["meta.json"])
    if meta_change:
        meta_change(meta)
    # "DEEP" stands for an array nested 5000 levels deep, which json.dumps cannot write
    members["meta.json"] = json.dumps(meta).replace('"DEEP"', "[" * 5000 + "]" * 5000).encode()
    members.pop(drop, None)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def _load_error(path, sha=SHA):
    with pytest.raises(UserError) as info:
        load_checkpoint(path, sha)
    return str(info.value)


def test_other_model_and_other_version(saved):
    path, _ = saved
    assert _load_error(path, "ff" * 32) == (
        f"{path}: checkpoint of another model (sha256 5e5e5e5e5e5e..., this model is ffffffffffff...)")
    _rewrite(path, lambda m: m.update(version=2))
    assert _load_error(path) == (f"{path}: meta.json: version: version 2; "
                                 "this microtrain reads version 1")


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(b"not a zip at all"), "damaged checkpoint (BadZipFile"),
    (lambda p: p.write_bytes(p.read_bytes()[:-40]), "damaged checkpoint"),
    (lambda p: np.savez(p.with_suffix(".npz"), params=np.ones(3)) or p.with_suffix(".npz").rename(p),
     "not a microtrain checkpoint (no meta.json)"),
    (lambda p: _rewrite(p, lambda m: m.update(format="something else")), "not a microtrain checkpoint"),
    (lambda p: _rewrite(p, drop="optimizer/velocity.npy"), "damaged checkpoint (KeyError"),
    (lambda p: _rewrite(p, lambda m: m.update(epoch=-1)), "meta.json: epoch: -1 is outside 0.."),
    (lambda p: _rewrite(p, lambda m: m.update(epoch=1e6)), "meta.json: epoch: expected int, found 1000000.0"),
    (lambda p: _rewrite(p, lambda m: m["optimizer"].update(iterations=True)),
     "meta.json: optimizer.iterations: expected int, found true"),
    (lambda p: _rewrite(p, lambda m: m["rng_state"].update(bit_generator="os.system")),
     "meta.json: rng_state.bit_generator: unknown field"),
    (lambda p: _rewrite(p, lambda m: m["rng_state"].update(draws="garbage")),
     'meta.json: rng_state.draws: expected int, found "garbage"'),
    (lambda p: _rewrite(p, lambda m: m.update(extra=[[[]]] * 2)), "meta.json: extra: expected an object"),
    (lambda p: _rewrite(p, lambda m: m.update(extra="DEEP")),
     "meta.json: not valid JSON (nested 5001 levels deep)"),
    (lambda p: _rewrite(p, lambda m: m.pop("loss_scale")), "meta.json: loss_scale: missing"),
])
def test_damaged_files_are_user_errors(saved, damage, message):
    path, _ = saved
    damage(path)
    assert message in _load_error(path)


def test_flipped_byte_in_the_parameters_is_caught(saved):
    path, _ = saved
    data = bytearray(path.read_bytes())
    npy = data.index(b"\x93NUMPY", data.index(b"params.npy"))
    at = npy + 10 + int.from_bytes(data[npy + 8:npy + 10], "little") + 4   # past the .npy header
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    assert "damaged checkpoint (BadZipFile: Bad CRC-32" in _load_error(path)


def test_missing_file(tmp_path):
    assert _load_error(tmp_path / "none.ckpt") == f"{tmp_path / 'none.ckpt'}: no such checkpoint"


def test_non_finite_parameters_are_never_written(saved):
    path, ckpt = saved
    before = path.read_bytes()
    ckpt.state.params[3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        save_checkpoint(path, ckpt)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no temporary left behind


def test_a_trainer_restored_from_its_state_continues_exactly(tmp_path):
    from pathlib import Path
    from microtrain.step.loss_scale import make_loss_scale
    from microtrain.trainer import Trainer
    from trainconf.split import split
    fixtures = Path(__file__).parent / "fixtures"
    frozen = split(fixtures / "mlp.tflite", tmp_path).frozen
    x, y = np.load(fixtures / "digits_x.npy")[:96], np.load(fixtures / "digits_onehot.npy")[:96]

    def trainer():
        return Trainer(frozen, optimizer="adam", batch_size=16, learning_rate=0.01,
                       loss_scale=make_loss_scale("dynamic"))
    straight = trainer()
    straight.fit([x], [y], epochs=1, seed=3)
    state = straight.state()
    straight.fit([x], [y], epochs=3)  # the data order goes on from the first epoch's
    resumed = trainer()
    resumed.restore(state)
    assert resumed.epoch == 1 and resumed.state().iterations == state.iterations == 6
    resumed.fit([x], [y], epochs=3)
    np.testing.assert_array_equal(resumed.state().params, straight.state().params)
    moved = trainer()
    moved.fit([x], [y], epochs=1, seed=4)  # another data order: other weights
    assert not np.array_equal(moved.state().params, state.params)
    with pytest.raises(UserError, match="holds adam state .* this run uses sgd"):
        Trainer(frozen, optimizer="sgd", batch_size=16).restore(state)
