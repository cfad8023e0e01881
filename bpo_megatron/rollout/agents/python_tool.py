"""A Python tool: the model writes code after ``<tool_call>`` and ends the turn with the call
token (``</tool_call>``, one token of Qwen3's vocabulary); the agent runs it in a fresh
interpreter in isolated mode (``python -I``) inside the sandbox (``rollout.agent.sandbox``,
:mod:`bpo_megatron.rollout.agents.sandbox`: it sees the Python installation and a private ``/tmp``,
nothing else of the host's files, no network, no other process; one process with bounded threads,
memory, CPU time and file size), killed past ``rollout.agent.timeout_s``, and answers with what it
printed (cut, and said so, past :data:`MAX_OUTPUT_CHARS`), or the error's last line, inside
``<tool_response>``."""

from __future__ import annotations

import sys
from pathlib import Path

from bpo_megatron.rollout.agents.base import Agent, Turn
from bpo_megatron.rollout.agents.sandbox import SandboxConfig, run_confined, run_unconfined

OPEN = "<tool_call>"
MAX_OUTPUT_CHARS = 2000  # longer output is cut, and the cut is said


class PythonTool(Agent):
    call_token = "</tool_call>"
    reply = "<tool_response>\n{output}\n</tool_response>\n"
    executes_model_output = True

    def respond(self, prompt: str, transcript: list[Turn]) -> str:
        return self.format_reply(run_python(self.call_of(transcript, OPEN), timeout_s=self.settings.timeout_s,
                                            sandbox=self.settings.sandbox, run_dir=self.run_dir))


def run_python(code: str, *, timeout_s: float, sandbox: SandboxConfig = SandboxConfig(),
               run_dir: str | Path | None = None) -> str:
    """What ``code`` prints (stdout, cut past :data:`MAX_OUTPUT_CHARS` and said so), or its error's
    last line; a run past ``timeout_s`` is killed with everything it started."""
    argv = [sys.executable, "-I", "-c", code]
    if sandbox.mode == "none":
        done = run_unconfined(argv, sandbox, timeout_s=timeout_s)
    else:
        done = run_confined(argv, sandbox, timeout_s=timeout_s, run_dir=run_dir)
    if done.timed_out:
        return f"TimeoutError: the code ran past {timeout_s:g} s"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    output = done.stdout.strip()
    if len(output) > MAX_OUTPUT_CHARS or done.stdout_cut:
        output = output[:MAX_OUTPUT_CHARS] + f"... (cut: the code printed {done.stdout_bytes} bytes)"
    return output
