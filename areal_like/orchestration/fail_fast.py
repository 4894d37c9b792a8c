"""Fail-fast for the rollout side: failed episodes must never loop without bound.

A reward or agent-loop error is counted per episode (the run goes on through one bad
episode); but when every episode of the first `agent.fail_fast_groups` groups fails,
or more than `agent.max_failure_ratio` of the last `agent.failure_window` episodes
did, or no rollout server is left (`NoServerAvailableError`), nothing useful can come
of going on: the controller stops with `RolloutFailedError`, carrying the first
error's type, message and traceback, so the CLI prints it first and exits 1
(docs/design.md: "when every episode of the first N groups (or more than
agent.max_failure_ratio of a window) fails, the run stops with the first error's
traceback and exit 1"). Without this, a dead engine made the controller start
millions of episodes that each failed at once.

`FailFast` is plain bookkeeping (no asyncio, no I/O): the controller reports each
episode and each finished group, and asks `raise_if_tripped` in its main loop.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

from areal_like.core.types import EpisodeFailures
from rollout_cluster.server_manager import NoServerAvailableError, error_headline

__all__ = ["FailFast", "FirstError", "RolloutFailedError", "beyond_resume"]

log = logging.getLogger(__name__)

MAX_TRACEBACK_CHARS = 8000


@dataclass(frozen=True)
class FirstError:
    """An episode error as text (it crosses Ray and process boundaries)."""

    headline: str
    """The root cause, first line first: `Type: message`, or an engine's own error."""
    error_type: str
    message: str
    traceback: str
    user_traceback: str = ""
    """Only the user's frames and the exception line, for the console (empty when no
    frame of the error is user code)."""

    @classmethod
    def of(cls, error: BaseException) -> FirstError:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        # An engine's or server's error carries its own root cause (`error_headline`): that
        # leads; otherwise, when user code raised it, the user's file and line lead.
        located = None if getattr(error, "root_cause", "") else user_frame(error)
        if located is not None:  # user code raised it: its file and line lead (docs/design.md §10.12)
            where, exc = located
            ours = _ours_or_library()
            frames = [f for f in traceback.extract_tb(exc.__traceback__)
                      if not f.filename.startswith("<") and not os.path.realpath(f.filename).startswith(ours)]
            short = ("Traceback (most recent call last, your code only):\n"
                     + "".join(traceback.format_list(frames))
                     + "".join(traceback.format_exception_only(type(exc), exc)))
            return cls(f"{where}: {error_headline(exc)}", type(exc).__name__, str(exc), tb[-MAX_TRACEBACK_CHARS:],
                       short[-MAX_TRACEBACK_CHARS:])
        cause: BaseException | None = error
        while cause is not None:  # an engine's own log (EngineDeadError.details) says most
            details = getattr(cause, "details", "")
            if isinstance(details, str) and details:
                tb += f"\nthe engine's error log:\n{details}"
                break
            cause = cause.__cause__
        return cls(error_headline(error), type(error).__name__, str(error), tb[-MAX_TRACEBACK_CHARS:])


def _ours_or_library() -> tuple[str, ...]:
    """Folders whose frames are not the user's: our four packages, the standard library
    and installed packages."""
    import sysconfig
    from pathlib import Path

    here = Path(__file__).resolve().parents[2]
    roots = [str(here / p) for p in ("areal_like", "rollout_cluster", "train_cluster", "weight_sync")]
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.append(str(Path(path).resolve()))
    return tuple(r.rstrip(os.sep) + os.sep for r in roots)


def user_frame(error: BaseException) -> tuple[str, BaseException] | None:
    """`("path/file.py:LINE", exc)` for the innermost frame of user code in `error` or
    its causes (a `RewardError` wraps the user's `KeyError`), or None when no frame is
    the user's. The path is relative to the current directory when it is under it."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    ours = _ours_or_library()
    for exc in reversed(chain):  # the root cause first
        for fr in reversed(traceback.extract_tb(exc.__traceback__)):
            name = fr.filename
            if name.startswith("<") or os.path.realpath(name).startswith(ours):
                continue
            rel = os.path.relpath(name)
            return f"{name if rel.startswith('..') else rel}:{fr.lineno}", exc
    return None


class RolloutFailedError(RuntimeError):
    """The rollout side stopped because episodes kept failing (or no server is left).

    Its message starts with the root cause (`headline`), then why the run stopped,
    then the first error's traceback."""

    def __init__(self, first: FirstError, reason: str) -> None:
        super().__init__(f"{first.headline}\n{reason}\nfirst error ({first.error_type}):\n{first.traceback}")
        self.first = first
        self.reason = reason
        self.root_cause = first.headline

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.first, self.reason))


_MODEL_ERRORS = (ValueError, TypeError, KeyError, IndexError, NotImplementedError, ImportError)
"""Raised inside a library (transformers, the tokenizer, torch) while the rollout side
builds itself, these are what the model folder or the environment is (a tokenizer with
no chat template, an architecture a library does not know), not a crash of ours."""


def beyond_resume(error: BaseException) -> RolloutFailedError | None:
    """The rollout side's error as a `RolloutFailedError` (the run ends without the
    `--resume` line) when resuming cannot fix it: a `ConfigError` (the configuration, or
    the model folder found wrong once a server loads it), user code (a frame of the
    user's in its traceback), or one of `_MODEL_ERRORS` raised inside a library. None for
    what `--resume` continues from: a crash of our own code, a lost process or connection
    (docs/design.md §10.43)."""
    from areal_like.core.config import ConfigError

    if isinstance(error, RolloutFailedError) or not isinstance(error, Exception):
        return None
    if isinstance(error, ConfigError):
        text = str(error).strip()
        first = FirstError(headline=(text.splitlines() or ["ConfigError"])[0], error_type="ConfigError",
                           message=text, traceback="")
        return RolloutFailedError(first, "the rollout side stopped: fix the configuration or the model folder")
    if user_frame(error) is not None:
        return RolloutFailedError(FirstError.of(error), "the rollout side stopped on an error in user code")
    frames = traceback.extract_tb(error.__traceback__)
    ours = _ours_or_library()[:4]  # our four packages (the rest: the standard library, installed packages)
    if isinstance(error, _MODEL_ERRORS) and frames and not os.path.realpath(frames[-1].filename).startswith(ours):
        return RolloutFailedError(FirstError.of(error), "the rollout side stopped on an error of the model or a "
                                                        "library it uses")
    return None


class FailFast:
    """Counts episode outcomes and trips on the rules of the module docstring."""

    def __init__(self, *, fail_fast_groups: int = 4, max_failure_ratio: float = 0.5, window: int = 256,
                 log_first: int = 20, log_every: int = 100) -> None:
        self.fail_fast_groups = fail_fast_groups
        self.max_failure_ratio = max_failure_ratio
        self._window: deque[bool] = deque(maxlen=window)
        self._window_failed = 0
        self.failed = 0
        self.succeeded = 0
        self._groups_seen = 0
        self._early_success = False
        self.first: FirstError | None = None
        self.tripped: RolloutFailedError | None = None
        self._log_first = log_first
        self._log_every = log_every

    @classmethod
    def from_config(cls, agent: Any) -> FailFast:
        """From `AgentConfig` (`fail_fast_groups`, `max_failure_ratio`, `failure_window`)."""
        return cls(fail_fast_groups=agent.fail_fast_groups, max_failure_ratio=agent.max_failure_ratio,
                   window=agent.failure_window)

    def episode(self, error: BaseException | None) -> None:
        """One episode ended: `error` is None when it produced something (sent or rejected)."""
        failed = error is not None
        if self._window.maxlen is not None and len(self._window) == self._window.maxlen:
            self._window_failed -= self._window[0]
        self._window.append(failed)
        self._window_failed += failed
        if error is None:
            self.succeeded += 1
            return
        self.failed += 1
        if self.first is None:
            self.first = FirstError.of(error)
        if isinstance(error, NoServerAvailableError):
            self.no_server_left(error)
        elif (len(self._window) == self._window.maxlen and self.max_failure_ratio < 1.0
              and self._window_failed > self.max_failure_ratio * len(self._window)):
            self._trip(f"{self._window_failed} of the last {len(self._window)} episodes failed "
                       f"(more than agent.max_failure_ratio={self.max_failure_ratio})")

    def no_server_left(self, error: NoServerAvailableError) -> None:
        """Every server failed and none is being restarted (seen by an episode, or by a
        weight update that found them dead): nothing can be generated any more."""
        self._trip("no rollout server is left (every server failed and none is being restarted)",
                   FirstError.of(error))

    def group(self, failed: int, size: int) -> None:
        """A group ended with `failed` of its `size` episodes failed."""
        if self._groups_seen >= self.fail_fast_groups:
            return
        self._groups_seen += 1
        self._early_success |= failed < size
        if self._groups_seen == self.fail_fast_groups and not self._early_success:
            self._trip(f"every episode of the first {self.fail_fast_groups} groups failed (agent.fail_fast_groups)")

    def should_log(self) -> bool:
        """Whether to log the latest failure: the first few, then one in `log_every`,
        so a broken run does not flood its log while the window fills."""
        return self.failed <= self._log_first or self.failed % self._log_every == 0

    def report(self) -> EpisodeFailures | None:
        """What the trainer's console says of failures (`RolloutStats.failures`)."""
        # what stopped the side leads (no server left, found by a weight update: no episode failed)
        first = self.tripped.first if self.tripped is not None else self.first
        if first is None:
            return None
        judging = self.succeeded == 0 and not self._early_success and self._groups_seen < self.fail_fast_groups
        return EpisodeFailures(first=first.headline, traceback=first.user_traceback[-4000:],
                               stopped=self.tripped.reason if self.tripped is not None else None,
                               judging=judging)

    def raise_if_tripped(self) -> None:
        if self.tripped is not None:
            raise self.tripped

    def _trip(self, reason: str, error: FirstError | None = None) -> None:
        if self.tripped is not None:
            return
        first = error or self.first
        assert first is not None
        reason = f"the rollout side stopped: {reason}; {self.failed} episodes failed, {self.succeeded} succeeded"
        self.tripped = RolloutFailedError(first, reason)
        log.error("%s\n%s", first.headline, reason)
