"""Which files of the repository's packages the rollout side's code runs in during steady
cycles (an announcement in → admit → episodes → a group out → acknowledged), over real
sockets with a scripted trainer, traced by call events in the rollout side's threads only
(issue #32 item 2; docs/design.md §10.22). Episodes are the tests' fakes and not counted.

Run: `python scripts/rollout_cycle_files.py [--ref REV]` (REV: a git revision to measure
instead of the working tree; it is unpacked into a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

_PACKAGES = ("areal_like", "rollout_cluster", "train_cluster", "weight_sync")


def _root(ref: str | None) -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if ref is None:
        return here
    tmp = tempfile.mkdtemp(prefix="cycle-")
    tar = subprocess.run(["git", "archive", ref], cwd=here, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
    return tmp


def measure(root: str, groups_wanted: int = 12) -> tuple[int, set[str]]:
    sys.path.insert(0, root)
    os.chdir(root)
    from areal_like.core.staleness import StalenessGate
    from areal_like.core.types import SamplingParams, TrajectoryGroup, VersionAnnouncement, WeightUpdateMeta
    from areal_like.orchestration.channels import ControlPublisher, ControlSubscriber, DataPuller, DataPusher
    from areal_like.orchestration.dataset import PromptSource
    from areal_like.orchestration.rollout_controller import RolloutController
    from tests.test_rollout_controller import FakeRollout, _rows

    try:
        from areal_like.orchestration.rollout_controller import drive_rollout, make_sender
    except ImportError:  # a revision before the link moved beside the controller
        try:
            from areal_like.orchestration.rollout_side import drive_rollout, make_sender  # type: ignore[no-redef]
        except ImportError:  # a revision before #32 item 2: the bridge module had them
            from areal_like.orchestration.bridge import drive_rollout, make_sender  # type: ignore[no-redef]

    files: set[str] = set()
    recording = threading.Event()

    def tracer(frame: Any, event: str, arg: Any) -> None:
        f = frame.f_code.co_filename
        if recording.is_set() and f.startswith(root + "/"):
            rel = os.path.relpath(f, root)
            if rel.split(os.sep, 1)[0] in _PACKAGES:  # ours: not the tests' fakes, not a .venv inside the tree
                files.add(rel)

    puller, pub = DataPuller("tcp://127.0.0.1:0"), ControlPublisher("tcp://127.0.0.1:0")

    def rollout() -> None:
        sys.settrace(tracer)
        threading.settrace(tracer)  # the rollout side's threads: a bridge, to_thread sends

        async def main() -> None:
            fake = FakeRollout(0)
            pusher, sub = DataPusher(puller.addr), ControlSubscriber(pub.addr)
            ctl = RolloutController(gate=StalenessGate(8, 1, 16), source=PromptSource(_rows(), seed=0), group_size=4,
                                    sampling=SamplingParams(), run_episode=fake.run_episode, score=fake.score,
                                    send=make_sender(pusher), apply_weights=fake.apply_weights, stats_every_s=0.5)
            await drive_rollout(ctl, sub, peer_timeout_s=30, peer_dead_s=10, pusher=pusher, flush_s=2)
            pusher.close()
            sub.close()

        asyncio.run(main())

    t = threading.Thread(target=rollout, daemon=True)
    t.start()
    state = {"v": 0, "consumed": 0}

    def announce(*, stop: bool = False, **kw: Any) -> None:
        try:  # the announcement's typed parts (#32)
            from areal_like.core.types import GateCounts, Goodbye, TrainerId

            parts: dict[str, Any] = {"counts": GateCounts(consumed=state["consumed"]),
                                     "trainer": TrainerId(run_id="r", epoch=0),
                                     "end": Goodbye(final_eval=False) if stop else None}
        except ImportError:  # an older revision: flat fields
            parts = {"consumed": state["consumed"], "run_id": "r", "epoch": 0, "stop": stop, "final_eval": False}
        pub.publish(VersionAnnouncement(version=state["v"], acked=puller.acks(0), **parts, **kw))

    groups, deadline = 0, time.time() + 60
    while groups < groups_wanted and time.time() < deadline:
        announce()
        m = puller.recv(0.2)
        while m is not None:
            if isinstance(m, TrajectoryGroup):
                groups += 1
                if groups == 3:  # past the start: steady cycles from here
                    recording.set()
                if groups % 2 == 0:  # a train step: its counts, then its weights
                    state["consumed"] += 8
                    state["v"] += 1
                    announce(weights=WeightUpdateMeta(version=state["v"], transport="disk", tensors=[],
                                                      checksum="x"))
            m = puller.recv(0)
    recording.clear()
    for _ in range(20):
        announce(stop=True)
        time.sleep(0.2)
        if not t.is_alive():
            break
    return groups, files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default=None, help="a git revision to measure instead of the working tree")
    ref = ap.parse_args().ref
    groups, files = measure(_root(ref))
    print(f"{ref or 'working tree'}: {groups} groups, {len(files)} files:")
    for f in sorted(files):
        print("  ", f)
    sys.stdout.flush()
    os._exit(0)  # the scripted trainer's sockets: nothing to wind down


if __name__ == "__main__":
    main()
