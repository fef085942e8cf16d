"""Flower's deployment engine: the app directory `flwr run` needs.

The ServerApp and ClientApp live in this package, so a Flower app is only its
pyproject.toml: the two components by module path and the run's settings as the
run config (key `microtrain`, JSON).  The processes that run the apps (SuperLink,
SuperNodes) need this package installed, as `microtrain` itself is not in the
app bundle.  Paths are made absolute because the apps do not run in the caller's
folder.
"""
from dataclasses import replace
from pathlib import Path

import tomli_w

from microtrain.files.atomic import atomic_write
from microtrain.commands.federated.settings import CONFIG_KEY, FederatedSettings

# the fields of its RunConfig that name files
PATH_FIELDS = ("frozen", "wof", "backprop", "output_wof")
PATH_LIST_FIELDS = ("inputs", "targets", "test_inputs", "test_targets")


def _absolute(spec: str) -> str:
    """An absolute data spec (keeps an .npz ':KEY' suffix as it is)."""
    head, sep, key = spec.rpartition(":")
    if sep and head.lower().endswith(".npz"):
        return str(Path(head).resolve()) + sep + key
    return str(Path(spec).resolve())


def absolute_paths(settings: FederatedSettings) -> FederatedSettings:
    run = settings.run
    changes = {name: _absolute(getattr(run, name)) for name in PATH_FIELDS
               if getattr(run, name)}
    changes.update({name: tuple(_absolute(s) for s in getattr(run, name))
                    for name in PATH_LIST_FIELDS})
    return replace(settings, run=replace(run, **changes))


def app_pyproject(settings: FederatedSettings) -> str:
    from flwr import __version__ as flwr_version
    return tomli_w.dumps({
        "project": {"name": "microtrain-federated", "version": "1.0.0",
                    "dependencies": [f"flwr>={flwr_version}"]},
        "tool": {"flwr": {"app": {
            "publisher": "microtrain",
            "components": {"serverapp": "microtrain.commands.federated.server_app:app",
                           "clientapp": "microtrain.commands.federated.client_app:app"},
            "config": {CONFIG_KEY: absolute_paths(settings).to_json()}}}}})


def write_app(directory, settings: FederatedSettings) -> Path:
    """Write DIRECTORY/pyproject.toml (atomically); returns its path."""
    path = Path(directory) / "pyproject.toml"
    Path(directory).mkdir(parents=True, exist_ok=True)
    atomic_write(path, app_pyproject(settings).encode())
    return path
