"""trainconf/operators.py: one registry of operators, consistent with the
runtime's kernels (docs/operators.md's table generated from it: tests/test_docs.py)."""
from pathlib import Path

from microtrain.files.artifacts import load_artifacts
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import enum_names, load_model, op_name
from microtrain.step.kernels import KERNELS
from trainconf.operators import OPERATORS, ROW_GRADS, spec
from trainconf.split import split

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def test_every_builtin_kernel_has_an_entry():
    builtin = {name for name in KERNELS if hasattr(circle.BuiltinOperator, name)}
    assert builtin <= OPERATORS.keys(), builtin - OPERATORS.keys()


def test_what_trains_or_passes_gradients_runs_forward():
    assert [n for n, op in OPERATORS.items() if op.gradient and not op.forward] == []


def test_properties_are_consistent():
    for name, op in OPERATORS.items():
        assert op.name == name
        if op.bias is not None or op.layer or op.row_grad:
            assert op.weighted and op.gradient, name
    # a weight gradient that can be cut to rows is an operator the runtime runs
    assert ROW_GRADS and ROW_GRADS <= KERNELS.keys()


def test_an_unknown_operator_has_nothing():
    op = spec("MaxPoolingWithArgmax2D")  # a MediaPipe custom op we do not know
    assert (op.forward, op.gradient, op.fold, op.weighted) == (False, None, None, False)


def test_backprop_metadata_names_the_layers(tmp_path):
    """Adaptive loss scaling learns the layers from the backprop graph's metadata:
    the input gradient of every weighted op that has one (not the first layer's)."""
    files = split(FIXTURES / "cnn.tflite", tmp_path)
    art = load_artifacts(files.frozen)
    producers = art.backprop.producers()
    layer_types = [producers[t].type for t in art.links.layers]
    assert layer_types == ["FullyConnectedInputGrad", "Conv2DInputGrad"]


def test_options_tables_are_the_converters():
    """The options table the registry gives each operator is the one TensorFlow's
    and litert-torch's converters wrote for it in every fixture model."""
    enums = (enum_names(circle.BuiltinOptions), enum_names(circle.BuiltinOptions2))
    seen = {}
    for path in sorted(FIXTURES.rglob("*.tflite")):
        model = load_model(path)
        for sg in model.subgraphs:
            for op in sg.operators:
                for enum, kind in zip(enums, (op.builtinOptionsType, op.builtinOptions2Type)):
                    if kind:
                        seen.setdefault(op_name(model, op), set()).add(enum[kind])
    assert len(seen) >= 15, seen
    for name, tables in seen.items():
        if name in OPERATORS:
            assert {spec(name).options} == tables, name
    for name, op in OPERATORS.items():
        if op.options:
            assert any(op.options in enum.values() for enum in enums), name
