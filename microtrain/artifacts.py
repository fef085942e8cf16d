"""Load the three files written by `trainconf split` and check that they belong together."""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UserError
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


# Metadata entries (schemas/backprop.md): the training setup in the frozen model,
# and the links from the backprop graph to the forward graph.
TRAINING_META = "microtrain.training"
BACKPROP_META = "microtrain.backprop"


@dataclass
class Artifacts:
    frozen_path: Path
    wof_path: Path
    backprop_path: Path | None
    forward: Graph
    training: dict  # loss, reduction, trainable tensor indices
    weights: dict[int, np.ndarray]  # trainable tensor -> fp32 master weights from the .wof
    backprop: Graph | None = None
    links: dict | None = None  # BACKPROP_META
    frozen_sha256: str = ""


def sibling(frozen: Path, suffix: str) -> Path:
    """STEM.frozen.circle -> STEM<suffix>."""
    name = frozen.name
    stem = name[: -len(".frozen.circle")] if name.endswith(".frozen.circle") else frozen.stem
    return frozen.with_name(stem + suffix)


def _json_meta(model, name: str, path: Path) -> dict:
    raw = get_metadata(model, name)
    if raw is None:
        raise UserError(path, f"no {name!r} metadata: not a file written by `trainconf split`")
    try:
        return json.loads(bytes(raw).decode())
    except ValueError:
        raise UserError(path, f"the {name!r} metadata is not valid JSON") from None


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
    training = _json_meta(model, TRAINING_META, frozen)
    weights = read_wof(wof, model)
    if set(weights) != set(training["trainable"]):
        raise UserError(wof, f"holds tensors {sorted(weights)} but {frozen.name} trains "
                             f"tensors {sorted(training['trainable'])}: not this model's .wof")
    art = Artifacts(frozen, wof, None, graph_of(model), training, weights,
                    frozen_sha256=fingerprint(frozen_bytes))
    if with_backprop:
        _attach_backprop(art, Path(backprop) if backprop else sibling(frozen, ".backprop.circle"))
    return art


def _attach_backprop(art: Artifacts, path: Path) -> None:
    model = model_from_bytes(_read(path), path)
    links = _json_meta(model, BACKPROP_META, path)
    if links.get("frozen_sha256") != art.frozen_sha256:
        raise UserError(path, f"was generated for another model than {art.frozen_path.name} "
                              "(its frozen-model checksum differs); run `trainconf split` again")
    grads_for = [f for _, f in links["gradients"]]
    if grads_for != list(art.training["trainable"]):
        raise UserError(path, f"computes gradients of tensors {grads_for}, but the model trains "
                              f"{art.training['trainable']}")
    art.backprop_path, art.backprop, art.links = path, graph_of(model), links
