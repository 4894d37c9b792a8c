"""Agent loops: one async function per episode, chosen per dataset row by `agent_name`.

Importing this package registers the built-in loops `single_turn`, `tool_agent` and
`long_answer`.
The controller needs only `AgentRunner` (see `runner.py` for what it raises).
"""

from rollout_cluster.agent_loop.base import AGENT_LOOPS, AgentLoopBase, register
from rollout_cluster.agent_loop.chat import ChatTemplate, template_ids
from rollout_cluster.agent_loop.long_answer import LongAnswerLoop
from rollout_cluster.agent_loop.runner import AgentRunner, EpisodeAbortedError, resolve_agent_loop
from rollout_cluster.agent_loop.single_turn import SingleTurnAgentLoop
from rollout_cluster.agent_loop.tool_agent import AgentState, ToolAgentLoop, truncate_text

__all__ = [
    "AGENT_LOOPS",
    "AgentLoopBase",
    "AgentRunner",
    "AgentState",
    "ChatTemplate",
    "EpisodeAbortedError",
    "LongAnswerLoop",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "register",
    "resolve_agent_loop",
    "template_ids",
    "truncate_text",
]
