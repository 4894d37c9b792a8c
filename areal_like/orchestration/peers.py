"""The trainer's view of the rollout side: who may send, who is alive, who started what.

One rollout controller per run and trainer epoch (docs/design.md §10.2, §10.7). Every
data frame carries its `Origin`; `admit` refuses — counts by reason (`refused`, the
summary's `refused_frames`), never hands to the buffer, and says so on the console once
per reason, then at most every 30 s with how many more (`channels.RefusalNotes`) —
frames of another run, of an older trainer epoch, without an origin, or from a second
controller while the accepted one lives.
A controller silent for `transport.peer_dead_s` is declared lost at once (a new one
may then join, or the same one may come back); after `transport.peer_timeout_s`
without any, `check` raises and the trainer stops with a checkpoint.

Counts survive controllers coming and going: each frame carries its sender's
cumulative `started`; a sender that said goodbye reports what it cancelled, and for
one that vanished, what it started and never delivered is counted as cancelled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from areal_like.core.types import Origin, RolloutStats, TrajectoryGroup
from areal_like.orchestration.channels import RefusalNotes

__all__ = ["RolloutPeers"]

log = logging.getLogger(__name__)


@dataclass
class _Sender:
    started: int = 0
    delivered: int = 0
    """Episodes that reached the trainer inside groups (trajectories + failed + rejected)."""
    final: RolloutStats | None = None


class RolloutPeers:
    def __init__(self, run_id: str, epoch: int, *, dead_s: float, timeout_s: float, note_every_s: float = 30.0) -> None:
        self.run_id = run_id
        self.epoch = epoch
        self.dead_s = dead_s
        self.timeout_s = timeout_s
        self.note_every_s = note_every_s
        self.accepted: str | None = None
        """The rollout controller this epoch listens to (announced, so others stop)."""
        self.notes = RefusalNotes("the data channel", level=logging.ERROR, logger=log)
        self.refused: dict[str, int] = {}
        """Refused frames by reason (the summary's `refused_frames`)."""
        self.senders: dict[str, _Sender] = {}
        self.heard_at = 0.0
        self._since = time.time()
        """Start of the current wait for a (new) rollout side."""
        self._noted_at = time.time()
        self.joined: str | None = None
        """Set when a controller is accepted; the trainer hands it the current weights."""
        self.found_dead: Exception | None = None
        """A dead rollout side the trainer found during a train step: the run stops once
        the step is whole (with a checkpoint first)."""

    # ---- frames ----------------------------------------------------------------------
    def admit(self, msg: TrajectoryGroup | RolloutStats, stopping: bool) -> bool:
        """Whether the trainer should use `msg`; refusals are logged and counted."""
        o = msg.origin
        reason = self._refusal(o)
        if reason is not None:
            key = reason.split(" (")[0]
            self.refused[key] = self.refused.get(key, 0) + 1
            self.notes.add(key, f"frames from rollout controller {o.sender if o else '?'}: {reason}")
            return False
        assert o is not None
        if self.accepted is None:
            self.accepted = self.joined = o.sender
            log.info("rollout controller %s joined (trainer epoch %d)", o.sender, self.epoch)
        s = self.senders.setdefault(o.sender, _Sender())
        s.started = max(s.started, o.started)
        self.heard_at = time.time()
        if isinstance(msg, TrajectoryGroup):
            s.delivered += msg.size
        elif msg.kind == "final":
            s.final = msg
            if not stopping and not (msg.failures is not None and msg.failures.stopped):
                # (a side stopped by failing episodes: the trainer ends the run with their cause)
                log.error("the rollout side (%s) stopped while the trainer still needs data; waiting up to "
                          "transport.peer_timeout_s=%.0fs for a rollout side to join", o.sender, self.timeout_s)
                self._lose()
        return True

    def _refusal(self, o: Origin | None) -> str | None:
        if o is None:
            return "a frame without an origin (not from a rollout controller of this version)"
        if o.run_id != self.run_id:
            return f"a frame of another run ({o.run_id}; this trainer serves {self.run_id})"
        if o.epoch != self.epoch:
            return f"a frame of another trainer epoch ({o.epoch}; this trainer is epoch {self.epoch})"
        if self.accepted is not None and o.sender != self.accepted:
            return f"a second rollout controller (this run's is {self.accepted}; one per run)"
        final = self.senders[o.sender].final if o.sender in self.senders else None
        if final is not None and not (o.seq and final.origin is not None and o.seq < final.origin.seq):
            return "a frame after that controller's final report"  # (a resend of an earlier one is welcome)
        return None

    # ---- liveness --------------------------------------------------------------------
    def _lose(self) -> None:
        self.accepted = None
        self._since = self._noted_at = time.time()

    def check(self) -> None:
        """Call while waiting for data: declare a silent controller lost, say how long the
        trainer has been waiting, raise past `peer_timeout_s`."""
        now = time.time()
        self.notes.tick()
        if self.accepted is not None:
            silent = now - self.heard_at
            if silent > self.dead_s:
                log.error("the rollout side (%s) has been silent for %.0fs (transport.peer_dead_s): declared lost; "
                          "waiting up to transport.peer_timeout_s=%.0fs for a rollout side to join",
                          self.accepted, silent, self.timeout_s)
                self._lose()
                self._since = self.heard_at
            return
        waited = now - self._since
        if now - self._noted_at > self.note_every_s:
            self._noted_at = now
            log.warning("no rollout side for %.0fs (of transport.peer_timeout_s=%.0fs)", waited, self.timeout_s)
        if waited > self.timeout_s:
            what = "has sent nothing" if self.senders else "never connected"
            raise RuntimeError(f"the rollout side {what} for {waited:.0f}s (transport.peer_timeout_s)")

    # ---- accounting ------------------------------------------------------------------
    def started(self) -> int:
        return sum(s.started for s in self.senders.values())

    def cancelled(self) -> int:
        """Episodes started and never delivered: reported by a controller that said
        goodbye, inferred for one that vanished."""
        return sum(s.final.cancelled if s.final is not None else max(0, s.started - s.delivered)
                   for s in self.senders.values())

    def delivered(self, sender: str | None) -> int:
        s = self.senders.get(sender) if sender else None
        return s.delivered if s is not None else 0

    def missing_before_final(self, acks: dict[str, list[int]]) -> bool:
        """Whether a frame the accepted controller sent before its final report has not
        arrived yet (lost on a reset, on its way again): the trainer waits for it."""
        final = self.accepted_final()
        if final is None or final.origin is None or not final.origin.seq:
            return False
        return acks.get(final.origin.sender, [0])[0] < final.origin.seq

    def accepted_final(self) -> RolloutStats | None:
        s = self.senders.get(self.accepted) if self.accepted else None
        return s.final if s is not None else None
