"""`trainconf import`: convert a .tflite model to .circle.

Circle is a binary superset of the TFLite schema, so the conversion is a load
and a save.  What circle cannot hold is found first with the `tflite` package
(TensorFlow's own bindings of the TFLite schema), which names it as TFLite
does, e.g. "STABLEHLO_COMPOSITE" rather than a bare code.
"""
import tflite

from microtrain.files.errors import UserError
from microtrain.files.opening import read_regular
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import DECODE_ERRORS, enum_names, model_from_bytes, save_model

TFLITE_VERSION = 3


def import_tflite(src, dst) -> circle.ModelT:
    """Write the .tflite file `src` as the .circle file `dst`; returns the model."""
    data = read_regular(src, "model")
    check_tflite(data, src)
    model = model_from_bytes(data, src)
    save_model(model, dst)
    return model


def check_tflite(data: bytes, path) -> None:
    """Reject a file that is not a .tflite model circle can represent."""
    if len(data) < 8:
        raise UserError(path, f"{len(data)} bytes is too short for a tflite model")
    if not tflite.Model.ModelBufferHasIdentifier(data, 0):
        raise UserError(path, f"not a .tflite model: file identifier {data[4:8]!r}, "
                              "expected b'TFL3'")
    try:
        m = tflite.Model.GetRootAs(data, 0)
        if m.Version() != TFLITE_VERSION:
            raise UserError(path, f"TFLite schema version {m.Version()}, expected {TFLITE_VERSION}")
        codes = _operator_codes(m)
        _check_operator_codes(codes, path)
        for s in range(m.SubgraphsLength()):
            _check_subgraph(m, s, codes, path)
    except DECODE_ERRORS as e:
        raise UserError(path, f"truncated or corrupt model: {e}") from None


def _same_in_circle(enum, name: str, value: int) -> bool:
    return getattr(enum, name, None) == value


def _operator_codes(m) -> list[tuple[str, int]]:
    """(TFLite name, code) of each operator code."""
    names = enum_names(tflite.BuiltinOperator)
    codes = []
    for i in range(m.OperatorCodesLength()):
        oc = m.OperatorCodes(i)
        code = max(oc.BuiltinCode(), oc.DeprecatedBuiltinCode())  # TFLite's rule
        codes.append((names.get(code, f"builtin code {code}"), code))
    return codes


def _check_operator_codes(codes, path) -> None:
    for name, code in codes:
        if not _same_in_circle(circle.BuiltinOperator, name, code):
            raise UserError(path, f"operator {name} has no circle equivalent")


def _check_subgraph(m, s: int, codes, path) -> None:
    sg = m.Subgraphs(s)
    unions = ((enum_names(tflite.BuiltinOptions), circle.BuiltinOptions, "BuiltinOptionsType"),
              (enum_names(tflite.BuiltinOptions2), circle.BuiltinOptions2, "BuiltinOptions2Type"))
    for k in range(sg.OperatorsLength()):
        op = sg.Operators(k)
        for names, circle_union, field in unions:
            t = getattr(op, field)()
            if t and not _same_in_circle(circle_union, names.get(t, ""), t):
                op_name = codes[op.OpcodeIndex()][0] if op.OpcodeIndex() < len(codes) else "?"
                raise UserError(path, f"subgraph {s} operator {k} ({op_name}) uses "
                                      f"{names.get(t, f'options type {t}')}, "
                                      "which schemas/circle.fbs does not include")
    types = enum_names(tflite.TensorType)
    for t in range(sg.TensorsLength()):
        tensor = sg.Tensors(t)
        name = types.get(tensor.Type(), str(tensor.Type()))
        if not _same_in_circle(circle.TensorType, name, tensor.Type()):
            raise UserError(path, f"subgraph {s} tensor {t} '{tensor.Name().decode(errors='replace')}'"
                                  f" has type {name}, which circle does not have")
