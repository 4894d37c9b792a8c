"""Token continuity on the OpenAI-shaped path (docs/design.md §9.17).

An agent framework that speaks OpenAI sends the whole conversation back every turn, with our earlier answers as text. Re-encoding
that text need not give the ids the model produced (invariant 4), so per session
(`session_id` in the body or the `X-Session-Id` header) the server remembers each
assistant turn's exact ids (prompt + generated) next to the messages that produced
them; when a request's messages start with a remembered conversation, the
remembered ids are reused and only the new suffix is tokenized. Anything else that
contains an assistant turn is re-tokenized, counted in `retokenize_fallbacks` and
logged.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_cluster.engine.base import RequestError

__all__ = ["SessionTokens"]

logger = logging.getLogger(__name__)


def _norm_message(m: Any) -> str:
    """A message's identity for prefix matching (role, content, tool calls, ...)."""
    if not isinstance(m, dict) or "role" not in m:
        raise RequestError(f"each message must be an object with a role, got {m!r}"[:200])
    keep = {k: m.get(k) for k in ("role", "content", "tool_calls", "tool_call_id", "name") if m.get(k)}
    return json.dumps(keep, sort_keys=True, ensure_ascii=False)


@dataclass
class _Turn:
    messages: list[str]
    """Normalised messages up to and including the assistant reply."""
    ids: list[int]
    """Prompt ids + generated ids (+ the template's turn-closing ids if not generated)."""


class SessionTokens:
    """Per-session memory of produced assistant turns (LRU over sessions)."""

    def __init__(self, max_sessions: int = 10000, max_turns: int = 64) -> None:
        self.max_sessions = max_sessions
        self.max_turns = max_turns
        self._sessions: OrderedDict[str, list[_Turn]] = OrderedDict()
        self.counters: dict[str, float] = {"token_continuity_hits": 0.0, "retokenize_fallbacks": 0.0}

    def prompt_ids(
        self,
        session_id: str | None,
        messages: list[dict[str, Any]],
        render: Callable[[list[dict[str, Any]], bool], str],
        encode: Callable[[str], list[int]],
    ) -> list[int]:
        """Token ids of `messages` + generation prompt, reusing remembered turns' ids."""
        norm = [_norm_message(m) for m in messages]
        full_text = render(messages, True)
        turns = self._sessions.get(session_id, []) if session_id else []
        for turn in sorted(turns, key=lambda t: len(t.messages), reverse=True):
            k = len(turn.messages)
            if k <= len(norm) and norm[:k] == turn.messages:
                prefix_text = render(messages[:k], False)
                if full_text.startswith(prefix_text):
                    self.counters["token_continuity_hits"] += 1
                    self._sessions.move_to_end(session_id)  # type: ignore[arg-type]
                    return turn.ids + encode(full_text[len(prefix_text) :])
        if any(m.get("role") == "assistant" for m in messages):
            self.counters["retokenize_fallbacks"] += 1
            logger.warning(
                "session %s: no remembered turn matches the %d messages; re-tokenizing text "
                "(token continuity not guaranteed)",
                session_id,
                len(messages),
            )
        return encode(full_text)

    def remember(self, session_id: str, messages: list[dict[str, Any]], ids: list[int]) -> None:
        """Record a produced turn: `messages` ends with the assistant reply we returned."""
        turns = self._sessions.setdefault(session_id, [])
        self._sessions.move_to_end(session_id)
        turns.append(_Turn([_norm_message(m) for m in messages], list(ids)))
        del turns[: -self.max_turns]
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
