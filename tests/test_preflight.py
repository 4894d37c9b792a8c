"""Starting and resuming (docs/design.md §10.8): what can be checked before Ray starts is
refused in one line, without a traceback, and leaves nothing that blocks a retry."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_like.core.config import ConfigError, load_config
from areal_like.orchestration.preflight import preflight
from areal_like.orchestration.run_dir import RunDir, RunDirError, RunFinished

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]


def _cli(*args: str, timeout: float = 120) -> tuple[int, str, float]:
    t0 = time.time()
    p = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.time() - t0


def _cfg(tmp_path: Path, *extra: str):
    return load_config(ROOT / "configs" / "quickstart.yaml", [f"run.dir={tmp_path / 'run'}", *extra])


def _finished_run(run: Path, version: int) -> None:
    ckpt = run / "checkpoints" / f"v{version:06d}"
    ckpt.mkdir(parents=True)
    RunDir.mark_complete(ckpt, {"version": version, "time": 0.0})
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "summary", "trainer_version": version}) + "\n")
    (run / "final").mkdir()
    (run / "final" / "model.safetensors").write_bytes(b"exported")


def test_port_in_use_is_one_line_before_anything_starts(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out, _ = _cli("run", "configs/quickstart.yaml", "--set", f"run.dir={tmp_path / 'run'}",
                          "--set", f"transport.data_addr=tcp://127.0.0.1:{port}")
    assert rc == 2, out
    assert f"transport.data_addr: 127.0.0.1:{port} is in use" in out
    assert "Traceback" not in out and "ray" not in out.lower()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
    (["--resume"], "--resume: there is no run folder"),
])
def test_flag_conflicts_and_resume_without_a_run_are_refused(tmp_path, flags, message) -> None:
    rc, out, _ = _cli("run", "configs/quickstart.yaml", "--set", f"run.dir={tmp_path / 'run'}", *flags)
    assert rc == 2 and message in out and "Traceback" not in out, out


def test_resume_on_a_finished_run_says_so_and_changes_nothing(tmp_path) -> None:
    run = tmp_path / "run"
    _finished_run(run, 100)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    rc, out, _ = _cli("train", "configs/quickstart.yaml", "--resume", "--set", f"run.dir={run}",
                      "--set", "train.total_steps=100")
    assert rc == 0 and "already finished at v100" in out and "nothing to resume" in out, out
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # asking for more steps continues it
    with pytest.raises(ConfigError):  # (gets past the finished check; stops at the missing model path)
        preflight(_cfg(tmp_path, "train.total_steps=200", "model.path=/nonexistent"), "train", resume=True)
    RunDir(run).check(resume=True, total_steps=200)


def test_resume_on_a_finished_run_whose_export_failed_writes_the_final_model(tmp_path) -> None:
    """A full disk during the final export leaves a finished run without final/ (the
    trainer saved a final checkpoint first): `--resume` writes final/ from it and says so."""
    run = tmp_path / "run"
    _finished_run(run, 100)
    shutil.rmtree(run / "final")
    (run / "final.tmp").mkdir()  # what a failed export could leave
    (run / "final.tmp" / "config.json").write_text("{")
    trainer = run / "checkpoints" / "v000100" / "trainer"
    trainer.mkdir()
    (trainer / "model.safetensors").write_bytes(b"weights of v100")
    rc, out, _ = _cli("train", "configs/quickstart.yaml", "--resume", "--set", f"run.dir={run}",
                      "--set", "train.total_steps=100")
    assert rc == 0, out
    assert "already finished at v100; its final model was missing (the export had failed) and is now written to" \
        in out, out
    assert (run / "final" / "model.safetensors").read_bytes() == b"weights of v100"
    assert json.loads((run / "final" / "config.json").read_text())  # the model's side files came along
    assert not (run / "final.tmp").exists()
    # once written, a resume says there is nothing to do and changes nothing
    rc, out, _ = _cli("train", "configs/quickstart.yaml", "--resume", "--set", f"run.dir={run}",
                      "--set", "train.total_steps=100")
    assert rc == 0 and "nothing to resume" in out, out


def test_a_failed_start_does_not_block_the_retry(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text("")
    assert RunDir(run).check() is False  # no results: a plain retry is allowed
    (run / "metrics.jsonl").write_text('{"kind":"train_step"}\n')
    with pytest.raises(RunDirError, match="already exists; pass --resume"):
        RunDir(run).check()


def test_weight_store_beyond_loopback_needs_the_explicit_secret(tmp_path) -> None:
    with pytest.raises(ConfigError, match="weight_sync.store_addr=0.0.0.0:0: the weight group's store beyond "
                                          "loopback needs transport.secret"):
        preflight(_cfg(tmp_path, "weight_sync.store_addr=0.0.0.0:0"), "train")


def test_rollout_side_needs_real_ports(tmp_path) -> None:
    with pytest.raises(ConfigError, match="the rollout side connects"):
        preflight(_cfg(tmp_path), "rollout")


def test_resume_finished_raises_run_finished(tmp_path) -> None:
    _finished_run(tmp_path / "run", 5)
    with pytest.raises(RunFinished):
        RunDir(tmp_path / "run").check(resume=True, total_steps=5)


def test_counts_that_do_not_add_up_exit_3() -> None:
    import typer

    from areal_like.orchestration.cli import _end

    good = {"trained": 8, "rejected": 0, "filtered": 0, "over_stale": 0, "failed": 0, "skipped": 0, "buffered": 0,
            "cancelled": 0, "started": 8}
    _end(good, "run")  # returns: exit 0
    with pytest.raises(typer.Exit) as e:
        _end({**good, "started": 9}, "run")
    assert e.value.exit_code == 3


def test_joining_a_ray_cluster_beyond_loopback_needs_token_auth_or_the_explicit_opt_out(
        tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    code, out, _ = _cli("train", "configs/quickstart.yaml", "--set", f"run.dir={tmp_path / 'run'}",
                        "--set", "cluster.ray_address=10.1.2.3:6379")
    assert code == 2 and "error: cluster.ray_address=10.1.2.3:6379: joining a Ray cluster beyond loopback " \
                          "needs Ray's token auth" in out, out
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    preflight(_cfg(tmp_path, "cluster.ray_address=10.1.2.3:6379"), "train")  # token auth: accepted
    monkeypatch.delenv("RAY_AUTH_MODE")
    preflight(_cfg(tmp_path, "cluster.ray_address=10.1.2.3:6379", "cluster.allow_unauthenticated_ray=true"),
              "train")
    preflight(_cfg(tmp_path, "cluster.ray_address=127.0.0.1:6379"), "train")  # loopback: no auth needed
