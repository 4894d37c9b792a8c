"""Kept for its import path only (`cli.py` imports `TrainerLostError` from here).

The control channel is asyncio-native (`zmq.asyncio`), so the thread that bridged it to
the controller's event loop is gone (issue #32 item 2): the rollout side's link to the
trainer is `TrainerLink`, a task beside the controller, in `rollout_side` with
`drive_rollout` and `make_sender`. Delete this module once `cli.py` imports from there.
"""

from areal_like.orchestration.rollout_side import TrainerLink, TrainerLostError, drive_rollout, make_sender

__all__ = ["make_sender", "drive_rollout", "TrainerLink", "TrainerLostError"]
