"""`sweep-staleness`: one short real run per η, then a table, a JSON file and a plot."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_sweep_staleness_command(tiny_model_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from areal_like.orchestration.cli import app

    r = CliRunner().invoke(app, [
        "sweep-staleness", "configs/quickstart.yaml", "--eta", "0,2",
        "--set", f"model.path={tiny_model_dir}", "--set", f"run.dir={tmp_path}", "--set", "train.total_steps=3",
        "--set", "train.batch_size=2", "--set", "rollout.group_size=4", "--set", "staleness.filter_uniform_groups=false",
        "--set", "eval.num_samples=4",
    ])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [x["eta"] for x in rows] == [0, 2]
    assert rows[0]["max_version_lag"] == 0 and all(x["steps"] == 3 for x in rows)
    assert (tmp_path / "sweep" / "sweep.png").is_file()
