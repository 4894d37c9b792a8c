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
