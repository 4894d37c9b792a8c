"""Ray for this project: the environment of an embedded single-machine Ray, and
`init_ray`, which keeps the caller's signal handlers (used by the launcher, the train
CLI and a rollout side that runs alone)."""

from __future__ import annotations

from typing import Any

__all__ = ["init_ray", "ray_env"]


def ray_env() -> dict[str, str]:
    """Environment for an embedded single-machine Ray (docs/design.md §8)."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind everything to 127.0.0.1
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def init_ray(**kwargs: Any) -> None:
    """`ray.init`, keeping the caller's SIGTERM and SIGINT handlers; without an `address`
    it starts a fresh local Ray (`address="local"`).

    Ray installs its own SIGTERM handler in the driver, which aborts the process
    without running our `finally` blocks (engines, sockets, placement groups and Ray
    itself stay behind). The CLI turns SIGTERM into KeyboardInterrupt; put that back.
    """
    import signal
    import threading

    import ray

    # No address: our own embedded Ray, never a cluster someone else started on this
    # machine (`ray start`), which plain `ray.init()` would join (and then refuse num_cpus).
    if not kwargs.get("address"):
        kwargs["address"] = "local"
    if not kwargs.get("log_to_driver", True):  # a quiet run: Ray's own INFO banner stays off the console
        import logging

        kwargs.setdefault("logging_level", logging.WARNING)
    main_thread = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGTERM, signal.SIGINT)
    prev = {sig: signal.getsignal(sig) for sig in sigs} if main_thread else {}
    ray.init(**kwargs)
    for sig, handler in prev.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
