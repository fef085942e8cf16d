"""Per-process limits on BLAS threads, for running several trainings at once.

numpy's OpenBLAS starts one thread per core in every process: two training
processes on two cores then fight over them and run up to 55x slower than one.
Each worker process calls `limit_blas_threads(share_of_cores(workers))` first.
threadpoolctl (an optional extra, `[parallel]`) is the well-kept way to change
the thread count of an already-loaded BLAS library."""
import os

from .errors import UserError

INSTALL_HINT = "pip install 'trainconf-microtrain[parallel]'"


def cores() -> int:
    """Cores this process may run on (its CPU affinity, where the OS reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_of_cores(workers: int) -> int:
    """BLAS threads each of `workers` processes may use so that together they use
    every core once (at least one each)."""
    return max(1, cores() // max(1, workers))


def limit_blas_threads(threads: int):
    """Cap this process's BLAS thread pools (OpenBLAS, MKL, BLIS) at `threads`.
    Returns threadpoolctl's limiter (`.restore_original_limits()` undoes it); a
    worker process keeps the limit for its whole life."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        raise UserError(None, f"limiting BLAS threads needs threadpoolctl: {INSTALL_HINT}") from None
    return threadpool_limits(limits=threads, user_api="blas")
