"""Running model-written code confined (``rollout.agent.sandbox``): what a tool that executes the
model's output (the Python tool) runs it in.

``confined`` (the default) starts the program through ``unshare`` (util-linux) in fresh user, PID,
network and mount namespaces, set up by :mod:`bpo_megatron.rollout.agents.sandbox_init`: no network
(no interface is up), every file system read-only but a fresh size-limited ``/tmp`` (its home and
working directory), the run directory and credential files hidden, an environment of ``PATH``,
``HOME`` and ``LANG`` only, no view of other processes (``/proc`` shows the sandbox's own), limits
on memory, CPU time, open files and file size, a bound on its processes and on its time — past
either every process it started is killed, also one in a session of its own, and none outlives the
call. Where the host cannot set that up (no user namespaces, no ``unshare``) the run is refused
before it starts (:func:`check_confinement`), naming ``rollout.agent.sandbox=none``: running the
code unconfined is only ever chosen explicitly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bpo_megatron.rollout.agents import sandbox_init

INIT = Path(sandbox_init.__file__)
# files and directories of the user's home that hold credentials (hidden from the code)
CREDENTIALS = (".netrc", ".git-credentials", ".pypirc", ".ssh", ".aws", ".azure", ".kube", ".docker",
               ".config/gcloud", ".cache/huggingface", ".huggingface", ".config/wandb", ".mlflow")
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
KILL_MARGIN_S = 10.0  # beyond the sandbox's own timeout, before the caller kills unshare itself


class SandboxUnavailable(RuntimeError):
    """This host cannot confine model-written code (``rollout.agent.sandbox=none`` runs it unconfined)."""


@dataclass(frozen=True)
class SandboxConfig:
    """``rollout.agent.sandbox``: ``mode`` ``confined`` (see the module docstring) or ``none`` (a
    separate ``python -I`` process, nothing more: only where the model's code may do anything the
    training user may). The limits bound one call: its address space, processes (besides the
    sandbox's own first process), the size of any file it writes and of its ``/tmp``."""

    mode: Literal["confined", "none"] = "confined"
    memory_mb: int = 1024  # the address space of one call
    processes: int = 16  # processes one call may start besides the sandbox's first
    file_mb: int = 64  # the largest file one call may write
    tmp_mb: int = 64  # the size of its /tmp
    open_files: int = 256  # files one process may hold open

    def __post_init__(self) -> None:
        for name in ("memory_mb", "processes", "file_mb", "tmp_mb", "open_files"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.agent.sandbox.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Finished:
    """How a confined program ended: its exit status and output, or cut by a bound."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    too_many_processes: bool = False


def hidden_paths(run_dir: str | Path | None) -> list[str]:
    """What the code must not see: the run directory and the home's credential files."""
    home = Path(os.path.expanduser("~"))
    paths = [str(home / name) for name in CREDENTIALS if (home / name).exists()]
    if run_dir is not None:
        paths.insert(0, str(Path(run_dir).resolve()))
    return paths


def run_confined(argv: list[str], settings: SandboxConfig, *, timeout_s: float,
                 run_dir: str | Path | None = None) -> Finished:
    """``argv`` (an absolute program path first) confined by ``settings`` within ``timeout_s``.
    :class:`SandboxUnavailable` when the sandbox cannot be set up here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("the 'unshare' program (util-linux) is not installed")
    spec = {"hidden": hidden_paths(run_dir), "tmp_bytes": settings.tmp_mb << 20, "timeout_s": timeout_s,
            "env": ENVIRONMENT,
            "limits": {"memory_bytes": settings.memory_mb << 20, "cpu_s": math.ceil(timeout_s) + 1,
                       "file_bytes": settings.file_mb << 20, "open_files": settings.open_files,
                       "processes": settings.processes}}
    command = [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount", "--mount-proc",
               "--kill-child", sys.executable, "-I", str(INIT), json.dumps(spec), "--", *argv]
    try:
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=ENVIRONMENT,
                              timeout=timeout_s + KILL_MARGIN_S)
    except subprocess.TimeoutExpired:  # unshare killed: --kill-child takes the namespace's first process along
        return Finished(-1, "", "", timed_out=True)
    if done.returncode == sandbox_init.SETUP_FAILED and done.stderr.startswith("sandbox: "):
        raise SandboxUnavailable(done.stderr.strip().removeprefix("sandbox: "))
    if done.returncode != 0 and "unshare: " in done.stderr and not done.stdout:  # refused before the sandbox ran
        raise SandboxUnavailable(done.stderr.strip().splitlines()[-1])
    return Finished(done.returncode, done.stdout, done.stderr, timed_out=done.returncode == sandbox_init.TIMEOUT,
                    too_many_processes=done.returncode == sandbox_init.TOO_MANY_PROCESSES)


def check_confinement(settings: SandboxConfig) -> str | None:
    """Before a run whose tool executes model output starts: the sandbox works on this host (a
    confined ``print`` runs and prints), else :class:`SandboxUnavailable` saying so and naming the
    opt-out. A note saying how the code will run."""
    if settings.mode == "none":
        return ("rollout.agent.sandbox.mode=none: model-written code runs unconfined, with the training user's "
                "rights (network, files, environment)")
    try:
        finished = run_confined([sys.executable, "-I", "-c", "print('confined')"], settings, timeout_s=30.0)
    except SandboxUnavailable as exc:
        raise SandboxUnavailable(f"model-written code cannot be confined on this host ({exc}); the run would execute "
                                 "it with the training user's rights. Run where user namespaces are allowed (e.g. "
                                 "sysctl kernel.unprivileged_userns_clone=1, or a container started with them), or "
                                 "set rollout.agent.sandbox.mode=none to run it unconfined") from exc
    if finished.stdout.strip() != "confined":
        raise SandboxUnavailable(f"the sandbox's trial run printed {finished.stdout!r} (status {finished.returncode}, "
                                 f"{finished.stderr.strip()[-300:]!r}); set rollout.agent.sandbox.mode=none to run "
                                 "model-written code unconfined")
    return None
