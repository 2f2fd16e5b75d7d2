"""Joining or starting a Ray cluster, and routing an actor's output to its log file."""

from __future__ import annotations

import os

from rl.startup import CACHE_ENV


def connect(address: str = "", need_cpus: float = 1.0) -> bool:
    """Joins the Ray cluster at `address` (or RAY_ADDRESS), else starts a local one.

    Returns True if this call started Ray (the caller shuts it down), False if Ray was already
    initialised in this process. A local cluster gets at least this host's CPUs and need_cpus.
    """
    import math

    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address:  # join a running cluster (Ray's own RAY_ADDRESS convention too)
        # Its workers did not start from this process: they get the compilation cache's setting
        # (rl/startup.py) through their runtime environment.
        env = {k: v for k, v in os.environ.items() if k in CACHE_ENV}
        ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": env})
    else:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, math.ceil(need_cpus)),
            include_dashboard=False,
            log_to_driver=False,
        )
    return True


def first_line(e: BaseException) -> str:
    """The innermost cause of a Ray error, on one line."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause) else ''}"
