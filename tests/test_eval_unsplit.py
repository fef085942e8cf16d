"""`microtrain eval` of a model no split wrote (a float or full-integer .tflite, as
`microtrain infer` runs it) reports what eval of a split reports: the loss (cce after
a final SOFTMAX, else mse) and the metric.  On an int8 model its accuracy is that of
LiteRT's reference kernels (BUILTIN_REF) on the same data; its loss is Keras's on
LiteRT's (dequantized) outputs."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert.interpreter import OpResolverType
from click.testing import CliRunner

from litert_reference import keras_loss
from microtrain.commands.cli import main
from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES.parents[1] / "scripts"))
from int8_table import litert_invoked  # noqa: E402

INT8 = [("int8/mlp_tf", "digits_x"), ("int8/mlp_tf_float_io", "digits_x"),
        ("int8/cnn_tf", "digits_images"), ("int8/depthwise_tf", "digits_images"),
        ("quantized/full_int8", "digits_images"), ("quantized/full_int8_float_io", "digits_images")]
FLOAT = [("mlp", "digits_x", "digits_onehot", "cce"), ("cnn", "digits_images", "digits_onehot", "cce"),
         ("regression", "diabetes_x", "diabetes_y", "mse")]


def evaluate(model: Path, inputs: str, targets: str) -> dict:
    result = CliRunner().invoke(main, ["eval", str(model), "--input", str(FIXTURES / f"{inputs}.npy"),
                                       "--target", str(FIXTURES / f"{targets}.npy"), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def litert_outputs(model: Path, x: np.ndarray) -> np.ndarray:
    """LiteRT's reference kernels' outputs on float samples x, real-valued."""
    run = litert_invoked(model, x, experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    out = run.get_output_details()[0]
    y = run.get_tensor(out["index"])
    if y.dtype == np.int8:
        scale, zero = out["quantization"]
        y = (y.astype(np.float32) - zero) * np.float32(scale)
    return y


def data(inputs: str, targets: str) -> tuple[np.ndarray, np.ndarray]:
    return (np.load(FIXTURES / f"{inputs}.npy").astype(np.float32),
            np.load(FIXTURES / f"{targets}.npy").astype(np.float32))


@pytest.mark.parametrize("model,inputs", INT8, ids=[m for m, _ in INT8])
def test_an_int8_models_accuracy_is_litert_reference_kernels(model, inputs):
    path = FIXTURES / f"{model}.tflite"
    x, t = data(inputs, "digits_onehot")
    result = evaluate(path, inputs, "digits_onehot")
    y = litert_outputs(path, x)
    assert result["loss_function"] == "cce" and result["samples"] == len(x)
    assert result["accuracy"] == np.mean(y.argmax(1) == t.argmax(1))
    assert result["loss"] == pytest.approx(keras_loss("cce", [y], [t]), rel=1e-5)


@pytest.mark.parametrize("model,inputs,targets,loss", FLOAT, ids=[m for m, *_ in FLOAT])
def test_a_float_models_loss_is_keras_on_litert_outputs(model, inputs, targets, loss, tmp_path):
    """Its keys and values are those of eval of its split (the same weights), the
    loss up to the form it is computed in (a split takes cce from the logits)."""
    path = FIXTURES / f"{model}.tflite"
    x, t = data(inputs, targets)
    result = evaluate(path, inputs, targets)
    y = litert_outputs(path, x)
    assert result["loss_function"] == loss
    assert result["loss"] == pytest.approx(keras_loss(loss, [y], [t]), rel=1e-5)
    metric = "accuracy" if loss == "cce" else loss
    if loss == "cce":  # the same argmax but on near ties of float sums in other orders
        assert abs(result[metric] - np.mean(y.argmax(1) == t.argmax(1))) <= 1 / len(x)
    of_split = evaluate(split(path, tmp_path).frozen, inputs, targets)
    assert of_split.keys() == result.keys()
    assert of_split[metric] == pytest.approx(result[metric], abs=1 / len(x))
    assert of_split["loss"] == pytest.approx(result["loss"], rel=1e-4)


def test_targets_that_do_not_fit_are_one_line(tmp_path):
    result = CliRunner().invoke(main, ["eval", str(FIXTURES / "int8" / "mlp_tf.tflite"), "--input",
                                       str(FIXTURES / "digits_x.npy"), "--target",
                                       str(FIXTURES / "digits_y.npy")])
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: {FIXTURES / 'digits_y.npy'}: expected target samples of shape "
                           "(10,)"), line
