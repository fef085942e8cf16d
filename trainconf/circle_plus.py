"""circle+ training parameters: the CIRCLE_TRAINING metadata of a circle model
(schemas/circle_traininfo.fbs) read into our training setup and written from it.

The mapping, and what circle+ cannot say, are documented in schemas/circle_plus.md.
"""
from dataclasses import dataclass

import flatbuffers
import numpy as np

from microtrain.files.contracts import TrainingParameters
from microtrain.files.errors import UserError
from microtrain.files.format import circle_traininfo_generated as ct
from microtrain.files.format.model import DECODE_ERRORS, get_metadata, set_metadata
from microtrain.files.loss_registry import LOSS_KINDS, circle_plus_enum
from microtrain.step.optimizers import DEFAULTS

METADATA = "CIRCLE_TRAINING"
IDENTIFIER = b"CTR0"

# circle+ value <-> our name, one table per enum.
OPTIMIZERS = {ct.Optimizer.SGD: "sgd", ct.Optimizer.ADAM: "adam"}
CIRCLE_LOSSES = [kind for kind in LOSS_KINDS.values() if kind.circle_plus]
LOSSES = {getattr(ct.LossFn, circle_plus_enum(kind)): kind.name for kind in CIRCLE_LOSSES}
REDUCTIONS = {ct.LossReductionType.SumOverBatchSize: "mean", ct.LossReductionType.Sum: "sum"}
# Each optimizer's options table, and our hyperparameter -> its attribute there.
OPTIMIZER_OPTIONS = {
    "sgd": (ct.OptimizerOptions.SGDOptions, ct.SGDOptionsT, {"learning_rate": "learningRate"}),
    "adam": (ct.OptimizerOptions.AdamOptions, ct.AdamOptionsT,
             {"learning_rate": "learningRate", "beta_1": "beta1", "beta_2": "beta2",
              "epsilon": "epsilon"}),
}
# Each loss's options table.
LOSS_OPTIONS = {kind.name: (getattr(ct.LossFnOptions, f"{kind.circle_plus}Options"),
                            getattr(ct, f"{kind.circle_plus}OptionsT")) for kind in CIRCLE_LOSSES}


@dataclass
class CirclePlus:
    """A ModelTraining table in our terms."""
    optimizer: str
    hyperparameters: dict[str, float]  # those circle+ holds for the optimizer
    loss: str
    reduction: str
    epochs: int
    batch_size: int
    trainable_ops: list[int] | None  # operator indices; None: not given (all)

    def parameters(self) -> TrainingParameters:
        """As our record; an epoch count or batch size of 0 (unset) takes the default."""
        given = {k: v for k, v in (("epochs", self.epochs), ("batch_size", self.batch_size))
                 if v > 0}
        return TrainingParameters(optimizer=self.optimizer, hyperparameters=self.hyperparameters,
                                  **given)


def read_circle_plus(model, path) -> CirclePlus | None:
    """The model's CIRCLE_TRAINING, or None when it has none."""
    raw = get_metadata(model, METADATA)
    if raw is None:
        return None
    where = f"{METADATA} metadata"
    if len(raw) < 8 or raw[4:8] != IDENTIFIER:
        raise UserError(path, f"the {where} is not a circle+ ModelTraining table "
                              f"(identifier {raw[4:8]!r}, expected {IDENTIFIER!r})")
    try:
        t = ct.ModelTrainingT.InitFromPackedBuf(bytearray(raw), 0)
    except DECODE_ERRORS as e:
        raise UserError(path, f"the {where} is truncated or corrupt: {e}") from None
    if t.optimizer not in OPTIMIZERS or t.lossfn not in LOSSES \
            or t.lossReductionType not in REDUCTIONS:
        raise UserError(path, f"the {where} names optimizer {t.optimizer}, loss {t.lossfn} or "
                              f"reduction {t.lossReductionType}, which circle+ does not define")
    optimizer = OPTIMIZERS[t.optimizer]
    kind, _, fields = OPTIMIZER_OPTIONS[optimizer]
    if t.optimizerOptType != kind or t.optimizerOpt is None:
        raise UserError(path, f"the {where}: {optimizer} without its options table")
    if getattr(t.lossfnOpt, "fromLogits", False):
        raise UserError(path, f"the {where} asks for {LOSSES[t.lossfn]} from logits, which "
                              "microtrain does not compute (it reads a final SOFTMAX's logits "
                              "itself): give --loss")
    return CirclePlus(optimizer, {k: _decimal(getattr(t.optimizerOpt, a)) for k, a in fields.items()},
                      LOSSES[t.lossfn], REDUCTIONS[t.lossReductionType], t.epochs, t.batchSize,
                      None if t.trainableOps is None else [int(i) for i in np.ravel(t.trainableOps)])


def _decimal(value: float) -> float:
    """A float32 as the shortest decimal that gives it (0.005, not 0.004999999888)."""
    return float(str(np.float32(value)))


def circle_plus_bytes(c: CirclePlus) -> bytes:
    """The ModelTraining table of `c`, with its file identifier CTR0."""
    t = ct.ModelTrainingT()
    t.optimizer = {v: k for k, v in OPTIMIZERS.items()}[c.optimizer]
    kind, table, fields = OPTIMIZER_OPTIONS[c.optimizer]
    t.optimizerOptType, t.optimizerOpt = kind, table()
    for key, attr in fields.items():
        setattr(t.optimizerOpt, attr, c.hyperparameters[key])
    t.lossfn = {v: k for k, v in LOSSES.items()}[c.loss]
    t.lossfnOptType, t.lossfnOpt = LOSS_OPTIONS[c.loss][0], LOSS_OPTIONS[c.loss][1]()
    t.lossReductionType = {v: k for k, v in REDUCTIONS.items()}[c.reduction]
    t.epochs, t.batchSize = c.epochs, c.batch_size
    t.trainableOps = c.trainable_ops
    builder = flatbuffers.Builder(256)
    builder.Finish(t.Pack(builder), file_identifier=IDENTIFIER)
    return bytes(builder.Output())


def to_circle_plus(optimizer: str, given: dict, loss: str, reduction: str, epochs: int,
                   batch_size: int, trainable_ops: list[int]) -> CirclePlus:
    """Our setup as circle+; UserError naming what circle+ cannot hold."""
    if optimizer not in OPTIMIZER_OPTIONS:
        raise UserError(None, f"circle+ holds the optimizers sgd and adam, not {optimizer}")
    fields = OPTIMIZER_OPTIONS[optimizer][2]
    beyond = sorted(k for k in given if k not in fields)
    if beyond:
        raise UserError(None, f"circle+ cannot hold {optimizer}'s {', '.join(beyond)}")
    if loss not in LOSS_OPTIONS:
        raise UserError(None, f"circle+ holds the losses {', '.join(LOSS_OPTIONS)}, not {loss}")
    config = {**DEFAULTS[optimizer], **given}
    return CirclePlus(optimizer, {k: config[k] for k in fields}, loss, reduction, epochs,
                      batch_size, trainable_ops)


def set_circle_plus(model, c: CirclePlus) -> None:
    set_metadata(model, METADATA, circle_plus_bytes(c))
