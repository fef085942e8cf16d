"""Fused recurrent operators, lowered at split (trainconf/recurrent.py): the lowered graph
computes what LiteRT's fused kernel computes, for every option combination, and its gradients
through time equal PyTorch's (float64) on an independent implementation of TFLite's cell
(and torch.nn.LSTM itself for the plain cell)."""
from pathlib import Path

import numpy as np
import pytest
import torch
from ai_edge_litert.interpreter import Interpreter
from click.testing import CliRunner

from litert_reference import interpreter_outputs
from microtrain.commands.cli import main
from microtrain.files.errors import UserError
from microtrain.files.format.model import load_model, model_from_bytes, model_to_bytes, save_model
from microtrain.files.graph import Graph, Op, Tensor
from microtrain.trainer import Trainer
from torch_reference import ACT
from trainconf.inspect import describe
from trainconf.recurrent import lower_recurrent
from trainconf.split import split
from trainconf.writer import graph_to_model

FIXTURES = Path(__file__).parent / "fixtures" / "recurrent"  # batch 1, unlike the others
GATES = "ifco"
D, H, T = 3, 4, 5
UNI, BI, RNN = ("UNIDIRECTIONAL_SEQUENCE_LSTM", "BIDIRECTIONAL_SEQUENCE_LSTM",
                "UNIDIRECTIONAL_SEQUENCE_RNN")


# -- single-operator models -----------------------------------------------------------------------

def lstm_weights(rng, cifg=False, peephole=False, projection=0, projection_bias=True) -> dict:
    """One direction's weights by role: x{g}, h{g}, b{g}, p{g} (peephole), proj, proj_b."""
    out = projection or H
    w = {}
    for g in GATES:
        if cifg and g == "i":
            continue
        w[f"x{g}"] = rng.normal(0, 0.5, (H, D))
        w[f"h{g}"] = rng.normal(0, 0.5, (H, out))
        w[f"b{g}"] = rng.normal(0, 0.3, H)
        if peephole and g != "c":
            w[f"p{g}"] = rng.normal(0, 0.5, H)
    if projection:
        w["proj"] = rng.normal(0, 0.5, (projection, H))
        if projection_bias:
            w["proj_b"] = rng.normal(0, 0.3, projection)
    return {k: v.astype(np.float32) for k, v in w.items()}


def lstm_slots(w: dict) -> list:
    """The 17 weight inputs of one direction in TFLite's order (None: absent)."""
    return ([w.get(f"x{g}") for g in GATES] + [w.get(f"h{g}") for g in GATES]
            + [w.get(f"p{g}") for g in "ifo"] + [w.get(f"b{g}") for g in GATES]
            + [w.get("proj"), w.get("proj_b")])


def units(w: dict) -> int:
    return len(w["proj"]) if "proj" in w else H


class Maker:
    """A one-operator model: graph input x, constant weights, variable zero states."""

    def __init__(self, x_shape):
        self.tensors, self.variables = [], []
        self.x = self.add(x_shape)

    def add(self, shape, data=None) -> int:
        self.tensors.append(Tensor(len(self.tensors), f"w{len(self.tensors)}", tuple(shape),
                                   np.dtype(np.float32), data))
        return len(self.tensors) - 1

    def inputs(self, arrays) -> list[int]:
        return [-1 if a is None else self.add(a.shape, a) for a in arrays]

    def state(self, shape) -> int:
        self.variables.append(self.add(shape))
        return self.variables[-1]

    def model(self, op_type, inputs, out_shapes, **options):
        outs = [self.add(s) for s in out_shapes]
        for t, name in zip(outs, ("out", "out_bw")):
            self.tensors[t].name = name
        model = graph_to_model(Graph(self.tensors, [Op(0, op_type, inputs, outs, options)],
                                     [self.x], outs), "test", {})
        for t in self.variables:
            model.subgraphs[0].tensors[t].isVariable = True
        return model


def sequence_shape(batch, features, time_major):
    return (T, batch, features) if time_major else (batch, T, features)


def uni_lstm(weights, batch, time_major=False, **options):
    m = Maker(sequence_shape(batch, D, time_major))
    out = units(weights)
    inputs = [m.x] + m.inputs(lstm_slots(weights)) + [m.state((batch, out)), m.state((batch, H))]
    inputs += [-1] * 4  # no layer normalization
    options = {"fused_activation_function": 4, "time_major": time_major, **options}
    return m.model(UNI, inputs, [sequence_shape(batch, out, time_major)], **options)


def bi_lstm(fw, bw, batch, time_major, merge_outputs, **options):
    m = Maker(sequence_shape(batch, D, time_major))
    inputs = [m.x] + m.inputs(lstm_slots(fw)) + m.inputs(lstm_slots(bw))
    inputs += [m.state((batch, units(fw))), m.state((batch, H)),
               m.state((batch, units(bw))), m.state((batch, H))] + [-1] * 9  # no aux input
    shapes = ([sequence_shape(batch, units(fw) + units(bw), time_major)] if merge_outputs else
              [sequence_shape(batch, units(fw), time_major), sequence_shape(batch, units(bw),
                                                                            time_major)])
    options = {"fused_activation_function": 4, "time_major": time_major,
               "merge_outputs": merge_outputs, **options}
    return m.model(BI, inputs, shapes, **options)


def rnn_weights(rng) -> dict:
    return {"x": rng.normal(0, 0.5, (H, D)).astype(np.float32),
            "h": rng.normal(0, 0.5, (H, H)).astype(np.float32),
            "b": rng.normal(0, 0.3, H).astype(np.float32)}


def rnn(weights, batch, time_major=False, activation=4):
    m = Maker(sequence_shape(batch, D, time_major))
    inputs = [m.x] + m.inputs([weights["x"], weights["h"], weights["b"]]) + [m.state((batch, H))]
    return m.model(RNN, inputs, [sequence_shape(batch, H, time_major)], time_major=time_major,
                   fused_activation_function=activation)


# -- references -----------------------------------------------------------------------------------

def litert(model, x: np.ndarray) -> list[np.ndarray]:
    """LiteRT on the whole batch at the model's fixed shapes."""
    interpreter = Interpreter(model_content=model_to_bytes(model, b"TFL3"))
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    return [interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()]


def lowered(model):
    copy = model_from_bytes(model_to_bytes(model))
    assert lower_recurrent(copy) == 1
    return copy


def torch_lstm(x, w: dict, options: dict, reverse=False):
    """TFLite's LSTM cell over batch-major x (float64), from the zero state."""
    act = ACT[options.get("fused_activation_function", 4)]
    cell_clip, proj_clip = options.get("cell_clip", 0.0), options.get("proj_clip", 0.0)
    clip = (lambda v, limit: v.clamp(-limit, limit) if limit > 0 else v)
    batch, steps = x.shape[:2]
    h, c = x.new_zeros(batch, w["proj"].shape[0] if "proj" in w else H), x.new_zeros(batch, H)
    outputs = [None] * steps
    for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
        z = {g: x[:, t] @ w[f"x{g}"].T + h @ w[f"h{g}"].T + w[f"b{g}"] for g in GATES
             if f"x{g}" in w}
        f = torch.sigmoid(z["f"] + (c * w["pf"] if "pf" in w else 0))
        i = 1 - f if "xi" not in w else torch.sigmoid(z["i"] + (c * w["pi"] if "pi" in w else 0))
        c = clip(f * c + i * act(z["c"]), cell_clip)
        o = torch.sigmoid(z["o"] + (c * w["po"] if "po" in w else 0))
        h = o * act(c)
        if "proj" in w:
            h = clip(h @ w["proj"].T + (w["proj_b"] if "proj_b" in w else 0), proj_clip)
        outputs[t] = h
    return torch.stack(outputs, 1)


def torch_rnn(x, w: dict, activation: int):
    h = x.new_zeros(x.shape[0], H)
    outputs = []
    for t in range(x.shape[1]):
        h = ACT[activation](x[:, t] @ w["x"].T + h @ w["h"].T + w["b"])
        outputs.append(h)
    return torch.stack(outputs, 1)


def leaves(weights: dict) -> dict:
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in weights.items()}


def batch_major(y: np.ndarray, time_major: bool) -> np.ndarray:
    return y.transpose(1, 0, 2) if time_major else y


def gate_groups(w: dict) -> tuple[list, list]:
    """The gates with a peephole, and the others (TFLite's order i, f, c, o in each)."""
    gates = [g for g in GATES if f"x{g}" in w]
    return [g for g in gates if f"p{g}" in w], [g for g in gates if f"p{g}" not in w]


def lowered_names(w: dict, prefix: str) -> dict:
    """The tensors the lowering trains, made of the weights by role: the rows of the gates
    without a peephole in input_kernel and bias; a peephole gate's input kernel rows in
    peephole_gates_input_kernel, its bias in bias_{g}; recurrent rows peephole gates first."""
    peeped, plain = gate_groups(w)
    out = {f"{prefix}input_kernel": np.concatenate([w[f"x{g}"] for g in plain]),
           f"{prefix}bias": np.concatenate([w[f"b{g}"] for g in plain]),
           f"{prefix}recurrent_kernel": np.concatenate([w[f"h{g}"] for g in peeped + plain])}
    if peeped:
        out[f"{prefix}peephole_gates_input_kernel"] = np.concatenate([w[f"x{g}"] for g in peeped])
    for g in peeped:
        out[f"{prefix}peephole_{g}"] = w[f"p{g}"].reshape(1, 1, 1, -1)
        out[f"{prefix}bias_{g}"] = w[f"b{g}"]
    return out


# -- forward: LiteRT's fused kernel = the lowered graph ------------------------------------------

LSTM_CASES = {
    "plain": ({}, {}),
    "clips_projection": (dict(projection=3), dict(cell_clip=0.6, proj_clip=0.4)),
    "projection_no_bias": (dict(projection=5, projection_bias=False), {}),
    "peephole": (dict(peephole=True), {}),
    "cifg_peephole": (dict(cifg=True, peephole=True), dict(cell_clip=0.8)),
    "relu6": ({}, dict(fused_activation_function=3)),
    "relu_projection": (dict(projection=2), dict(fused_activation_function=1)),
}


def x_for(rng, batch, time_major=False) -> np.ndarray:
    return rng.normal(0, 1.5, sequence_shape(batch, D, time_major)).astype(np.float32)


@pytest.mark.parametrize("time_major", [False, True], ids=["batch_major", "time_major"])
@pytest.mark.parametrize("case", LSTM_CASES)
def test_unidirectional_lstm_forward_equals_litert(case, time_major):
    rng = np.random.default_rng(1)
    kinds, options = LSTM_CASES[case]
    w = lstm_weights(rng, **kinds)
    model, x = uni_lstm(w, 2, time_major, **options), x_for(rng, 2, time_major)
    (want,) = litert(model, x)
    (got,) = litert(lowered(model), x)
    np.testing.assert_allclose(got, want, atol=1e-5)
    ours = torch_lstm(torch.tensor(batch_major(x, time_major), dtype=torch.float64),
                      leaves(w), options).detach().numpy()
    np.testing.assert_allclose(batch_major(want, time_major), ours, atol=1e-5)


def torch_bidirectional(x, fw: dict, bw: dict, options: dict, merge: bool) -> list:
    """Both directions over batch-major x, the backward one over reversed time."""
    xs = torch.tensor(x, dtype=torch.float64)
    outputs = [torch_lstm(xs, fw, options), torch_lstm(xs, bw, options, reverse=True)]
    return [torch.cat(outputs, -1)] if merge else outputs


BI_CASES = {"plain": ({}, {}), "peephole_projection": (dict(peephole=True), dict(projection=H)),
            "cifg": (dict(cifg=True), dict(cifg=True, peephole=True))}  # LiteRT: same units


@pytest.mark.parametrize("time_major", [False, True], ids=["batch_major", "time_major"])
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "two_outputs"])
@pytest.mark.parametrize("case", BI_CASES)
def test_bidirectional_lstm_forward_equals_litert(case, merge, time_major):
    """Batch-major at batch 1: LiteRT's kernel mixes up the samples of a batch-major batch
    above 1 (its outputs change from run to run there); time-major at batch 2."""
    rng = np.random.default_rng(2)
    fw, bw = (lstm_weights(rng, **kinds) for kinds in BI_CASES[case])
    batch = 2 if time_major else 1
    model = bi_lstm(fw, bw, batch, time_major, merge, cell_clip=0.7)
    x = x_for(rng, batch, time_major)
    want, got = litert(model, x), litert(lowered(model), x)
    assert len(got) == len(want) == (1 if merge else 2)
    ours = torch_bidirectional(batch_major(x, time_major), leaves(fw), leaves(bw),
                               {"cell_clip": 0.7}, merge)
    for a, b, c in zip(got, want, ours):
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(batch_major(b, time_major), c.detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("time_major", [False, True], ids=["batch_major", "time_major"])
@pytest.mark.parametrize("activation", [4, 1, 0], ids=["tanh", "relu", "none"])
def test_rnn_forward_equals_litert(activation, time_major):
    rng = np.random.default_rng(3)
    w = rnn_weights(rng)
    model, x = rnn(w, 2, time_major, activation), x_for(rng, 2, time_major)
    (want,) = litert(model, x)
    np.testing.assert_allclose(litert(lowered(model), x)[0], want, atol=1e-5)
    ours = torch_rnn(torch.tensor(batch_major(x, time_major), dtype=torch.float64), leaves(w),
                     activation)
    np.testing.assert_allclose(batch_major(want, time_major), ours.detach().numpy(), atol=1e-5)


# -- training: microtrain's forward and gradients through time -----------------------------------

def split_and_compare(model, x, reference, tmp_path) -> None:
    """Split the model (mse on its outputs); microtrain's outputs, loss and gradients equal
    torch's.  `reference()` returns the torch outputs (the reference cell, checked against
    LiteRT above) and the leaves by lowered tensor name (as lowered_names arranges them)."""
    path = tmp_path / "model.circle"
    save_model(model, path)
    trainer = Trainer(split(path, tmp_path, loss="mse").frozen, batch_size=len(x),
                      optimizer="sgd")
    outputs, named = reference()
    for got, want in zip(trainer.predict([x]), outputs):
        np.testing.assert_allclose(got, want.detach().numpy(), atol=1e-5)
    rng = np.random.default_rng(9)
    targets = [rng.normal(0, 0.5, y.shape).astype(np.float32) for y in outputs]
    loss, grads = trainer.gradients([x], targets)
    total = sum(((y - torch.tensor(t, dtype=torch.float64)) ** 2).mean()
                for y, t in zip(outputs, targets))
    total.backward()
    assert loss == pytest.approx(total.item(), rel=1e-5)
    names = {trainer.art.forward.tensors[t].name: g for t, g in grads.items()}
    assert set(names) == set(named)
    for name, leaf in named.items():
        want_grad = leaf.grad.numpy()
        err = np.linalg.norm(names[name] - want_grad) / np.linalg.norm(want_grad)
        assert err < 1e-5, name


def joined(w: dict, prefix: str, extra: dict) -> tuple[dict, dict]:
    """Leaves by lowered name (and `extra`), and the views of them by role for torch_lstm."""
    named = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
             for k, v in lowered_names(w, prefix).items()}
    named.update(extra)
    peeped, plain = gate_groups(w)
    rows = lambda k: slice(k * H, (k + 1) * H)  # noqa: E731
    roles = {}
    for k, g in enumerate(plain):
        roles[f"x{g}"] = named[f"{prefix}input_kernel"][rows(k)]
        roles[f"b{g}"] = named[f"{prefix}bias"][rows(k)]
    for k, g in enumerate(peeped):
        roles[f"x{g}"] = named[f"{prefix}peephole_gates_input_kernel"][rows(k)]
        roles[f"b{g}"] = named[f"{prefix}bias_{g}"]
        roles[f"p{g}"] = named[f"{prefix}peephole_{g}"].reshape(-1)
    for k, g in enumerate(peeped + plain):
        roles[f"h{g}"] = named[f"{prefix}recurrent_kernel"][rows(k)]
    return named, roles


@pytest.mark.parametrize("case", LSTM_CASES)
def test_unidirectional_lstm_gradients_match_torch(case, tmp_path):
    rng = np.random.default_rng(4)
    kinds, options = LSTM_CASES[case]
    w = lstm_weights(rng, **kinds)
    model, x = uni_lstm(w, 1, **options), x_for(rng, 3)
    # the projection trains as the model's own tensors, inputs 16 and 17
    sg = model.subgraphs[0]
    names = {k: sg.tensors[sg.operators[0].inputs[p]].name for p, k in ((16, "proj"),
                                                                         (17, "proj_b"))}
    projection = {k: torch.tensor(w[k], dtype=torch.float64, requires_grad=True)
                  for k in names if k in w}

    def reference():
        named, roles = joined(w, "out/", {names[k]: v for k, v in projection.items()})
        roles.update(projection)
        return [torch_lstm(torch.tensor(x, dtype=torch.float64), roles, options)], named
    split_and_compare(model, x, reference, tmp_path)


def test_plain_lstm_gradients_match_torch_nn_lstm(tmp_path):
    """torch.nn.LSTM has TFLite's plain cell, and its gate rows are ours: i, f, c (g), o."""
    rng = np.random.default_rng(5)
    w = lstm_weights(rng)
    model, x = uni_lstm(w, 1), x_for(rng, 3)
    lstm = torch.nn.LSTM(D, H, batch_first=True).double()
    names = lowered_names(w, "out/")
    with torch.no_grad():
        lstm.weight_ih_l0.copy_(torch.tensor(names["out/input_kernel"]))
        lstm.weight_hh_l0.copy_(torch.tensor(names["out/recurrent_kernel"]))
        lstm.bias_ih_l0.copy_(torch.tensor(names["out/bias"]))
        lstm.bias_hh_l0.zero_()

    def reference():
        named = {"out/input_kernel": lstm.weight_ih_l0, "out/recurrent_kernel": lstm.weight_hh_l0,
                 "out/bias": lstm.bias_ih_l0}
        return [lstm(torch.tensor(x, dtype=torch.float64))[0]], named
    split_and_compare(model, x, reference, tmp_path)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "two_outputs"])
def test_bidirectional_lstm_gradients_match_torch(merge, tmp_path):
    rng = np.random.default_rng(6)
    fw, bw = lstm_weights(rng, peephole=True), lstm_weights(rng, cifg=True)
    model, x = bi_lstm(fw, bw, 1, False, merge, cell_clip=0.9), x_for(rng, 3)

    def reference():
        fw_named, fw_roles = joined(fw, "out/fw/", {})
        bw_named, bw_roles = joined(bw, "out/bw/", {})
        return (torch_bidirectional(x, fw_roles, bw_roles, {"cell_clip": 0.9}, merge),
                {**fw_named, **bw_named})
    split_and_compare(model, x, reference, tmp_path)


def test_rnn_gradients_match_torch(tmp_path):
    rng = np.random.default_rng(7)
    w = rnn_weights(rng)
    model, x = rnn(w, 1), x_for(rng, 3)

    def reference():
        named = {"out/input_kernel": w["x"], "out/recurrent_kernel": w["h"], "out/bias": w["b"]}
        named = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
                 for k, v in named.items()}
        roles = {"x": named["out/input_kernel"], "h": named["out/recurrent_kernel"],
                 "b": named["out/bias"]}
        return [torch_rnn(torch.tensor(x, dtype=torch.float64), roles, 4)], named
    split_and_compare(model, x, reference, tmp_path)


# -- a tf_keras classifier, as the TF converter writes it -----------------------------------------

def sequences(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences [n, 10, 4]; the class is the feature (of the first 3) with the largest sum."""
    x = np.random.default_rng(seed).normal(0, 1, (n, 10, 4)).astype(np.float32)
    return x, np.eye(3, dtype=np.float32)[x[..., :3].sum(1).argmax(-1)]


def test_keras_lstm_classifier_is_lowered_and_inspected():
    model = load_model(FIXTURES / "lstm_classifier.tflite")
    operators = describe(model)["subgraphs"][0]["operators"]
    assert [op["training"] for op in operators if op["type"] == UNI] == ["lowered"]
    lower_recurrent(model)
    types = [op["type"] for op in describe(model)["subgraphs"][0]["operators"]]
    assert UNI not in types
    # the classifier keeps the last step: read from it, not sliced out of the joined sequence
    assert "CONCATENATION" not in types and "STRIDED_SLICE" not in types


@pytest.mark.parametrize("trainable", ["all", "last:2"])
def test_keras_lstm_classifier_trains(trainable, tmp_path):
    x, y = sequences(96, 0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    result = split(FIXTURES / "lstm_classifier.tflite", tmp_path, trainable=trainable)
    names = {t["name"] for t in result.trainable}
    # the cell (its input and recurrent kernels) is one layer, as a Keras 3 LSTM's
    assert any(n.endswith("/recurrent_kernel") for n in names)
    assert any(n.endswith("/input_kernel") for n in names)
    got = Trainer(result.frozen).predict([x[:8]])[0]
    want = interpreter_outputs(FIXTURES / "lstm_classifier.tflite", [x[:8]])[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
    run = CliRunner().invoke(main, ["run", str(result.frozen), "--input", str(tmp_path / "x.npy"),
                                    "--target", str(tmp_path / "y.npy"), "--epochs", "2",
                                    "--learning-rate", "0.01", "--batch-size", "16", "--json"])
    assert run.exit_code == 0, run.output
    import json
    epochs = [json.loads(line) for line in run.stdout.splitlines()][:-1]
    assert all(np.isfinite(e["loss"]) for e in epochs)
    assert epochs[-1]["loss"] < epochs[0]["loss"]


# -- refusals -------------------------------------------------------------------------------------

def refusal(model, tmp_path) -> str:
    path = tmp_path / "bad.circle"
    save_model(model, path)
    with pytest.raises(UserError) as e:
        split(path, tmp_path)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_layer_normalization_is_refused(tmp_path):
    model = uni_lstm(lstm_weights(np.random.default_rng(0)), 1)
    sg = model.subgraphs[0]
    coefficients = sg.operators[0].inputs[1]  # any constant [H, D] stands in: it is refused first
    sg.operators[0].inputs[20] = coefficients
    assert f"({UNI}) has layer normalization" in refusal(model, tmp_path)


def test_sign_bit_activation_is_refused(tmp_path):
    model = rnn(rnn_weights(np.random.default_rng(0)), 1, activation=5)
    assert f"({RNN}) has fused activation SIGN_BIT" in refusal(model, tmp_path)


def test_lstm_without_activation_is_refused(tmp_path):
    """LiteRT's kernel does not compute NONE as the identity: nothing to match."""
    model = uni_lstm(lstm_weights(np.random.default_rng(0)), 1, fused_activation_function=0)
    assert f"({UNI}) has fused activation NONE" in refusal(model, tmp_path)


def test_a_computed_state_is_refused(tmp_path):
    model = uni_lstm(lstm_weights(np.random.default_rng(0)), 1)
    sg = model.subgraphs[0]
    sg.operators[0].inputs[18] = sg.operators[0].inputs[0]  # the state read from the input
    assert "only the zero state" in refusal(model, tmp_path)
