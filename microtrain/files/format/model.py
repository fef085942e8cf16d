"""Circle models in memory: load, validate, save, and the helpers every tool needs.

The in-memory model is the generated object API's `ModelT` (see
schemas/circle.fbs).  Circle extends the TFLite schema, so the same bindings
read .tflite files (identifier TFL3); models are always saved as circle (CIR0).

After loading, `OperatorCodeT.builtinCode` is the operator's code for every
entry (the file's rule, "builtin_code only when deprecated_builtin_code is
127", is applied once here), and saving derives deprecated_builtin_code from it.
"""
import functools
import math
import re
import struct

import flatbuffers
import numpy as np
from flatbuffers import flexbuffers

from microtrain.files.atomic import atomic_write
from microtrain.files.errors import UserError
from microtrain.files.opening import FileMap, read_regular
from microtrain.files.format import circle_generated as circle

IDENTIFIERS = (b"CIR0", b"TFL3")
PLACEHOLDER = circle.BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES


def enum_names(enum) -> dict[int, str]:
    """Value -> name of a generated enum class."""
    return {v: k for k, v in vars(enum).items() if not k.startswith("_")}


BUILTIN_NAMES = enum_names(circle.BuiltinOperator)
BUILTIN_CODES = {name: code for code, name in BUILTIN_NAMES.items()}
TYPE_NAMES = enum_names(circle.TensorType)
_T = circle.TensorType
DTYPES = {_T.FLOAT32: np.float32, _T.FLOAT16: np.float16, _T.FLOAT64: np.float64,
          _T.INT8: np.int8, _T.INT16: np.int16, _T.INT32: np.int32, _T.INT64: np.int64,
          _T.UINT8: np.uint8, _T.UINT16: np.uint16, _T.UINT32: np.uint32,
          _T.UINT64: np.uint64, _T.BOOL: np.bool_, _T.COMPLEX64: np.complex64,
          _T.COMPLEX128: np.complex128}
# Decoding errors the generated readers raise on truncated or garbage input.
DECODE_ERRORS = (struct.error, IndexError, ValueError, TypeError, OverflowError)


# ---------------------------------------------------------------- load / save

def load_model(path) -> circle.ModelT:
    """Read a .circle or .tflite file."""
    return model_from_bytes(read_regular(path, "model"), path)


def model_from_bytes(data: bytes, path=None) -> circle.ModelT:
    """Decode and validate a model; `path` only names the file in errors.  The
    model's arrays are views of `data`: a read-only map of the file
    (files.map_regular) is read in place, other data is frozen into bytes first."""
    data = data if isinstance(data, FileMap) else bytes(data)
    if len(data) < 8:
        raise UserError(path, f"{len(data)} bytes is too short for a circle or tflite model")
    if data[4:8] not in IDENTIFIERS:
        raise UserError(path, f"not a circle or tflite model: file identifier {data[4:8]!r}, "
                              "expected b'CIR0' or b'TFL3'")
    root = struct.unpack_from("<I", data)[0]
    if root + 4 > len(data):
        raise UserError(path, f"truncated: the root table at byte {root} lies beyond "
                              f"the end of the {len(data)}-byte file")
    try:
        model = circle.ModelT.InitFromPackedBuf(data, 0)
    except DECODE_ERRORS as e:
        raise UserError(path, f"truncated or corrupt model: {e}") from None
    for code in model.operatorCodes or ():
        code.builtinCode = _file_builtin_code(code)
    _check_model(model, path)
    return model


def save_model(model: circle.ModelT, path) -> None:
    """Write the model as a .circle file, atomically."""
    atomic_write(path, model_to_bytes(model))


def model_to_bytes(model: circle.ModelT, identifier: bytes = b"CIR0") -> bytes:
    """Serialize as circle (identifier CIR0; TFL3 writes the same bytes as a
    .tflite).  Normalizes operator codes and buffer data in place (see
    `_normalize`), which changes no meaning."""
    _normalize(model)
    size = sum(len(b.data) for b in model.buffers or () if b.data is not None)
    builder = _AlignedBuilder(size + (1 << 16))
    builder.Finish(model.Pack(builder), file_identifier=identifier)
    return bytes(builder.Output())


class _AlignedBuilder(flatbuffers.Builder):
    """Starts every byte vector on a 16-byte boundary.

    The schema asks for that on Buffer.data (`force_align: 16`, so runtimes can
    use weights in place), but flatc's Python code ignores force_align.  Aligning
    the other byte vectors (custom options) too costs at most 15 bytes each.
    """

    def CreateNumpyVector(self, x):
        if x.dtype.itemsize == 1:
            self.Prep(16, x.nbytes)
        return super().CreateNumpyVector(x)


def _normalize(model: circle.ModelT) -> None:
    for code in model.operatorCodes or ():
        code.deprecatedBuiltinCode = min(code.builtinCode, PLACEHOLDER)
    for buf in model.buffers or ():
        if buf.data is not None:
            buf.data = _byte_array(buf.data)


def _byte_array(data) -> np.ndarray:
    """Buffer data as a flat uint8 array (the generated packer's fast path)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(bytes(data), np.uint8)


def _file_builtin_code(code: circle.OperatorCodeT) -> int:
    if code.deprecatedBuiltinCode == PLACEHOLDER:
        return code.builtinCode
    return code.deprecatedBuiltinCode


# ---------------------------------------------------------------- validation

def _check_model(model: circle.ModelT, path) -> None:
    """Reject what would decode but break later: dangling indices, options
    types this schema lacks, data stored outside the flatbuffer."""
    if not model.subgraphs:
        raise UserError(path, "the model has no subgraphs")
    n_buffers = len(model.buffers or ())
    for b, buf in enumerate(model.buffers or ()):
        if buf.offset > 1:
            raise UserError(path, f"buffer {b} keeps its data outside the flatbuffer "
                                  "(models over 2 GB are not supported)")
    for s, sg in enumerate(model.subgraphs):
        _check_subgraph(model, s, sg, n_buffers, path)
    for m in model.metadata or ():
        _check_index(m.buffer, n_buffers, f"metadata '{m.name}'", "buffer", path)
    for sig in model.signatureDefs or ():
        _check_index(sig.subgraphIndex, len(model.subgraphs),
                     f"signature '{sig.signatureKey}'", "subgraph", path)
        n_tensors = len(model.subgraphs[sig.subgraphIndex].tensors or ())
        for tm in (sig.inputs or []) + (sig.outputs or []):
            _check_index(tm.tensorIndex, n_tensors,
                         f"signature '{sig.signatureKey}' entry '{tm.name}'", "tensor", path)


def _check_subgraph(model, s, sg, n_buffers, path) -> None:
    n_tensors = len(sg.tensors or ())
    for t, tensor in enumerate(sg.tensors or ()):
        _check_index(tensor.buffer, n_buffers, f"subgraph {s} tensor {t} '{tensor.name}'",
                     "buffer", path)
        q = tensor.quantization
        if q is not None and q.detailsType and q.details is None:
            raise UserError(path, f"subgraph {s} tensor {t} '{tensor.name}' uses quantization "
                                  f"details type {q.detailsType}, unknown to schemas/circle.fbs")
    for where, indices in (("inputs", sg.inputs), ("outputs", sg.outputs)):
        for i in int_list(indices):
            _check_index(i, n_tensors, f"subgraph {s} {where}", "tensor", path)
    n_codes = len(model.operatorCodes or ())
    for o, op in enumerate(sg.operators or ()):
        what = f"subgraph {s} operator {o}"
        _check_index(op.opcodeIndex, n_codes, what, "operator code", path)
        for i in int_list(op.inputs):
            if i != -1:  # -1 marks an absent optional input
                _check_index(i, n_tensors, f"{what} input", "tensor", path)
        for i in int_list(op.outputs):
            _check_index(i, n_tensors, f"{what} output", "tensor", path)
        _check_options(model, op, what, path)


def _check_options(model, op, what, path) -> None:
    # An options table the bindings do not know decodes to None; saving that
    # would write the type without the table, so refuse it here.
    for kind, type_, table in (("builtin options", op.builtinOptionsType, op.builtinOptions),
                               ("builtin options 2", op.builtinOptions2Type, op.builtinOptions2)):
        if type_ and table is None:
            raise UserError(path, f"{what} ({op_name(model, op)}) has {kind} of type "
                                  f"{type_}, which schemas/circle.fbs does not include")
    if op.largeCustomOptionsOffset > 1:
        raise UserError(path, f"{what} keeps its custom options outside the flatbuffer "
                              "(models over 2 GB are not supported)")


def _check_index(i, n, what, kind, path) -> None:
    if not 0 <= i < n:
        raise UserError(path, f"{what} refers to {kind} {i}, but there are only {n}")


def int_list(v) -> list[int]:
    """A vector field (None, list or numpy array) as a list of ints."""
    return [] if v is None else [int(i) for i in v]


# ---------------------------------------------------------------- operators

def op_name(model: circle.ModelT, op: circle.OperatorT) -> str:
    """"FULLY_CONNECTED" for a builtin op, the custom_code for a CUSTOM one."""
    code = model.operatorCodes[op.opcodeIndex]
    if code.builtinCode == circle.BuiltinOperator.CUSTOM:
        return code.customCode or "CUSTOM"
    return BUILTIN_NAMES.get(code.builtinCode, f"BUILTIN_{code.builtinCode}")


def add_operator_code(model: circle.ModelT, name: str, version: int = 1) -> int:
    """Index of the operator code for a builtin name or a custom_code (and its
    version), added if new."""
    builtin = BUILTIN_CODES.get(name, circle.BuiltinOperator.CUSTOM)
    custom = None if name in BUILTIN_CODES else name
    codes = model.operatorCodes = model.operatorCodes or []
    for i, code in enumerate(codes):
        if (code.builtinCode, code.customCode, code.version) == (builtin, custom, version):
            return i
    code = circle.OperatorCodeT(builtinCode=builtin, customCode=custom, version=version,
                                deprecatedBuiltinCode=min(builtin, PLACEHOLDER))
    codes.append(code)
    return len(codes) - 1


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


# Custom operators whose custom_options are a C struct, not a flexbuffer map.
# MediaPipe's Convolution2DTransposeBias reads TfLiteTransposeConvParams:
# int32 padding (TfLitePadding: 1 SAME, 2 VALID), int32 stride_width, int32 stride_height.
_TFLITE_PADDING = {1: circle.Padding.SAME, 2: circle.Padding.VALID}


def _read_transpose_conv_params(data: bytes) -> dict:
    if len(data) < 12:
        raise ValueError(f"{len(data)} bytes, expected 12")
    padding, stride_w, stride_h = struct.unpack_from("<3i", data)
    if padding not in _TFLITE_PADDING or stride_w < 1 or stride_h < 1:
        raise ValueError(f"padding {padding}, strides {stride_w}x{stride_h}")
    return {"padding": _TFLITE_PADDING[padding], "stride_w": stride_w, "stride_h": stride_h}


def _write_transpose_conv_params(options: dict) -> bytes:
    padding = {v: k for k, v in _TFLITE_PADDING.items()}[options["padding"]]
    return struct.pack("<3i", padding, options["stride_w"], options["stride_h"])


STRUCT_OPTIONS = {"Convolution2DTransposeBias": (_read_transpose_conv_params,
                                                 _write_transpose_conv_params)}


def options_dict(op: circle.OperatorT, name: str | None = None) -> dict:
    """The op's options with the schema's field names: builtin options, a
    custom op's flexbuffer map, or the struct of a custom op named `name` in
    STRUCT_OPTIONS ({"custom_options": [bytes]} when they are some other
    layout, for a kernel that knows it); {} when it has none."""
    table = op.builtinOptions or op.builtinOptions2
    if table is not None:
        return {_snake(k): _plain(v) for k, v in vars(table).items()}
    if op.customOptions is None or len(op.customOptions) == 0:
        return {}
    data = bytes(op.customOptions)
    if name in STRUCT_OPTIONS:
        try:
            return STRUCT_OPTIONS[name][0](data)
        except ValueError as e:
            raise UserError(None, f"custom options of {name} are not its parameters: {e}") from None
    try:
        options = flexbuffers.Loads(data)
    except (*DECODE_ERRORS, KeyError, AssertionError, RecursionError):
        options = None
    if not isinstance(options, dict):
        return {"custom_options": [int(b) for b in op.customOptions]}
    return options


def set_builtin_options(op: circle.OperatorT, table) -> None:
    """Attach an options object such as `circle.ReshapeOptionsT(newShape=[-1, 4])`."""
    name = type(table).__name__[:-1]  # ReshapeOptionsT -> ReshapeOptions
    if hasattr(circle.BuiltinOptions, name):
        op.builtinOptionsType, op.builtinOptions = getattr(circle.BuiltinOptions, name), table
    else:
        op.builtinOptions2Type, op.builtinOptions2 = getattr(circle.BuiltinOptions2, name), table


def set_custom_options(op: circle.OperatorT, options: dict, name: str | None = None) -> None:
    """Store a custom op's options as a flexbuffer map (or the struct of a
    custom op named `name` in STRUCT_OPTIONS)."""
    data = STRUCT_OPTIONS[name][1](options) if name in STRUCT_OPTIONS else flexbuffers.Dumps(options)
    op.customOptions = np.frombuffer(data, np.uint8)
    op.customOptionsFormat = circle.CustomOptionsFormat.FLEXBUFFERS


# ---------------------------------------------------------------- tensors

@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported only when bf16 is used (optional extra [bf16])."""
    try:
        import ml_dtypes
    except ImportError:
        raise UserError(None, "bf16 needs the ml_dtypes package: pip install "
                              "'trainconf-microtrain[bf16]'") from None
    return np.dtype(ml_dtypes.bfloat16)


def tensor_dtype(tensor: circle.TensorT) -> np.dtype:
    """The numpy dtype (little-endian) of the tensor's elements."""
    if tensor.type == _T.BFLOAT16:
        return bfloat16()
    if tensor.type not in DTYPES:
        raise UserError(None, f"tensor '{tensor.name}' has type "
                              f"{TYPE_NAMES.get(tensor.type, tensor.type)}, which numpy cannot hold")
    return np.dtype(DTYPES[tensor.type]).newbyteorder("<")


def buffer_array(model: circle.ModelT, tensor: circle.TensorT) -> np.ndarray | None:
    """The tensor's constant data (a read-only view), or None when it has none."""
    data = model.buffers[tensor.buffer].data
    if data is None or len(data) == 0:
        return None
    dtype, shape = tensor_dtype(tensor), int_list(tensor.shape)
    need = math.prod(shape) * dtype.itemsize
    if len(data) != need:
        raise UserError(None, f"tensor '{tensor.name}': buffer {tensor.buffer} holds "
                              f"{len(data)} bytes, shape {shape} of {dtype.name} needs {need}")
    return _byte_array(data).view(dtype).reshape(shape)


# ---------------------------------------------------------------- metadata

def get_metadata(model: circle.ModelT, name: str) -> bytes | None:
    for m in model.metadata or ():
        if m.name == name:
            data = model.buffers[m.buffer].data
            return b"" if data is None else _byte_array(data).tobytes()
    return None


def remove_metadata(model: circle.ModelT, name: str) -> None:
    """Drop the named metadata entry; its buffer stays, emptied."""
    for m in model.metadata or ():
        if m.name == name and m.buffer != 0:
            model.buffers[m.buffer].data = None
    model.metadata = [m for m in model.metadata or () if m.name != name] or None


def set_metadata(model: circle.ModelT, name: str, data: bytes) -> None:
    """Set the named metadata entry, adding it (and its buffer) if new."""
    array = np.frombuffer(bytes(data), np.uint8)
    for m in model.metadata or ():
        if m.name == name and m.buffer != 0:  # buffer 0 is the shared empty one
            model.buffers[m.buffer].data = array
            return
    model.buffers = model.buffers or [circle.BufferT()]
    model.buffers.append(circle.BufferT(data=array))
    model.metadata = [m for m in model.metadata or () if m.name != name]
    model.metadata.append(circle.MetadataT(name=name, buffer=len(model.buffers) - 1))
