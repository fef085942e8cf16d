"""How many threads the BLAS library may use in this process.

Processes that train side by side on a few cores (simulated federated clients,
sweep workers) must each keep to their share of the cores: two microtrain
processes that both use every core run many times slower than one.  Needs
threadpoolctl (the optional extra `[parallel]`), imported here only when called
so that `microtrain` itself does not need it.
"""
import os

from microtrain.files.errors import UserError

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


def require_threadpoolctl():
    """The threadpoolctl module, or a UserError saying how to install it (a parent
    process checks before it starts workers that would each fail)."""
    try:
        import threadpoolctl
    except ImportError:
        raise UserError(None, "limiting BLAS threads needs threadpoolctl: "
                              f"{INSTALL_HINT}") from None
    return threadpoolctl


def limit_blas_threads(threads: int) -> None:
    """Limit the BLAS thread pools of this process to `threads` from now on."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    require_threadpoolctl().threadpool_limits(limits=threads, user_api="blas")


def blas_threads() -> int:
    """The largest thread count of this process's BLAS pools (1 if none is loaded)."""
    pools = require_threadpoolctl().threadpool_info()
    return max((pool["num_threads"] for pool in pools if pool["user_api"] == "blas"), default=1)
