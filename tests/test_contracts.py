"""Contracts kept, not probed (issue #32 item 4): an optional capability of one of our
types is a method (or flag) with an explicit default on its protocol or base class
(`AsyncGenerateEngine.hold`, `.receives_weights`, `WeightPublisher.publish`, ...), and
callers call it. They do not ask `getattr(x, "method", None)` / `hasattr(x, "method")`
whether some implementation happens to have it.

Checked on the source: a `getattr`/`hasattr` whose name is a literal naming a method
defined on a class of ours fails, unless the call is on the short allow-list below,
each entry a probe of a foreign object (vLLM, torch, Ray, user code) with its reason.
Probes of plain attributes and of dynamic names (config fields, dispatch) are not
this test's business.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("areal_like", "rollout_cluster", "train_cluster", "weight_sync")

ALLOWED: dict[tuple[str, str], str] = {
    # (file, name): why probing there is right
    ("rollout_cluster/engine/vllm_worker.py", "reload_weights"):
        "vLLM's model runner (foreign): older vLLMs lack it, and the error says which is needed",
    ("rollout_cluster/engine/vllm_worker.py", "process_weights_after_loading"):
        "a vLLM layer's quant method (foreign), which only some methods have",
    ("rollout_cluster/engine/vllm_worker.py", "device"):
        "the vLLM worker the extension is mixed into (foreign) sets `device`; a bare one in tests does not",
    ("areal_like/orchestration/cli.py", "summary"):
        "any KeyboardInterrupt (Ctrl-C's is Python's); only our RunInterrupted carries `summary`, a field",
    ("areal_like/orchestration/trainer_side.py", "waiting"):
        "`on_step` is any callable the caller of run_both hands in (a test's function, the "
        "CLI's Progress): `waiting` is an opt-in hook on it",
    ("train_cluster/torch_engine.py", "no_sync"):
        "torch's DDP wrapper (foreign) has no_sync, a plain module does not",
    ("train_cluster/megatron/engine.py", "no_sync"):
        "Megatron's DDP wrapper (foreign) has no_sync, a plain module does not",
}


def _our_method_names() -> set[str]:
    """Names of the methods defined on our classes (properties are data, not methods)."""
    methods: set[str] = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not (
                        (item.name.startswith("__") and item.name.endswith("__"))
                        or any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)
                    ):
                        methods.add(item.name)
    return methods


def _probes() -> list[tuple[str, int, str, str]]:
    """(file, line, getattr|hasattr, name) for every probe with a literal name."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                ):
                    out.append((rel, node.lineno, node.func.id, node.args[1].value))
    return out


def test_no_probing_for_our_own_methods():
    methods = _our_method_names()
    bad = [
        f"{rel}:{line}: {fn}(..., {name!r}): {name} is a method of ours; make it part of the "
        "protocol/base class with a default and call it"
        for rel, line, fn, name in _probes()
        if name in methods and (rel, name) not in ALLOWED
    ]
    assert not bad, "capabilities probed instead of kept:\n" + "\n".join(bad)


def test_allow_list_is_current():
    """Every allowed probe still exists, so the list cannot rot into a blanket pass."""
    found = {(rel, name) for rel, _, _, name in _probes()}
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"allow-list entries with no probe left (remove them): {stale}"


def test_engine_capabilities_have_defaults():
    """The optional engine capabilities the server calls exist on the protocol, with a
    default, so a new engine gets a clear refusal instead of an AttributeError."""
    import asyncio

    import pytest

    from rollout_cluster.engine.base import AsyncGenerateEngine, RequestError

    class Bare(AsyncGenerateEngine):
        pass

    e = Bare()
    assert (e.streams_tokens, e.receives_weights, e.lends_threads, e.lender) == (False, False, False, None)
    with pytest.raises(RuntimeError, match="cannot hold"):
        asyncio.run(e.hold(True))
    with pytest.raises(RequestError, match="top_logprobs needs the embedded engine"):
        asyncio.run(e.top_logprobs([1], [2], 1, 1.0))
    with pytest.raises(RuntimeError, match="cannot export"):
        asyncio.run(e.export_weights())
