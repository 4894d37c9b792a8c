"""The local launcher's zygote, started before the command has read its config.

The zygote's imports (torch, transformers' tokenizers: about 3 s on 2 cores) are what the first
train step waits for longest (docs/benchmarks.md, start-up), so every fraction of a
second before they begin is on that path. `areal-like run|train|rollout` calls
`prestart()` first thing, before typer, pydantic and numpy are imported (0.3-0.5 s);
`Zygote.start()` adopts that zygote when the config picks the local launcher, and
`discard()` kills it when it picks Ray (so does the exit of a process that never
adopted it). Nothing but the standard library here: this module is imported first.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

__all__ = ["PRELOAD", "adopt", "discard", "popen", "prestart"]

PRELOAD = (
    "torch", "tokenizers", "jinja2", "jinja2.sandbox", "jinja2.ext", "areal_like.models.lite_tokenizer",
    "areal_like.models.lite", "torch.optim", "safetensors.torch", "zmq", "msgpack", "pydantic",
    "areal_like.core.config", "areal_like.core.types", "areal_like.orchestration.rollout_side",
    "rollout_cluster.server_actor", "rollout_cluster.server", "rollout_cluster.engine.embedded",
    "rollout_cluster.agent_loop.runner", "train_cluster.worker_group", "train_cluster.torch_engine",
    "weight_sync",
)
"""Imported by the zygote before it forks anything: what every actor would import. Not
transformers (1.4 s with its tokenizer modules; `transformers.modeling_utils` 2-3 s more):
the quickstart's model loads as `areal_like.models.lite.LiteCausalLM` and its tokenizer as
`areal_like.models.lite_tokenizer.LiteTokenizer`; an actor that needs transformers
(another model or tokenizer, `model_impl: hf`) imports it itself."""

COMMANDS = ("run", "train", "rollout")
"""The CLI's commands that open a launcher (the others never start a zygote)."""

_early: tuple[str, tuple[str, ...], subprocess.Popen[bytes]] | None = None


def popen(preload: tuple[str, ...] = PRELOAD) -> tuple[str, subprocess.Popen[bytes]]:
    """A new zygote process (`areal_like.launcher.local_process`) and its socket name; it
    imports `preload` in the background, then serves."""
    address = f"areal-like-zygote-{os.getpid()}-{os.urandom(4).hex()}"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "areal_like.launcher.local_process", address,
                             ",".join(preload)], stdin=subprocess.PIPE, env=env)
    return address, proc


def wants_zygote(argv: list[str]) -> bool:
    """`argv` (without the program) is a CLI command that opens a launcher, not a `--help`."""
    words = [a for a in argv if not a.startswith("-")]
    return bool(words) and words[0] in COMMANDS and not {"--help", "-h"} & set(argv)


def prestart(preload: tuple[str, ...] = PRELOAD) -> None:
    """Start a zygote now for a later `adopt` (at most one per process)."""
    global _early
    if _early is None:
        address, proc = popen(preload)
        _early = (address, preload, proc)
        atexit.register(discard)


def adopt(preload: tuple[str, ...]) -> tuple[str, subprocess.Popen[bytes]] | None:
    """The prestarted zygote if it preloads `preload` and still runs (once), else None
    (one that does not fit is killed)."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    address, had, proc = early
    if had == preload and proc.poll() is None:
        return address, proc
    _kill(proc)
    return None


def discard() -> None:
    """Kill the prestarted zygote unless it was adopted: the config picked Ray, or the
    command failed before it opened a launcher."""
    global _early
    early, _early = _early, None
    if early is not None:
        _kill(early[2])


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.kill()
        proc.wait(timeout=5)
    except Exception:  # gone already
        pass
