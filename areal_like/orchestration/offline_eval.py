"""Held-out evaluation of a run's saved versions, after the run (`areal-like eval`).

An evaluation during a run shares the rollout servers with training: it slows the
rollout side, the trainer waits for data, and the version lag the run reaches shrinks
(the staleness ablation at η = 8 ran at a mean lag of 3.6 with an evaluation every 5
versions, against 6.7 without; docs/benchmarks.md). Evaluating afterwards leaves the run
as it was. A run that sets `run.record_weights` keeps every version the engines loaded
under `weights/v{N}/` (HF folders); this module starts the run's rollout servers on each
of them in turn and scores the same held-out rows, with the same per-episode sampling
seeds, as the run's own evaluation of that version (`Evaluator`), so the two can be
compared number for number.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from areal_like.core.config import ExperimentConfig, load_config
from areal_like.core.types import EvalResult, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["OfflineEvalError", "saved_versions", "pick_versions", "evaluate_run"]

_VERSION_DIR = re.compile(r"^v(\d+)$")


class OfflineEvalError(RuntimeError):
    """The run folder cannot be evaluated as asked (no config, no saved weights, a version
    that was not saved)."""


def saved_versions(run_dir: Path) -> dict[int, Path]:
    """Version -> its HF folder under `weights/` (complete folders only)."""
    root = Path(run_dir) / "weights"
    out: dict[int, Path] = {}
    if root.is_dir():
        for d in root.iterdir():
            m = _VERSION_DIR.match(d.name)
            if m and d.is_dir() and (d / "config.json").is_file():
                out[int(m.group(1))] = d
    return dict(sorted(out.items()))


def pick_versions(saved: dict[int, Path], spec: str) -> dict[int, Path]:
    """`all`, `every:N` (versions N, 2N, … and the last), or a comma list of versions."""
    if not saved:
        raise OfflineEvalError("no saved versions: the run did not set run.record_weights=true "
                               "(its weights/v{N}/ folders are what this command evaluates)")
    spec = spec.strip()
    if spec == "all":
        return dict(saved)
    if spec.startswith("every:"):
        try:
            n = int(spec.removeprefix("every:"))
        except ValueError:
            n = 0
        if n < 1:
            raise OfflineEvalError(f"--versions {spec!r}: expected every:N with N >= 1")
        last = max(saved)
        return {v: p for v, p in saved.items() if v > 0 and (v % n == 0 or v == last)}
    try:
        wanted = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise OfflineEvalError(f"--versions {spec!r}: expected all, every:N or a comma list of versions") from None
    missing = [v for v in wanted if v not in saved]
    if missing:
        raise OfflineEvalError(f"--versions: {missing} not saved; saved: {_ranges(list(saved))}")
    return {v: saved[v] for v in wanted}


def _ranges(vs: list[int]) -> str:
    return f"v{vs[0]}..v{vs[-1]} ({len(vs)} versions)" if vs else "none"


def run_config(run_dir: Path, overrides: list[str] | None = None) -> ExperimentConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise OfflineEvalError(f"{run_dir}: no config.yaml (is it a run folder, run.dir?)")
    return load_config(path, overrides or [])


async def _evaluate(cfg: ExperimentConfig, versions: dict[int, Path], num_samples: int,
                    on_result: Any) -> list[dict[str, Any]]:
    from areal_like.launcher import open_launcher
    from areal_like.models.tiny_model import load_tokenizer
    from areal_like.orchestration.dataset import load_rows
    from areal_like.orchestration.pools import rollout_bundles
    from areal_like.orchestration.rollout_policies import Evaluator
    from areal_like.orchestration.server_pool import ServerPool
    from rollout_cluster.agent_loop.runner import AgentRunner
    from rollout_cluster.server_manager import ServerManager

    first = next(iter(versions.values()))
    tokenizer = load_tokenizer(first)
    # The run's own held-out rows: the same dataset, seed and cap as its evaluations.
    rows = load_rows(cfg.dataset, "eval", cfg.run.seed, max_eval_rows=cfg.eval.num_samples)[:num_samples]
    if not rows:
        raise OfflineEvalError("the run's dataset holds out no evaluation rows (dataset.eval_split, eval_path)")
    sampling = SamplingParams(temperature=cfg.eval.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_tokens=cfg.rollout.response_length)
    launcher = open_launcher(cfg, num_cpus=cfg.cluster.rollout_pool.num_cpus)
    await asyncio.to_thread(launcher.up)
    group = None
    out: list[dict[str, Any]] = []
    try:
        group = await asyncio.to_thread(launcher.place, "rollout_pool", rollout_bundles(cfg),
                                        cfg.cluster.rollout_pool.strategy)
        for version, path in versions.items():
            pool = ServerPool(cfg, path, group, launcher=launcher)
            manager = None
            try:
                servers = await pool.start()
                manager = ServerManager(servers, max_sticky_sessions=cfg.rollout.max_sticky_sessions)
                runner = AgentRunner.from_config(cfg, server_manager=manager, tokenizer=tokenizer)
                got: list[EvalResult] = []

                async def report(_v: int, result: EvalResult, got: list[EvalResult] = got) -> None:
                    got.append(result)

                ev = Evaluator(rows=rows, every=1, sampling=sampling, seed=cfg.run.seed,
                               timeout_s=cfg.eval.final_timeout_s,
                               episodes=SimpleNamespace(run_episode=runner.run_episode, score=runner.score),
                               report=report)
                ev.start(version)
                await asyncio.gather(*ev.tasks)
                rec = {"version": version, **got[0].model_dump()}
                out.append(rec)
                on_result(rec)
            finally:
                if manager is not None:
                    await manager.close()
                await pool.close()
    finally:
        if group is not None:
            launcher.remove(group)
        await asyncio.to_thread(launcher.shutdown)
    return out


def evaluate_run(run_dir: Path, versions: str = "all", num_samples: int | None = None,
                 overrides: list[str] | None = None, on_result: Any = None) -> list[dict[str, Any]]:
    """Evaluate the saved versions `versions` picks (see `pick_versions`) of the run in
    `run_dir` on its held-out rows; each result is also appended to
    `run_dir/offline_eval.jsonl` as `{"kind": "offline_eval", "version", "accuracy", ...}`."""
    import json
    import time

    cfg = run_config(run_dir, overrides)
    picked = pick_versions(saved_versions(run_dir), versions)
    n = num_samples or cfg.eval.num_samples
    dest = Path(run_dir) / "offline_eval.jsonl"

    def write(rec: dict[str, Any]) -> None:
        with dest.open("a") as f:
            f.write(json.dumps({"kind": "offline_eval", "time": time.time(), **rec}) + "\n")
        if on_result is not None:
            on_result(rec)

    return asyncio.run(_evaluate(cfg, picked, n, write))
