"""The commands of microtrain as Python functions (the CLI only parses and prints)."""
import io
import math
from pathlib import Path

import numpy as np

from microtrain.files.atomic import atomic_write
from microtrain.files.artifacts import sha256
from microtrain.commands.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from microtrain.files.contracts import RunState
from microtrain.files.artifacts import sibling
from microtrain.data import load_array, spec_file, validation_split
from microtrain.files.errors import UserError
from microtrain.files.opening import check_output
from microtrain.run_config import RunConfig
from microtrain.shuffle import Shuffler
from microtrain.trainer import Trainer


def load_data(specs, shapes=(), dtypes=()) -> list[np.ndarray]:
    """The arrays of data files; `dtypes`: the types of the tensors they are loaded
    into (Trainer.data_types), so that floats are held no wider than those."""
    if shapes and len(shapes) != len(specs):
        raise UserError(None, f"{len(shapes)} sample shapes given for {len(specs)} data files")
    return [load_array(spec, shapes[i] if shapes else None,
                       dtypes[i] if i < len(dtypes) else None) for i, spec in enumerate(specs)]


def _load_set(config: RunConfig, inputs, targets, dtypes) -> tuple[list, list]:
    """(inputs, targets) of one data set, with the sample shapes and `dtypes`
    (Trainer.data_types) that load_data takes."""
    return (load_data(inputs, config.input_shapes, dtypes[0]),
            load_data(targets, config.target_shapes, dtypes[1]))


def split_test_set(config: RunConfig, xs, ts, dtypes=((), ())):
    """(training inputs, training targets, test set or None) by --validation-split
    or --test-input/--test-target (loaded as load_data loads, into `dtypes`)."""
    if config.validation_split:
        (train, test) = validation_split(xs + ts, config.validation_split)
        n = len(xs)
        return train[:n], train[n:], (test[:n], test[n:])
    if config.test_inputs:
        return xs, ts, _load_set(config, config.test_inputs, config.test_targets, dtypes)
    return xs, ts, None


def data_digest(arrays) -> str | None:
    """SHA-256 over arrays' types, shapes and bytes (None for no arrays)."""
    if not arrays:
        return None
    digest = sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(a.reshape(-1).view(np.uint8).data)  # bytes of any type (bfloat16 too)
    return digest.hexdigest()


def _resume(trainer: Trainer, path, run: RunState, epochs: int) -> dict:
    """Restore the trainer from a checkpoint of the same run (batch size, data,
    test set); returns the baseline."""
    ckpt = load_checkpoint(path, trainer.art.frozen_sha256)
    same = (("batch_size", "--batch-size"), ("data_sha256", "training data"),
            ("test_sha256", "test set (--test-input or --validation-split)"))
    for name, what in same if ckpt.run.data_sha256 else ():  # older checkpoints lack them
        if getattr(ckpt.run, name) != getattr(run, name):
            raise UserError(path, f"was saved by a run with another {what}; resume with the "
                                  "same data and options, or start afresh without --resume")
    missing = {"loss", trainer.metric} - set(ckpt.run.baseline)
    if missing:
        raise UserError(path, f"has no starting {sorted(missing)[0]} to judge improvement by",
                        "meta.json: extra.baseline")
    if epochs <= ckpt.state.epoch:
        raise UserError(path, f"has already done {ckpt.state.epoch} epochs; --epochs {epochs} "
                              "would train nothing (--epochs counts the epochs done before)")
    try:
        trainer.restore(ckpt.state)
    except UserError as e:
        raise e.at(path) from None
    return ckpt.run.baseline


def prepare(config: RunConfig) -> tuple[Trainer, list, list, tuple | None]:
    """The trainer of a `run` and its checked training data and test set (None without one)."""
    trainer = Trainer.from_config(config)
    dtypes = trainer.data_types()
    xs, ts = _load_set(config, config.inputs, config.targets, dtypes)
    xs, ts, test = split_test_set(config, xs, ts, dtypes)
    xs, ts = trainer.check_data(xs, ts, (config.inputs, config.targets))
    if test:
        test = trainer.check_data(*test, (config.test_inputs or config.inputs,
                                          config.test_targets or config.targets))
    return trainer, xs, ts, test


def reads(config: RunConfig) -> list[tuple[str, Path]]:
    """(option, file) of every file a command given `config` reads (for check_output)."""
    frozen = Path(config.frozen)
    files = [("FROZEN", frozen), ("--wof", config.wof or sibling(frozen, ".wof")),
             ("--backprop", config.backprop or sibling(frozen, ".backprop.circle"))]
    for option, specs in (("--input", config.inputs), ("--target", config.targets),
                          ("--test-input", config.test_inputs),
                          ("--test-target", config.test_targets)):
        files += [(option, spec_file(spec)) for spec in specs]
    return files


def check_run_outputs(config: RunConfig, force: bool = False) -> Path:
    """Check every file a `run` (or a sweep, or a federated run) writes before any
    work: the weights (the .wof it reads unless --output-wof; writing over that is
    the point) and the checkpoint (unless `force`, only over files of their kind);
    returns the weights' path."""
    others = [(option, path) for option, path in reads(config) if option != "--wof"]
    target = config.output_wof or config.wof or sibling(Path(config.frozen), ".wof")
    # the default target is the .wof read: a FROZEN that is that file is for the loader to name
    check_output(target, ("wof",), force, reads=others if config.output_wof else (),
                 option="--output-wof")
    if config.checkpoint and not config.resume:
        check_output(config.checkpoint, ("checkpoint",), force, reads=reads(config),
                     option="--checkpoint")
    return Path(target)


def run(config: RunConfig, on_epoch=None, progress=None, force: bool = False,
        warn=None) -> dict:
    """Train as `microtrain run`; returns the summary.  `warn(line)` is told when
    the run holds other memory than the split planned."""
    check_run_outputs(config, force)
    trainer, xs, ts, test = prepare(config)
    unplanned = trainer.unplanned()
    if warn and unplanned:
        warn(f"{config.frozen}: the plan assumed {' and '.join(unplanned)}; held memory will "
             "differ from the planned peak")
    judge = test or (xs, ts)
    run_state = RunState(baseline={}, batch_size=trainer.batch_size,
                         data_sha256=data_digest(xs + ts),
                         test_sha256=data_digest(test[0] + test[1]) if test else None)
    if config.resume:
        baseline = _resume(trainer, config.checkpoint, run_state,
                           trainer.resolved.parameters.epochs)
    else:
        baseline = trainer.evaluate(*judge)
        trainer.data_order = Shuffler(config.seed)
    run_state.baseline = baseline

    def epoch_done(record):
        if config.checkpoint:
            save_checkpoint(config.checkpoint,
                            Checkpoint(trainer.state(), trainer.art.frozen_sha256, run_state))
        if on_epoch:
            on_epoch(record)

    history = trainer.fit(xs, ts, shuffle=config.shuffle,
                          test=test, on_epoch=epoch_done, progress=progress)
    final = trainer.evaluate(*judge)
    return _save(trainer, config, baseline, final, history, judged_on="test" if test else "train")


def _save(trainer: Trainer, config: RunConfig, baseline: dict, final: dict, history,
          judged_on: str) -> dict:
    policy = config.save
    improved = trainer.improved(baseline, final)
    target = Path(config.output_wof or trainer.art.wof_path)
    saved = policy == "always" or (policy == "improved" and improved)
    if saved:
        trainer.save_weights(target)
    metric = trainer.metric
    verdict = "improved" if improved else "did not improve"
    message = (f"{judged_on} {metric} {verdict}: {baseline[metric]:.4f} -> {final[metric]:.4f}; "
               + (f"weights written to {target}" if saved else "weights not written"))
    return {"event": "summary", "model": str(config.frozen),
            "inputs": [str(i) for i in config.inputs], "epochs": trainer.epoch,
            "loss": trainer.art.training.loss,
            "optimizer": trainer.optimizer_name, "metric": metric, "judged_on": judged_on,
            f"initial_{metric}": baseline[metric], f"final_{metric}": final[metric],
            "initial_loss": baseline["loss"], "final_loss": final["loss"],
            **{f"{when}_perplexity": values["perplexity"] for when, values in
               (("initial", baseline), ("final", final)) if "perplexity" in values},
            "improved": improved, "saved": saved, "wof": str(target) if saved else None,
            "memory_bytes": trainer.memory_bytes(), "parameters": trainer.resolved.report(),
            "history": [r["loss"] for r in history], "message": message}


def evaluate(config: RunConfig) -> dict:
    """Loss and metric as `microtrain eval`: of a split model, or of a model no split
    wrote, judged by its outputs (microtrain/step/output_loss.py)."""
    trainer = Trainer.from_config(config, plain=True)
    xs, ts = _load_set(config, config.inputs, config.targets, trainer.data_types())
    result = trainer.evaluate(*trainer.check_data(xs, ts, (config.inputs, config.targets)))
    if not math.isfinite(result["loss"]):
        raise UserError(trainer.art.wof_path, f"these weights give a loss of {result['loss']} on "
                                              "the data: they overflow float32")
    return {"loss_function": trainer.art.training.loss, **result}


def infer(config: RunConfig, output, force: bool = False) -> dict:
    """Run forward as `microtrain infer` and write the outputs to `output` (.npy or .npz)."""
    out = Path(output)
    if out.suffix not in (".npy", ".npz"):
        raise UserError(out, "the output must end in .npy (one output) or .npz (several)")
    check_output(out, (out.suffix[1:],), force, reads=reads(config))
    trainer = Trainer.from_config(config, with_backprop=False, plain=True)  # a split model, or any
    xs, _ = trainer.check_data(load_data(config.inputs, config.input_shapes,
                                         trainer.data_types()[0]),
                               names=(config.inputs, None))
    outputs = trainer.predict(xs)
    if not all(np.isfinite(o).all() for o in outputs):
        raise UserError(trainer.art.wof_path, "these weights give NaN or inf outputs on the data "
                                              "(they overflow float32); nothing written")
    buf = io.BytesIO()
    if out.suffix == ".npz":
        np.savez(buf, *outputs)
    elif len(outputs) == 1:
        np.save(buf, outputs[0])
    else:
        raise UserError(out, f"the model has {len(outputs)} outputs: write them to a .npz")
    atomic_write(out, buf.getvalue())
    return {"output": str(out), "samples": len(outputs[0]), "shapes": [list(o.shape) for o in outputs]}
