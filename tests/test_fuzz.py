"""Fuzzing every input of every command: a clean one-line error or a result,
never a traceback, a hang, or an edited backprop graph accepted.

Seeded and bounded: CI runs MICROTRAIN_FUZZ_EXAMPLES (default 400, about 20 s) cases; a
campaign sets it higher (and MICROTRAIN_FUZZ_SEED), collects every verdict
instead of stopping at the first failure, writes the table to
MICROTRAIN_FUZZ_REPORT and copies each failing case's files to MICROTRAIN_FUZZ_KEEP
if given:

    MICROTRAIN_FUZZ_EXAMPLES=1600 MICROTRAIN_FUZZ_REPORT=fuzz.json python -m pytest -q tests/test_fuzz.py -k corrupted -s
"""
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from fuzz_cases import KINDS, draw_case, make_corpus, run_case

EXAMPLES = int(os.environ.get("MICROTRAIN_FUZZ_EXAMPLES", "400"))
KEEP = os.environ.get("MICROTRAIN_FUZZ_KEEP")  # a folder for the files of failing cases
CAMPAIGN = "MICROTRAIN_FUZZ_EXAMPLES" in os.environ
BAD = ("traceback", "hang", "silent")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_corrupted_inputs_give_one_line_errors(corpus, tmp_path_factory):
    verdicts: Counter = Counter()
    failures: list = []

    @seed(int(os.environ.get("MICROTRAIN_FUZZ_SEED", "14")))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.generate] if CAMPAIGN else [Phase.generate, Phase.shrink])
    @given(st.data())
    def case(data):
        folder = tmp_path_factory.mktemp("case")
        c = draw_case(data.draw, corpus, folder)
        verdict, detail = run_case(c)
        verdicts[(c.kind, verdict)] += 1
        if c.kind == "backprop" and verdict == "accepted":
            verdicts[("backprop accepted", c.why or "?")] += 1
        if verdict in BAD:
            failures.append((c.kind, verdict, c.args, detail))
            if KEEP:  # the case's files, to reproduce it after the campaign
                shutil.copytree(folder, Path(KEEP) / folder.name, symlinks=True,
                                ignore_dangling_symlinks=True, dirs_exist_ok=True)
            if not CAMPAIGN:
                raise AssertionError(f"{verdict}: {' '.join(c.args)}\n{detail}")

    case()
    table = {k: {v: verdicts[(k, v)] for v in ("error", "accepted") + BAD} for k in KINDS}
    table["backprop accepted"] = {why: verdicts[("backprop accepted", why)]
                                  for why in ("unchanged", "forged", "infer", "?")}
    report = os.environ.get("MICROTRAIN_FUZZ_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"examples": EXAMPLES, "table": table, "failures": failures}, f, indent=1,
                      default=str)
    print(json.dumps(table))
    assert not failures, failures[:5]
