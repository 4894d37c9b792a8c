"""Config loading: every shipped config parses; bad files and overrides fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_like.core.config import ConfigError, ExperimentConfig, dump_config, load_config

CONFIGS = sorted(p for p in (Path(__file__).parent.parent / "configs").glob("*.yaml") if not p.name.startswith("sft_"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, ExperimentConfig)
    # the resolved config round-trips through YAML
    again = ExperimentConfig.model_validate(__import__("yaml").safe_load(dump_config(cfg)))
    assert again.model_dump() == cfg.model_dump()


def test_shipped_configs_exist() -> None:
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


def test_sft_configs_parse() -> None:
    from train_cluster.sft import load_sft_config

    for p in (Path(__file__).parent.parent / "configs").glob("sft_*.yaml"):
        load_sft_config(p)


def test_overrides_apply_with_types() -> None:
    cfg = load_config(None, ["train.lr=1e-5", "staleness.max_staleness=4", "rollout.engine.max_batch_size=8"])
    assert cfg.train.lr == 1e-5
    assert cfg.staleness.max_staleness == 4
    assert cfg.rollout.engine.type == "embedded" and cfg.rollout.engine.max_batch_size == 8
    assert cfg.samples_per_step == cfg.train.batch_size * cfg.rollout.group_size


def test_backend_union_chosen_by_type() -> None:
    cfg = load_config(None, ["train.backend.type=megatron", "train.backend.tensor_parallel_size=2"])
    assert cfg.train.backend.type == "megatron" and cfg.train.backend.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"rollout\.engine.*'embedded', 'vllm'"):
        load_config(None, ["rollout.engine.type=tgi"])


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lrr=1", r"unknown key 'lrr' at train; valid keys: \[.*'lr'"),
        ("nosuch.key=1", r"unknown key 'nosuch' at top level"),
        ("train.lr=abc", r"train\.lr: .*valid number"),
        ("staleness.max_staleness=-1", r"staleness\.max_staleness: .*greater than or equal to 0"),
        ("train.lr", r"expected KEY=VALUE"),
        ("train.lr.x=1", r"train\.lr is not a section"),
    ],
)
def test_bad_overrides_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_bad_file_names_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  batch_size: zero\nrollout:\n  colour: blue\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert str(bad) in msg
    assert "train.batch_size" in msg and "rollout.colour: unknown key" in msg


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "x.yaml").write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "x.yaml")
    (tmp_path / "y.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "y.yaml")


def test_dataset_file_types_need_a_path() -> None:
    with pytest.raises(ConfigError, match="dataset.type='jsonl' needs dataset.path"):
        load_config(None, ["dataset.type=jsonl"])


def test_every_field_is_documented() -> None:
    def walk(model: type, prefix: str) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            if name == "source":
                continue
            ann = field.annotation
            sub = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and hasattr(a, "model_fields")]
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                sub = [ann]
            if sub:
                for s in sub:
                    missing += walk(s, f"{prefix}{name}.")
            elif not field.description and name != "type":
                missing.append(prefix + name)
        return missing

    assert walk(ExperimentConfig, "") == []


def test_config_reference_is_current() -> None:
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    r = subprocess.run([sys.executable, "scripts/gen_config_reference.py", "--check"], cwd=root)
    assert r.returncode == 0, "docs/config_reference.md is stale: run python scripts/gen_config_reference.py"


_RUN_CONFIGS = sorted(p for p in (Path(__file__).parents[1] / "configs").glob("*.yaml") if not p.name.startswith("sft"))


@pytest.mark.parametrize("path", _RUN_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_every_shipped_config_switches_engine_by_override(path, engine, caplog):
    """`--set rollout.engine.type=...` works from any shipped config: keys of the other
    engine variant in the file are dropped with a note, not refused."""
    from areal_like.core.config import EmbeddedEngineConfig, VLLMEngineConfig

    cfg = load_config(path, [f"rollout.engine.type={engine}"])
    assert isinstance(cfg.rollout.engine, {"embedded": EmbeddedEngineConfig, "vllm": VLLMEngineConfig}[engine])


def test_switching_variant_drops_file_keys_but_refuses_explicit_foreign_keys(caplog):
    cfg = load_config("configs/quickstart.yaml", ["rollout.engine.type=vllm", "rollout.engine.kv_cache_gb=1"])
    assert cfg.rollout.engine.kv_cache_gb == 1
    assert "dropped keys of the other variant" in caplog.text and "rollout.engine.max_batch_size" in caplog.text
    with pytest.raises(ConfigError, match="max_batch_size: unknown key"):
        load_config("configs/quickstart.yaml", ["rollout.engine.type=vllm", "rollout.engine.max_batch_size=4"])


def test_only_a_switched_variant_drops_unknown_file_keys(tmp_path):
    """`dataset.type` is a choice inside one section, not a union of sections: a wrong
    key in the file is refused, not dropped, when an override sets it."""
    bad = tmp_path / "c.yaml"
    bad.write_text("dataset:\n  type: generated\n  colour: blue\nrollout:\n  engine:\n    type: embedded\n    colour: red\n")
    with pytest.raises(ConfigError, match="dataset.colour: unknown key"):
        load_config(bad, ["dataset.type=jsonl", f"dataset.path={tmp_path / 'x.jsonl'}", "rollout.engine.type=vllm"])
    with pytest.raises(ConfigError, match=r"unknown key 'colour' at rollout\.engine"):
        load_config(bad, ["rollout.engine.type=vllm", "rollout.engine.colour=1"])  # set by an override: kept


def test_weight_sync_is_a_union_chosen_by_type(tmp_path):
    from areal_like.core.config import DiskWeightSyncConfig, DistWeightSyncConfig

    assert isinstance(load_config(None).weight_sync, DistWeightSyncConfig)
    cfg = load_config(None, ["weight_sync.type=disk", f"weight_sync.disk_path={tmp_path}"])
    assert isinstance(cfg.weight_sync, DiskWeightSyncConfig) and cfg.weight_sync.disk_path == str(tmp_path)
    with pytest.raises(ConfigError, match="disk_path: unknown key"):
        load_config(None, [f"weight_sync.disk_path={tmp_path}"])  # the dist transport has no folder


def test_a_gate_that_could_never_admit_a_group_is_refused_at_load():
    with pytest.raises(ConfigError, match="max_concurrent=4 < rollout.group_size=8: groups are admitted whole"):
        load_config(None, ["staleness.max_concurrent=4", "rollout.group_size=8"])
