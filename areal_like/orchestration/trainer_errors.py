"""How a trainer-side run ends early, as exceptions (raised by the controller and its
policies, caught by the CLI and the API). `trainer_controller` re-exports them."""

from __future__ import annotations

__all__ = ["RunAborted", "RunFailed", "RunInterrupted"]


class RunAborted(RuntimeError):
    """The run stopped on a fault it cannot go on through (a dead train worker, a dead
    rollout side, a full disk). The message says what happened and which checkpoint
    `--resume` continues from."""


class RunFailed(RunAborted):
    """The run stopped because of something `--resume` cannot fix: user code that keeps
    failing (its file and line first), or no learning signal. The message leads with
    the cause and carries no resume hint."""


class RunInterrupted(KeyboardInterrupt):
    """The user stopped the run (Ctrl-C, SIGTERM): a final checkpoint and the summary are
    written; `summary` holds the counts and `hint` the --resume line."""

    def __init__(self, summary: dict[str, int], hint: str) -> None:
        super().__init__(hint)
        self.summary = summary
        self.hint = hint
