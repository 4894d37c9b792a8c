"""The layers of docs/design.md §4, checked on the source (every import, lazy ones too).

    orchestration (areal_like.orchestration, areal_like.api, bench)   may import anything
    rollout_cluster, train_cluster        -> core, tasks, models, weight_sync, launcher; never each other
    weight_sync                           -> core
    launcher (areal_like.launcher)        -> core
    models, tasks                         -> core
    core                                  -> nothing of the project, nothing heavy

and no import circles between modules. Only the launcher knows which launcher runs and
what Ray's errors are, and only it starts Ray (`test_only_the_launcher_knows_its_kind_and_rays_errors`).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("areal_like", "rollout_cluster", "train_cluster", "weight_sync")

LAYER_OF = [  # longest prefix first
    ("areal_like.orchestration", "orchestration"),
    ("areal_like.api", "orchestration"),
    ("areal_like.plan", "orchestration"),
    ("areal_like.launcher", "launcher"),
    ("areal_like.core", "core"),
    ("areal_like.tasks", "tasks"),
    ("areal_like.models", "models"),
    ("areal_like", "core"),  # the package's __init__ exports contracts only
    ("weight_sync", "weight_sync"),
    ("rollout_cluster", "rollout_cluster"),
    ("train_cluster", "train_cluster"),
]
ALLOWED = {
    "core": {"core"},
    "tasks": {"core", "tasks"},
    "models": {"core", "models"},
    "weight_sync": {"core", "weight_sync"},
    "launcher": {"core", "launcher"},
    "rollout_cluster": {"core", "tasks", "models", "weight_sync", "launcher", "rollout_cluster"},
    "train_cluster": {"core", "tasks", "models", "weight_sync", "launcher", "train_cluster"},
    "orchestration": {"core", "tasks", "models", "weight_sync", "launcher", "rollout_cluster", "train_cluster",
                      "orchestration"},
}


def _layer(module: str) -> str | None:
    for prefix, layer in LAYER_OF:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            out[_module_name(path)] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules this file imports, anywhere in it (lazy imports count)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:  # `from pkg import module` or `import pkg.module.attr`
                name = name.rpartition(".")[0]
            if name and _layer(name) is not None and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    known = set(sources)
    return {m: _imports(m, p, known) for m, p in sources.items()}


def test_imports_point_down_only():
    bad = []
    for module, deps in _graph().items():
        layer = _layer(module)
        for dep in deps:
            if _layer(dep) not in ALLOWED[layer]:
                bad.append(f"{module} ({layer}) imports {dep} ({_layer(dep)})")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_no_import_circles():
    graph = _graph()
    # a package's __init__ re-exporting its own modules is not a circle of design
    edges = {m: {d for d in deps if not (m.startswith(d + ".") and d in graph)} for m, deps in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_contracts_import_nothing_heavy():
    """`import areal_like` and every contract module load without torch, Ray, ZMQ,
    transformers, vLLM or Megatron (checked in a fresh interpreter)."""
    mods = [m for m in _sources() if _layer(m) == "core"]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "heavy = ('torch', 'ray', 'zmq', 'transformers', 'vllm', 'megatron', 'aiohttp')\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"contracts pulled in heavy modules: {out.stdout.strip()}"


# What only areal_like/launcher/ may write: a branch on which launcher runs, Ray's error
# types, starting Ray. Looked for in code only (comments and strings, docstrings too, may
# name them).
LAUNCHER_ONLY = re.compile(r"launcher\s*[!=]=|ray\.exceptions|RayActorError|RayTaskError|RayError\b|ray\.init\(")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, the line's code without its comments and strings) of a source file."""
    code: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE) or \
                tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            continue
        code.setdefault(tok.start[0], []).append(tok.string)
    return [(n, " ".join(parts).replace(" . ", ".").replace(" (", "(").replace(" ==", "==").replace("! =", "!="))
            for n, parts in sorted(code.items())]


def test_only_the_launcher_knows_its_kind_and_rays_errors():
    bad = []
    for module, path in sorted(_sources().items()):
        if _layer(module) == "launcher":
            continue
        for n, line in _code_lines(path):
            if LAUNCHER_ONLY.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line}")
    assert not bad, "outside areal_like/launcher/ (branch on the launcher, Ray's errors, ray.init):\n" + "\n".join(bad)


def test_the_launcher_check_sees_code_not_words(tmp_path):
    sample = (
        'x = 1  # launcher == "ray" in a comment\n'
        '"""ray.init( in a docstring, RayTaskError too"""\n'
        'if cfg.cluster.launcher == "local":\n'
        '    import ray.exceptions\n'
        '    ray.init(address="auto")\n'
    )
    (tmp_path / "sample.py").write_text(sample)
    hits = [n for n, line in _code_lines(tmp_path / "sample.py") if LAUNCHER_ONLY.search(line)]
    assert hits == [3, 4, 5]
