"""Write docs/config_reference.md from the pydantic config models (their field docstrings).

    python scripts/gen_config_reference.py          # rewrite the file
    python scripts/gen_config_reference.py --check  # exit 1 if the file is stale (tests use this)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from areal_like.core.config import ExperimentConfig

OUT = Path(__file__).resolve().parent.parent / "docs" / "config_reference.md"


def _members(ann: Any) -> list[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    out: list[type[BaseModel]] = []
    for a in getattr(ann, "__args__", ()) or ():
        out += _members(a)
    return out


def _type_name(ann: Any) -> str:
    s = getattr(ann, "__name__", None) if isinstance(ann, type) else None
    return s or str(ann).replace("typing.", "")


def _section(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    rows, subs = [], []
    for name, f in model.model_fields.items():
        if name == "source":
            continue
        members = _members(f.annotation)
        if members:
            subs.append((name, members))
            continue
        default = f.get_default(call_default_factory=True)
        bounds = ", ".join(str(m) for m in f.metadata) if f.metadata else ""
        doc = (f.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | `{_type_name(f.annotation)}` | `{default!r}` | {bounds} | {doc} |")
    if rows:
        lines += [f"## `{prefix.rstrip('.') or 'top level'}`", "", "| key | type | default | bounds | meaning |",
                  "| --- | --- | --- | --- | --- |", *rows, ""]
    for name, members in subs:
        for m in members:
            tag = ""
            if len(members) > 1 and "type" in m.model_fields:
                tag = f" (type: {m.model_fields['type'].default})"
                lines.append(f"### `{prefix}{name}`{tag}")
            _section(m, f"{prefix}{name}.", lines)


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from the pydantic models in `areal_like/core/config.py` by",
        "`python scripts/gen_config_reference.py`; do not edit by hand. Every key can be set in a",
        "YAML file or overridden with `--set section.key=value`. Backend sections are chosen by",
        "their `type` field.",
        "",
    ]
    _section(ExperimentConfig, "", lines)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.is_file() and OUT.read_text() == text else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")
