"""The data of a federated run: the devices share the training part, the server
keeps the held-out part (--test-input/--test-target or --validation-split)."""
from microtrain.commands.session import load_data, split_test_set
from microtrain.commands.federated.settings import FederatedSettings


def _split(settings: FederatedSettings):
    run = settings.run
    return split_test_set(run, load_data(run.inputs, run.input_shapes),
                          load_data(run.targets, run.target_shapes))


def training_part(settings: FederatedSettings) -> tuple[list, list]:
    xs, ts, _ = _split(settings)
    return xs, ts


def held_out_part(settings: FederatedSettings) -> tuple[list, list]:
    _, _, test = _split(settings)
    return test
