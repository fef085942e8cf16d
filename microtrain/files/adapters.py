"""Adapter files: several .wof files of low-rank adapters serve one frozen model
(`trainconf split --lora`, whose `microtrain.lora` metadata lists them).  A .wof
that does not fit is refused in one line saying what differs: made for a model
of other tensors, for other targets, or of another rank."""
from pathlib import Path

from microtrain.files.contracts import Adapters
from microtrain.files.errors import UserError
from microtrain.files.opening import read_regular
from microtrain.files.format.model import get_metadata, int_list, tensor_dtype
from microtrain.files.format.wof import ALIGN, layout


def explain_misfit(wof: Path, frozen: Path, model, trainable: list[int]) -> None:
    """Raise a UserError naming how the .wof `wof`, which does not fit `model`
    (loaded from `frozen`), differs from its adapters; return when the model has
    none or the .wof cannot be read as one."""
    raw = get_metadata(model, Adapters.NAME)
    if raw is None:
        return
    meta = Adapters.from_json(raw, frozen)
    data = read_regular(wof, ".wof")
    found = layout(data)
    if found is None:
        return
    tensors = model.subgraphs[0].tensors
    count, offsets = found
    if count != len(tensors):
        raise UserError(wof, f"was written for a model of {count} tensors, {frozen.name} has "
                             f"{len(tensors)}: not an adapter file of this model (another model, "
                             "or adapters of other targets)")
    present = [i for i, o in enumerate(offsets) if o]
    if present != sorted(trainable):
        raise UserError(wof, f"holds tensors {present}, {frozen.name} trains {sorted(trainable)}: "
                             "adapters of other targets, or of another model")
    ranks = {_rank(data, offsets, t, tensors[t], meta.rank)
             for ad in meta.adapters for t in (ad.a, ad.b)}
    if len(ranks) == 1 and None not in ranks and ranks != {meta.rank}:
        raise UserError(wof, f"holds adapters of rank {ranks.pop()}, {frozen.name}'s have rank "
                             f"{meta.rank}: split the model again with --lora of that rank")
    raise UserError(wof, f"holds adapters of other shapes than {frozen.name}'s (rank "
                         f"{meta.rank}): made for other targets or another model")


def _rank(data: bytes, offsets, index: int, tensor, rank: int) -> int | None:
    """The rank that the bytes of adapter `index` in the .wof hold, None when no rank fits."""
    ends = sorted(o for o in offsets if o > offsets[index]) + [len(data)]
    span = ends[0] - offsets[index]
    per_rank = tensor_dtype(tensor).itemsize * _size(tensor) // rank
    k = span // per_rank
    exact = ends[0] == len(data)
    fits = span == k * per_rank if exact else k * per_rank <= span < k * per_rank + ALIGN
    return k if fits and k > 0 else None


def _size(tensor) -> int:
    n = 1
    for d in int_list(tensor.shape):
        n *= d
    return n
