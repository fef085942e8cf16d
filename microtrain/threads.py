"""How many threads the BLAS library may use in this process.

Processes that train side by side on a few cores (simulated federated clients,
sweep workers) must each keep to one or two BLAS threads: two microtrain
processes that both use every core run many times slower than one.  Needs
threadpoolctl (installed by the extras that run such processes), imported here
only when called so that `microtrain` itself does not need it.
"""


def limit_blas_threads(threads: int) -> None:
    """Limit the BLAS thread pools of this process to `threads` from now on."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=threads, user_api="blas")


def blas_threads() -> int:
    """The largest thread count of this process's BLAS pools (1 if none is loaded)."""
    from threadpoolctl import threadpool_info
    return max((pool["num_threads"] for pool in threadpool_info()
                if pool["user_api"] == "blas"), default=1)
