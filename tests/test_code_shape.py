"""Small classes, files of a readable size (issue #32): no class over `MAX_ATTRIBUTES`
attributes and no file over `MAX_LINES` lines without a reason in its docstring, measured by
scripts/code_shape.py. The classes and files over the bound today are listed with their size
now: they may shrink, never grow, and one back under the bound must leave the list (so the
list only gets shorter)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from code_shape import MAX_ATTRIBUTES, MAX_LINES, measure  # noqa: E402

OVER_ATTRIBUTES: dict[str, int] = {
    # "path:Class": attributes on 2026-11-26.
}
OVER_LINES: dict[str, int] = {
    # path: lines on 2026-11-26.
}


def test_no_class_grows_past_the_attribute_bound() -> None:
    _, classes, _ = measure()
    seen = {f"{c.path}:{c.name}": c.attributes for c in classes}
    grown = {k: v for k, v in seen.items() if v > MAX_ATTRIBUTES and v > OVER_ATTRIBUTES.get(k, MAX_ATTRIBUTES)}
    assert not grown, (f"classes over {MAX_ATTRIBUTES} attributes (or over their listed size): {grown}; "
                       "split a collaborator out rather than raise the number")
    back = [k for k in OVER_ATTRIBUTES if seen.get(k, 0) <= MAX_ATTRIBUTES]
    assert not back, f"back under the bound (or gone): take them off OVER_ATTRIBUTES: {back}"
    shrunk = {k: seen[k] for k, v in OVER_ATTRIBUTES.items() if k in seen and seen[k] < v}
    assert not shrunk, f"smaller now: lower their numbers in OVER_ATTRIBUTES to {shrunk}"


def test_no_file_grows_past_the_line_bound_without_a_reason() -> None:
    _, _, files = measure()
    seen = {f.path: f for f in files}
    grown = {f.path: f.lines for f in files
             if f.lines > MAX_LINES and not f.reason and f.lines > OVER_LINES.get(f.path, MAX_LINES)}
    assert not grown, (f"files over {MAX_LINES} lines with no 'Why this file is long:' in the module "
                       f"docstring (or over their listed size): {grown}")
    back = [p for p in OVER_LINES if p not in seen or seen[p].lines <= MAX_LINES or seen[p].reason]
    assert not back, f"back under the bound, gone, or with a reason now: take them off OVER_LINES: {back}"


def test_one_rollout_cycle_runs_in_at_most_eight_files() -> None:
    """Issue #32's must-show: the rollout side's steady cycle (announcement in → admit →
    episodes → group out → acknowledged), traced over real sockets by
    scripts/rollout_cycle_files.py, runs in ≤ 8 of our files (docs/design.md §10.22)."""
    import re
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "rollout_cycle_files.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"(\d+) groups, (\d+) files:", out.stdout)
    assert m, out.stdout
    groups, files = int(m.group(1)), int(m.group(2))
    assert groups >= 12, f"the scripted trainer saw only {groups} groups: the trace is not of steady cycles"
    assert files <= 8, f"one rollout cycle runs in {files} files (bound 8):\n{out.stdout}"
