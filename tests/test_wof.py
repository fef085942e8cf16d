"""The .wof format: layout, round trip, and every validation failure."""
import struct

import numpy as np
import pytest

from microtrain.files.errors import UserError
from microtrain.files.format.model import buffer_array, load_model
from microtrain.files.format.wof import read_wof, wof_from_bytes, wof_to_bytes, write_wof
from model_patch import FIXTURES


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURES / "mlp.tflite")


@pytest.fixture(scope="module")
def weights(model):
    """The mlp's constant tensors: index -> array."""
    arrays = {t: buffer_array(model, tensor) for t, tensor in enumerate(model.subgraphs[0].tensors)}
    return {t: a for t, a in arrays.items() if a is not None}


def _offsets(data: bytes) -> list[int]:
    n = struct.unpack_from("<I", data, 4)[0]
    return list(struct.unpack_from(f"<{n}I", data, 8))


def test_layout(model, weights):
    n = len(model.subgraphs[0].tensors)
    data = wof_to_bytes(n, weights)
    assert struct.unpack_from("<HBBI", data) == (429, 1, 0, n)
    offsets = _offsets(data)
    assert [t for t, o in enumerate(offsets) if o] == sorted(weights)
    first = min(o for o in offsets if o)
    assert first == -(-(8 + 4 * n) // 16) * 16
    for t, a in weights.items():
        assert offsets[t] % 16 == 0
        assert data[offsets[t]:offsets[t] + a.nbytes] == a.astype("<f4").tobytes()
    last = max(weights, key=lambda t: offsets[t])
    assert len(data) == offsets[last] + weights[last].nbytes


def test_round_trip(tmp_path, model, weights):
    n = len(model.subgraphs[0].tensors)
    some = {t: a * 2 for t, a in list(weights.items())[:3]}
    write_wof(tmp_path / "w.wof", n, some)
    back = read_wof(tmp_path / "w.wof", model)
    assert back.keys() == some.keys()
    for t, a in some.items():
        assert back[t].dtype == np.float32 and back[t].shape == a.shape
        assert np.array_equal(back[t], a)
    with pytest.raises(ValueError, match="read-only"):  # read in place: the file is never written
        back[next(iter(back))][...] = 0
    assert [p.name for p in tmp_path.iterdir()] == ["w.wof"]


def test_empty_wof(model):
    n = len(model.subgraphs[0].tensors)
    data = wof_to_bytes(n, {})
    assert len(data) == 8 + 4 * n and wof_from_bytes(bytearray(data), model) == {}


def _encoded(model, weights) -> bytearray:
    return bytearray(wof_to_bytes(len(model.subgraphs[0].tensors), weights))


def _broken(model, weights, edit) -> bytearray:
    data = _encoded(model, weights)
    edit(data)
    return data


def _set_offset(t: int, value: int):
    return lambda data: struct.pack_into("<I", data, 8 + 4 * t, value)


CASES = {
    "magic": (lambda d: struct.pack_into("<H", d, 0, 430),
              "w.wof: not a .wof file: magic number 430, expected 429"),
    "version": (lambda d: struct.pack_into("<B", d, 2, 2),
                "w.wof: .wof version 2 is not supported (expected 1)"),
    "reserved": (lambda d: struct.pack_into("<B", d, 3, 7),
                 "w.wof: reserved byte 3 is 7, expected 0"),
    "count": (lambda d: struct.pack_into("<I", d, 4, 5),
              "w.wof: holds 5 buffers, but the model's subgraph has {n} tensors"),
    "short header": (lambda d: d.__delitem__(slice(6, None)),
                     "w.wof: truncated: 6 bytes, a .wof header needs 8"),
    "short table": (lambda d: d.__delitem__(slice(20, None)),
                    "w.wof: truncated: the offset table ends at byte {end}, the file has 20 bytes"),
}


@pytest.mark.parametrize("case", CASES)
def test_header_failures(case, model, weights):
    edit, message = CASES[case]
    with pytest.raises(UserError) as e:
        wof_from_bytes(_broken(model, weights, edit), model, "w.wof")
    n = len(model.subgraphs[0].tensors)
    assert str(e.value) == message.format(n=n, end=8 + 4 * n)


def test_offset_failures(model, weights):
    t = min(weights)
    name, shape, size = model.subgraphs[0].tensors[t].name, list(weights[t].shape), weights[t].nbytes
    end = 8 + 4 * len(model.subgraphs[0].tensors)

    def fails(edit, message):
        with pytest.raises(UserError) as e:
            wof_from_bytes(_broken(model, weights, edit), model, "w.wof")
        assert str(e.value) == f"w.wof: tensor {t} '{name}': {message}"

    fails(_set_offset(t, 52), "offset 52 is not a multiple of 16")
    fails(_set_offset(t, 32), f"offset 32 points into the header, which ends at byte {end}")
    fails(_set_offset(t, 1 << 20), f"shape {shape} of float32 needs {size} bytes at offset "
                                   f"{1 << 20}, but the file ends at byte "
                                   f"{len(_encoded(model, weights))}")


def test_truncated_data(model, weights):
    data = _encoded(model, weights)
    last = max(weights, key=lambda t: _offsets(data)[t])
    with pytest.raises(UserError, match=rf"tensor {last} .*but the file ends at byte "
                                        rf"{len(data) - 4}$"):
        wof_from_bytes(data[:-4], model, "w.wof")


def test_overlap(model, weights):
    a, b = sorted(weights)[:2]
    data = _encoded(model, weights)
    offsets = _offsets(data)
    struct.pack_into("<I", data, 8 + 4 * b, offsets[a])  # b now starts where a does
    with pytest.raises(UserError, match=rf"tensor {max(a, b)} '.*' \(bytes \d+-\d+\) overlaps "
                                        rf"tensor {min(a, b)} '"):
        wof_from_bytes(data, model, "w.wof")
