"""Federated fine-tuning under Flower's two engines, each started once (Ray and
the deployment processes are slow to start): the simulation through
`microtrain federated --json`, and a SuperLink with three SuperNodes on loopback
running the same apps with `flwr run`, one SuperNode killed mid-run."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from microtrain.data import validation_split
from microtrain.trainer import Trainer
from trainconf.split import split

pytest.importorskip("flwr")
pytest.importorskip("ray")

FIXTURES = Path(__file__).parent / "fixtures"
X, Y = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"
PARAMS = 2410                        # the mlp's trainable weights
NPY_HEADER = 128


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    return split(FIXTURES / "mlp.tflite", tmp_path_factory.mktemp("mlp")).frozen


def held_out_accuracy(frozen: Path, wof: Path) -> float:
    _, (x, y) = validation_split([np.load(X), np.load(Y)], 0.2)
    return Trainer(frozen, wof=wof).evaluate([x], [y])["accuracy"]


# -- simulation ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def simulation(frozen):
    wof = frozen.with_name("mlp.wof")
    before = wof.stat().st_ino, held_out_accuracy(frozen, wof)
    out = subprocess.run(
        [sys.executable, "-m", "microtrain.commands.cli", "federated", str(frozen), "--input", str(X),
         "--target", str(Y), "--validation-split", "0.2", "--clients", "4", "--rounds", "3",
         "--fraction", "0.5", "--partition", "dirichlet:0.5", "--local-epochs", "2",
         "--transmit", "fp16", "--evaluate-fraction", "0.5", "--workers", "2", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()], wof, before


def test_simulation_prints_one_json_line_per_round(simulation):
    records, _, _ = simulation
    rounds, summary = records[:-1], records[-1]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3] and summary["event"] == "summary"
    for r in rounds[1:]:
        assert (r["clients"], r["failed"]) == (2, 0)          # half of the 4 devices
        # fp16 on the wire both ways: 2 bytes a weight (+ the .npy header) per device;
        # the 2 devices that evaluate receive the weights too and send none back
        assert r["bytes_down"] == 4 * (2 * PARAMS + NPY_HEADER)
        assert r["bytes_up"] == 2 * (2 * PARAMS + NPY_HEADER)
        assert np.isfinite(r["train_loss"]) and np.isfinite(r["test_loss"])
        assert 0 <= r["device_accuracy"] <= 1      # 2 devices evaluated on their own data


def test_simulation_learns_and_replaces_the_wof_atomically_with_the_best(simulation, frozen):
    records, wof, (inode, start_accuracy) = simulation
    rounds, summary = records[:-1], records[-1]
    assert rounds[0]["test_accuracy"] == pytest.approx(start_accuracy)
    best = max(rounds, key=lambda r: r["test_accuracy"])
    assert best["test_accuracy"] > start_accuracy + 0.05
    assert summary["saved"] and summary["best_round"] == best["round"]
    assert wof.stat().st_ino != inode                  # a new file renamed into place
    assert not [p for p in wof.parent.iterdir() if p.name.startswith(".")]   # no temp left
    assert held_out_accuracy(frozen, wof) == pytest.approx(best["test_accuracy"])


# -- deployment ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Processes started in their own sessions, each stopped with its whole group."""

    def __init__(self, env, folder: Path):
        self.env, self.folder, self.running = env, folder, {}

    def start(self, name: str, *args) -> Path:
        log = self.folder / f"{name}.log"
        self.running[name] = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                              env=self.env, start_new_session=True)
        return log

    def stop(self, name: str) -> None:
        process = self.running.pop(name)
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
                process.wait(wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                if process.poll() is not None:
                    return

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


def wait_for(log: Path, pattern: str, count: int = 1, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if len(re.findall(pattern, text)) >= count:
            return text
        time.sleep(0.5)
    raise AssertionError(f"no {count} x {pattern!r} in {log.name} after {timeout} s:\n"
                         + log.read_text(errors="replace")[-3000:])


def test_deployment_over_loopback_survives_a_killed_device(frozen, tmp_path):
    from microtrain.commands.federated.deployment import write_app
    from microtrain.commands.federated.settings import FederatedSettings
    from microtrain.run_config import RunConfig
    out = tmp_path / "global.wof"
    run = RunConfig(str(frozen), inputs=(str(X),), targets=(str(Y),), validation_split=0.2,
                    output_wof=str(out))
    write_app(tmp_path / "app", FederatedSettings(run, clients=3, rounds=3, min_clients=2,
                                                  round_timeout=120))
    link = free_port()
    home = tmp_path / "flwr"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
        f'address = "127.0.0.1:{link}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home)}
    procs = Processes(env, tmp_path)
    try:
        link_log = procs.start("superlink", "flower-superlink", "--insecure", "--host",
                               "127.0.0.1", "--port", str(link),
                               "--disable-runtime-dependency-installation")
        wait_for(link_log, "Uvicorn running")
        for i in range(3):
            procs.start(f"supernode{i}", "flower-supernode", "--insecure", "--superlink",
                        f"127.0.0.1:{link}", "--host", "127.0.0.1", "--port", str(free_port()),
                        "--node-config", f"partition-id={i} num-partitions=3")
        wait_for(link_log, r"Activated node_id", count=3)
        run_log = procs.start("run", "flwr", "run", str(tmp_path / "app"), "local", "--stream")
        wait_for(run_log, r'microtrain \{"round": 1,', timeout=120)
        procs.stop("supernode2")                           # a device drops out
        text = wait_for(run_log, r'microtrain \{"event": "summary"', timeout=240)
    finally:
        procs.stop_all()
    records = [json.loads(m) for m in re.findall(r"microtrain (\{.*\})", text)]
    rounds, summary = records[:-1], records[-1]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[1]["clients"] == 3
    assert [r["clients"] for r in rounds[2:]] == [2, 2]     # the rounds went on without it
    assert sum(r["failed"] for r in rounds) <= 1
    assert summary["saved"] and held_out_accuracy(frozen, out) == pytest.approx(
        summary["best_accuracy"])
