"""A pool with no work lends its threads (areal_like/core/cores.py, docs/design.md §10.16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_like.core.cores import CoreLedger, ThreadLender

ROOT = Path(__file__).resolve().parents[1]


def test_a_pool_is_idle_only_when_every_process_of_it_is(tmp_path) -> None:
    path = tmp_path / ".cores"
    s0, s1 = CoreLedger(path, "rollout", 0), CoreLedger(path, "rollout", 1)
    trainer = CoreLedger(path, "train", 0)
    assert trainer.idle_since("rollout") is None  # nobody wrote yet: a pool we cannot see lends nothing
    s0.working(True)
    s1.working(False)
    assert trainer.idle_since("rollout") is None  # one server still has work
    s0.working(False)
    time.sleep(0.05)
    assert time.time() - trainer.idle_since("rollout") >= 0.04
    s1.working(True)
    assert trainer.idle_since("rollout") is None
    assert s0.idle_since("train") is None  # the trainer never wrote


def test_the_lender_borrows_while_the_other_pool_is_idle_and_gives_back(tmp_path) -> None:
    path = tmp_path / ".cores"
    server = CoreLedger(path, "rollout", 0)
    trainer = CoreLedger(path, "train", 0)
    before = torch.get_num_threads()
    lender = ThreadLender(trainer, own=1, borrow=1, other="rollout", grace_s=0.05,
                          runnable=lambda: 0, cpus=2)  # a machine with nothing else on it
    try:
        server.working(True)
        assert lender.pick() == 1 and torch.get_num_threads() == 1
        server.working(False)
        assert lender.pick() == 1  # not idle for the grace period yet
        time.sleep(0.06)
        assert lender.pick() == 2 and torch.get_num_threads() == 2
        time.sleep(0.02)
        lender.done()
        assert lender.borrowed_s >= 0.02
        server.working(True)
        assert lender.pick() == 1 and torch.get_num_threads() == 1  # given back at the next check
    finally:
        torch.set_num_threads(before)


def test_a_lull_that_began_before_the_trainers_version_went_out_counts_only_from_then(tmp_path) -> None:
    """Servers a version ahead wait for the trainer's next version: their lull ends when the
    version goes out, just as the trainer's next step begins. Borrowing their threads then
    lands a thread on a core they take back within a micro-batch."""
    path = tmp_path / ".cores"
    server = CoreLedger(path, "rollout", 0)
    before = torch.get_num_threads()
    lender = ThreadLender(CoreLedger(path, "train", 0), own=1, borrow=1, other="rollout", grace_s=0.05,
                          runnable=lambda: 0, cpus=2)
    try:
        server.working(False)
        time.sleep(0.06)
        assert lender.pick() == 2  # idle for the grace period, within the step
        lender.done()
        lender.published()
        assert lender.pick() == 1  # the same lull, now that a version went out: not yet
        time.sleep(0.06)
        assert lender.pick() == 2  # the servers stayed idle past the version: a lull of their own
        lender.published()
        server.working(True)
        time.sleep(0.03)
        server.working(False)  # busy, then idle again after the version: counts from its start
        time.sleep(0.03)
        assert lender.pick() == 1
        time.sleep(0.03)
        assert lender.pick() == 2
    finally:
        torch.set_num_threads(before)


def test_the_lender_leaves_a_core_that_a_process_outside_the_run_holds(tmp_path) -> None:
    """A borrowed thread on a core a neighbour is busy on makes every parallel region wait
    for it (a 2-core train step: 1.25 s on 2 threads against 0.59 s on 1): the lender
    borrows only while the threads runnable outside this process leave a core free."""
    path = tmp_path / ".cores"
    server = CoreLedger(path, "rollout", 0)
    trainer = CoreLedger(path, "train", 0)
    before = torch.get_num_threads()
    elsewhere = [1]
    lender = ThreadLender(trainer, own=1, borrow=1, other="rollout", grace_s=0.0,
                          runnable=lambda: elsewhere[0], cpus=2, crowded_hold_s=0.0)
    try:
        torch.set_num_threads(1)
        lender.current = 1
        server.working(False)
        assert lender.pick() == 1  # a neighbour
        elsewhere[0] = 0
        assert lender.pick() == 2 and torch.get_num_threads() == 2
        assert lender.pick() == 2
        elsewhere[0] = 1  # a neighbour started: give the thread back
        assert lender.pick() == 1 and torch.get_num_threads() == 1

        # A neighbour that comes and goes keeps the threads home for a while after it was seen.
        held = ThreadLender(trainer, own=1, borrow=1, other="rollout", grace_s=0.0,
                            runnable=lambda: elsewhere[0], cpus=2, crowded_hold_s=0.3)
        assert held.pick() == 1
        elsewhere[0] = 0  # a moment's thread of the run, seen once: lending goes on
        assert held.pick() == 2
        elsewhere[0] = 1
        assert held.pick() == 1
        time.sleep(0.06)
        assert held.pick() == 1  # seen again 60 ms later: a neighbour
        elsewhere[0] = 0  # gone again: not trusted yet
        assert held.pick() == 1
        time.sleep(0.35)
        assert held.pick() == 2

        # The hold runs from the neighbour's last sighting: one that comes back within it (a
        # neighbour busy every second against a 3 s hold) keeps the threads home throughout.
        back = ThreadLender(trainer, own=1, borrow=1, other="rollout", grace_s=0.0,
                            runnable=lambda: elsewhere[0], cpus=2, crowded_hold_s=0.3)
        elsewhere[0] = 1
        assert back.pick() == 1
        time.sleep(0.06)
        assert back.pick() == 1  # seen twice: held until 0.3 s from now
        elsewhere[0] = 0
        time.sleep(0.15)
        assert back.pick() == 1
        elsewhere[0] = 1  # back while held
        assert back.pick() == 1
        time.sleep(0.06)
        assert back.pick() == 1
        elsewhere[0] = 0
        time.sleep(0.2)  # past the first hold's end, within the second's
        assert back.pick() == 1
        time.sleep(0.15)
        assert back.pick() == 2
    finally:
        torch.set_num_threads(before)


def test_a_neighbour_is_seen_by_the_kernels_count_while_threads_are_borrowed(tmp_path) -> None:
    """The count is the kernel's, and this process's own share of it is read, not assumed:
    between micro-batches a borrowing trainer's pool threads sleep, and taking all of them off
    the machine's count hid a neighbour spinning on the other core (the trainer kept both
    threads through the neighbour's bursts)."""
    path = tmp_path / ".cores"
    server = CoreLedger(path, "rollout", 0)
    trainer = CoreLedger(path, "train", 0)
    before = torch.get_num_threads()
    real = ThreadLender(trainer, own=1, borrow=1, other="rollout", grace_s=0.0, cpus=2, crowded_hold_s=0.0)
    x = torch.randn(256, 256)
    try:
        server.working(False)
        deadline = time.time() + 10
        while time.time() < deadline and real.pick() != 2:  # (quiet enough to borrow: may take a moment)
            time.sleep(0.05)
        assert real.current == 2
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)  # (the neighbour's interpreter is up and spinning)
            picks = []
            for _ in range(6):
                for _ in range(5):
                    x @ x  # a micro-batch on the threads it holds
                real.done()
                time.sleep(0.1)  # the step's Python between micro-batches: the pool threads sleep
                picks.append(real.pick())
            assert picks == [1] * 6, picks
        finally:
            spin.kill()
            spin.wait()
    finally:
        torch.set_num_threads(before)


def test_no_run_folder_on_this_machine_means_no_ledger_and_no_folder_made(tmp_path) -> None:
    """`areal-like rollout` on a second machine (issue #31 item 3): the trainer's run folder
    is not there, so nothing lends, nothing is created, and a ledger that cannot be opened
    lends nothing instead of failing the server."""
    from areal_like.core.config import load_config
    from areal_like.orchestration.pools import thread_lending

    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"run.dir={tmp_path / 'run'}"])
    assert thread_lending(cfg) is None
    (tmp_path / "run").mkdir()
    assert thread_lending(cfg)["path"] == str(tmp_path / "run" / ".cores")

    alone = CoreLedger(tmp_path / "gone" / ".cores", "rollout", 0)
    assert not alone.shared and not (tmp_path / "gone").exists()
    alone.working(False)
    assert alone.idle_since("train") is None
    alone.close()


@pytest.mark.parametrize("lend", [True, False])
def test_a_run_borrows_threads_only_when_lending_is_on(tiny_model_dir, tmp_path, lend) -> None:
    """The quickstart shape: each pool records the seconds it ran on borrowed threads."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    sets = [f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "train.total_steps=4", "train.batch_size=16",
            "rollout.group_size=4", "rollout.response_length=24", "staleness.filter_uniform_groups=false",
            "eval.every_n_steps=0", "staleness.max_staleness=0", f"cluster.lend_idle_threads={str(lend).lower()}"]
    p = subprocess.run([sys.executable, "-m", "areal_like.orchestration.cli", "run", "configs/quickstart.yaml",
                        *[x for s in sets for x in ("--set", s)]], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = [r.get("train_borrowed_thread_s") for r in recs if r["kind"] == "train_step"]
    served = [r.get("rollout_borrowed_thread_s", 0.0) for r in recs if r["kind"] == "rollout"]
    if lend:
        # synchronous (η = 0): the servers wait for each step and the trainer for each batch,
        # so each pool has run on the other's threads (16 groups: each phase outlasts the
        # 0.1 s grace)
        assert trained[-1] > 0 and max(served) > 0, (trained, served)
        assert (run_dir / ".cores").is_file()
    else:
        assert all(t is None for t in trained) and max(served, default=0.0) == 0.0
        assert not (run_dir / ".cores").exists()
