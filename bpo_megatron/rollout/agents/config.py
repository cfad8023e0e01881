"""The ``rollout.agent`` section: multi-turn rollouts in which the model talks to a tool."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bpo_megatron.registry import LazyRegistry
from bpo_megatron.rollout.agents.sandbox import SandboxConfig

# built-in agent name -> its class, imported only when a run names it
AGENTS = LazyRegistry({
    "calculator": "bpo_megatron.rollout.agents.calculator:Calculator",
    "python_tool": "bpo_megatron.rollout.agents.python_tool:PythonTool",
}, unknown="rollout.agent.name={name!r} is unknown; choose one of {sorted}, package.module:Class, or null "
           "(single-turn)")


@dataclass(frozen=True)
class AgentConfig:
    """``name``: the environment each response talks to (``rollout/agents``): a built-in
    (``calculator``, ``python_tool``), ``package.module:Class`` (a subclass of
    :class:`~bpo_megatron.rollout.agents.base.Agent`, importable by the driver), or null for
    single-turn rollouts.

    A model turn that ends with ``call_token`` (a text that must be one token of the run's
    tokenizer; null: the agent's own default) asks the environment, whose output is appended as
    tokens and the model continues in a new turn; any other stop ends the response. ``max_turns``
    bounds the model turns of one response; the whole response, tool outputs included, stays
    within ``rollout.max_new_tokens``. ``reply``: the text around a tool's output (``{output}``
    marks where it goes; null: the agent's default). ``timeout_s``: one tool call's bound (a call
    past it answers with an error text the model sees); ``reply_threads``: the calls answered at
    once (each conversation goes at its own pace: its tool is called as soon as its turn is back).
    ``sandbox``: how a tool that executes the
    model's output (``python_tool``) confines it (:class:`~bpo_megatron.rollout.agents.sandbox.SandboxConfig`).

    ``affinity_backlog``: a conversation's next turn goes to the engine that served its previous
    turn (whose prefix cache holds the conversation so far: the turn reuses it, and its tokens keep
    the routing R3 replays) unless that engine was replaced since, or is full: it has at least this
    many more samples outstanding than the least loaded engine. Then the turn goes to the least
    loaded engine, which recomputes the conversation (its tokens masked for R3; counted in
    ``rollout/multi_turn_hop_frac``)."""

    name: str | None = None
    call_token: str | None = None
    max_turns: int = 4
    reply: str | None = None
    timeout_s: float = 10.0
    reply_threads: int = 32
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    affinity_backlog: int = 128

    def __post_init__(self) -> None:
        if self.affinity_backlog < 1:
            raise ValueError(f"rollout.agent.affinity_backlog must be >= 1 (samples outstanding beyond the least "
                             f"loaded engine's), got {self.affinity_backlog}")
        if self.max_turns < 1:
            raise ValueError(f"rollout.agent.max_turns must be >= 1 (model turns per response), got {self.max_turns}")
        if self.reply_threads < 1:
            raise ValueError(f"rollout.agent.reply_threads must be >= 1 (tool calls answered at once), got "
                             f"{self.reply_threads}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"rollout.agent.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.reply is not None and "{output}" not in self.reply:
            raise ValueError(f"rollout.agent.reply={self.reply!r} must hold {{output}}, where the tool's output goes")
        if self.call_token == "":
            raise ValueError("rollout.agent.call_token is empty; give the text of one token (or null: the agent's)")
        if self.name is not None and ":" not in self.name:
            AGENTS.check(self.name)

    @property
    def enabled(self) -> bool:
        return self.name is not None
