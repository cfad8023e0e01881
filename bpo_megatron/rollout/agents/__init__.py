"""Multi-turn rollouts: responses that call a tool (``rollout.agent``) between the model's turns."""

from bpo_megatron.rollout.agents.base import AGENTS, Agent, Turn, load_agent
from bpo_megatron.rollout.agents.config import AgentConfig
from bpo_megatron.rollout.agents.conversation import Conversations, assemble, with_agent

__all__ = ["AGENTS", "Agent", "AgentConfig", "Conversations", "Turn", "assemble", "load_agent", "with_agent"]
