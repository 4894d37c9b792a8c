"""A user's first mistakes, met as a user meets them: `areal-like run` and API scripts in
real processes, their console read line by line with the time each line came
(docs/design.md §10.12, §10.13, §10.15, §10.18).

- a reward that scores everything the same is named on the console (reward, values,
  the setting that filters) and the run stops by itself with exit 1;
- a reward that raises on every row: the first error line is the user's file:line,
  nothing on the console says ERROR or WARNING, and there is no --resume hint;
- a reward failing on some rows: one console line, the run goes on and ends with 0;
- the API, with a reward defined in the calling script, a lambda and a TRL-signature
  function, runs on the local launcher (no Ray);
- SIGTERM or SIGKILL of a run at any moment leaves no process of it alive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "areal_like.orchestration.cli"]
SMALL = ["train.batch_size=2", "rollout.group_size=4", "rollout.response_length=24", "eval.every_n_steps=0",
         "eval.num_samples=4", "staleness.max_concurrent=16"]


class Console:
    """A child process whose output lines are kept with the time each arrived."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.t0 = time.time()
        self.p = subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append((time.time() - self.t0, line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
            pytest.fail(f"still running after {timeout}s:\n{self.text()[-4000:]}")
        self._reader.join(5)
        return rc

    def first(self, needle: str) -> tuple[float, str] | None:
        return next(((t, s) for t, s in self.lines if needle in s), None)

    def text(self) -> str:
        return "\n".join(s for _, s in self.lines)


def _run_cli(tiny_model_dir: Path, tmp_path: Path, reward: Path, *sets: str) -> Console:
    args = [*CLI, "run", "configs/quickstart.yaml", "--set", f"model.path={tiny_model_dir}",
            "--set", f"run.dir={tmp_path / 'run'}", "--set", f"agent.reward={reward}:score"]
    for s in [*SMALL, *sets]:
        args += ["--set", s]
    return Console(args, ROOT)


def test_a_flat_reward_is_named_within_30s_and_the_run_stops_by_itself(tiny_model_dir, tmp_path) -> None:
    reward = tmp_path / "flat.py"
    reward.write_text("def score(sample, output):\n    return 0.0\n")
    c = _run_cli(tiny_model_dir, tmp_path, reward, "train.total_steps=50", "agent.max_no_signal_s=14")
    rc = c.wait(240)
    out = c.text()
    assert rc == 1, out[-3000:]
    start = c.first("run folder:")
    named = c.first("no learning signal:")
    assert start is not None and named is not None, out[-3000:]
    assert named[0] - start[0] <= 30, out
    # the reward by name, its values, and the setting that filters them
    assert f"{reward}:score" in named[1] and "0 ×" in named[1] and "staleness.filter_uniform_groups" in named[1]
    last = [s for _, s in c.lines if s.startswith("error:")]
    assert last and last[0].startswith("error: no learning signal for"), out
    assert "ERROR" not in out and "--resume" not in out, out
    # never a silent console: at most ~10 s (+ a loaded machine's slack) between lines
    times = [t for t, _ in c.lines if t >= start[0]]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 20, c.lines


def test_a_reward_raising_on_every_row_leads_with_the_users_line(tiny_model_dir, tmp_path) -> None:
    reward = tmp_path / "reward.py"
    reward.write_text("def score(sample, output):\n    q = sample['q']\n    return float(q == output.final_text)\n")
    c = _run_cli(tiny_model_dir, tmp_path, reward, "train.total_steps=20")
    rc = c.wait(240)
    out = c.text()
    assert rc == 1, out[-3000:]
    errors = [s for _, s in c.lines if s.startswith("error:")]
    assert errors and errors[0] == f"error: {reward}:2: KeyError: 'q'", out
    assert "q = sample['q']" in out  # the user's own line, from their traceback
    assert "every episode of the first" in errors[-1], out
    for word in ("ERROR", "WARNING", "--resume", "waiting up to"):
        assert word not in out, (word, out)


def test_a_rollout_process_that_cannot_start_ends_the_run_at_once(tiny_model_dir, tmp_path) -> None:
    """The rollout side dies while starting (its reward module fails to import there):
    the run ends with that cause first, not after transport.peer_timeout_s of waiting."""
    reward = tmp_path / "needs.py"
    reward.write_text("import json\nimport no_such_package_for_this_reward\n\ndef score(sample, output):\n"
                      "    return 1.0\n")
    c = _run_cli(tiny_model_dir, tmp_path, reward, "train.total_steps=5", "transport.peer_timeout_s=600")
    rc = c.wait(120)  # far below peer_timeout_s: the death is seen, not waited out
    out = c.text()
    assert rc in (1, 2), out[-3000:]
    errors = [s for _, s in c.lines if s.startswith("error:")]
    assert errors and errors[0].startswith(f"error: {reward}:2: ModuleNotFoundError"), out
    assert "no rollout side for" not in out, out


def test_a_reward_failing_on_some_rows_is_said_once_and_the_run_goes_on(tiny_model_dir, tmp_path) -> None:
    reward = tmp_path / "sometimes.py"
    reward.write_text(textwrap.dedent("""\
        def score(sample, output):
            if sample["answer"].endswith("7"):
                raise ValueError("no sevens, said the reward")
            return float(len(output.final_text) % 2)
        """))
    c = _run_cli(tiny_model_dir, tmp_path, reward, "train.total_steps=4", "staleness.filter_uniform_groups=false")
    rc = c.wait(240)
    out = c.text()
    assert rc == 0, out[-3000:]
    said = [(t, s) for t, s in c.lines if "episodes failed so far" in s]
    assert len(said) >= 1, out
    assert f"{reward}:3: ValueError: no sevens, said the reward" in said[0][1], said
    summary = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["failed"] > 0 and summary["counts_add_up"], summary
    # within 30 s of the first failure the rollout side saw (its log has the time)
    assert "ERROR" not in out, out


API_SCRIPT = """\
import json, sys
from areal_like.api import GRPOTrainer

MODEL, RUN = sys.argv[1], sys.argv[2]
rows = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(100, 110) for b in range(200, 203)]


def in_main(sample, output):                      # defined in __main__
    return float(output.final_text.strip() == sample["answer"])


def trl_style(completions, answer, **kwargs):     # TRL's signature
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


bonus = 0.5
closure = lambda sample, output: bonus * float(len(output.final_text) % 2)   # a lambda over a global

for i, fn in enumerate([in_main, closure, trl_style]):
    args = {"train": {"total_steps": 2, "batch_size": 2}, "rollout": {"group_size": 4, "response_length": 24},
            "eval": {"every_n_steps": 0}, "staleness": {"filter_uniform_groups": False},
            "run": {"dir": f"{RUN}/{i}"}}
    summary = GRPOTrainer(model=MODEL, reward_funcs=fn, args=args, train_dataset=rows).train()
    print("SUMMARY", i, json.dumps(summary), flush=True)
ray = sys.modules.get("ray")
print("RAY", bool(ray is not None and ray.is_initialized()), flush=True)
import os, time
from pathlib import Path
mark = f"AREAL_TEST_MARK={os.environ['AREAL_TEST_MARK']}".encode()
time.sleep(2)
alive = []
for d in Path("/proc").iterdir():
    try:
        if d.name.isdigit() and int(d.name) != os.getpid() and mark in (d / "environ").read_bytes() \
                and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            alive.append((d / "comm").read_text().strip())
    except OSError:
        pass
print("ALIVE", alive, flush=True)   # after train() returned, nothing of its runs is left
"""


def test_the_api_runs_user_callables_on_the_local_launcher(tiny_model_dir, tmp_path) -> None:
    script = tmp_path / "my_script.py"
    script.write_text(API_SCRIPT)
    c = Console([sys.executable, str(script), str(tiny_model_dir), str(tmp_path / "runs")], tmp_path,
                env={"PYTHONPATH": str(ROOT), "AREAL_TEST_MARK": uuid.uuid4().hex})
    rc = c.wait(300)
    out = c.text()
    assert rc == 0, out[-4000:]
    for i in range(3):
        line = c.first(f"SUMMARY {i} ")
        assert line is not None, out
        assert json.loads(line[1].split(" ", 2)[2])["trained"] == 16, line  # 2 steps × 2 prompts × 4
        log = (tmp_path / "runs" / str(i) / "run.log").read_text()
        assert "(local)" in log and "Can't get attribute" not in log, log[-2000:]
    assert "RAY False" in out, out
    assert "ALIVE []" in out, out  # an idle rollout process per finished run used to stay


KILL_SCRIPT = """\
import sys
from areal_like.api import GRPOTrainer

def reward(sample, output):
    return float(len(output.final_text) % 2)

GRPOTrainer(model=sys.argv[1], reward_funcs=reward, train_dataset=None,
            args={"train": {"total_steps": 10000, "batch_size": 2}, "rollout": {"group_size": 4},
                  "eval": {"every_n_steps": 0}, "run": {"dir": sys.argv[2]}}).train()
"""


def _marked(mark: str) -> list[str]:
    """Live (not zombie) processes whose environment carries `mark`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"AREAL_TEST_MARK={mark}".encode() not in (d / "environ").read_bytes():
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                found.append(f"{d.name} {(d / 'cmdline').read_bytes()[:120]!r}")
        except OSError:
            continue
    return found


_KILLS = [(how, after) for how in ("api-sigterm", "api-sigkill", "cli-sigkill") for after in (1.0, 6.0, 15.0)]
_QUICK = {("api-sigkill", 1.0), ("cli-sigkill", 6.0)}
"""One kill per way and moment class in the default suite; the whole grid in the slow one."""


@pytest.mark.parametrize(("how", "after_s"), [k if k in _QUICK else pytest.param(*k, marks=pytest.mark.slow)
                                             for k in _KILLS])
def test_a_killed_run_leaves_no_process_of_ours(tiny_model_dir, tmp_path, how, after_s) -> None:
    """Killed during start-up (imports, the zygote, the first actors) or while training:
    10 s later nothing of the run is alive (a zygote once lived on for minutes)."""
    mark = uuid.uuid4().hex
    env = {**os.environ, "AREAL_TEST_MARK": mark, "PYTHONPATH": str(ROOT)}
    if how.startswith("api"):
        script = tmp_path / "script.py"
        script.write_text(KILL_SCRIPT)
        args = [sys.executable, str(script), str(tiny_model_dir), str(tmp_path / "run")]
    else:
        args = [*CLI, "run", "configs/quickstart.yaml", "--set", f"model.path={tiny_model_dir}",
                "--set", f"run.dir={tmp_path / 'run'}", "--set", "train.total_steps=10000"]
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(after_s)
    p.send_signal(signal.SIGKILL if how.endswith("sigkill") else signal.SIGTERM)
    p.wait(timeout=60)
    deadline = time.time() + 10
    while _marked(mark) and time.time() < deadline:
        time.sleep(0.2)
    left = _marked(mark)
    for line in left:
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert left == [], left
