"""bf16 (`--precision bf16`, ml_dtypes' bfloat16): tensors stored in 2 bytes and
rounded to nearest even, the fixtures train to within 1% of fp32's losses, the
docs/mixed_precision.md's underflow case needs no loss scale, the plan is what a run holds, and
ml_dtypes loads only for bf16."""
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from microtrain.step import precision
from microtrain.files.errors import UserError
from microtrain.step.loss_scale import make_loss_scale
from microtrain.step.precision import narrow, round_in_place
from microtrain.trainer import Trainer
from test_memory_plan import data
from trainconf.split import split

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from mixed_precision_table import small_gradient_model  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
BF16 = np.dtype(ml_dtypes.bfloat16)


def test_stores_round_to_nearest_even():
    # 1 + 2^-8 lies halfway between bfloat16's 1 and 1 + 2^-7: even is 1; 1 + 3*2^-8
    # lies halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x00008000], np.uint32)
    want = np.array([1.0, 1 + 2 ** -6, 1 + 2 ** -7, 0.0], np.float32)
    dst = np.empty(4, BF16)
    narrow(bits.view(np.float32).copy(), dst)()
    np.testing.assert_array_equal(dst.astype(np.float32), want)
    in_place = bits.view(np.float32).copy()
    round_in_place(in_place, dtype=BF16)()
    np.testing.assert_array_equal(in_place, want)


@pytest.mark.parametrize("model", ["mlp", "residual_mlp", "cnn", "depthwise", "regression"])
def test_bf16_trains_the_fixtures_within_one_percent_of_fp32(tmp_path, model):
    x, t = data(model, 320)
    losses = {}
    for p in ("fp32", "bf16"):
        frozen = split(FIXTURES / f"{model}.tflite", tmp_path / p, precision=p).frozen
        trainer = Trainer(frozen, batch_size=32, optimizer="adam")
        history = trainer.fit([x], [t], epochs=3, shuffle=False)
        losses[p] = history[-1]["loss"]
        if p == "bf16":
            arrays = [a for a in trainer.memory.forward + trainer.memory.backprop
                      if a.dtype == BF16]
            assert arrays and history[0]["grad_underflow_all"] < 0.01
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.01)
    assert losses["bf16"] != losses["fp32"]  # it did compute in reduced precision


def test_bf16_needs_no_loss_scale_where_fp16_underflows(tmp_path):
    x, y = np.load(FIXTURES / "diabetes_x.npy"), np.load(FIXTURES / "diabetes_y.npy")
    runs = {}
    for p in ("fp32", "fp16", "bf16"):
        trainer = Trainer(small_gradient_model(tmp_path / p, p), loss_scale=make_loss_scale("none"))
        runs[p] = trainer.fit([x], [y], epochs=2, shuffle=False)
    assert runs["fp16"][0]["grad_underflow_all"] > 0.01
    assert runs["bf16"][0]["grad_underflow_all"] == 0
    assert runs["bf16"][-1]["loss"] == pytest.approx(runs["fp32"][-1]["loss"], rel=0.01)


@pytest.mark.parametrize("options", [{"precision": "bf16"}, {"grad_dtype": "bf16"},
                                     {"precision": "fp16", "activation_dtype": "bf16"}])
def test_planned_peak_is_what_a_bf16_run_holds(tmp_path, options):
    result = split(FIXTURES / "cnn.tflite", tmp_path, **options)
    trainer = Trainer(result.frozen, batch_size=32)
    x, t = data("cnn", 300)
    trainer.fit([x], [t], epochs=1, test=([x[:50]], [t[:50]]))
    assert trainer.memory_bytes() == result.memory["ram"]
    assert trainer.mapped_bytes() == result.memory["read_only"]


def test_bf16_without_ml_dtypes_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    precision.bfloat16.cache_clear()
    try:
        with pytest.raises(UserError, match=r"bf16 needs the ml_dtypes package"):
            precision.dtype_of("bf16")
    finally:
        monkeypatch.undo()
        precision.bfloat16.cache_clear()


def test_only_a_bf16_run_loads_ml_dtypes(tmp_path):
    x, y = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"
    code = ("import json, sys\n"
            "from microtrain.commands.cli import main\n"
            "main(sys.argv[1:], standalone_mode=False)\n"
            "print(json.dumps('ml_dtypes' in sys.modules))")
    for p in ("fp16", "bf16"):
        frozen = split(FIXTURES / "mlp.tflite", tmp_path / p, precision=p).frozen
        args = ["run", str(frozen), "--input", str(x), "--target", str(y), "--epochs", "1"]
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                             text=True, check=True).stdout
        assert json.loads(out.splitlines()[-1]) == (p == "bf16")
