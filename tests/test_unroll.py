"""WHILE loops unrolled by trainconf split (trainconf/unroll.py): hand-written loops
(an RNN, a nested loop, loops that cannot be unrolled) and Keras 3's recurrent layers
(tests/fixtures/loops/, made by scripts/make_loop_fixtures.py)."""
from pathlib import Path

import numpy as np
import pytest

from litert_reference import interpreter_outputs
from microtrain.step import kernels
from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (add_operator_code, load_model, model_to_bytes, op_name,
                                           save_model, set_builtin_options)
from microtrain.files.graph import Graph, Op, graph_of
from test_split_gradients import GraphMaker, check_gradients
from trainconf import unroll
from trainconf.inspect import describe
from trainconf.select import select_trainable
from trainconf.split import load_prepared, resolve_precision
from trainconf.writer import graph_to_model

LOOPS = Path(__file__).parent / "fixtures" / "loops"
RNG = np.random.default_rng(11)
T, F, H = 4, 3, 5  # steps, features, hidden units of the hand-written RNN


def loop_model(path: Path, graphs: list[tuple[GraphMaker, list, list]], bools=()) -> Path:
    """A circle model of several subgraphs (the first is the main graph); an op
    WHILE's options {"cond": c, "body": b} name subgraphs; tensors (subgraph,
    tensor) in `bools` are boolean."""
    model = graph_to_model(Graph(graphs[0][0].tensors, graphs[0][0].ops, *graphs[0][1:]),
                           "test", {})
    for m, inputs, outputs in graphs[1:]:
        part = graph_to_model(Graph(m.tensors, m.ops, inputs, outputs), "test", {})
        sg = part.subgraphs[0]
        for t in sg.tensors:
            if t.buffer:
                model.buffers.append(part.buffers[t.buffer])
                t.buffer = len(model.buffers) - 1
        for op in sg.operators:
            code = part.operatorCodes[op.opcodeIndex]
            op.opcodeIndex = add_operator_code(model, op_name(part, op), code.version)
        model.subgraphs.append(sg)
    for (m, _, _), sg in zip(graphs, model.subgraphs):
        for op, written in zip(m.ops, sg.operators):
            if op.type == "WHILE":
                written.customOptions = None
                set_builtin_options(written, circle.WhileOptionsT(op.options["cond"],
                                                                  op.options["body"]))
    for sg in model.subgraphs:
        sg.name = None  # unroll names them by index
    for s, t in bools:
        model.subgraphs[s].tensors[t].type = circle.TensorType.BOOL
    save_model(model, path)
    return path


def counter_cond(limit: int, carried: int):
    """cond(i, ...) = i < limit, over `carried` loop values."""
    m = GraphMaker()
    ins = [m.tensor((), dtype=np.int32)] + [m.tensor((1,)) for _ in range(carried - 1)]
    out = m.op("LESS", [ins[0], m.tensor((), limit, np.int32)], ())
    return (m, ins, [out]), out


def count(m: GraphMaker, i: int) -> int:
    """i + 1 (int32)."""
    out = m.op("ADD", [i, m.tensor((), 1, np.int32)], ())
    m.tensors[out].dtype = np.dtype(np.int32)
    return out


def rnn_model(path: Path, steps: int = T) -> tuple[Path, dict]:
    """x [B, T, F] -> h = tanh(x[:, 0] Wi) -> WHILE over the steps: h = tanh(x[:, i] Wx + h Wh
    + b) -> dense -> softmax."""
    weights = {"Wi": RNG.normal(0, .5, (H, F)), "Wx": RNG.normal(0, .5, (H, F)), "Wh": RNG.normal(0, .5, (H, H)),
               "b": RNG.normal(0, .5, H), "Wo": RNG.normal(0, .5, (3, H))}
    body = GraphMaker()
    i, h, x = body.tensor((), dtype=np.int32), body.tensor((-1, H)), body.tensor((-1, T, F))
    step = body.op("GATHER", [x, i], (-1, F), axis=1)
    a = body.op("FULLY_CONNECTED", [step, body.tensor((H, F), weights["Wx"]),
                                    body.tensor((H,), weights["b"])], (-1, H))
    r = body.op("FULLY_CONNECTED", [h, body.tensor((H, H), weights["Wh"])], (-1, H))
    h2 = body.op("TANH", [body.op("ADD", [a, r], (-1, H))], (-1, H))
    i2 = count(body, i)
    cond, flag = counter_cond(steps, 3)
    main = GraphMaker()
    xin = main.tensor((-1, T, F))
    zero = main.tensor((), 0, np.int32)
    first = main.op("GATHER", [xin, main.tensor((), 0, np.int32)], (-1, F), axis=1)
    h0 = main.op("TANH", [main.op("FULLY_CONNECTED", [first, main.tensor((H, F), weights["Wi"])],
                                  (-1, H))], (-1, H))
    outs = [main.tensor(()), main.tensor((-1, H)), main.tensor((-1, T, F))]
    main.ops.append(Op(3, "WHILE", [zero, h0, xin], outs,
                                                            {"cond": 1, "body": 2}))
    main.tensors[outs[0]].dtype = np.dtype(np.int32)
    y = main.op("FULLY_CONNECTED", [outs[1], main.tensor((3, H), weights["Wo"])], (-1, 3))
    prob = main.op("SOFTMAX", [y], (-1, 3), beta=1.0)
    loop_model(path, [(main, [xin], [prob]), cond, (body, [i, h, x], [i2, h2, x])],
               bools=[(1, flag)])
    return path, weights


def reference_rnn(x: np.ndarray, w: dict, steps: int = T) -> np.ndarray:
    h = np.tanh(x[:, 0] @ w["Wi"].T)
    for t in range(steps):
        h = np.tanh(x[:, t] @ w["Wx"].T + w["b"] + h @ w["Wh"].T)
    y = h @ w["Wo"].T
    e = np.exp(y - y.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def forward(model, xs: list[np.ndarray]) -> list[np.ndarray]:
    """Subgraph 0 of a model without loops run by microtrain's kernels, at its fixed shapes."""
    g = graph_of(model)
    arrays = {t.index: t.data for t in g.tensors if t.data is not None}
    arrays.update(zip(g.inputs, xs))
    for op in g.ops:
        outs = [np.zeros([1 if d == -1 else d for d in g.tensors[t].shape], g.tensors[t].dtype)
                for t in op.outputs]
        kernels.build(op.type, [arrays.get(t) for t in op.inputs], outs, **op.options)()
        arrays.update(zip(op.outputs, outs))
    return [arrays[t] for t in g.outputs]


def test_rnn_unrolls_into_shared_weights(tmp_path):
    path, w = rnn_model(tmp_path / "rnn.circle")
    model = load_model(path)
    (loop,) = unroll.unroll_loops(model)
    assert loop.to_dict() == {"subgraph": 0, "operator": 3, "cond": "subgraph 1",
                              "body": "subgraph 2", "trips": T, "reason": None}
    g = graph_of(model)
    assert len(model.subgraphs) == 1 and "WHILE" not in {op.type for op in g.ops}
    dense = [op for op in g.ops if op.type == "FULLY_CONNECTED"]
    assert len(dense) == 2 * T + 2
    assert len({op.inputs[1] for op in dense}) == 4  # Wi, Wx, Wh, Wo: one tensor each
    gathers = [op for op in g.ops if op.type == "GATHER"]
    assert [int(g.tensors[op.inputs[1]].data) for op in gathers] == [0, *range(T)]
    x = RNG.normal(size=(1, T, F)).astype(np.float32)
    (got,) = forward(model, [x])
    np.testing.assert_allclose(got, reference_rnn(x, w), atol=1e-6)


def test_rnn_gradients_through_time_match_torch(tmp_path):
    path, _ = rnn_model(tmp_path / "rnn.circle")
    x = RNG.normal(size=(6, T, F)).astype(np.float32)
    t = np.eye(3, dtype=np.float32)[RNG.integers(0, 3, 6)]
    got = check_gradients(path, tmp_path, x, t, "cce")
    assert len(got) == 5  # Wi, Wx, b, Wh, Wo: Wx, b, Wh summed over the steps


def test_unrolled_steps_count_as_one_layer(tmp_path):
    path, _ = rnn_model(tmp_path / "rnn.circle")
    g = load_prepared(path, resolve_precision())[1]
    names = {t: g.tensors[t].name for t in range(len(g.tensors))}
    last1 = select_trainable(g, "last:1")
    last2 = select_trainable(g, "last:2")
    assert [names[t] for t in last1] == [names[t] for t in last2[-1:]]
    # layers Wi, the cell (x·Wx + b + h·Wh: its kernels one layer, trainconf/select.py), Wo
    assert len(last2) == 4 and len(select_trainable(g, "last:3")) == 5
    with pytest.raises(UserError, match="between 1 and 3"):
        select_trainable(g, "last:4")


def test_nested_loops_unroll(tmp_path):
    """for i < 3: for j < 2: h = tanh(h W)  (the inner loop inside the outer body)."""
    weight = RNG.normal(0, .5, (H, H))
    inner = GraphMaker()
    j, h = inner.tensor((), dtype=np.int32), inner.tensor((-1, H))
    h2 = inner.op("TANH", [inner.op("FULLY_CONNECTED", [h, inner.tensor((H, H), weight)],
                                    (-1, H))], (-1, H))
    j2 = count(inner, j)
    outer = GraphMaker()
    i, g = outer.tensor((), dtype=np.int32), outer.tensor((-1, H))
    outs = [outer.tensor((), dtype=np.int32), outer.tensor((-1, H))]
    outer.ops.append(Op(0, "WHILE", [outer.tensor((), 0, np.int32), g], outs,
                        {"cond": 3, "body": 4}))
    i2 = count(outer, i)
    main = GraphMaker()
    x = main.tensor((-1, H))
    res = [main.tensor((), dtype=np.int32), main.tensor((-1, H))]
    main.ops.append(Op(0, "WHILE", [main.tensor((), 0, np.int32), x], res,
                       {"cond": 1, "body": 2}))
    (cond_outer, f1), (cond_inner, f2) = counter_cond(3, 2), counter_cond(2, 2)
    path = loop_model(tmp_path / "nested.circle",
                      [(main, [x], [res[1]]), cond_outer, (outer, [i, g], [i2, outs[1]]),
                       cond_inner, (inner, [j, h], [j2, h2])], bools=[(1, f1), (3, f2)])
    model = load_model(path)
    loops = {(lp.subgraph, lp.operator): lp.trips for lp in unroll.unroll_loops(model)}
    assert loops == {(0, 0): [3], (2, 0): [2, 2, 2]}
    xs = RNG.normal(size=(1, H)).astype(np.float32)
    want = xs.astype(np.float64)
    for _ in range(6):
        want = np.tanh(want @ weight.T)
    np.testing.assert_allclose(forward(model, [xs])[0], want, atol=1e-6)


def test_loops_that_cannot_unroll_are_refused_in_one_line(tmp_path, monkeypatch):
    path, _ = rnn_model(tmp_path / "rnn.circle", steps=40)
    monkeypatch.setattr(unroll, "MAX_STEPS", 25)
    with pytest.raises(UserError, match=r"^operator 3 \(WHILE\): unrolling it passes 25 steps"):
        unroll.unroll_loops(load_model(path))
    # a limit read from the model's input: no static trip count
    cond = GraphMaker()
    i, n, x = cond.tensor((), dtype=np.int32), cond.tensor((), dtype=np.int32), cond.tensor((-1, 2))
    flag = cond.op("LESS", [i, n], ())
    body = GraphMaker()
    bi, bn, bx = body.tensor((), dtype=np.int32), body.tensor((), dtype=np.int32), \
        body.tensor((-1, 2))
    main = GraphMaker()
    limit, xin = main.tensor((), dtype=np.int32), main.tensor((-1, 2))
    res = [main.tensor((), dtype=np.int32), main.tensor((), dtype=np.int32), main.tensor((-1, 2))]
    main.ops.append(Op(0, "WHILE", [main.tensor((), 0, np.int32), limit, xin], res,
                       {"cond": 1, "body": 2}))
    path = loop_model(tmp_path / "dynamic.circle",
                      [(main, [limit, xin], [res[2]]), (cond, [i, n, x], [flag]),
                       (body, [bi, bn, bx], [bi, bn, bx])], bools=[(1, flag)])
    model = load_model(path)
    with pytest.raises(UserError, match=r"^operator 0 \(WHILE\): its trip count is not static: "
                                        r"the condition 'subgraph 1': its LESS reads 't1'"):
        unroll.unroll_loops(model)
    (loop,) = describe(model)["loops"]
    assert loop["trips"] is None and "not static" in loop["reason"]
    # other control flow
    m = GraphMaker()
    xin = m.tensor((-1, 2))
    m.op("IF", [m.tensor((), 1, np.int32), xin], (-1, 2))
    save_model(graph_to_model(Graph(m.tensors, m.ops, [xin], [1]), "test", {}),
               tmp_path / "if.circle")
    with pytest.raises(UserError, match=r"^operator 0 \(IF\): control flow other than WHILE"):
        unroll.unroll_loops(load_model(tmp_path / "if.circle"))


# -- Keras 3 recurrent layers -------------------------------------------------------------------

KERAS = ["lstm", "gru", "bilstm", "stacked"]


@pytest.mark.parametrize("name", KERAS)
def test_keras_loops_unroll_to_what_litert_computes(name):
    path = LOOPS / f"{name}.tflite"
    x = RNG.normal(size=(3, 5, 3)).astype(np.float32)
    (want,) = interpreter_outputs(path, [x])
    model = load_model(path)
    loops = unroll.unroll_loops(model)
    assert [lp.trips for lp in loops] == [[5]] * (2 if name in ("bilstm", "stacked") else 1)
    assert len(model.subgraphs) == 1
    (unrolled,) = interpreter_outputs(model_to_bytes(model, b"TFL3"), [x])
    np.testing.assert_allclose(unrolled, want, atol=1e-6)
    if name == "bilstm" and "REVERSE_V2" not in kernels.KERNELS:
        return  # microtrain runs it once REVERSE_V2 has a kernel
    got = np.concatenate([forward(model, [x[k:k + 1]])[0] for k in range(len(x))])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_inspect_shows_the_loops():
    desc = describe(load_model(LOOPS / "bilstm.tflite"))
    assert [(lp["operator"], lp["trips"], lp["reason"]) for lp in desc["loops"]] == \
        [(2, 5, None), (4, 5, None)]
    assert desc["loops"][0]["body"].endswith("backward_lstm_1_1/while_body")
