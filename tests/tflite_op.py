"""Run one operator in the TFLite interpreter (LiteRT), the reference for our
kernels' forward semantics: the operator is written with our own writer as a
one-operator .tflite model."""
import numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from microtrain.files.format.model import model_to_bytes
from microtrain.files.graph import Graph, Op, Tensor
from trainconf.writer import graph_to_model


def interpreter(model, reference: bool = False, **options) -> Interpreter:
    """LiteRT's interpreter for a model (its bytes or path); `reference`: with its
    reference kernels (BUILTIN_REF) instead of the default optimized ones and XNNPACK;
    `options`: the Interpreter's other arguments."""
    source = {"model_content": model} if isinstance(model, bytes) else {"model_path": str(model)}
    resolver = OpResolverType.BUILTIN_REF if reference else OpResolverType.AUTO
    return Interpreter(**source, experimental_op_resolver_type=resolver, **options)


def tflite_run(op_type: str, inputs: list, out_shapes: list, constant=(), out_dtypes=None,
               version=1, quantization=(), reference=False, **options) -> list:
    """The outputs of `op_type` on `inputs` (float32, int32, int64, bool or int8 arrays); the
    inputs at the positions in `constant` are stored in the model as constant tensors;
    the outputs are float32 unless `out_dtypes` gives their types.  `version` is the
    operator code's version (LiteRT registers some operators from a later one).
    `quantization`: a microtrain.files.quantization.Quantization (or None) per input, then per
    output; `reference`: run LiteRT's reference kernels."""
    quantization = list(quantization) or [None] * (len(inputs) + len(out_shapes))
    tensors = [Tensor(i, f"in{i}", a.shape, a.dtype, a if i in constant else None, quantization[i])
               for i, a in enumerate(inputs)]
    outs = [len(tensors) + k for k in range(len(out_shapes))]
    out_dtypes = out_dtypes or [np.float32] * len(out_shapes)
    tensors += [Tensor(t, f"out{t}", tuple(s), np.dtype(d), None, quantization[t])
                for t, s, d in zip(outs, out_shapes, out_dtypes)]
    feeds = [i for i in range(len(inputs)) if i not in constant]
    g = Graph(tensors, [Op(0, op_type, list(range(len(inputs))), outs, options, version)], feeds, outs)
    run = interpreter(model_to_bytes(graph_to_model(g, "op", {}), b"TFL3"), reference)
    run.allocate_tensors()
    for d, i in zip(run.get_input_details(), feeds):
        run.set_tensor(d["index"], inputs[i])
    run.invoke()
    return [run.get_tensor(d["index"]) for d in run.get_output_details()]
