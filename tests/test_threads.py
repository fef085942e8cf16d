"""limit_blas_threads: the limit holds for the rest of the process (checked in a
fresh interpreter, so that this test process keeps its own pools)."""
import subprocess
import sys

import pytest

pytest.importorskip("threadpoolctl")


def test_limit_holds_after_the_call():
    code = ("import numpy; from microtrain.step.threads import limit_blas_threads, blas_threads; "
            "limit_blas_threads(1); print(blas_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_rejects_zero():
    from microtrain.step.threads import limit_blas_threads
    with pytest.raises(ValueError):
        limit_blas_threads(0)


def test_share_of_cores_splits_the_cores_and_keeps_one_each():
    from microtrain.step.threads import cores, share_of_cores
    assert share_of_cores(1) == cores()
    assert share_of_cores(cores()) == 1
    assert share_of_cores(4 * cores()) == 1
    assert 2 * share_of_cores(2) <= max(2, cores())


def test_missing_threadpoolctl_says_how_to_install(monkeypatch):
    from microtrain.files.errors import UserError
    from microtrain.step.threads import limit_blas_threads
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import now raises ImportError
    with pytest.raises(UserError, match=r"needs threadpoolctl: pip install "
                                        r"'trainconf-microtrain\[parallel\]'"):
        limit_blas_threads(1)
