"""Chat-template arithmetic that keeps token continuity (invariant 4).

An episode's token sequence is built incrementally: the prompt is the template of
the first messages; each assistant turn is exactly the ids the engine produced; each
observation (tool or user messages) is the template of *those messages alone* with
the template's automatic prefix (a default system block, a tools block) removed,
rendered with the assistant generation header so the next turn starts where the
template would. Nothing generated is ever decoded and re-encoded.

The automatic prefix is found from the template itself: render one dummy message
and two dummy messages; the second adds exactly one message's worth of ids, so
what remains of the first after removing that much is the prefix (verl's trick,
which works for templates that inject a default system prompt).

Renders are cached (`ChatTemplate.cache_size`, least recently used out): the samples of a
group share their prompt, and tool results repeat, while one jinja render plus its
tokenization cost the quickstart's rollout controller ~18 % of its CPU (py-spy). A
template that reads the clock (`strftime_now`) is never cached.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

__all__ = ["ChatTemplate", "template_ids"]


def template_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool,
    **kwargs: Any,
) -> list[int]:
    """`apply_chat_template(..., tokenize=True)` as a plain list of ids.

    transformers 5 returns a `BatchEncoding`; older versions a list.
    """
    out = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    ids = out["input_ids"] if not isinstance(out, list) else out
    return list(ids)


class ChatTemplate:
    """Prompt ids and observation ids for one tokenizer (prefix computed once)."""

    _DUMMY = {"role": "user", "content": ""}
    cache_size = 1024
    """Renders kept (a group's prompt, repeated tool results); 0 turns the cache off."""

    def __init__(self, tokenizer: Any, **template_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self._prefix: list[int] | None = None
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        template = getattr(tokenizer, "chat_template", None)
        self._cacheable = not (isinstance(template, str) and "strftime_now" in template)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """`template_ids` with the generation header, through the cache."""
        key = None
        if self._cacheable and self.cache_size > 0:
            try:
                key = json.dumps([messages, tools], sort_keys=True, ensure_ascii=False)
            except (TypeError, ValueError):  # not plain data (an object in a message): uncached
                key = None
        if key is not None:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return list(hit)
        ids = template_ids(self.tokenizer, messages, tools=tools, add_generation_prompt=True,
                           **self.template_kwargs)
        if key is not None:
            self._cache[key] = tuple(ids)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return ids

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The first turn's prompt: the whole conversation so far, with the generation header."""
        return self._render(messages, tools)

    @property
    def prefix(self) -> list[int]:
        """Ids the template puts before any conversation (e.g. a default system prompt)."""
        if self._prefix is None:
            one = template_ids(
                self.tokenizer, [self._DUMMY], add_generation_prompt=False, **self.template_kwargs
            )
            two = template_ids(
                self.tokenizer,
                [self._DUMMY, self._DUMMY],
                add_generation_prompt=False,
                **self.template_kwargs,
            )
            per_message = len(two) - len(one)
            prefix = one[: len(one) - per_message]
            if two[: len(prefix)] != prefix:
                raise ValueError(
                    "cannot find the chat template's automatic prefix (template is not additive)"
                )
            self._prefix = prefix
        return self._prefix

    def observation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of non-assistant messages appended after an assistant turn, plus the next
        assistant header, without the template's automatic prefix."""
        ids = self._render(messages, None)
        prefix = self.prefix
        if ids[: len(prefix)] != prefix:
            raise ValueError(
                "the chat template renders these messages without its usual prefix; "
                "cannot append them as an observation"
            )
        return ids[len(prefix) :]
