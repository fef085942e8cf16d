"""Load the three files written by `trainconf split` and check that they belong together."""
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from microtrain.files.adapters import explain_misfit
from microtrain.files.atomic import PENDING, check_set_complete
from microtrain.files.contracts import GraphLinks, Precision, TrainingMeta
from microtrain.files.errors import ContractError, UserError
from microtrain.files.opening import map_regular
from microtrain.files.format.model import get_metadata, model_from_bytes
from microtrain.files.format.wof import MAGIC, VERSION, layout, wof_from_bytes
from microtrain.files.graph import BATCH, Graph, Tensor, check_dataflow, graph_of, symbolic_batch
from microtrain.step.kernels.quantized import check_integer_ops
from microtrain.files.loss_registry import default_loss

try:  # CPython's own SHA-256: hashlib would load OpenSSL (~4 MB resident) just for this
    from _sha2 import sha256  # Python 3.12+
except ImportError:
    try:
        from _sha256 import sha256  # Python 3.11
    except ImportError:
        from hashlib import sha256



def fingerprint(data: bytes) -> str:
    """The hex SHA-256 by which a backprop graph names its frozen model."""
    return sha256(data).hexdigest()


WOF_MAGIC = MAGIC.to_bytes(2, "little") + bytes([VERSION])  # a .wof's first bytes
UNSEALED = "0" * 64  # the backprop_sha256 a backprop graph is hashed with


def _seal_token(digest: str) -> bytes:
    return f'"backprop_sha256": "{digest}"'.encode()


def seal(data: bytes) -> bytes:
    """A backprop graph written with backprop_sha256 = UNSEALED, with its digest
    filled in (64 hex digits for 64: the layout does not move)."""
    assert data.count(_seal_token(UNSEALED)) == 1
    return data.replace(_seal_token(UNSEALED), _seal_token(fingerprint(data)))


def _unsealed_fingerprint(data, at: int, size: int) -> str:
    """The fingerprint of `data` with its seal token at `at` (of `size` bytes) back
    to UNSEALED, hashed in place (no copy of a mapped file)."""
    digest = sha256()
    with memoryview(data) as view:
        digest.update(view[:at])
        digest.update(_seal_token(UNSEALED))
        digest.update(view[at + size:])
    return digest.hexdigest()


def _check_seal(data, digest: str, path: Path) -> None:
    token = _seal_token(digest)
    at = data.find(token)
    if at < 0 or data.find(token, at + 1) >= 0 or \
            _unsealed_fingerprint(data, at, len(token)) != digest:
        raise UserError(path, "was changed after `trainconf split` wrote it (its contents do not "
                              "match its backprop_sha256); run `trainconf split` again")


# Metadata entries (schemas/contracts.md): the training setup in the frozen model,
# and the links from the backprop graph to the forward graph.
TRAINING_META = TrainingMeta.NAME
BACKPROP_META = GraphLinks.NAME


@dataclass
class Artifacts:
    frozen_path: Path
    wof_path: Path
    backprop_path: Path | None
    forward: Graph
    training: TrainingMeta
    weights: dict[int, np.ndarray]  # trainable tensor -> fp32 master weights from the .wof
    backprop: Graph | None = None
    links: GraphLinks | None = None
    frozen_sha256: str = ""
    # where the .wof holds each weight (byte offsets) and its size: a weight map
    # (microtrain/files/weight_map.py) reads frozen rows there in place; {} when not from a file
    wof_offsets: dict[int, int] = field(default_factory=dict)
    wof_size: int = 0


def sibling(frozen: Path, suffix: str) -> Path:
    """STEM.frozen.circle -> STEM<suffix>."""
    name = frozen.name
    stem = name[: -len(".frozen.circle")] if name.endswith(".frozen.circle") else frozen.stem
    return frozen.with_name(stem + suffix)


def _record(model, record, path: Path):
    raw = get_metadata(model, record.NAME)
    if raw is None:
        raise UserError(path, _not_split(model, record, path))
    return record.from_json(raw, path)


SPLIT_SUFFIXES = (".frozen.circle", ".backprop.circle", ".wof")


def split_name(path: Path, suffix: str) -> str:
    """The name of the file of `path`'s split set with `suffix` (STEM.wof, ...)."""
    stem = next((path.name[:-len(s)] for s in SPLIT_SUFFIXES if path.name.endswith(s)), path.stem)
    return stem + suffix


def _not_split(model, record, path: Path) -> str:
    """What a model without `record` is, and what to give instead."""
    if record is TrainingMeta and get_metadata(model, GraphLinks.NAME) is not None:
        return (f"is the backprop graph of a split, not the model; give the model "
                f"{split_name(path, '.frozen.circle')} instead")
    if record is GraphLinks and get_metadata(model, TrainingMeta.NAME) is not None:
        return ("is the split model, not its backprop graph; give "
                f"{split_name(path, '.backprop.circle')} instead")
    return (f"no {record.NAME!r} metadata: not a file written by `trainconf split`; split it "
            f"first (trainconf split {path.name}) and give STEM.frozen.circle")




def load_artifacts(frozen, wof=None, backprop=None, with_backprop: bool = True,
                   plain: bool = False) -> Artifacts:
    """The split set of `frozen`; `plain`: a model that no split wrote (neither
    split metadata) is loaded too, as its graph with every weight a constant and no .wof
    (what `microtrain infer` runs as it is)."""
    frozen = Path(frozen)
    check_set_complete(sibling(frozen, PENDING))
    wof = Path(wof) if wof else sibling(frozen, ".wof")
    frozen_bytes = map_regular(frozen, "model")
    if frozen_bytes[:3] == WOF_MAGIC:
        raise UserError(frozen, f"is a .wof weights file, not the model; give the model "
                                f"{split_name(frozen, '.frozen.circle')} instead")
    model = model_from_bytes(frozen_bytes, frozen)
    if plain and all(get_metadata(model, r.NAME) is None for r in (TrainingMeta, GraphLinks)):
        return _plain(frozen, model, frozen_bytes)
    training = _record(model, TrainingMeta, frozen)
    _check_indices(frozen, TrainingMeta.NAME, "trainable", training.trainable,
                   len(model.subgraphs[0].tensors or ()))
    try:
        wof_bytes = map_regular(wof, ".wof")
        weights = wof_from_bytes(wof_bytes, model, wof)
        if set(weights) != set(training.trainable):
            raise UserError(wof, f"holds tensors {sorted(weights)} but {frozen.name} trains "
                                 f"tensors {sorted(training.trainable)}: not this model's .wof")
    except UserError:
        explain_misfit(wof, frozen, model, training.trainable)  # an adapter file's misfit
        raise
    forward = _forward(model, frozen, set(training.trainable))
    offsets = layout(wof_bytes)[1]
    art = Artifacts(frozen, wof, None, forward, training, weights,
                    frozen_sha256=fingerprint(frozen_bytes),
                    wof_offsets={t: offsets[t] for t in weights}, wof_size=len(wof_bytes))
    if with_backprop:
        _attach_backprop(art, Path(backprop) if backprop else sibling(frozen, ".backprop.circle"))
    return art


def _forward(model, path: Path, given: set[int]) -> Graph:
    """The model's graph, checked for what the runtime relies on: its dataflow, and
    every input and output with the batch first (symbolic, or a fixed batch of 1)."""
    forward = graph_of(model)
    check_dataflow(forward, path, given)
    first = (BATCH,) if symbolic_batch(forward) else (1,)
    for t in forward.inputs + forward.outputs:
        if forward.tensors[t].shape[:1] != first:
            raise UserError(path, f"model input or output {t} '{forward.tensors[t].name}' has "
                                  f"shape {list(forward.tensors[t].shape)}, without the batch "
                                  f"dimension ({first[0]}) first")
    return forward


def _plain(path: Path, model, data: bytes) -> Artifacts:
    """A model no split wrote, to run forward as it is: nothing trains."""
    # quantized operators it cannot run first: an int8 LSTM reads int16 state no operator writes
    check_integer_ops(graph_of(model), path)
    try:
        forward = _forward(model, path, set())
    except UserError as e:  # a constant split would have made plain float32 (sparse, ...)
        raise e.at(path) from None
    training = TrainingMeta(version=TrainingMeta.VERSION, loss=default_loss(forward),
                            reduction="mean",
                            trainable=[], precision=Precision("fp32", "fp32", "fp32"),
                            batch=BATCH if symbolic_batch(forward) else 1,
                            stable_logits_loss=False)
    return Artifacts(path, path, None, forward, training, {}, frozen_sha256=fingerprint(data))


def _attach_backprop(art: Artifacts, path: Path) -> None:
    data = map_regular(path, "model")
    model = model_from_bytes(data, path)
    links = _record(model, GraphLinks, path)
    _check_seal(data, links.backprop_sha256, path)
    if links.frozen_sha256 != art.frozen_sha256:
        raise UserError(path, f"was generated for another model than {art.frozen_path.name} "
                              "(its frozen-model checksum differs); run `trainconf split` again")
    grads_for = [f for _, f in links.gradients]
    if grads_for != art.training.trainable:
        raise UserError(path, f"computes gradients of tensors {grads_for}, but the model trains "
                              f"{art.training.trainable}")
    backprop = graph_of(model)
    sizes = {"forward": len(art.forward.tensors), "backprop": len(backprop.tensors)}
    for name, pairs in (("forward", links.forward), ("gradients", links.gradients)):
        _check_indices(path, GraphLinks.NAME, name, [b for b, _ in pairs], sizes["backprop"])
        _check_indices(path, GraphLinks.NAME, name, [f for _, f in pairs], sizes["forward"])
    _check_indices(path, GraphLinks.NAME, "targets", links.targets + [links.loss], sizes["backprop"])
    _check_indices(path, GraphLinks.NAME, "layers", links.layers, sizes["backprop"])
    _check_indices(path, GraphLinks.NAME, "recomputed", links.recomputed or [], sizes["backprop"])
    for graph in ("forward", "backprop"):
        if links.memory is not None:
            _check_indices(path, GraphLinks.NAME, f"memory.{graph}",
                           [t for t, *_ in getattr(links.memory, graph)], sizes[graph])
    _check_shapes(art, backprop, links, path)
    check_dataflow(backprop, path, {b for b, _ in links.forward} | set(links.targets))
    art.backprop_path, art.backprop, art.links = path, backprop, links


def _check_shapes(art: Artifacts, backprop: Graph, links: GraphLinks, path: Path) -> None:
    """Linked tensors have the shapes of the forward tensors they stand for (and
    a fake quantization's int8 levels their type and grid: so marked); one target per
    model output, shaped like it (class ids: without its last axis)."""
    where = f"{GraphLinks.NAME}: forward"
    for b, f in links.forward:
        if backprop.tensors[b].shape != art.forward.tensors[f].shape:
            raise ContractError(path, f"backprop tensor {b} has shape {list(backprop.tensors[b].shape)}"
                                      f" but stands for forward tensor {f} of shape "
                                      f"{list(art.forward.tensors[f].shape)}", where)
        _link_levels(backprop.tensors[b], art.forward.tensors[f], path)
    if list(backprop.tensors[links.loss].shape) != [1]:
        raise ContractError(path, f"loss tensor {links.loss} has shape "
                                  f"{list(backprop.tensors[links.loss].shape)}; a loss is one "
                                  "value, shape [1]", f"{GraphLinks.NAME}: loss")
    if len(links.targets) != len(art.forward.outputs):
        raise ContractError(path, f"{len(links.targets)} targets for a model of "
                                  f"{len(art.forward.outputs)} outputs", f"{GraphLinks.NAME}: targets")
    for t, y in zip(links.targets, art.forward.outputs):
        shape, out = backprop.tensors[t].shape, art.forward.tensors[y].shape
        if shape not in (out, out[:-1]):
            raise ContractError(path, f"target tensor {t} has shape {list(shape)}, the model output "
                                      f"{list(out)}", f"{GraphLinks.NAME}: targets")


def _link_levels(linked: Tensor, forward: Tensor, path: Path) -> None:
    """Mark the backprop tensor that stands for a fake quantization's int8 levels."""
    if not forward.fake_quant:
        return
    q = linked.quantization
    if linked.dtype != forward.dtype or not forward.quantization.same(q) or \
            q.axis != forward.quantization.axis:
        raise ContractError(path, f"backprop tensor {linked.index} stands for forward tensor "
                                  f"{forward.index}, int8 levels of a {forward.fake_quant}, but "
                                  "is not declared int8 of their scales and zero points",
                            f"{GraphLinks.NAME}: forward")
    linked.fake_quant = forward.fake_quant


def _check_indices(path: Path, record: str, name: str, indices: list[int], n: int) -> None:
    """The tensor indices a record names exist in the graph of `n` tensors."""
    bad = [i for i in indices if i >= n]
    if bad:
        raise ContractError(path, f"tensor {bad[0]} does not exist (the graph has {n})",
                            f"{record}: {name}")
