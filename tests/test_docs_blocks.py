"""Every code block of README.md, docs/tutorial.md, docs/launching.md, docs/real_models.md and docs/lora.md runs
as written (#30, #31, #43, #45), so the docs
cannot drift from the code.

What a block is, read from the markdown itself:

- a block right after a line that is only `` `PATH`: `` is that file's content: it is
  written to PATH (a `.py` file must compile, a `.yaml` file must parse), as a reader
  following the doc would save it;
- any other ```bash block runs with `bash -e -o pipefail`, any other ```python block
  with `python -c`; other blocks (console output, yaml fragments) are not run.

A block may be preceded by HTML comments, invisible on the rendered page, that say how to
test it, one per line:

- `<!-- docs-test: skip REASON -->`: not run; the reason is the test's skip message;
- `<!-- docs-test: slow -->`: run in the slow suite only (`scripts/test.sh --slow`);
- `<!-- docs-test: replace `OLD` with `NEW` -->`: run with OLD replaced by NEW (fewer
  steps, a throwaway output folder); OLD must be in the block, so the directive
  cannot outlive the command it shortens;
- `<!-- docs-test: creates PATH -->`: PATH (relative to where the block ran) must exist
  afterwards;
- `<!-- docs-test: finally `COMMAND` -->`: COMMAND runs after the block, whether it passed
  or not (`ray stop --force` after a block that starts a Ray cluster).

The blocks of one doc share a folder and run in order: README.md's in a copy of the
repository's tracked files (its commands run from the repository root), with `.venv`
linked in; the tutorial's in an empty folder, as the tutorial says. A block run on its own
(`-k`) first runs the doc's earlier blocks that are not slow or skipped.
"""

from __future__ import annotations

import hashlib
import os
import py_compile
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = {"README.md": "repo", "docs/tutorial.md": "empty", "docs/launching.md": "repo", "docs/real_models.md": "repo",
        "docs/lora.md": "repo"}
"""Each doc and where its blocks run: a copy of the repository, or an empty folder."""

PENDING: dict[tuple[str, str], str] = {}
"""Blocks, by (doc, section), that are known not to run yet; each says why."""

_FENCE = re.compile(r"^```([\w-]*)\s*$")
_DIRECTIVE = re.compile(r"^<!-- docs-test: (.*?) -->\s*$")
_LABEL = re.compile(r"^`([^`\s]+)`:\s*$")
_REPLACE = re.compile(r"^replace `([^`]+)` with `([^`]*)`$")
_FINALLY = re.compile(r"^finally `([^`]+)`$")


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    section: str
    path: str | None = None
    slow: bool = False
    skip: str | None = None
    replace: list[tuple[str, str]] = field(default_factory=list)
    creates: list[str] = field(default_factory=list)
    cleanup: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.path is not None or self.lang in ("bash", "python")


def parse(doc: str) -> list[Block]:
    lines = (REPO / doc).read_text().splitlines()
    blocks: list[Block] = []
    section, i = "", 0
    while i < len(lines):
        text = lines[i]
        m = _FENCE.match(text)
        if not m:
            if text.startswith("#"):
                section = text.lstrip("#").strip()
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        block = Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", section)
        k = i - 1
        while k >= 0 and (d := _DIRECTIVE.match(lines[k])):
            _apply(block, d.group(1).strip())
            k -= 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        if k >= 0 and (label := _LABEL.match(lines[k])):
            block.path = label.group(1)
        if block.runs:
            blocks.append(block)
        i = end + 1
    return blocks


def _apply(block: Block, directive: str) -> None:
    word, _, rest = directive.partition(" ")
    if word == "slow":
        block.slow = True
    elif word == "skip":
        block.skip = rest.strip() or "no reason given"
    elif word == "creates":
        block.creates.append(rest.strip())
    elif (r := _REPLACE.match(directive)) is not None:
        block.replace.append((r.group(1), r.group(2)))
    elif (f := _FINALLY.match(directive)) is not None:
        block.cleanup.append(f.group(1))
    else:
        raise AssertionError(f"{block.id}: unknown docs-test directive {directive!r}")


BLOCKS = [b for doc in DOCS for b in parse(doc)]
BLOCKS_BY_ID = {b.id: b for b in BLOCKS}


def _param(b: Block) -> object:
    marks = [pytest.mark.slow] if b.slow else []
    return pytest.param(b, id=f"{b.id}-{b.path or b.lang}", marks=marks)


# ---- the folders the blocks run in, one per doc, kept for the module ----------------------

class Workspace:
    def __init__(self, doc: str, root: Path) -> None:
        self.doc, self.root = doc, root
        self.done: set[str] = set()
        self.failed: set[str] = set()
        if DOCS[doc] == "repo":
            tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
            for name in filter(None, tracked.decode().split("\0")):
                src = REPO / name
                if src.is_file():
                    (root / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, root / name)
            if (REPO / ".venv").is_dir():
                (root / ".venv").symlink_to(REPO / ".venv")


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workspace]:
    return {doc: Workspace(doc, tmp_path_factory.mktemp(re.sub(r"\W", "_", doc))) for doc in DOCS}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # areal-like, python
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               TOKENIZERS_PARALLELISM="false", EXTRAS="dev")  # EXTRAS: scripts/setup.sh finds .venv as made
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _setup_stamp_ok() -> bool:
    """scripts/setup.sh will do nothing (its stamp matches): a script calling it from the
    copy must not reinstall the shared .venv, which would point it at the copy."""
    stamp = REPO / ".venv" / ".areal_like_setup"
    want = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "scripts/setup.sh").read_bytes())
    return stamp.is_file() and stamp.read_text().strip() == f"{want.hexdigest()[:16]}-dev"


def run_block(b: Block, ws: Workspace) -> None:
    code = b.code
    for old, new in b.replace:
        assert old in code, f"{b.id}: the docs-test directive replaces {old!r}, which the block no longer has"
        code = code.replace(old, new)
    if b.path is not None:
        target = ws.root / b.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)
        if target.suffix == ".py":
            py_compile.compile(str(target), doraise=True)
        elif target.suffix in (".yaml", ".yml"):
            yaml.safe_load(code)
    else:
        if "scripts/setup.sh" in code or "scripts/quickstart.sh" in code:
            if not _setup_stamp_ok():
                pytest.skip("scripts/setup.sh would reinstall .venv (its stamp is stale): run it first")
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if b.lang == "bash" else [sys.executable, "-c", code]
        timeout = 900 if b.slow else 300
        ws.failed.add(b.id)  # until it has passed
        try:
            run = subprocess.run(cmd, cwd=ws.root, env=_env(), capture_output=True, text=True, timeout=timeout)
        finally:
            for c in b.cleanup:
                subprocess.run(["bash", "-c", c], cwd=ws.root, env=_env(), capture_output=True, timeout=120)
        assert run.returncode == 0, (f"{b.id} exited {run.returncode}\n--- block as run ---\n{code}"
                                     f"--- stdout ---\n{run.stdout[-3000:]}\n--- stderr ---\n{run.stderr[-3000:]}")
    for p in b.creates:
        assert (ws.root / p).exists(), f"{b.id}: {p} was not created in {ws.root}"
    ws.failed.discard(b.id)
    ws.done.add(b.id)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block(block: Block, workspaces: dict[str, Workspace]) -> None:
    why = block.skip or PENDING.get((block.doc, block.section))
    if why:
        pytest.skip(why)
    ws = workspaces[block.doc]
    broken = sorted(i for i in ws.failed if BLOCKS_BY_ID[i].line < block.line)
    if broken:
        pytest.fail(f"an earlier block of {block.doc} failed: {', '.join(broken)}")
    for earlier in BLOCKS:  # what a reader did before this block (when run on its own)
        if earlier.doc == block.doc and earlier.line < block.line and earlier.id not in ws.done \
                and not (earlier.slow or earlier.skip or PENDING.get((earlier.doc, earlier.section))):
            run_block(earlier, ws)
    run_block(block, ws)


def test_the_docs_have_blocks_and_every_directive_parses() -> None:
    """parse() raises on an unknown directive; both docs still have runnable blocks."""
    for doc in DOCS:
        assert any(b.doc == doc for b in BLOCKS), doc
    assert any(b.path == "my_task/config.yaml" for b in BLOCKS)
