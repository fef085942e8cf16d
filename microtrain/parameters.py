"""The training parameters a run uses and where each came from: given (on the
command line, or to the Python call), else recorded (in the frozen model by
`trainconf split`, or in a circle+ model's CIRCLE_TRAINING), else the defaults
of the record (microtrain.files.contracts.TrainingParameters) and of the optimizer."""
from dataclasses import dataclass

from microtrain.files.contracts import TrainingParameters
from microtrain.step.optimizers import DEFAULTS

GIVEN = "command line"
FROZEN_MODEL = "frozen model"
DEFAULT = "default"
FIELDS = ("optimizer", "batch_size", "epochs")


@dataclass
class Resolved:
    parameters: TrainingParameters  # hyperparameters: those given or recorded
    sources: dict[str, str]  # each parameter and hyperparameter -> GIVEN, the record's name, DEFAULT

    def report(self) -> dict:
        """{name: {"value", "source"}}, hyperparameters in full, for --json."""
        p = self.parameters
        values = {"optimizer": p.optimizer, **{**DEFAULTS[p.optimizer], **p.hyperparameters},
                  "batch_size": p.batch_size, "epochs": p.epochs}
        return {k: {"value": v, "source": self.sources[k]} for k, v in values.items()}


def resolve(recorded: TrainingParameters | None, recorded_as: str, optimizer: str | None = None,
            batch_size: int | None = None, epochs: int | None = None,
            **hyperparameters) -> Resolved:
    """Each parameter given (not None), else `recorded` (named `recorded_as` in the
    sources), else the default.  Recorded hyperparameters belong to the recorded
    optimizer: another optimizer given starts from its own defaults."""
    record, source = (recorded, recorded_as) if recorded is not None \
        else (TrainingParameters(), DEFAULT)
    given = {"optimizer": optimizer, "batch_size": batch_size, "epochs": epochs}
    values = {k: given[k] if given[k] is not None else getattr(record, k) for k in FIELDS}
    sources = {k: GIVEN if given[k] is not None else source for k in FIELDS}
    kept = record.hyperparameters if values["optimizer"] == record.optimizer else {}
    chosen = {**kept, **{k: v for k, v in hyperparameters.items() if v is not None}}
    for k in DEFAULTS.get(values["optimizer"], ()):
        sources[k] = GIVEN if hyperparameters.get(k) is not None \
            else source if k in kept else DEFAULT
    parameters = TrainingParameters(**values, hyperparameters=chosen)
    return Resolved(parameters, sources)
