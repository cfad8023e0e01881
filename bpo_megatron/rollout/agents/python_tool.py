"""A Python tool: the model writes code after ``<tool_call>`` and ends the turn with the call
token (``</tool_call>``, one token of Qwen3's vocabulary); the agent runs it in a fresh
interpreter in isolated mode (``python -I``: no ``PYTHON*`` variables, no user site, not the run's
directory on its path), killed past ``rollout.agent.timeout_s``, and answers with what it printed,
or the error's last line, inside ``<tool_response>``. A separate process is all the isolation
there is: run it only where the model's code may run."""

from __future__ import annotations

import subprocess
import sys

from bpo_megatron.rollout.agents.base import Agent, Turn

OPEN = "<tool_call>"
MAX_OUTPUT_CHARS = 2000  # longer output is cut, and the cut is said


class PythonTool(Agent):
    call_token = "</tool_call>"
    reply = "<tool_response>\n{output}\n</tool_response>\n"

    def respond(self, prompt: str, transcript: list[Turn]) -> str:
        return self.format_reply(run_python(self.call_of(transcript, OPEN), timeout_s=self.settings.timeout_s))


def run_python(code: str, *, timeout_s: float) -> str:
    """What ``code`` prints (stdout), or its error's last line; a run past ``timeout_s`` is killed."""
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"TimeoutError: the code ran past {timeout_s:g} s"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    output = done.stdout.strip()
    if len(output) > MAX_OUTPUT_CHARS:
        output = output[:MAX_OUTPUT_CHARS] + f"... ({len(output) - MAX_OUTPUT_CHARS} more characters)"
    return output
