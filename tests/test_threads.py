"""limit_blas_threads: the limit holds for the rest of the process (checked in a
fresh interpreter, so that this test process keeps its own pools)."""
import subprocess
import sys

import pytest

pytest.importorskip("threadpoolctl")


def test_limit_holds_after_the_call():
    code = ("import numpy; from microtrain.threads import limit_blas_threads, blas_threads; "
            "limit_blas_threads(1); print(blas_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_rejects_zero():
    from microtrain.threads import limit_blas_threads
    with pytest.raises(ValueError):
        limit_blas_threads(0)
