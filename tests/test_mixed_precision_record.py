"""Every mixed-precision scenario of the tests gives the losses, weights and
first gradients recorded before reduced-precision storage changed
(scripts/record_mixed_precision.py wrote the record): bit for bit, against the
record of the BLAS kernel set this machine's numpy runs."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from record_mixed_precision import RECORD, blas_kernels, run, scenarios  # noqa: E402

RECORDS = json.loads(RECORD.read_text())
RECORDED = RECORDS.get(blas_kernels())
pytestmark = pytest.mark.skipif(
    RECORDED is None, reason=f"no record for BLAS kernels {blas_kernels()} (recorded: "
                             f"{', '.join(RECORDS)}): run scripts/record_mixed_precision.py on "
                             "unchanged code to add one")


def test_the_record_covers_every_scenario():
    assert set(RECORDED) == set(scenarios())


@pytest.mark.parametrize("name", sorted(scenarios()))
def test_bit_identical_to_the_record(name):
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        assert run(name) == RECORDED[name]
