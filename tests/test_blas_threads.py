"""The BLAS thread limit that parallel trainings (sweep --jobs) put on each worker."""
import sys

import numpy as np  # noqa: F401  (loads the BLAS library whose threads are limited)
import pytest
from threadpoolctl import threadpool_info

from microtrain.blas_threads import cores, limit_blas_threads, share_of_cores
from microtrain.errors import UserError


def _blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_limit_and_restore():
    before = _blas_threads()
    assert before, "numpy's BLAS is not visible to threadpoolctl"
    limiter = limit_blas_threads(1)
    try:
        assert _blas_threads() == {1}
    finally:
        limiter.restore_original_limits()
    assert _blas_threads() == before


def test_share_of_cores_splits_the_cores_and_keeps_one_each():
    assert share_of_cores(1) == cores()
    assert share_of_cores(cores()) == 1
    assert share_of_cores(4 * cores()) == 1
    assert sum(share_of_cores(2) for _ in range(2)) <= max(2, cores())


def test_missing_threadpoolctl_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import now raises ImportError
    with pytest.raises(UserError, match=r"needs threadpoolctl: pip install 'trainconf-microtrain\[parallel\]'"):
        limit_blas_threads(1)
