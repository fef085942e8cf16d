"""Data a user would feed a sequence model (issue 18): for each integer input, random ids
within the range of the embedding table it indexes; for each output, one-hot targets (per
position for per-token outputs, such as a language model's [B, T, V] logits)."""
from pathlib import Path

import numpy as np

from microtrain.files.format.model import buffer_array, load_model, op_name, tensor_dtype

LOOKUPS = {"GATHER": (0, 1), "EMBEDDING_LOOKUP": (1, 0)}  # (table, ids) operand positions


def indexed_tables(model, graph, tensor: int) -> list[int]:
    """The constant tables (tensor indices) that ids flowing from `tensor` index, through any
    operators on the way (such as Keras's wrap of negative ids)."""
    consumers = {}
    for op in graph.operators:
        for i in op.inputs:
            consumers.setdefault(i, []).append(op)
    tables, seen, frontier = [], {tensor}, [tensor]
    while frontier:
        t = frontier.pop()
        for op in consumers.get(t, []):
            table, ids = LOOKUPS.get(op_name(model, op), (None, None))
            if table is not None and op.inputs[ids] == t \
                    and buffer_array(model, graph.tensors[op.inputs[table]]) is not None:
                tables.append(op.inputs[table])
                continue
            for out in op.outputs:
                if out not in seen:
                    seen.add(out)
                    frontier.append(out)
    return tables


def embedding_tables(path: Path) -> set[str]:
    """The names of the tables the model's inputs index: its embeddings."""
    model = load_model(path)
    graph = model.subgraphs[0]
    return {graph.tensors[t].name for i in graph.inputs for t in indexed_tables(model, graph, i)}


def sample_inputs(path: Path, samples: int, rng) -> list[np.ndarray]:
    """One batch for each input of the model file: ids in [0, rows) of the table an integer
    input indexes (ones where it indexes none: a mask that keeps every position), uniform
    [0, 1) for a float input."""
    model = load_model(path)
    graph = model.subgraphs[0]
    batch = []
    for i in graph.inputs:
        tensor = graph.tensors[i]
        shape, dtype = (samples, *tensor.shape[1:]), tensor_dtype(tensor)
        if np.issubdtype(dtype, np.integer):
            rows = [graph.tensors[t].shape[0] for t in indexed_tables(model, graph, i)]
            batch.append(rng.integers(0, min(rows), shape).astype(dtype) if rows
                         else np.ones(shape, dtype))
        else:
            batch.append(rng.random(shape, dtype=np.float32))
    return batch


def one_hot(shape, rng) -> np.ndarray:
    """Random one-hot rows of `shape` (a label per row along the last axis: per sample, or per
    position of a per-token output)."""
    t = np.zeros(shape, np.float32)
    np.put_along_axis(t, rng.integers(0, shape[-1], (*shape[:-1], 1)), 1.0, axis=-1)
    return t


def one_hot_targets(path: Path, samples: int, rng) -> list[np.ndarray]:
    """One-hot targets for each output of the model file."""
    graph = load_model(path).subgraphs[0]
    return [one_hot((samples, *graph.tensors[o].shape[1:]), rng) for o in graph.outputs]
