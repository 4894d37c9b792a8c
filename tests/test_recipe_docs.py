"""What the docs say the shipped configs set is what they set.

docs/real_models.md explains the real recipe's settings in a table (`| \`key\` | value | why |`),
and the README names the quickstart's η. When a config changes (η went 2 → 1 on 2026-11-29)
and the prose does not, a reader tunes from the wrong value; these tests fail instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from areal_like.core.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def _value(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _same(doc: str, real: object) -> bool:
    if isinstance(real, bool) or not isinstance(real, (int, float)):
        return doc.strip().lower() == str(real).lower()
    return float(doc) == float(real)


def _table_rows(text: str, heading: str) -> list[tuple[list[str], list[str]]]:
    """(keys, values) of each row of the table after `heading` whose first cell names keys."""
    rows = []
    for line in text.split(heading, 1)[1].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        keys = re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", cells[0])
        if keys:
            rows.append((keys, [v.strip() for v in re.split(r",|×", cells[1])]))
    return rows


def test_the_real_recipes_settings_table_matches_configs_smollm2() -> None:
    cfg = load_config(str(ROOT / "configs/smollm2.yaml"), [])
    rows = _table_rows((ROOT / "docs/real_models.md").read_text(), "The settings that worked, and why:")
    assert len(rows) >= 8, rows  # the table is there and was read
    for keys, values in rows:
        assert len(keys) == len(values), (keys, values)
        for key, doc in zip(keys, values, strict=True):
            assert _same(doc, _value(cfg, key)), f"docs/real_models.md says {key} = {doc}, " \
                                                 f"configs/smollm2.yaml sets {_value(cfg, key)}"


def test_the_readme_names_the_quickstarts_eta() -> None:
    cfg = load_config(str(ROOT / "configs/quickstart.yaml"), [])
    said = re.findall(r"with η = (\d+) \(max version lag (\d+)", (ROOT / "README.md").read_text())
    eta = cfg.staleness.max_staleness
    assert said == [(str(eta), str(eta))], said
