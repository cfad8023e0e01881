"""What a multi-turn rollout talks to: an :class:`Agent` answers the model's tool calls.

A response is a conversation: the model writes a turn; when the turn ends with the agent's call
token, the agent answers with text (a tool's output), which is appended to the sequence as tokens
(``Sample.from_environment``), and the model writes its next turn after it. The model's own
tokens are never decoded and encoded again (token in, token out): only the agent's text is
encoded. :data:`AGENTS` names the built-ins; ``rollout.agent.name: package.module:Class`` names a
user's subclass.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from bpo_megatron.rollout.agents.config import AGENTS, AgentConfig


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation: the model's text, or the environment's (``from_environment``)."""

    text: str
    from_environment: bool = False


class Agent(abc.ABC):
    """An environment answering a model's calls within one response.

    Subclasses set :attr:`call_token` and :attr:`reply` (defaults that ``rollout.agent.call_token``
    and ``rollout.agent.reply`` override) and implement :meth:`respond`; :meth:`demonstration`
    (optional) gives a supervised warm start a conversation to imitate. One agent object serves
    every conversation of a run, from the driver's threads: keep per-conversation state in the
    transcript, not on the object.
    """

    call_token: str = "\n"
    reply: str = "{output}"
    # True for a tool that executes what the model wrote: a run checks first that it can be
    # confined (rollout.agent.sandbox), and such a tool runs it through run_confined
    executes_model_output: ClassVar[bool] = False
    run_dir: Path | None = None  # the run's directory, which model-written code must not see

    def __init__(self, settings: AgentConfig) -> None:
        self.settings = settings
        if settings.call_token is not None:
            self.call_token = settings.call_token
        if settings.reply is not None:
            self.reply = settings.reply

    @abc.abstractmethod
    def respond(self, prompt: str, transcript: list[Turn]) -> str | None:
        """The environment's text after the model's last turn (``transcript[-1]``, which ended with
        :attr:`call_token`), or None to end the conversation there. ``prompt``: the question's
        text as the model saw it."""

    def demonstration(self, problem: str, answer: str) -> list[Turn] | None:
        """A conversation that answers ``problem`` with ``answer`` (a warm start imitates its model
        turns), or None: the warm start trains on the plain answer."""
        return None

    def format_reply(self, output: str) -> str:
        return self.reply.replace("{output}", output)

    def call_of(self, transcript: list[Turn], opener: str) -> str:
        """What the model's last turn asks: its text after the last ``opener`` (all of it without
        one), up to the call token."""
        text = transcript[-1].text
        if text.endswith(self.call_token):
            text = text[: -len(self.call_token)]
        return text.rsplit(opener, 1)[1] if opener in text else text


def load_agent(settings: AgentConfig, run_dir: str | Path | None = None) -> Agent:
    """The agent ``rollout.agent.name`` names, constructed (told the run's directory); ValueError
    naming the setting and the fix."""
    where = f"rollout.agent.name={settings.name!r}"
    if settings.name in AGENTS:
        cls, module_name, attribute = AGENTS.load(settings.name), "bpo_megatron.rollout.agents", settings.name
    else:
        module_name, _, attribute = settings.name.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"{where}: expected package.module:Class")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{where}: module {module_name!r} cannot be imported ({exc}); is its directory on "
                             "PYTHONPATH?") from exc
        cls = getattr(module, attribute, None)
    if not (isinstance(cls, type) and issubclass(cls, Agent)):
        raise ValueError(f"{where}: {attribute!r} in {module_name} is not a subclass of "
                         "bpo_megatron.rollout.agents.Agent")
    try:
        agent = cls(settings)
    except Exception as exc:  # noqa: BLE001 - a user's constructor: its own error, named
        raise ValueError(f"{where}: constructing {attribute} raised {type(exc).__name__}: {exc}") from exc
    agent.run_dir = None if run_dir is None else Path(run_dir)
    return agent
