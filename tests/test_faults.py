"""Fault injection in real runs (issue #10): the `areal-like` commands with the small test
model, a few steps, recording weights and trajectories so `audit` can check what was
trained. For each fault the run either goes on, or stops with a clear message and a
checkpoint that `--resume` continues from; the outcome counts add up, the audit passes,
and no process of the run is left behind.

Two runs are shared by the tests, one stands alone:

- `chain`: one run folder taken through three stopping faults, each launch resuming the
  previous one: (e) the disk fills up (ENOSPC, emulated) while a checkpoint is written, (b) a train worker is killed
  mid-step, (a) the rollout process is killed with SIGKILL mid-episode; then a last
  `--resume` finishes the run.
- the final export: the disk fills up exactly when the finished run writes `final/`;
  `--resume` writes it from the final checkpoint.
- `split`: `areal-like train` and `areal-like rollout` as two processes whose ZMQ
  channels go through a small TCP proxy; (d) the proxy is frozen for a few seconds (the
  link is down, nothing reaches either side), (c) the weight receiver stalls past
  `weight_sync.timeout_s` inside a transfer, and (f) the link swallows what is written
  into it, then resets (TCP RST) and stays cut for 2 s. The run goes on to its last
  step, nothing lost (the data channel resends what was not acknowledged).

The faults are switched on by environment variables read by tests/fault_hooks/
sitecustomize.py, which the launches put first on PYTHONPATH (every process of the run,
Ray workers included, loads it).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_like.core.metrics import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # the chain fixture: 4 launches

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]
HOOKS = Path(__file__).parent / "fault_hooks"
TOTAL = 8
SPLIT_TOTAL = 16
"""The split run is longer: a stall, an outage and a reset come one after the other."""
B = 2 * 4  # train.batch_size × rollout.group_size


def _sets(model: Path, run_dir: Path, *extra: str, total: int = TOTAL) -> list[str]:
    sets = [f"model.path={model}", f"run.dir={run_dir}", f"train.total_steps={total}", "train.batch_size=2",
            "rollout.group_size=4", "rollout.response_length=32", "staleness.filter_uniform_groups=false",
            "eval.num_samples=4", "run.record_weights=true", "run.record_trajectories=true",
            "run.checkpoint_every_n_steps=2", *extra]
    return [x for s in sets for x in ("--set", s)]


def _env(**faults: str) -> dict[str, str]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", **faults}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOKS), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


class Launch:
    """One `areal-like` command in its own session, its output in a file (never a pipe
    that could fill up while the test polls the run folder)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._out = log.open("w")
        self.p = subprocess.Popen([*CLI, *args], cwd=ROOT, env=env, start_new_session=True,
                                  stdout=self._out, stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout: float = 400, also: tuple[Launch, ...] = ()) -> tuple[int, str]:
        """The exit code and output; past `timeout` the test fails with this launch's thread
        stacks and the output of the launches in `also` (the peers it may wait on)."""
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:  # every thread's stack into the log first (cli.py registers faulthandler on SIGUSR1)
                os.kill(self.p.pid, signal.SIGUSR1)
                time.sleep(2)
            except ProcessLookupError:
                pass
            self.kill()
            others = "".join(f"\n--- {o.log.name} (rc {o.p.poll()}):\n{o.output()[-2500:]}" for o in also)
            pytest.fail(f"{self.log.name} did not end within {timeout}s:\n{self.output()[-6000:]}{others}")
        self._out.close()
        return rc, self.output()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def left_behind(self, within_s: float = 60) -> list[str]:
        """Processes of the launch's session still alive after `within_s` (Ray's teardown
        takes a moment after the driver exits)."""
        deadline = time.time() + within_s
        while (left := _session_processes(self.p.pid)) and time.time() < deadline:
            time.sleep(0.5)
        return left


def _session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "sid=,pid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.split(None, 1)[0] == str(sid) and line.split()[2][0] != "Z"]


def _poll(what: str, check, launch: Launch, timeout: float = 300, every: float = 0.5):  # noqa: ANN001, ANN202
    """Wait until `check()` is truthy; fail (with the launch's output) if the launch ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        if launch.p.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{launch.output()[-4000:]}")
        time.sleep(every)
    launch.kill()
    pytest.fail(f"timed out waiting for {what}:\n{launch.output()[-4000:]}")


def _records(run_dir: Path) -> list[dict]:
    m = run_dir / "metrics.jsonl"
    return read_jsonl(m) if m.is_file() else []


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _records(run_dir) if r["kind"] == "train_step"]


def _latest_checkpoint(run_dir: Path) -> int | None:
    done = sorted(p.name for p in (run_dir / "checkpoints").glob("v*") if (p / "COMPLETE").is_file())
    return int(done[-1][1:]) if done else None


def _error_line(out: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith("error:")]
    return lines[-1] if lines else ""


def _driver_traceback(out: str) -> bool:
    """A traceback printed by the command itself (lines from Ray workers are prefixed)."""
    own = [x for x in out.splitlines() if not x.lstrip("\x1b[0123456789;m").startswith("(")]
    return any("Traceback" in x or "╭─" in x for x in own)


def _audit(run_dir: Path) -> tuple[int, str]:
    p = subprocess.run([*CLI, "audit", str(run_dir)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr


def _check_finished_run(run_dir: Path, total: int = TOTAL) -> None:
    """What every run that reached its last step must show."""
    recs = _records(run_dir)
    steps = [r["step"] for r in recs if r["kind"] == "train_step"]
    assert steps == list(range(1, total + 1)), steps  # each step once: resumes cut back what came after
    summaries = [r for r in recs if r["kind"] == "summary"]
    assert len(summaries) == 1 and recs[-1]["kind"] == "summary", [r["kind"] for r in recs[-3:]]
    s = summaries[0]
    assert s["counts_add_up"], s
    assert s["trained"] == total * B, s
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(trajs) == s["trained"]
    assert len({t["episode_id"] for t in trajs}) == len(trajs), "a sample was trained twice"
    rc, out = _audit(run_dir)
    assert rc == 0, out[-3000:]
    assert "audit passed" in out


# ---------------------------------------------------------------------------------------
# (e) full disk → (b) train worker killed → (a) rollout process killed → finish
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults_chain")
    run_dir = tmp / "run"
    marks = tmp / "marks"
    marks.mkdir()
    out: dict[str, dict] = {}

    # (e) the disk fills up after step 3, and the next checkpoint (v4) is what hits it:
    # every write under run.dir/checkpoints fails with ENOSPC
    flag = tmp / "disk_full"
    launch = Launch(["run", "configs/quickstart.yaml", *_sets(tiny_model_dir, run_dir)], tmp / "enospc.log",
                    _env(AREAL_FAULT_ENOSPC_DIR=str(run_dir / "checkpoints"), AREAL_FAULT_ENOSPC_FLAG=str(flag)))
    _poll("step 3", lambda: max(_steps(run_dir), default=0) >= 3, launch)
    flag.write_text("full\n")
    rc, text = launch.wait()
    flag.unlink()  # space is freed before resuming
    out["enospc"] = {"rc": rc, "out": text, "left": launch.left_behind(), "ckpt": _latest_checkpoint(run_dir),
                     "steps": _steps(run_dir)}

    # (b) resume; a train worker kills itself (SIGKILL) inside the step after the checkpoint
    resumed_at = out["enospc"]["ckpt"] or 0
    launch = Launch(["run", "configs/quickstart.yaml", "--resume", *_sets(tiny_model_dir, run_dir)],
                    tmp / "train_kill.log",
                    _env(AREAL_FAULT_KILL_TRAIN_AT=str(resumed_at + 1), AREAL_FAULT_MARK_DIR=str(marks)))
    rc, text = launch.wait()
    out["train_kill"] = {"rc": rc, "out": text, "left": launch.left_behind(), "ckpt": _latest_checkpoint(run_dir),
                         "resumed_at": resumed_at, "killed": (marks / "train_killed").is_file(),
                         "steps": _steps(run_dir)}

    # (a) resume with no periodic checkpoint left to come (every 100 steps); the rollout
    # process (a Ray worker) gets SIGKILL in the middle of an episode, in its first
    # generate call after it loaded the version after the resume point
    resumed_at = out["train_kill"]["ckpt"] or 0
    launch = Launch(["run", "configs/quickstart.yaml", "--resume",
                     *_sets(tiny_model_dir, run_dir, "run.checkpoint_every_n_steps=100")],
                    tmp / "rollout_kill.log",
                    _env(AREAL_FAULT_KILL_ROLLOUT_AT=str(resumed_at + 1), AREAL_FAULT_MARK_DIR=str(marks)))
    rc, text = launch.wait()
    out["rollout_kill"] = {"rc": rc, "out": text, "left": launch.left_behind(), "ckpt": _latest_checkpoint(run_dir),
                           "resumed_at": resumed_at, "steps": _steps(run_dir),
                           "killed": (marks / "rollout_killed").is_file()}

    # resume once more, no fault: the run finishes
    launch = Launch(["run", "configs/quickstart.yaml", "--resume", *_sets(tiny_model_dir, run_dir)],
                    tmp / "finish.log", _env())
    rc, text = launch.wait()
    out["finish"] = {"rc": rc, "out": text, "left": launch.left_behind()}
    return run_dir, out


def test_full_disk_stops_with_a_clear_message_and_resumes(chain) -> None:
    _, out = chain
    e = out["enospc"]
    assert e["rc"] == 1, e["out"][-4000:]
    err = _error_line(e["out"])
    assert "no space left on device" in err and "--resume" in err, e["out"][-4000:]
    assert "checkpoints" in err, err  # it names what it was writing: the checkpoint
    assert not _driver_traceback(e["out"]), "a clear message, not a traceback"
    assert e["ckpt"] is not None and e["ckpt"] >= 2 and f"v{e['ckpt']:06d}" in err
    assert e["left"] == [], e["left"]


def test_full_disk_during_the_final_export_then_resume_writes_it(tiny_model_dir, tmp_path) -> None:
    """The disk fills up exactly when the run writes final/: the run says so in one line
    (exit 1), leaves no half folder, its records are whole (summary, final checkpoint),
    and `--resume` with space freed writes final/ from the final checkpoint."""
    run_dir = tmp_path / "run"
    flag = tmp_path / "disk_full"
    flag.write_text("full\n")
    args = ["run", "configs/quickstart.yaml", *_sets(tiny_model_dir, run_dir, "run.checkpoint_every_n_steps=3")]
    launch = Launch(args, tmp_path / "export.log",
                    _env(AREAL_FAULT_ENOSPC_DIR=str(run_dir / "final.tmp"), AREAL_FAULT_ENOSPC_FLAG=str(flag)))
    rc, text = launch.wait()
    assert rc == 1, text[-4000:]
    err = _error_line(text)
    assert "no space left on device writing the final model" in err and "--resume" in err, text[-4000:]
    assert not _driver_traceback(text), "a clear message, not a traceback"
    assert launch.left_behind() == []
    assert not (run_dir / "final").exists() and not (run_dir / "final.tmp").exists()
    assert _latest_checkpoint(run_dir) == TOTAL  # saved before the summary, although 8 is no multiple of 3
    flag.unlink()
    launch = Launch([*args[:2], "--resume", *args[2:]], tmp_path / "resume.log", _env())
    rc, text = launch.wait()
    assert rc == 0 and f"is now written to {run_dir / 'final'} from checkpoint v{TOTAL}" in text, text[-4000:]
    from safetensors.torch import load_file

    final = load_file(str(run_dir / "final" / "model.safetensors"))
    ckpt = load_file(str(run_dir / "checkpoints" / f"v{TOTAL:06d}" / "trainer" / "model.safetensors"))
    assert final.keys() == ckpt.keys() and all((final[k] == ckpt[k]).all() for k in final)
    _check_finished_run(run_dir)


def test_killed_train_worker_stops_with_a_clear_message_and_resumes(chain) -> None:
    _, out = chain
    k = out["train_kill"]
    assert k["killed"], "the fault did not fire:\n" + k["out"][-3000:]
    assert k["rc"] == 1, k["out"][-4000:]
    err = _error_line(k["out"])
    assert f"train step at v{k['resumed_at'] + 1} failed" in err and "train worker" in err and "died" in err, err
    assert "--resume" in err and f"v{k['ckpt']:06d}" in err, err
    # the step in flight is lost; the folder still reads up to the checkpoint it resumed from
    assert k["ckpt"] == k["resumed_at"] and k["steps"][-1] == k["resumed_at"] + 1
    assert k["left"] == [], k["left"]


def test_killed_rollout_process_stops_with_a_checkpoint_and_resumes(chain) -> None:
    _, out = chain
    k = out["rollout_kill"]
    assert k["killed"], "the fault did not fire:\n" + k["out"][-3000:]
    assert k["rc"] == 1, k["out"][-4000:]
    err = _error_line(k["out"])
    assert "the rollout side died" in err and "--resume" in err, err
    assert not _driver_traceback(k["out"]), "a clear message, not a traceback"
    # no periodic checkpoint was due: the trainer saved one at the version it stopped at
    assert k["ckpt"] == k["steps"][-1] > k["resumed_at"], k
    assert k["left"] == [], k["left"]


def test_chain_of_faults_ends_in_a_whole_audited_run(chain) -> None:
    run_dir, out = chain
    f = out["finish"]
    assert f["rc"] == 0, f["out"][-4000:]
    assert f["left"] == [], f["left"]
    _check_finished_run(run_dir)


# ---------------------------------------------------------------------------------------
# (d) the ZMQ link is down for a while, (c) a weight receiver stalls past its timeout
# ---------------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def split(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults_split")
    run_dir = tmp / "run"
    marks = tmp / "marks"
    marks.mkdir()
    data, control, store, p_data, p_control = _free_ports(5)
    timeout_s = 4.0
    stall_at = 2
    common = ["configs/quickstart.yaml", *_sets(tiny_model_dir, run_dir, f"weight_sync.store_addr=127.0.0.1:{store}",
                                                 f"weight_sync.timeout_s={timeout_s}", total=SPLIT_TOTAL)]
    trainer = Launch(["train", *common, "--set", f"transport.data_addr=tcp://127.0.0.1:{data}",
                      "--set", f"transport.control_addr=tcp://127.0.0.1:{control}"], tmp / "train.log", _env())
    proxy_log = (tmp / "proxy.log").open("w")
    proxy = subprocess.Popen([sys.executable, str(Path(__file__).parent / "fault_proxy.py"),
                              f"{p_data}:{data}", f"{p_control}:{control}"],
                             start_new_session=True, stdout=proxy_log, stderr=subprocess.STDOUT)
    # (c) the receiver, inside the transfer of v2 (or the first later one it joins),
    # sleeps 3 × weight_sync.timeout_s
    rollout = Launch(["rollout", *common, "--set", f"transport.data_addr=tcp://127.0.0.1:{p_data}",
                      "--set", f"transport.control_addr=tcp://127.0.0.1:{p_control}"], tmp / "rollout.log",
                     _env(AREAL_FAULT_WS_STALL_AT=str(stall_at), AREAL_FAULT_WS_STALL_S=str(3 * timeout_s),
                          AREAL_FAULT_MARK_DIR=str(marks)))
    out: dict = {"ports": (p_data, p_control)}
    try:
        _poll("the stalled receiver to wake up", lambda: (marks / "ws_resumed").is_file(), rollout)
        out["stalled_at"] = int((marks / "ws_stalled").read_text())
        after_stall = max(_steps(run_dir), default=0)
        # (d) once the trainer has moved on after the stall, cut the link: the proxy is
        # frozen (nothing is forwarded either way, the connections stay open, as in a
        # network partition), then restored
        _poll("a step after the stall", lambda: max(_steps(run_dir), default=0) > after_stall, trainer)
        os.kill(proxy.pid, signal.SIGSTOP)
        time.sleep(5)  # the length of the outage (not a synchronisation)
        os.kill(proxy.pid, signal.SIGCONT)
        # (f) the link dies with data in flight — the proxy takes the bytes from both sides
        # and delivers nothing — then every connection gets a TCP RST and the link stays
        # cut for 2 s: what the rollout side wrote into it must be resent after the reconnect
        after_outage = max(_steps(run_dir), default=0)
        _poll("a step after the outage", lambda: max(_steps(run_dir), default=0) > after_outage, trainer)
        out["reset_at"] = max(_steps(run_dir), default=0)
        os.kill(proxy.pid, signal.SIGUSR1)
        time.sleep(3)  # the black hole's length (not a synchronisation)
        os.kill(proxy.pid, signal.SIGUSR2)
        out["train"] = trainer.wait()
        out["rollout"] = rollout.wait(timeout=120)
        out["left"] = trainer.left_behind() + rollout.left_behind()
    finally:
        for launch in (trainer, rollout):
            launch.kill()
        proxy.kill()
        proxy.wait()
        proxy_log.close()
    out["proxy"] = (tmp / "proxy.log").read_text()
    return run_dir, out


def test_link_outage_and_stalled_weight_receiver_the_run_goes_on(split) -> None:
    run_dir, out = split
    rc, text = out["train"]
    assert rc == 0, text[-4000:]
    rc, text = out["rollout"]
    assert rc == 0, text[-4000:]
    assert out["left"] == [], out["left"]
    # both channels went through the proxy, so freezing it cut them
    assert f"connected {out['ports'][0]} ->" in out["proxy"] and f"connected {out['ports'][1]} ->" in out["proxy"], \
        out["proxy"]
    _check_finished_run(run_dir, SPLIT_TOTAL)


def test_frames_lost_in_a_connection_reset_are_resent_and_counted_once(split) -> None:
    """The reset happened mid-run with data in flight (the proxy swallowed bytes of the data
    channel); the rollout side resent what was not acknowledged, the trainer dropped what it
    already had, and the counts add up (a lost frame would end the run with exit 3)."""
    run_dir, out = split
    assert out["reset_at"] < SPLIT_TOTAL
    swallowed = [int(n) for n in re.findall(rf"reset \d+ connections of {out['ports'][0]}; swallowed (\d+) bytes",
                                            out["proxy"])]
    assert swallowed and swallowed[0] > 0, out["proxy"]
    log_file = run_dir / "run.log"
    rollout_out = out["rollout"][1] + (log_file.read_text(errors="replace") if log_file.is_file() else "")
    assert re.search(r"data channel reconnected: resending [1-9]\d* unacknowledged frames", rollout_out), \
        rollout_out[-4000:]
    _check_finished_run(run_dir, SPLIT_TOTAL)


def test_stalled_weight_receiver_keeps_serving_and_catches_up(split) -> None:
    run_dir, out = split
    rollout_out = out["rollout"][1]
    # the receiver gave up that version with a clear error and kept its old weights ...
    assert re.search(rf"weight update to v{out['stalled_at']} failed, still serving v\d+", rollout_out), \
        rollout_out[-4000:]
    # ... and a later version reached it: the last weights the engines loaded are the final ones
    rollout_recs = [r for r in _records(run_dir) if r["kind"] == "rollout"]
    assert max(r["loaded_version"] for r in rollout_recs) > out["stalled_at"]
    trajs = read_jsonl(run_dir / "trajectories.jsonl")
    versions = {v for t in trajs for v in t["response_versions"] if v >= 0}
    assert max(versions) > out["stalled_at"], versions
