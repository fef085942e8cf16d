"""The typed records between the stages: what trainconf writes reads back equal,
every violation is one error naming the file, the record and the field, and
schemas/contracts.md is the one generated from them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from microtrain.files.artifacts import UNSEALED, load_artifacts, seal
from microtrain.commands.cli import main
from microtrain.files.contracts import (GraphLinks, LossScaleState, MemoryPlan, TrainingMeta,
                                        parse_json)
from microtrain.files.errors import ContractError, UserError
from microtrain.files.format.model import get_metadata, load_model, model_to_bytes, set_metadata
from model_patch import FIXTURES
from trainconf.split import split

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return split(FIXTURES / "mlp.tflite", tmp_path_factory.mktemp("mlp"))


def test_the_documentation_is_generated_from_the_records():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "contracts_doc.py"), "--check"])
    assert result.returncode == 0, "schemas/contracts.md is stale: run scripts/contracts_doc.py"


def test_what_split_writes_reads_back_equal(mlp):
    art = load_artifacts(mlp.frozen)
    assert isinstance(art.training, TrainingMeta) and isinstance(art.links, GraphLinks)
    assert isinstance(art.links.memory, MemoryPlan)
    assert TrainingMeta.from_json(art.training.to_json(), None) == art.training
    assert GraphLinks.from_json(art.links.to_json(), None) == art.links


def _edited(src: Path, dst: Path, record, change, sealed=True) -> Path:
    """A copy of model `src` whose `record` metadata JSON was changed by `change(dict)`;
    a backprop graph is `sealed` again as trainconf seals it, so that the check
    of the change itself is reached."""
    model = load_model(src)
    meta = json.loads(get_metadata(model, record.NAME))
    change(meta)
    resealed = sealed and record is GraphLinks and isinstance(meta.get("backprop_sha256"), str)
    if resealed:
        meta["backprop_sha256"] = UNSEALED
    set_metadata(model, record.NAME, json.dumps(meta).encode())
    data = model_to_bytes(model)
    dst.write_bytes(seal(data) if resealed else data)
    return dst


def _eval_error(frozen: Path, backprop: Path | None = None) -> str:
    args = ["eval", str(frozen), "--input", str(FIXTURES / "digits_x.npy"),
            "--target", str(FIXTURES / "digits_onehot.npy")]
    if backprop:
        args += ["--backprop", str(backprop)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(trainable=["a"]), "microtrain.training: trainable[0]: expected int, found \"a\""),
    (lambda m: m.pop("trainable"), "microtrain.training: trainable: missing"),
    (lambda m: m.update(trainable=[]), "microtrain.training: trainable: no trainable tensors"),
    (lambda m: m.update(trainable=[1, 1]), "microtrain.training: trainable: repeats a tensor"),
    (lambda m: m.update(trainable=[99999]), "microtrain.training: trainable: tensor 99999 does not exist"),
    (lambda m: m.update(loss="hinge"), "microtrain.training: loss: \"hinge\" is not one of"),
    (lambda m: m.update(version=2), "microtrain.training: version: version 2; this microtrain reads version 1"),
    (lambda m: m["precision"].update(weights="fp8"), "microtrain.training: precision.weights: \"fp8\""),
    (lambda m: m.update(rows={"x": [0, 1]}), "microtrain.training: rows: key 'x' is not a whole number"),
    (lambda m: m.update(surprise=1), "microtrain.training: surprise: unknown field"),
])
def test_an_edited_training_record_is_one_error(mlp, tmp_path, change, message):
    frozen = _edited(mlp.frozen, tmp_path / "mlp.frozen.circle", TrainingMeta, change)
    (tmp_path / "mlp.wof").write_bytes(mlp.wof.read_bytes())
    line = _eval_error(frozen, mlp.backprop)
    assert line.startswith(f"Error: {frozen}: {message}"), line


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("gradients"), "microtrain.backprop: gradients: missing"),
    (lambda m: m.pop("forward"), "microtrain.backprop: forward: missing"),
    (lambda m: m.update(forward={"a": 1}), "microtrain.backprop: forward: expected a list"),
    (lambda m: m.update(loss=None), "microtrain.backprop: loss: expected int, found null"),
    (lambda m: m.update(targets=[10 ** 6]), "microtrain.backprop: targets: tensor 1000000 does not exist"),
    (lambda m: m["memory"].update(arena=[-1, 0]), "microtrain.backprop: memory.arena[0]: -1 is outside"),
    (lambda m: m["memory"].update(arena=[2 ** 62, 0]), "microtrain.backprop: memory.arena[0]"),
    (lambda m: m["memory"].pop("forward"), "microtrain.backprop: memory.forward: missing"),
    (lambda m: m.update(frozen_sha256="x"), "microtrain.backprop: frozen_sha256: 'x' is not a hex SHA-256"),
])
def test_an_edited_links_record_is_one_error(mlp, tmp_path, change, message):
    backprop = _edited(mlp.backprop, tmp_path / "b.circle", GraphLinks, change)
    line = _eval_error(mlp.frozen, backprop)
    assert line.startswith(f"Error: {backprop}: {message}"), line


@pytest.mark.parametrize("change", [lambda m: m.update(loss=m["loss"] + 1),
                                    lambda m: m["memory"].update(arena=[0, 16])])
def test_an_edited_backprop_graph_is_refused_by_its_digest(mlp, tmp_path, change):
    backprop = _edited(mlp.backprop, tmp_path / "b.circle", GraphLinks, change, sealed=False)
    line = _eval_error(mlp.frozen, backprop)
    assert line == (f"Error: {backprop}: was changed after `trainconf split` wrote it (its "
                    "contents do not match its backprop_sha256); run `trainconf split` again")


def test_deep_json_is_refused_before_parsing():
    with pytest.raises(ContractError, match="nested 100001 levels deep"):
        parse_json("[" * 100001 + "]" * 100001, "f", "meta.json")


def test_loss_scale_kinds_need_their_fields():
    with pytest.raises(ContractError) as info:
        LossScaleState.from_dict({"kind": "dynamic", "seed": 2.0, "skipped": 0}, "c.ckpt")
    assert str(info.value) == "c.ckpt: loss_scale: good_steps: missing (needed by dynamic loss scaling)"


def test_writing_an_invalid_record_fails_in_the_writer():
    with pytest.raises(ValueError, match="writing an invalid microtrain.training: loss"):
        TrainingMeta(1, "hinge", "mean", [1], None, -1, False).to_json()


def test_an_error_raised_without_a_file_is_given_one_by_its_caller():
    e = UserError(None, "no trainable tensors", "--trainable")
    assert str(e.at("m.circle")) == "m.circle: --trainable: no trainable tensors"
    assert str(UserError("a", "x").at("b")) == "a: x"  # a file already named is kept
