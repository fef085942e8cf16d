"""`trainconf split --lora`: adapters beside frozen weights.  The first loss is the
original model's bit for bit; A and B gradients match torch float64 on the
original graph with W + (alpha/r)·B·A; the .wof holds only the adapters; merged
and kept exports run in LiteRT and onert like `microtrain infer`."""
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from microtrain.commands.cli import main as microtrain
from microtrain.files.format.model import load_model
from microtrain.files.format.wof import write_wof
from microtrain.files.graph import graph_of
from microtrain.trainer import Trainer
from model_patch import FIXTURES
from test_export import run_litert, run_onert
from test_split_gradients import GraphMaker, relative_error
from torch_reference import keras_loss, run_op
from trainconf.cli import main as trainconf
from trainconf.export import export
from trainconf.lora import LoraSpec, adapters_of
from trainconf.split import load_prepared, resolve_precision, split

SEQUENCE = FIXTURES / "sequence"


def _matmuls(m: GraphMaker):
    """Dense layers as BATCH_MATMUL with a constant operand, plain and adj_y."""
    x = m.tensor((-1, 4, 8))
    h = m.op("BATCH_MATMUL", [x, m.weight(8, 6)], (-1, 4, 6))
    h = m.op("BATCH_MATMUL", [h, m.weight(5, 6)], (-1, 4, 5), adj_y=True)
    flat = m.op("RESHAPE", [h, m.tensor((2,), [-1, 20], np.int32)], (-1, 20))
    out = m.op("FULLY_CONNECTED", [flat, m.weight(3, 20), m.weight(3)], (-1, 3))
    return [x], [m.op("SOFTMAX", [out], (-1, 3), beta=1.0)]


def _matmul_model(tmp_path) -> Path:
    m = GraphMaker()
    inputs, outputs = _matmuls(m)
    return m.save(tmp_path / "matmuls.circle", inputs, outputs)


# model -> (inputs, one-hot targets, rank, alpha)
def _case(name, tmp_path):
    rng = np.random.default_rng(3)
    if name == "mlp":
        return FIXTURES / "mlp.tflite", np.load(FIXTURES / "digits_x.npy")[:16], \
            np.load(FIXTURES / "digits_onehot.npy")[:16]
    if name == "cnn":
        return FIXTURES / "cnn.tflite", np.load(FIXTURES / "digits_images.npy")[:8], \
            np.load(FIXTURES / "digits_onehot.npy")[:8]
    if name == "transformer":
        return SEQUENCE / "keras_transformer.tflite", np.load(SEQUENCE / "text_ids.npy")[:8], \
            np.load(SEQUENCE / "text_labels.npy")[:8]
    x = rng.standard_normal((6, 4, 8)).astype(np.float32)
    return _matmul_model(tmp_path), x, np.eye(3, dtype=np.float32)[rng.integers(0, 3, 6)]


CASES = ["mlp", "cnn", "transformer", "matmuls"]


def _split(model, out, rank=4, alpha=8.0, lora_targets="all", **kw):
    return split(model, out, lora=LoraSpec(rank, alpha, lora_targets), **kw)


@pytest.mark.parametrize("name", CASES)
def test_first_loss_and_outputs_equal_the_original_bit_for_bit(name, tmp_path):
    model, x, t = _case(name, tmp_path)
    full = Trainer(split(model, tmp_path / "full").frozen, batch_size=len(x))
    lora = Trainer(_split(model, tmp_path / "lora").frozen, batch_size=len(x))
    assert lora.gradients([x], [t])[0] == full.gradients([x], [t])[0]
    assert np.array_equal(lora.predict([x])[0], full.predict([x])[0])


def _weight_as_w(op_type: str, options: dict, a, b):
    """B·A laid out as the frozen weight, as LoRA defines it."""
    if op_type == "CONV_2D":
        return torch.einsum("or,rhwi->ohwi", b[:, 0, 0, :], a)
    if op_type in ("GATHER", "EMBEDDING_LOOKUP"):
        return a @ b.T
    if op_type == "BATCH_MATMUL" and not options.get("adj_y"):
        return (b @ a).T
    return b @ a


def _float64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float64) if a.dtype.kind == "f" else a


def _reference(model, meta, weights, x, t, loss="cce"):
    """Loss and A, B gradients in float64 on the original graph, W + (alpha/r)·B·A."""
    g = load_prepared(model, resolve_precision())[1]
    v = {tensor.index: torch.tensor(_float64(tensor.data)) for tensor in g.tensors
         if tensor.data is not None}
    params = {i: torch.tensor(np.asarray(w, np.float64), requires_grad=True)
              for i, w in weights.items()}
    readers = {t: op for op in g.ops for t in op.inputs}
    for ad in meta.adapters:
        op = readers[ad.weight]
        v[ad.weight] = v[ad.weight] + meta.alpha / meta.rank * _weight_as_w(
            ad.op, op.options, params[ad.a], params[ad.b])
    v[g.inputs[0]] = torch.tensor(_float64(x))
    for op in g.ops:
        y = run_op(op, v, g)
        for out, value in zip(op.outputs, y if isinstance(y, tuple) else (y,)):
            v[out] = value
    last = g.producers()[g.outputs[0]]
    logits = v[last.inputs[0]] if last.type == "SOFTMAX" else None
    total = keras_loss(v[g.outputs[0]], logits, torch.tensor(np.float64(t)), loss,
                       "SOFTMAX" if logits is not None else None).mean()
    total.backward()
    return total.item(), {i: p.grad.numpy() for i, p in params.items()}


@pytest.mark.parametrize("name", CASES)
def test_adapter_gradients_match_torch(name, tmp_path):
    model, x, t = _case(name, tmp_path)
    result = _split(model, tmp_path, rank=3, alpha=6.0)
    frozen_model = load_model(result.frozen)
    meta = adapters_of(frozen_model)
    rng = np.random.default_rng(5)
    trainer = Trainer(result.frozen, batch_size=len(x))
    weights = {i: w.copy() for i, w in trainer.art.weights.items()}
    for ad in meta.adapters:  # B = 0 would make A's gradient zero: give both values
        weights[ad.a] = rng.normal(0, 0.3, weights[ad.a].shape).astype(np.float32)
        weights[ad.b] = rng.normal(0, 0.3, weights[ad.b].shape).astype(np.float32)
    write_wof(result.wof, len(frozen_model.subgraphs[0].tensors), weights)
    got_loss, got = Trainer(result.frozen, batch_size=len(x)).gradients([x], [t])
    want_loss, want = _reference(model, meta, weights, x, t)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert set(got) == {t for ad in meta.adapters for t in (ad.a, ad.b)}
    for tensor, grad in got.items():
        assert relative_error(grad, want[tensor]) < 1e-5, tensor


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_wof_holds_the_adapters_and_the_frozen_model_the_weights(name, tmp_path):
    model, _, _ = _case(name, tmp_path)
    result = _split(model, tmp_path, rank=2)
    meta = adapters_of(load_model(result.frozen))
    art = Trainer(result.frozen).art
    assert set(art.weights) == {t for ad in meta.adapters for t in (ad.a, ad.b)}
    for ad in meta.adapters:
        assert art.forward.tensors[ad.weight].data is not None  # read in place
        assert art.weights[ad.a].shape[0 if ad.op not in ("GATHER", "EMBEDDING_LOOKUP")
                                       else 1] == 2
    full = split(model, tmp_path / "full")
    assert result.wof.stat().st_size < full.wof.stat().st_size


def test_a_starts_kaiming_uniform_and_b_at_zero(tmp_path):
    result = _split(FIXTURES / "mlp_784.tflite", tmp_path, rank=16)
    art = Trainer(result.frozen).art
    meta = adapters_of(load_model(result.frozen))
    a, b = art.weights[meta.adapters[0].a], art.weights[meta.adapters[0].b]
    bound = 1 / np.sqrt(a.shape[1])  # torch's kaiming_uniform_(a=sqrt(5)) on [r, in]
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.99 * bound
    assert a.std() == pytest.approx(bound / np.sqrt(3), rel=0.05)
    assert not b.any()
    again = _split(FIXTURES / "mlp_784.tflite", tmp_path / "again", rank=16)
    assert np.array_equal(Trainer(again.frozen).art.weights[meta.adapters[0].a], a)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_merged_and_kept_exports_run_like_infer(name, tmp_path):
    model, x, t = _case(name, tmp_path)
    result = _split(model, tmp_path)
    trainer = Trainer(result.frozen, batch_size=8, optimizer="adam", learning_rate=0.01)
    trainer.fit([x], [t], epochs=2, shuffle=False)
    trainer.save_weights()
    expected = Trainer(result.frozen, with_backprop=False).predict([x])[0]
    original = len(graph_of(load_model(model)).ops)
    for mode in ("merge", "keep"):
        for suffix in (".tflite", ".circle"):
            path = tmp_path / f"{mode}{suffix}"
            export(result.frozen, path, lora=mode)
            ops = len(load_model(path).subgraphs[0].operators)
            assert (ops <= original) == (mode == "merge"), (mode, ops, original)
            outputs = [run_onert(path, x)] + ([run_litert(path, x)] if suffix == ".tflite" else [])
            for got in outputs:
                assert np.abs(got - expected).max() <= 1e-5, (mode, suffix)


def test_adapter_files_serve_one_frozen_model_and_a_wrong_one_is_refused(tmp_path):
    """alice.wof and bob.wof train from one frozen model; adapters of another rank,
    other targets or another model are refused in one line naming the file."""
    model, x, t = _case("mlp", tmp_path)
    frozen = _split(model, tmp_path / "r4", rank=4).frozen
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "t.npy", t)
    runner = CliRunner()
    outputs = []
    for user, seed in (("alice", 1), ("bob", 2)):
        wof = tmp_path / f"{user}.wof"
        wof.write_bytes(frozen.with_name("mlp.wof").read_bytes())
        run = runner.invoke(microtrain, ["run", str(frozen), "--wof", str(wof), "--seed", str(seed),
                                         "--input", str(tmp_path / "x.npy"), "--target",
                                         str(tmp_path / "t.npy"), "--epochs", "2",
                                         "--batch-size", "4", "--save", "always"])
        assert run.exit_code == 0, run.output
        out = tmp_path / f"{user}.npy"
        infer = runner.invoke(microtrain, ["infer", str(frozen), "--wof", str(wof), "--input",
                                           str(tmp_path / "x.npy"), "-o", str(out)])
        assert infer.exit_code == 0, infer.output
        outputs.append(np.load(out))
    assert not np.array_equal(*outputs)
    others = {"rank 8": _split(model, tmp_path / "r8", rank=8).wof,
              "tensors": _split(model, tmp_path / "last", rank=4,
                                lora_targets="last:1").wof,
              "tensors ": split(FIXTURES / "cnn.tflite", tmp_path / "cnn").wof}
    for what, wof in others.items():
        result = runner.invoke(microtrain, ["infer", str(frozen), "--wof", str(wof), "--input",
                                            str(tmp_path / "x.npy"), "-o", str(tmp_path / "o.npy")])
        lines = result.output.strip().splitlines()
        assert result.exit_code != 0 and len(lines) == 1, result.output
        assert lines[0].startswith(f"Error: {wof}: ") and what.strip() in lines[0], lines[0]


def test_targets_by_operator_type_and_a_bad_choice_in_one_line(tmp_path):
    runner = CliRunner()
    cnn = FIXTURES / "cnn.tflite"
    result = runner.invoke(trainconf, ["split", str(cnn), "-o", str(tmp_path), "--lora", "2",
                                       "--lora-targets", "CONV_2D"])
    assert result.exit_code == 0, result.output
    meta = adapters_of(load_model(tmp_path / "cnn.frozen.circle"))
    assert [ad.op for ad in meta.adapters] == ["CONV_2D", "CONV_2D"]
    assert meta.alpha == 2.0  # the default alpha is the rank
    for bad in (["--lora-targets", "no_such_layer"], ["--lora", "0"],
                ["--memory-budget", "64KiB"]):
        args = ["split", str(cnn), "-o", str(tmp_path / "bad"), "--lora", "2"] + bad
        result = runner.invoke(trainconf, args)
        assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1, \
            result.output
