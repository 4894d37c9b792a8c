"""Our own tokenizer folders without transformers: `tokenizers` for ids, jinja2 for the chat
template.

The quickstart's tokenizer (`tiny_model.build_tokenizer`, marked in its
`tokenizer_config.json`) is a plain `tokenizers` model. Loading it through transformers'
`PreTrainedTokenizerFast` imports transformers (0.9 s) and its tokenizer modules (0.5 s).
The zygote preloaded them before it forked any actor, so every actor and the first train
step waited for them (docs/design.md §10.33). `LiteTokenizer` answers what the loop asks
of a tokenizer, with the same ids and text as transformers' class:
- `encode` and `decode`, `convert_tokens_to_ids`;
- the special tokens and their ids (`all_special_tokens`, `added_tokens_decoder`), and `len()`;
- `apply_chat_template`, rendered in the jinja2 environment transformers sets up
  (sandboxed, `trim_blocks`/`lstrip_blocks`, `loopcontrols`, `tojson`, `raise_exception`,
  `strftime_now`);
- `save_pretrained`, which copies the folder's files.

A call it does not cover is handed to transformers' class, loaded on first need: any other
attribute, and chat-template options beyond messages, tools and `add_generation_prompt`
(documents, `continue_final_message`, assistant masks). A test holds both classes to the
same output.
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["LiteTokenizer"]

_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token(v: Any) -> str | None:
    """A special token as tokenizer_config.json spells it (a string, or an AddedToken dict)."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class LiteTokenizer:
    """A `tokenizers` tokenizer with the part of transformers' tokenizer API the loop uses."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = str(path)
        folder = Path(path)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        self._special = {k: _token(cfg.get(k)) for k in _SPECIAL_KEYS}
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        self._extra = [t for t in map(_token, extra if isinstance(extra, list) else extra.values()) if t]
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self.model_max_length = cfg.get("model_max_length")
        jinja = folder / "chat_template.jinja"
        self.chat_template: str | None = jinja.read_text() if jinja.is_file() else cfg.get("chat_template")
        self._compiled: tuple[str, Any] | None = None
        self._hf: Any = None

    # ---- tokens and ids ----------------------------------------------------------------
    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    bos_token = property(lambda self: self._special["bos_token"])
    eos_token = property(lambda self: self._special["eos_token"])
    unk_token = property(lambda self: self._special["unk_token"])
    pad_token = property(lambda self: self._special["pad_token"])
    bos_token_id = property(lambda self: self._id(self.bos_token))
    eos_token_id = property(lambda self: self._id(self.eos_token))
    unk_token_id = property(lambda self: self._id(self.unk_token))
    pad_token_id = property(lambda self: self._id(self.pad_token))

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones (transformers' set)."""
        return list(dict.fromkeys([*(v for v in self._special.values() if v), *self._extra]))

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """Added tokens by id, each with its `content` and `special` flag, as transformers'."""
        return dict(self._tok.get_added_tokens_decoder())

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        if isinstance(tokens, str):
            got = self._tok.token_to_id(tokens)
            return self.unk_token_id if got is None else got  # type: ignore[return-value]
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return self._transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self._transformers().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            return self._transformers().clean_up_tokenization(text)
        return text

    # ---- chat template -----------------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = True,
                            **kwargs: Any) -> Any:
        """Text, or (`tokenize`) ids as transformers 5 gives them: a mapping with `input_ids`
        and `attention_mask`, or with `return_dict=False` the list of ids."""
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        plain = (self.chat_template is not None and not kwargs
                 and all(isinstance(m, dict) for m in conversation)
                 and (tools is None or all(isinstance(t, dict) for t in tools)))
        if not plain:
            return self._transformers().apply_chat_template(
                conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                return_dict=return_dict, **kwargs)
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _compile(self.chat_template))
        special = {k: v for k, v in self._special.items() if v is not None}
        text = self._compiled[1].render(messages=conversation, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt, **special)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    # ---- files ---------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> tuple[str, ...]:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in _FILES:
            src = Path(self.name_or_path) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
            if (out / name).is_file():
                written.append(str(out / name))
        jinja = out / "chat_template.jinja"
        if self.chat_template is not None and (not jinja.is_file() or jinja.read_text() != self.chat_template):
            jinja.write_text(self.chat_template)  # set on this object since it was loaded
            written.append(str(jinja))
        return tuple(dict.fromkeys(written))

    # ---- everything else: transformers' class ------------------------------------------
    def _transformers(self) -> Any:
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast.from_pretrained(self.name_or_path)
            self._hf.chat_template = self.chat_template
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._transformers(), name)

    def __repr__(self) -> str:
        return f"LiteTokenizer({self.name_or_path!r}, vocab={len(self)})"
