"""The one place user code named in a config is imported (docs/design.md §9.10).

Configs name built-in components by a typed name and user code as
`path/to/file.py:Name` or `package.module:Name`. Everything that accepts user code
(agent loops, tools, rewards) resolves it here, so there is exactly one rule for
where a file is looked up and one shape of error when it cannot be found:
`UserCodeError`, naming the spec, what was tried and what is available. When the
user's own code fails to import (a syntax error, a failing import, an exception at
module level) the message leads with *their* `file:line: Error: message` and carries
their frames of the traceback, not ours: that is the line they have to fix.
`UserCodeError` is also a `ConfigError`, so the CLI prints it as one clear error.

A file's folder is appended to `sys.path` while (and after) it loads, so a reward or
loop file can import a helper module next to it, as it would when run as a script.

A file is loaded once per resolved path (cached in `sys.modules` under a private
name), so two config entries pointing at the same file share its module state.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from areal_like.core.config import ConfigError

__all__ = ["UserCodeError", "is_user_code_spec", "load_object"]


class UserCodeError(ImportError, ConfigError):
    """A `file.py:Name` / `pkg.mod:Name` spec could not be resolved; the message says why.

    An `ImportError` (it is one) and a `ConfigError` (the config names it), so every
    place that reports config errors in one line reports this one too."""


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
        except ModuleNotFoundError as e:
            if e.name is not None and target.startswith(e.name):
                raise UserCodeError(f"{what} {spec!r}: cannot import module {target!r}: {e}") from e
            raise UserCodeError(_user_error(e, f"{what} {spec!r}: importing module {target!r} failed")) from None
        except Exception as e:  # the user's module raised while importing: show their line first
            raise UserCodeError(_user_error(e, f"{what} {spec!r}: importing module {target!r} failed")) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            where = getattr(module, "__file__", None) or target
            raise UserCodeError(
                f"{where}: has no attribute {attr!r} ({what} {spec!r}); public names there: {public}"
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
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # appended, so a user file never shadows an installed package
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserCodeError(_user_error(e, f"{what} {spec!r}: importing {path} failed")) from None
    return module


def _user_error(e: BaseException, context: str) -> str:
    """`file:line: Type: message` of the user's own failing line, then `context`, then the
    user's frames of the traceback (importlib's and ours left out)."""
    here = str(Path(__file__).resolve())
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith("<frozen") and f.filename != here and "/importlib/" not in f.filename]
    if isinstance(e, SyntaxError):
        head = f"{e.filename}:{e.lineno}: {type(e).__name__}: {e.msg}"
        if e.text:
            head += "\n    " + e.text.strip()
    elif frames:
        last = frames[-1]
        head = f"{last.filename}:{last.lineno}: {type(e).__name__}: {e}"
    else:
        head = f"{type(e).__name__}: {e}"
    lines = [head, f"  ({context}: {type(e).__name__}: {e})"]
    if frames:
        lines.append("Traceback (your code, most recent call last):")
        for f in frames:
            lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
            if f.line:
                lines.append(f"    {f.line.strip()}")
    return "\n".join(lines)
