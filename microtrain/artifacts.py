"""Load the three files written by `trainconf split` and check that they belong together."""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .contracts import GraphLinks, TrainingMeta
from .errors import ContractError, UserError
from .format.model import get_metadata, model_from_bytes
from .format.wof import read_wof
from .graph import Graph, graph_of

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


def sibling(frozen: Path, suffix: str) -> Path:
    """STEM.frozen.circle -> STEM<suffix>."""
    name = frozen.name
    stem = name[: -len(".frozen.circle")] if name.endswith(".frozen.circle") else frozen.stem
    return frozen.with_name(stem + suffix)


def _record(model, record, path: Path):
    raw = get_metadata(model, record.NAME)
    if raw is None:
        raise UserError(path, f"no {record.NAME!r} metadata: not a file written by `trainconf split`")
    return record.from_json(raw, path)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(path, e.strerror or str(e)) from None


def load_artifacts(frozen, wof=None, backprop=None, with_backprop: bool = True) -> Artifacts:
    frozen = Path(frozen)
    wof = Path(wof) if wof else sibling(frozen, ".wof")
    frozen_bytes = _read(frozen)
    model = model_from_bytes(frozen_bytes, frozen)
    training = _record(model, TrainingMeta, frozen)
    _check_indices(frozen, TrainingMeta.NAME, "trainable", training.trainable,
                   len(model.subgraphs[0].tensors or ()))
    weights = read_wof(wof, model)
    if set(weights) != set(training.trainable):
        raise UserError(wof, f"holds tensors {sorted(weights)} but {frozen.name} trains "
                             f"tensors {sorted(training.trainable)}: not this model's .wof")
    art = Artifacts(frozen, wof, None, graph_of(model), training, weights,
                    frozen_sha256=fingerprint(frozen_bytes))
    if with_backprop:
        _attach_backprop(art, Path(backprop) if backprop else sibling(frozen, ".backprop.circle"))
    return art


def _attach_backprop(art: Artifacts, path: Path) -> None:
    model = model_from_bytes(_read(path), path)
    links = _record(model, GraphLinks, path)
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
    for graph in ("forward", "backprop"):
        if links.memory is not None:
            _check_indices(path, GraphLinks.NAME, f"memory.{graph}",
                           [t for t, *_ in getattr(links.memory, graph)], sizes[graph])
    art.backprop_path, art.backprop, art.links = path, backprop, links


def _check_indices(path: Path, record: str, name: str, indices: list[int], n: int) -> None:
    """The tensor indices a record names exist in the graph of `n` tensors."""
    bad = [i for i in indices if i >= n]
    if bad:
        raise ContractError(path, f"tensor {bad[0]} does not exist (the graph has {n})",
                            f"{record}: {name}")
