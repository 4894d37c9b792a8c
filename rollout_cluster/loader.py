"""The one place user code named in a config is imported (docs/design.md §9.10).

Configs name built-in components by a typed name and user code as
`path/to/file.py:Name` or `package.module:Name`. Everything that accepts user code
(agent loops, tools, rewards) resolves it here, so there is exactly one rule for
where a file is looked up and one shape of error when it cannot be found:
`UserCodeError`, naming the spec, what was tried and what is available.

A file is loaded once per resolved path (cached in `sys.modules` under a private
name), so two config entries pointing at the same file share its module state.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["UserCodeError", "is_user_code_spec", "load_object"]


class UserCodeError(ImportError):
    """A `file.py:Name` / `pkg.mod:Name` spec could not be resolved; the message says why."""


def is_user_code_spec(spec: str) -> bool:
    """True when `spec` names user code rather than a built-in (it has a `:Name` part)."""
    return ":" in spec


def load_object(spec: str, *, base_dir: str | Path | None = None, what: str = "object") -> Any:
    """Import and return the object named by `spec`.

    `spec` is `path/to/file.py:Name` (relative paths are tried against `base_dir`,
    normally the config file's folder, then the current directory) or
    `package.module:Name`. `Name` may be dotted (`Outer.Inner`). `what` only flavours
    the error message ("tool", "reward", ...).
    """
    if not is_user_code_spec(spec):
        raise UserCodeError(f"{what} {spec!r}: expected 'path/to/file.py:Name' or 'package.module:Name'")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise UserCodeError(f"{what} {spec!r}: both the module/file and the name are required")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(target, base_dir, spec, what)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserCodeError(f"{what} {spec!r}: cannot import module {target!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise UserCodeError(
                f"{what} {spec!r}: {target!r} has no attribute {attr!r}; public names there: {public}"
            )
        obj = getattr(obj, part)
    return obj


def _load_file(target: str, base_dir: str | Path | None, spec: str, what: str) -> Any:
    candidates = [Path(target)] if Path(target).is_absolute() else []
    if not candidates:
        if base_dir is not None:
            candidates.append(Path(base_dir) / target)
        candidates.append(Path.cwd() / target)
    path = next((p.resolve() for p in candidates if p.is_file()), None)
    if path is None:
        tried = ", ".join(str(p) for p in candidates)
        raise UserCodeError(f"{what} {spec!r}: file not found (tried {tried})")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_areal_like_user.{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserCodeError(f"{what} {spec!r}: {path} is not a loadable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserCodeError(f"{what} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module
