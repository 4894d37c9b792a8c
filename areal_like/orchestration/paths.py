"""Paths and user code of a config, settled once in the driver (docs/design.md §10.12).

A user keeps their task in a folder of their own (`my_task/config.yaml`, `data.jsonl`,
`reward.py`, `loop.py`, `tools.yaml`) and names those files relatively. The processes
that use them (the rollout side is a Ray actor, possibly on another machine) do not
share the driver's working directory and never see the config file's location, so
every relative path is resolved here, in the driver, before anything starts:

- against the config file's folder, then the current directory (`model.path` also
  tries the installed package's assets, as `resolve_model_path` always has);
- for `dataset.path`, `dataset.eval_path`, `model.path`, `agent.tools_file`, and the
  file of every user-code spec `file.py:Name` in `agent.reward`, `agent.default_loop`
  and `agent.tools[*].cls`;
- the config then holds absolute paths, so every process and `run.dir/config.yaml`
  see the same files whatever their working directory.

A missing file is one `ConfigError` line naming the key, the value and the places
looked. `check_user_code` then imports the user's code in the driver, so a syntax or
import error is reported with the user's own `file:line` before Ray starts, not from
inside a dead actor. `check_metrics_backends` refuses `metrics.tensorboard` /
`metrics.wandb_project` without the package, naming the extra to install.
"""

from __future__ import annotations

import glob
import importlib.util
from pathlib import Path

import yaml

from areal_like.core.config import ConfigError, ExperimentConfig
from rollout_cluster.loader import is_user_code_spec, load_object

__all__ = ["check_metrics_backends", "check_model", "check_user_code", "config_dir", "resolve_file", "resolve_model_path", "resolve_paths"]


def config_dir(cfg: ExperimentConfig) -> Path | None:
    """The folder of the config file `cfg` was loaded from (None for a config built in code)."""
    return Path(cfg.source).parent if cfg.source else None


def resolve_file(value: str, key: str, bases: list[Path | None], *, kind: str = "file") -> str:
    """`value` as an absolute path: itself if absolute, else the first of `bases` (then the
    current directory) where it exists. `kind` is `file`, `dir`, `any` or `glob` (a
    pattern that must match at least one file). Raises one `ConfigError` line otherwise."""
    p = Path(value).expanduser()
    if p.is_absolute():
        candidates = [p]
    else:
        candidates = [b / p for b in bases if b is not None]
        candidates.append(Path.cwd() / p)
    seen: list[Path] = []
    for c in candidates:
        if c in seen:
            continue
        seen.append(c)
        if kind == "glob":
            if glob.glob(str(c)):
                return str(c)
        elif (kind == "file" and c.is_file()) or (kind == "dir" and c.is_dir()) or (kind == "any" and c.exists()):
            return str(c.resolve())
    what = {"file": "no such file", "dir": "no such folder", "any": "no such file or folder",
            "glob": "no file matches"}[kind]
    raise ConfigError(f"{key}={value!r}: {what}; looked in {', '.join(str(s) for s in seen)}")


def _resolve_spec(spec: str, key: str, bases: list[Path | None]) -> str:
    """A user-code spec with its file made absolute; built-in names and `pkg.mod:Name` as given."""
    if not is_user_code_spec(spec):
        return spec
    target, _, name = spec.rpartition(":")
    if not (target.endswith(".py") or "/" in target or "\\" in target):
        return spec  # a module on sys.path: importing decides
    return f"{resolve_file(target, key, bases)}:{name}"


_DATA_KIND = {"jsonl": "file", "parquet": "file", "hf_disk": "dir"}


def resolve_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """Make every path in `cfg` absolute, in place (and return `cfg`); idempotent.

    In place because the caller's `cfg` is the one later dumped to the rollout side and
    the run folder. Raises `ConfigError` naming the key, the value and the places looked.
    """

    bases = [config_dir(cfg)]
    cfg.model.path = str(resolve_model_path(cfg))
    d = cfg.dataset
    if d.type != "generated":
        for key in ("path", "eval_path"):
            value = getattr(d, key)
            if value:
                kind = _DATA_KIND.get(d.type) or ("glob" if glob.has_magic(value) else "any")
                setattr(d, key, resolve_file(value, f"dataset.{key}", bases, kind=kind))
    a = cfg.agent
    a.reward = _resolve_spec(a.reward, "agent.reward", bases)
    a.default_loop = _resolve_spec(a.default_loop, "agent.default_loop", bases)
    a.tools = [t.model_copy(update={"cls": _resolve_spec(t.cls, f"agent.tools[{i}].cls", bases)})
               for i, t in enumerate(a.tools)]
    if a.tools_file:
        a.tools_file = resolve_file(a.tools_file, "agent.tools_file", bases)
    return cfg


def check_user_code(cfg: ExperimentConfig) -> None:
    """Import every piece of user code the config names (reward, default loop, tools), in
    the driver, before anything starts: a syntax error, a failing import or a missing name
    is a `UserCodeError` (a `ConfigError`) leading with the user's own `file:line`.

    Only imports: tools are not constructed and nothing is called. Built-in names are
    checked where they are used. Call after `resolve_paths`.
    """
    from rollout_cluster.agent_loop.runner import resolve_agent_loop
    from rollout_cluster.rewards import load_reward
    from rollout_cluster.tools import load_tools_file

    base = config_dir(cfg)
    a = cfg.agent
    load_reward(a.reward, base_dir=base)
    if is_user_code_spec(a.default_loop):
        resolve_agent_loop(a.default_loop, base_dir=base)
    specs = list(a.tools)
    if a.tools_file:
        try:
            specs += load_tools_file(a.tools_file, base_dir=base)
        except (OSError, ValueError, yaml.YAMLError) as e:  # unreadable, not YAML, an invalid entry
            raise ConfigError(f"agent.tools_file={a.tools_file!r}: {e}") from None
    for spec in specs:
        if is_user_code_spec(spec.cls):
            load_object(spec.cls, base_dir=base, what=f"tool {spec.name!r}")


_BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_metrics_backends(cfg: ExperimentConfig) -> None:
    """`metrics.tensorboard` / `metrics.wandb_project` need their package; say which extra
    installs it before Ray starts, instead of a traceback from the trainer once it has."""
    wanted = []
    if cfg.metrics.tensorboard:
        wanted.append(("metrics.tensorboard=true", "tensorboard"))
    if cfg.metrics.wandb_project:
        wanted.append((f"metrics.wandb_project={cfg.metrics.wandb_project!r}", "wandb"))
    for key, extra in wanted:
        if importlib.util.find_spec(_BACKENDS[extra]) is None:
            raise ConfigError(f"{key} needs the {_BACKENDS[extra]} package, which is not installed: "
                              f"pip install 'areal_like[{extra}]'")


def resolve_model_path(cfg: ExperimentConfig) -> Path:
    """`model.path` relative to the config file, the current folder, or the package; or the
    name of a model `areal-like model fetch` knows, once fetched."""
    from areal_like.models.fetch import cached_folder, is_known

    p = Path(cfg.model.path).expanduser()
    candidates = [p] if p.is_absolute() else []
    if not p.is_absolute():
        if cfg.source:
            candidates.append(Path(cfg.source).parent / p)
            candidates.append(Path(cfg.source).parent.parent / p)
        candidates.append(Path.cwd() / p)
        pkg = Path(__file__).resolve().parents[1]  # the areal_like package
        candidates.append(pkg.parent / p)
        if p.parts and p.parts[0] == "areal_like":
            candidates.append(pkg.joinpath(*p.parts[1:]))
    for c in candidates:
        if (c / "config.json").is_file():
            return c.resolve()
    if is_known(cfg.model.path):  # a name `areal-like model fetch` knows (a folder of that name wins)
        folder = cached_folder(cfg.model.path)
        if folder is None:
            raise ConfigError(f"model.path={cfg.model.path!r} is not fetched yet: "
                              f"areal-like model fetch {cfg.model.path}")
        return folder.resolve()
    raise ConfigError(f"model.path={cfg.model.path!r}: no HF model folder (config.json) at {[str(c) for c in candidates]}")


def check_model(cfg: ExperimentConfig) -> None:
    """What the model folder must hold for this config, read from its JSON files alone (no
    torch, no weights), before any process, port or checkpoint: an architecture the chosen
    engine computes, and a chat template (every prompt is rendered with it; a string prompt
    becomes one user message). Raises `ConfigError` naming the folder, what is wrong and the fix."""
    import json

    from areal_like.core.config import EMBEDDED_MODEL_TYPES

    folder = resolve_model_path(cfg)
    try:
        conf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={folder}: config.json is not readable JSON ({e})") from None
    model_type = conf.get("model_type")
    if cfg.rollout.engine.type == "embedded" and model_type not in EMBEDDED_MODEL_TYPES:
        raise ConfigError(f"model.path={folder}: model type {model_type!r} is not one the embedded engine computes "
                          f"({', '.join(EMBEDDED_MODEL_TYPES)}); set rollout.engine.type=vllm (docs/launching.md)")
    engine = cfg.rollout.engine
    if engine.type == "embedded":  # what the engine would refuse once loaded, said now
        if "sliding_attention" in (conf.get("layer_types") or []):
            raise ConfigError(f"model.path={folder}: the model has sliding-window attention layers, which the "
                              "embedded engine does not compute; set rollout.engine.type=vllm")
        longest = conf.get("max_position_embeddings")
        if isinstance(longest, int) and longest < engine.max_seq_len:
            raise ConfigError(f"rollout.engine.max_seq_len={engine.max_seq_len} exceeds the max_position_embeddings "
                              f"({longest}) of model.path={folder}: lower it")
    vocab = conf.get("vocab_size") or (conf.get("text_config") or {}).get("vocab_size")
    bad = [t for t in cfg.rollout.stop_token_ids if isinstance(vocab, int) and t >= vocab]
    if bad:
        raise ConfigError(f"rollout.stop_token_ids {bad} are outside the vocabulary of model.path={folder} "
                          f"(vocab_size {vocab})")
    if not _has_chat_template(folder):
        raise ConfigError(f"model.path={folder}: the tokenizer has no chat template, and every prompt is rendered "
                          "with one (a string prompt becomes one user message): add one as chat_template.jinja in "
                          "that folder, or as `chat_template` in its tokenizer_config.json")
    _check_lora(cfg)


def _check_lora(cfg: ExperimentConfig) -> None:
    lora = cfg.model.lora
    if not lora.enabled:
        return
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"model.lora.rank={lora.rank} needs the peft package, which is not installed: "
                          "pip install 'areal_like[lora]'")
    if lora.init_from:
        src = Path(lora.init_from).expanduser()
        if not (src / "adapter_model.safetensors").is_file() or not (src / "adapter_config.json").is_file():
            raise ConfigError(f"model.lora.init_from={lora.init_from}: not a saved adapter (it needs "
                              "adapter_config.json and adapter_model.safetensors: a run's final/adapter, or "
                              "PEFT's save_pretrained)")


def _has_chat_template(folder: Path) -> bool:
    import json

    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        tok = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return True  # not ours to judge here: the tokenizer's own loader says what is wrong
    return bool(tok.get("chat_template"))
