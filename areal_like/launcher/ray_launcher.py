"""The Ray launcher: every actor a Ray actor, placed in the pools' placement groups.

The one place in the project that starts Ray (`init_ray`, through `RayLauncher.up`) and
the one that knows Ray's errors: a call's `RayRef` turns them into the launcher's own
(`areal_like/launcher/base.py`) as it resolves:

- `RayActorError` (the actor died, or cannot be reached): `ActorDied`; so are the errors
  that say the actor's process is gone without being one: `OutOfMemoryError` (Ray's
  memory monitor killed it: every later call on it raises this one too, with the memory
  the process and the node had), `WorkerCrashedError`, `NodeDiedError`, `LocalRayletDiedError`;
- `RayTaskError` (the method raised): the method's own exception, as itself, with the
  actor's traceback as a note; `ActorCallError` when it could not travel;
- `GetTimeoutError`: `TimeoutError`; any other `RayError` (an object lost, a worker
  crashed, the task cancelled): `ActorCallError` with its text.

Ray is imported when a Ray launcher is brought up or used, never on import of this module.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from areal_like.launcher.base import ActorCallError, ActorDied, Placement, Ref, kill

log = logging.getLogger(__name__)

__all__ = ["RayActor", "RayLauncher", "RayRef", "init_ray", "oom_message", "ray_env"]


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
        kwargs.setdefault("logging_level", logging.WARNING)
    main_thread = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGTERM, signal.SIGINT)
    prev = {sig: signal.getsignal(sig) for sig in sigs} if main_thread else {}
    ray.init(**kwargs)
    for sig, handler in prev.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
def _convert(error: BaseException) -> BaseException | None:
    """The launcher's error for one of Ray's (module docstring); None: not Ray's, as is."""
    from ray import exceptions as rx

    if not isinstance(error, rx.RayError):
        return None
    if isinstance(error, rx.OutOfMemoryError) or (isinstance(error, rx.RayActorError) and _oom_text(str(error))):
        return ActorDied(oom_message(str(error)))
    if isinstance(error, (rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError, rx.LocalRayletDiedError)):
        first = (str(error).strip().splitlines() or [""])[0]
        return ActorDied(f"{type(error).__name__}: {first}" if first else type(error).__name__)
    if isinstance(error, rx.GetTimeoutError):
        return TimeoutError(str(error))
    if isinstance(error, rx.RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, rx.RayError):
            # Ray's text of it (what `ray.get` raises keeps only that) carries the actor's traceback
            tb = getattr(error, "traceback_str", "") or str(error)
            pid = getattr(error, "pid", None)
            try:
                cause.add_note(f"in actor process {pid}:\n{tb}" if pid else f"in the actor:\n{tb}")
            except Exception:
                pass
            return cause
        if isinstance(cause, rx.RayError):  # the original could not travel: Ray sent its text
            return ActorCallError(str(cause).strip(), None)
    lines = [x for x in str(error).splitlines() if x.strip() and not x.startswith("ray::")]
    return ActorCallError(lines[-1].strip() if lines else type(error).__name__, None)


_OOM_MARK = "running low on memory"
"""What Ray's memory monitor writes when it kills a worker (raylet: `OutOfMemoryError`, or
the death cause of an `ActorDiedError` for calls made after it)."""


def _oom_text(text: str) -> bool:
    return _OOM_MARK in text


def oom_message(text: str) -> str:
    """One line for a process Ray's memory monitor killed: the memory the process and the
    node had, and Ray's threshold (`RAY_memory_usage_threshold`), read out of Ray's text
    (its layout varies by version: what is not found is left out)."""
    import re

    used = re.search(r"memory used=([\d.]+\s*[KMGT]?i?B)", text)
    node = re.search(r"was ([\d.]+\s*[KMGT]?i?B) / ([\d.]+\s*[KMGT]?i?B)(?: \(([\d.]+)\))?", text)
    threshold = re.search(r"memory usage threshold of (\d+(?:\.\d+)?)", text)
    parts = ["OutOfMemoryError: Ray's memory monitor killed the process (the node ran low on memory)"]
    if used:
        parts.append(f"it had {used.group(1)}")
    if node:
        parts.append(f"the node had {node.group(1)} of {node.group(2)} in use"
                     + (f" ({node.group(3)} > Ray's threshold {threshold.group(1)})" if node.group(3) and threshold
                        else ""))
    return "; ".join(parts)


def _reraise(error: BaseException) -> None:
    out = _convert(error)
    if out is None:
        raise error
    raise out from (None if out is getattr(error, "cause", None) else error)


# ---------------------------------------------------------------------------------------
# refs and handles
# ---------------------------------------------------------------------------------------
class RayRef(Ref):
    """One call's Ray `ObjectRef`, resolving to the launcher's errors."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def __await__(self) -> Any:
        return self._result().__await__()

    async def _result(self) -> Any:
        try:
            return await self.ref
        except Exception as e:
            _reraise(e)

    @classmethod
    def _get_many(cls, refs: list[Any], timeout: float | None) -> list[Any]:
        import ray

        try:
            return list(ray.get([r.ref for r in refs], timeout=timeout))
        except Exception as e:
            _reraise(e)
            raise  # unreachable

    @classmethod
    def _wait_many(cls, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        import ray

        mine = {r.ref: r for r in refs}
        done, pending = ray.wait(list(mine), num_returns=num_returns, timeout=timeout)
        return [mine[d] for d in done], [mine[p] for p in pending]


class _RayMethod:
    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> RayRef:
        return RayRef(self._method.remote(*args, **kwargs))


class RayActor:
    """A Ray actor's handle with the launcher's face: `handle.method.remote()` gives a `RayRef`."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self.actor_name = name

    def __getattr__(self, name: str) -> _RayMethod:  # the actor's methods (this handle's own start with _ or actor_)
        if name.startswith("_"):
            raise AttributeError(name)
        return _RayMethod(getattr(self._handle, name))

    def __repr__(self) -> str:
        return f"RayActor({self.actor_name})"

    def actor_kill(self) -> None:
        import ray

        try:
            ray.kill(self._handle, no_restart=True)
        except Exception:  # already gone
            pass


# ---------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------
class RayLauncher:
    """Actors on Ray: an embedded single-machine Ray, or the cluster at `address`
    (`cluster.ray_address`). `up` starts or joins it (not when this process is in Ray
    already: a Ray actor, or a caller that ran `ray.init`); `shutdown` stops only a Ray
    that `up` started."""

    runtime: str | None = "ray"
    address = "ray"
    """What `areal_like.launcher.connect` takes for this launcher: the Ray the process is in."""

    def __init__(self, *, address: str | None = None, num_cpus: float | None = None, verbose: bool = False) -> None:
        self.cluster_address = address
        self.num_cpus = num_cpus
        """The CPUs the run needs: an embedded Ray gets at least these (else this machine's
        count); None: Ray counts them itself."""
        self.verbose = verbose
        self._started = False

    @classmethod
    def connect(cls) -> RayLauncher:
        """The Ray this process is already in (a Ray actor, or a caller's `ray.init`)."""
        import sys

        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            raise RuntimeError("no Ray in this process: call ray.init() first, or give a launcher")
        return cls()

    def up(self) -> None:
        import ray

        for k, v in ray_env().items():
            os.environ.setdefault(k, v)
        if ray.is_initialized():
            return
        if self.cluster_address:
            init_ray(address=self.cluster_address, include_dashboard=False, log_to_driver=self.verbose)
        else:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": self.verbose,
                                      "runtime_env": {"env_vars": ray_env()}}
            if self.num_cpus is not None:
                kwargs["num_cpus"] = max(os.cpu_count() or 1, self.num_cpus)
            init_ray(**kwargs)
        self._started = True

    def spawn(self, cls: type, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, *, name: str,
              cpus: float = 0.0, gpus: float = 0.0, threads: int | None = None, env: dict[str, str] | None = None,
              stdio: str | None = None, placement: Placement | None = None, concurrency: int | None = None,
              record_calls: bool = True, zero_copy_tensors: bool = False) -> RayActor:
        """`Launcher.spawn`: a Ray actor that never restarts (a restart would start from
        scratch while its callers go on: they replace it themselves); `threads` become its
        OMP/MKL thread variables; `stdio` is Ray's (its logs); `name` is for messages."""
        import ray

        options: dict[str, Any] = {"name": None, "num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0,
                                   "max_task_retries": 0}
        env_vars: dict[str, str] = {}
        if threads:
            env_vars.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
        env_vars.update(env or {})
        if zero_copy_tensors:
            env_vars["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        if concurrency is not None:
            options["max_concurrency"] = concurrency
        if not record_calls:
            # every call is a task: Ray's GCS would keep an event for each (the one-hour
            # soak saw its memory grow 20 %); we never read them
            options["enable_task_events"] = False
        if placement is not None and placement.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement.group, placement_group_bundle_index=placement.bundle)
        handle = ray.remote(cls).options(**options).remote(*args, **(kwargs or {}))
        return RayActor(handle, name)

    async def aspawn(self, cls: type, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                     **options: Any) -> RayActor:
        return self.spawn(cls, args, kwargs, **options)  # Ray's `.remote()` does not block

    def place(self, name: str, bundles: list[dict[str, float]], strategy: str = "PACK") -> Any:
        from areal_like.launcher.ray_placement import place

        return place(name, bundles, strategy)

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """Ray's autoscaler hook (`ray.autoscaler.sdk.request_resources`): an autoscaling
        cluster adds nodes until `bundles` fit (a fixed cluster ignores it). Best effort: a
        failure is logged, never raised (the placement itself says when room is missing)."""
        from ray.autoscaler.sdk import request_resources

        try:
            request_resources(bundles=[dict(b) for b in bundles])
        except Exception as e:  # (an old Ray, a cluster without the autoscaler's channel)
            log.warning("could not ask Ray's autoscaler for %d bundle(s): %s", len(bundles), e)

    def remove(self, group: Any) -> None:
        if group is None:
            return
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)

    def kill(self, handle: Any) -> None:
        kill(handle)

    def shutdown(self) -> None:
        if self._started:
            import ray

            self._started = False
            ray.shutdown()


def ray_here() -> dict[str, Any]:
    """Where this Ray process runs (`areal_like.launcher.here`)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": list(ray.get_gpu_ids())}
