"""A user's own task in a folder of their own (docs/design.md §10.12): config, data, reward,
tool and agent loop named by relative paths resolve the same from any working directory,
and their mistakes are reported as one clear error leading with their own file and line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_like.core.config import ConfigError, ExperimentConfig, load_config
from areal_like.orchestration.paths import check_metrics_backends, check_user_code, resolve_paths

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "areal_like" / "assets" / "quickstart_model"

TOOL = '''
def calculator(expression: str) -> str:
    """Add or multiply two integers.

    Args:
        expression: e.g. 12+34
    """
    for op in "+*":
        if op in expression:
            a, b = expression.split(op)
            return str(int(a) + int(b) if op == "+" else int(a) * int(b))
    raise ValueError(f"cannot compute {expression!r}")
'''

LOOP = '''
import json

from rollout_cluster.tools import as_tool

from tool import calculator  # a module next to this file

TOOL = as_tool(calculator)


async def agent(client, sample):
    """The user's own agent: OpenAI-shaped calls, tools run by the agent itself."""
    messages = list(sample["prompt"])
    for _ in range(2):
        reply = await client.chat.completions.create(messages=messages, tools=[TOOL.schema])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
'''

REWARD = '''
def score(sample, output):
    text = output.final_text.strip()
    return {"reward": float(text == sample["answer"]), "answered": float(text.isdigit())}
'''


def make_user_folder(folder: Path, n_rows: int = 40) -> Path:
    """The user's folder, outside the repository: every file named relatively."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tool.py").write_text(TOOL)
    (folder / "loop.py").write_text(LOOP)
    (folder / "reward.py").write_text(REWARD)
    (folder / "tools.yaml").write_text("tools:\n  - {name: calculator, cls: tool.py:calculator}\n")
    rows = [{"prompt": f"{a}+{a + 7}", "answer": str(2 * a + 7)} for a in range(100, 100 + n_rows)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.yaml").write_text(
        "run: {dir: runs/my_task}\n"
        "model: {path: areal_like/assets/quickstart_model}\n"
        "dataset: {type: jsonl, path: data.jsonl, eval_split: 0.1}\n"
        "agent:\n"
        "  default_loop: loop.py:agent\n"
        "  reward: reward.py:score\n"
        "  tools: []\n"
        "  tools_file: tools.yaml\n"
    )
    return folder / "config.yaml"


def _resolved_from(cwd: Path, config: Path, monkeypatch: pytest.MonkeyPatch) -> ExperimentConfig:
    monkeypatch.chdir(cwd)
    return resolve_paths(load_config(os.path.relpath(config, cwd)))


def test_relative_paths_resolve_the_same_from_any_directory(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "my_task"
    config = make_user_folder(folder)
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    a = _resolved_from(folder, config, monkeypatch)
    b = _resolved_from(elsewhere, config, monkeypatch)
    assert a.model_dump() == b.model_dump()
    assert a.dataset.path == str(folder.resolve() / "data.jsonl")
    assert a.agent.reward == f"{folder.resolve() / 'reward.py'}:score"
    assert a.agent.default_loop == f"{folder.resolve() / 'loop.py'}:agent"
    assert a.agent.tools_file == str(folder.resolve() / "tools.yaml")
    assert Path(a.model.path) == QUICKSTART.resolve()
    # the config every process receives carries no relative path and no need for `source`
    again = ExperimentConfig.model_validate(b.model_dump(mode="json"))
    assert resolve_paths(again).model_dump() == b.model_dump()
    check_user_code(b)  # the user's reward, loop and tool (via tools.yaml) import from anywhere


def test_resolved_folder_loads_rows_and_holds_out_eval(tmp_path, monkeypatch) -> None:
    from areal_like.orchestration.dataset import load_rows

    cfg = _resolved_from(tmp_path, make_user_folder(tmp_path / "t", n_rows=40), monkeypatch)
    train = load_rows(cfg.dataset, "train", 0, max_eval_rows=cfg.eval.num_samples)
    ev = load_rows(cfg.dataset, "eval", 0, max_eval_rows=cfg.eval.num_samples)
    assert len(ev) == 4 and len(train) == 36  # eval_split 0.1 of the user's rows, removed from training
    assert not {r["answer"] for r in ev} & {r["answer"] for r in train}
    assert all(r["data_source"] != "arithmetic" for r in ev)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"dataset": "dataset: {type: jsonl, path: nope.jsonl}\n"},
         r"dataset.path='nope.jsonl': no such file; looked in .*/t/nope.jsonl, .*/nope.jsonl"),
        ({"agent": "agent: {reward: rewards.py:score}\n"}, r"agent.reward='rewards.py': no such file; looked in"),
        ({"agent": "agent: {tools_file: tool.yaml}\n"}, r"agent.tools_file='tool.yaml': no such file"),
    ],
)
def test_a_missing_file_is_one_line_naming_key_value_and_places(tmp_path, monkeypatch, edit, needle) -> None:
    config = make_user_folder(tmp_path / "t")
    text = config.read_text()
    for section, line in edit.items():
        text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(f"{section}:")
                         and not (section == "agent" and ln.startswith("  "))) + "\n" + line
    config.write_text(text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=needle) as e:
        resolve_paths(load_config(config))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("source", "first_line"),
    [
        ("def score(sample, output)\n    return 1.0\n", r"^.*/t/reward.py:1: SyntaxError: "),
        ("import not_installed_pkg_xyz\n", r"^.*/t/reward.py:1: ModuleNotFoundError: No module named"),
        ("def helper():\n    return 1 / 0\n\nX = helper()\n", r"^.*/t/reward.py:2: ZeroDivisionError"),
        ("def other(sample, output):\n    return 1.0\n", r"^.*/t/reward.py: has no attribute 'score'"),
    ],
)
def test_user_code_errors_lead_with_the_users_file_and_line(tmp_path, monkeypatch, source, first_line) -> None:
    config = make_user_folder(tmp_path / "t")
    (tmp_path / "t" / "reward.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    cfg = resolve_paths(load_config(config))
    with pytest.raises(ConfigError, match=first_line) as e:
        check_user_code(cfg)
    assert "rollout_cluster" not in str(e.value)  # the user's frames only, not ours


def test_metrics_backends_name_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    cfg = ExperimentConfig()
    check_metrics_backends(cfg)  # nothing asked for: nothing needed
    cfg.metrics.tensorboard = True
    with pytest.raises(ConfigError, match=r"metrics.tensorboard=true needs .*pip install 'areal_like\[tensorboard\]'"):
        check_metrics_backends(cfg)
    cfg.metrics.tensorboard, cfg.metrics.wandb_project = False, "proj"
    with pytest.raises(ConfigError, match=r"pip install 'areal_like\[wandb\]'"):
        check_metrics_backends(cfg)


def test_real_run_from_a_third_directory(tmp_path) -> None:
    """`areal-like run <folder>/config.yaml` from an unrelated directory, as a user types it:
    the rollout actor gets the user's loop, tool (imported by the loop), reward and rows."""
    config = make_user_folder(tmp_path / "my_task")
    cwd = tmp_path / "third"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "areal_like.orchestration.cli", "run", str(config),
           "--set", "train.total_steps=2", "--set", "train.batch_size=2", "--set", "rollout.group_size=4",
           "--set", "rollout.response_length=48", "--set", "staleness.filter_uniform_groups=false",
           "--set", f"model.path={QUICKSTART}", "--set", f"run.dir={tmp_path / 'run'}",
           "--set", "eval.num_samples=2", "--set", "cluster.rollout_pool.num_cpus=1",
           "--set", "cluster.train_pool.num_cpus=1"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train_step"] == [1, 2]
    assert [r["num_samples"] for r in records if r["kind"] == "eval"] == [2]  # held out from data.jsonl
    summary = next(r for r in records if r["kind"] == "summary")
    assert summary["failed"] == 0 and summary["trained"] == 16
