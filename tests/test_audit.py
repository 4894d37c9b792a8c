"""`audit` recomputes behaviour logprobs per recorded version and catches tampering."""

from __future__ import annotations

import json

import pytest
import torch

from areal_like.core.config import ExperimentConfig
from areal_like.core.metrics import MetricsLog
from areal_like.orchestration.audit import audit_run
from areal_like.orchestration.run_dir import RunDir


@pytest.fixture(scope="module")
def fake_run(tiny_model_dir, tmp_path_factory):
    """A run folder whose trajectories were sampled from v0 then v1 within one turn."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    rd = RunDir(tmp_path_factory.mktemp("run") / "r")
    cfg = ExperimentConfig()
    cfg.staleness.max_staleness = 1
    rd.prepare(cfg)
    models = {0: AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()}
    m1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        for p in m1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    models[1] = m1
    for v, m in models.items():
        rd.record_weights(v, dict(m.state_dict()), tiny_model_dir)
    log = MetricsLog(rd.metrics)
    with rd.trajectories.open("w") as f:
        for e in range(4):
            ids = [2, 10 + e, 11, 12]
            resp, lps, vers = [], [], []
            T = 0.7
            for k in range(8):
                v = 0 if k < 4 else 1  # an interrupt after 4 tokens
                with torch.no_grad():
                    logits = models[v](input_ids=torch.tensor([ids + resp])).logits[0, -1] / T
                lp = torch.log_softmax(logits, -1)
                tok = int(torch.multinomial(lp.exp(), 1))
                resp.append(tok)
                lps.append(float(lp[tok]))
                vers.append(v)
            rec = {"episode_id": f"e{e}", "group_id": "g", "prompt_ids": ids, "response_ids": resp,
                   "response_mask": [1] * 8, "response_logprobs": lps, "response_versions": vers,
                   "reward": 1.0, "consumed_at_version": 1, "temperature": T}
            f.write(json.dumps(rec) + "\n")
    log.write("summary", 2, trained=4, rejected=0, filtered=0, over_stale=0, failed=0, skipped=0, buffered=0,
              cancelled=0, started=4)
    log.close()
    return rd


def test_audit_passes_on_honest_run(fake_run) -> None:
    rep = audit_run(fake_run.path)
    assert rep.ok, rep.as_dict()
    assert rep.tokens_checked == 32 and rep.max_logprob_error < 1e-4
    assert rep.multi_version_turns == 4 and rep.multi_version_trajectories == 4
    assert rep.lag_histogram == {1: 4}


def test_audit_counts_trajectories_whose_turns_have_different_versions(fake_run, tmp_path) -> None:
    """Token 4 (the first of v1) becomes an observation: the v0 and v1 tokens are then two
    turns, each of one version — the trajectory spans versions, no single turn does."""
    import shutil

    shutil.copytree(fake_run.path, tmp_path / "c")
    rd = RunDir(tmp_path / "c")

    def observe(ls):  # noqa: ANN001, ANN202
        for t in ls:
            t["response_mask"][4], t["response_logprobs"][4], t["response_versions"][4] = 0, 0.0, -1

    _tamper(rd, observe)
    rep = audit_run(rd.path)
    assert rep.ok, rep.as_dict()
    assert rep.multi_version_turns == 0 and rep.multi_version_trajectories == 4
    assert rep.as_dict()["trajectories_spanning_versions"] == 4


def _tamper(rd, fn):
    lines = [json.loads(x) for x in rd.trajectories.read_text().splitlines()]
    fn(lines)
    rd.trajectories.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_audit_fails_on_tampered_logprob(fake_run, tmp_path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(fake_run.path, copy)
    from areal_like.orchestration.run_dir import RunDir as R

    rd = R(copy)
    _tamper(rd, lambda ls: ls[2]["response_logprobs"].__setitem__(5, ls[2]["response_logprobs"][5] - 0.01))
    rep = audit_run(copy)
    assert not rep.ok and rep.worst["episode_id"] == "e2" and rep.worst["token"] == 5
    # a token attributed to the wrong version is caught too
    shutil.copytree(fake_run.path, tmp_path / "c2")
    rd2 = R(tmp_path / "c2")
    _tamper(rd2, lambda ls: ls[0]["response_versions"].__setitem__(6, 0))
    assert not audit_run(tmp_path / "c2").ok
    from typer.testing import CliRunner

    from areal_like.orchestration.cli import app

    r = CliRunner().invoke(app, ["audit", str(copy)])
    assert r.exit_code == 3 and "audit FAILED" in r.output  # an integrity failure
    shutil.rmtree(rd.weights)
    assert CliRunner().invoke(app, ["audit", str(copy)]).exit_code == 1  # records missing: an error


def test_audit_checks_lag_and_reports_missing(fake_run, tmp_path) -> None:
    import shutil

    shutil.copytree(fake_run.path, tmp_path / "c")
    rd = RunDir(tmp_path / "c")
    _tamper(rd, lambda ls: ls[1].__setitem__("consumed_at_version", 5))
    rep = audit_run(rd.path)
    assert any("invariant 1" in p for p in rep.problems)
    shutil.rmtree(rd.weights)
    rep = audit_run(rd.path)
    assert any("record_weights" in m for m in rep.missing) and not rep.ok


def test_audit_and_report_commands(fake_run) -> None:
    from typer.testing import CliRunner

    from areal_like.orchestration.cli import app

    r = CliRunner().invoke(app, ["audit", str(fake_run.path)])
    assert r.exit_code == 0, r.output
    assert "audit passed" in r.output
    r = CliRunner().invoke(app, ["report", str(fake_run.path)])
    assert r.exit_code == 0, r.output
    assert (fake_run.path / "report.png").is_file()
