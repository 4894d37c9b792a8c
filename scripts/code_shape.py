"""The code's shape, measured (issue #32 item 6): lines per package, the largest classes by
attribute count, and the files over the size bound with or without a stated reason.

Run: `python scripts/code_shape.py [--ref REV] [--json]` (REV: a git revision to measure
instead of the working tree, e.g. the commit before a refactor). tests/test_code_shape.py
holds the bounds (`MAX_ATTRIBUTES`, `MAX_LINES`) against the same functions.

- A class's attributes: the distinct names assigned on `self` in its methods, plus the
  fields declared in its body (annotated names: pydantic models, dataclasses).
- A file over `MAX_LINES` lines states why in its module docstring, in a sentence that
  starts with `Why this file is long:`.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("areal_like", "rollout_cluster", "train_cluster", "weight_sync")
MAX_ATTRIBUTES = 20
MAX_LINES = 600
REASON = "Why this file is long:"


@dataclass
class ClassShape:
    name: str
    path: str
    line: int
    attributes: int


@dataclass
class FileShape:
    path: str
    lines: int
    reason: bool


def sources(ref: str | None = None) -> dict[str, str]:
    """Path → text of every .py file of the packages (at `ref`, or in the working tree)."""
    if ref is None:
        return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", ref, "--", *PACKAGES], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{ref}:{n}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout for n in names if n.endswith(".py")}


def class_attributes(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        names.add(sub.attr)
    return names


def measure(ref: str | None = None) -> tuple[dict[str, int], list[ClassShape], list[FileShape]]:
    per_package: dict[str, int] = dict.fromkeys(PACKAGES, 0)
    classes: list[ClassShape] = []
    files: list[FileShape] = []
    for path, text in sources(ref).items():
        n = len(text.splitlines())
        per_package[path.split("/", 1)[0]] += n
        tree = ast.parse(text, filename=path)
        doc = ast.get_docstring(tree) or ""
        files.append(FileShape(path, n, REASON in doc))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append(ClassShape(node.name, path, node.lineno, len(class_attributes(node))))
    classes.sort(key=lambda c: -c.attributes)
    files.sort(key=lambda f: -f.lines)
    return per_package, classes, files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", help="git revision to measure instead of the working tree")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args()
    per_package, classes, files = measure(a.ref)
    big_classes = [c for c in classes if c.attributes > MAX_ATTRIBUTES]
    big_files = [f for f in files if f.lines > MAX_LINES]
    if a.json:
        print(json.dumps({"ref": a.ref or "working tree", "lines": per_package,
                          "classes": [asdict(c) for c in classes[:a.top]],
                          "classes_over_bound": len(big_classes),
                          "files_over_bound": [asdict(f) for f in big_files]}))
        return
    print(f"# code shape of {a.ref or 'the working tree'}")
    print("lines per package: " + ", ".join(f"{k} {v}" for k, v in per_package.items())
          + f" (total {sum(per_package.values())})")
    print(f"largest classes (attributes; bound {MAX_ATTRIBUTES}, {len(big_classes)} over it):")
    for c in classes[:a.top]:
        print(f"  {c.attributes:3d}  {c.name}  {c.path}:{c.line}")
    print(f"files over {MAX_LINES} lines ({len(big_files)}):")
    for f in big_files:
        print(f"  {f.lines:5d}  {f.path}{'' if f.reason else '  (no reason in its docstring)'}")


if __name__ == "__main__":
    sys.exit(main())
