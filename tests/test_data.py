"""Data loading, validation split and batching."""
import os

import numpy as np
import pytest

from microtrain.data import batch_indices, load_array, validation_split
from microtrain.files.errors import UserError
from microtrain.shuffle import Shuffler


def test_npy_npz_and_bin_load(tmp_path):
    x = np.arange(24, dtype=np.float32).reshape(3, 8)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "one.npz", x)
    np.savez(tmp_path / "two.npz", inputs=x, labels=np.array([0, 1, 2]))
    x.astype("<f4").tofile(tmp_path / "x.bin")
    np.testing.assert_array_equal(load_array(str(tmp_path / "x.npy")), x)
    np.testing.assert_array_equal(load_array(str(tmp_path / "one.npz")), x)
    np.testing.assert_array_equal(load_array(f"{tmp_path}/two.npz:inputs"), x)
    np.testing.assert_array_equal(load_array(f"{tmp_path}/two.npz:labels"), [0, 1, 2])
    raw = load_array(str(tmp_path / "x.bin"), sample_shape=(2, 4, 1))
    assert raw.shape == (3, 2, 4, 1) and raw.dtype == np.float32
    np.testing.assert_array_equal(raw.reshape(3, 8), x)


def _error(spec, **kwargs):
    with pytest.raises(UserError) as info:
        load_array(spec, **kwargs)
    return str(info.value)


def test_missing_and_unknown_files(tmp_path):
    assert _error(str(tmp_path / "nope.npy")) == f"{tmp_path / 'nope.npy'}: no such data file"
    assert _error(str(tmp_path)).endswith("is a folder, not a data file")
    os.mkfifo(tmp_path / "fifo.npy")  # refused without opening it: reading would block
    assert _error(str(tmp_path / "fifo.npy")).endswith("is not a regular file (a FIFO, socket "
                                                       "or device); expected a data file")
    (tmp_path / "x.csv").write_text("1,2\n")
    assert "unknown data format" in _error(str(tmp_path / "x.csv"))


def test_npz_keys(tmp_path):
    np.savez(tmp_path / "two.npz", a=np.ones(2), b=np.ones(2))
    spec = str(tmp_path / "two.npz")
    assert _error(spec) == f"{spec}: holds 2 arrays; name one as two.npz:KEY (keys: a, b)"
    assert _error(spec + ":c") == f"{spec}: has no array 'c' (keys: a, b)"
    np.savez(tmp_path / "none.npz")
    assert _error(str(tmp_path / "none.npz")).endswith("holds no arrays")


def test_bin_size_and_shape(tmp_path):
    np.zeros(10, "<f4").tofile(tmp_path / "x.bin")
    spec = str(tmp_path / "x.bin")
    assert _error(spec, sample_shape=(2, 2)) == (
        f"{spec}: 40 bytes is not a whole number of float32 samples of shape (2, 2) "
        "(16 bytes each)")
    assert _error(spec).endswith("raw .bin data needs the shape of one sample")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert _error(str(tmp_path / "empty.bin"), sample_shape=(2,)).endswith("holds no samples (shape (0, 2))")


def test_bad_contents(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([1, "a", None], dtype=object))
    np.save(tmp_path / "str.npy", np.array(["a", "b"]))
    np.save(tmp_path / "scalar.npy", np.float32(3))
    (tmp_path / "junk.npy").write_bytes(b"definitely not numpy")
    np.save(tmp_path / "cut.npy", np.ones(100, np.float32))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:-8])
    assert _error(str(tmp_path / "obj.npy")).endswith("holds an object array; only numeric arrays are supported")
    assert _error(str(tmp_path / "str.npy")).endswith("holds <U1 data; expected numbers")
    assert _error(str(tmp_path / "scalar.npy")).endswith("holds a single value; expected an array of samples")
    assert _error(str(tmp_path / "junk.npy")).endswith("is not a .npy file")
    assert "is not a valid .npy file" in _error(str(tmp_path / "cut.npy"))
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 broken zip")
    assert str(tmp_path / "junk.npz") in _error(str(tmp_path / "junk.npz"))


def test_non_finite_values_are_counted_and_located(tmp_path):
    x = np.zeros((4, 3), np.float32)
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    x[3, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=x)
    spec = f"{tmp_path}/d.npz:x"
    assert _error(spec) == f"{spec}: holds 2 NaN and 1 inf values; the first at index [1, 2]"


def test_validation_split_takes_the_last_samples_as_keras():
    x, y = np.arange(10), np.arange(10) * 2
    (tx, ty), (vx, vy) = validation_split([x, y], 0.25)
    # Keras: split_at = floor(10 * (1 - 0.25)) = 7.
    np.testing.assert_array_equal(tx, np.arange(7))
    np.testing.assert_array_equal(vy, [14, 16, 18])
    assert len(validation_split([np.arange(100)], 0.3)[1][0]) == 30


@pytest.mark.parametrize("arrays, fraction, message", [
    ([np.arange(10)], 0.0, "validation split must be between 0 and 1, got 0.0"),
    ([np.arange(10)], 0.95, "a validation split of 0.95 of 10 samples leaves no training samples"),
    ([np.arange(10)], 1e-17, "leaves no validation samples"),   # 1 - 1e-17 rounds to 1
    ([np.arange(3), np.arange(4)], 0.5, "different numbers of samples: 3, 4"),
])
def test_validation_split_errors(arrays, fraction, message):
    with pytest.raises(UserError, match=message):
        validation_split(arrays, fraction)


def test_batches_keep_the_partial_last_batch():
    batches = list(batch_indices(10, 4, False, Shuffler(0)))
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_shuffled_batches_replay_from_seed_and_saved_state():
    rng = Shuffler(42)
    epoch1 = np.concatenate(list(batch_indices(10, 3, True, rng)))
    saved = rng.state()
    epoch2 = np.concatenate(list(batch_indices(10, 3, True, rng)))
    assert sorted(epoch1) == list(range(10)) and not np.array_equal(epoch1, epoch2)
    replay = Shuffler(42)
    np.testing.assert_array_equal(np.concatenate(list(batch_indices(10, 3, True, replay))), epoch1)
    restored = Shuffler(**saved)
    np.testing.assert_array_equal(np.concatenate(list(batch_indices(10, 3, True, restored))), epoch2)


def test_permutation_is_drawn_when_called_not_when_iterated():
    rng = Shuffler(1)
    batch_indices(10, 3, True, rng)
    assert rng.state()["draws"] == 1


def test_shuffled_orders_look_uniform():
    """Each sample lands in each position about equally often over many epochs,
    and different seeds give different orders."""
    rng, n, epochs = Shuffler(7), 8, 4000
    counts = np.zeros((n, n))
    for _ in range(epochs):
        counts[np.arange(n), rng.permutation(n)] += 1
    expected = epochs / n
    assert np.all(np.abs(counts - expected) < 6 * np.sqrt(expected))  # ~6 sigma
    assert not np.array_equal(Shuffler(1).permutation(100), Shuffler(2).permutation(100))


def test_runtime_keeps_heavy_modules_out():
    """numpy.random (~6 MB resident) and OpenSSL through hashlib (~4 MB) are not
    imported by the runtime: it shuffles and fingerprints without them."""
    import subprocess
    import sys
    code = ("import sys, microtrain.commands.cli, microtrain.commands.session, microtrain.trainer; "
            "print(sorted({'numpy.random', '_hashlib'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_floats_held_in_a_narrower_tensor_type(tmp_path):
    """Data for an fp16 tensor is held as float16 (read a chunk at a time, rounded
    as numpy's cast rounds); wider tensor types and non-floats keep the file's type."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 7, 5)).astype(np.float32) * np.float32(1e-3)
    x[0, 0, 0] = 2.0 ** -25 * 1.5  # an fp16 subnormal's rounding
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "xf.npy", np.asfortranarray(x))
    np.savez(tmp_path / "x.npz", x)
    np.save(tmp_path / "ids.npy", np.arange(6, dtype=np.int64))
    for name in ("x.npy", "xf.npy", "x.npz"):
        held = load_array(str(tmp_path / name), dtype=np.float16)
        assert held.dtype == np.float16
        np.testing.assert_array_equal(held.view(np.uint16), x.astype(np.float16).view(np.uint16))
    assert load_array(str(tmp_path / "x.npy"), dtype=np.float32).dtype == np.float32
    assert load_array(str(tmp_path / "ids.npy"), dtype=np.float16).dtype == np.int64
    x[2, 3, 4] = 70000.0  # finite in float32, inf in float16
    np.save(tmp_path / "big.npy", x)
    spec = str(tmp_path / "big.npy")
    assert _error(spec, dtype=np.float16) == (
        f"{spec}: holds 70000.0 (element {2 * 35 + 3 * 5 + 4}), beyond the range of the "
        "float16 tensor the model loads it into")
    x[2, 3, 4] = np.nan
    np.save(tmp_path / "nan.npy", x)
    assert _error(str(tmp_path / "nan.npy"), dtype=np.float16).endswith(
        "holds 1 NaN and 0 inf values; the first at index [2, 3, 4]")
