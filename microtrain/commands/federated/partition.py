"""Splitting one data set across simulated devices.

iid: a seeded random permutation cut into near-equal parts.  dirichlet:ALPHA:
for every class, the share each device gets is drawn from Dirichlet(ALPHA, ...,
ALPHA) (small ALPHA: each device sees few classes), as in Hsu et al. 2019; the
draw is repeated until every device holds at least `min_size` samples.
This runs on the host (the simulation), so numpy's generator is fine here.
"""
import numpy as np

from microtrain.files.errors import UserError
from microtrain.commands.federated.settings import parse_partition

MAX_DRAWS = 1000


def class_labels(target: np.ndarray) -> np.ndarray:
    """Class ids of one-hot (or probability) rows, or of integer class targets."""
    if target.ndim >= 2 and target.shape[-1] > 1:
        return target.reshape(len(target), -1).argmax(axis=1)
    flat = target.reshape(len(target))
    if flat.dtype.kind == "f" and not np.all(flat == np.round(flat)):
        raise UserError(None, "a dirichlet partition needs class targets (one-hot rows or "
                              "class ids); these look continuous")
    return flat.astype(np.int64)


def partition(spec: str, target: np.ndarray, clients: int, seed: int) -> list[np.ndarray]:
    """Sorted sample indices of every client, by `spec` (iid or dirichlet:ALPHA)."""
    n = len(target)
    if n < clients:
        raise UserError(None, f"{n} samples cannot be split across {clients} clients")
    rng = np.random.default_rng(seed)
    kind, alpha = parse_partition(spec)
    if kind == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(n), clients)]
    return _dirichlet(class_labels(target), clients, alpha, rng, min_size=min(10, n // clients))


def _dirichlet(labels: np.ndarray, clients: int, alpha: float, rng, min_size: int
               ) -> list[np.ndarray]:
    for _ in range(MAX_DRAWS):
        parts = [[] for _ in range(clients)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for part, chunk in zip(parts, np.split(members, cuts)):
                part.append(chunk)
        parts = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise UserError(None, f"no Dirichlet({alpha}) draw in {MAX_DRAWS} gave every one of "
                          f"{clients} clients {min_size} samples; use a larger alpha or fewer clients")
