"""Running model-written code confined (``rollout.agent.sandbox``): what a tool that executes the
model's output (the Python tool) runs it in.

``confined`` (the default) starts the program through ``unshare`` (util-linux) in fresh user, PID,
network, IPC, UTS and mount namespaces, set up by :mod:`bpo_megatron.rollout.agents.sandbox_init`:

* what it can read is an allow-list (:func:`view`): the Python installation the driver runs
  (wherever it lives, a virtual environment under ``/tmp`` included) and the system's libraries
  (``/usr``, ``/lib*``, ``/bin``), read-only, and a fresh size-limited ``/tmp`` of its own (its home
  and working directory); the user's home, the run directories, the data and every other file of
  the host are not there. ``/proc`` shows its own processes only; ``/dev`` holds ``null``, ``zero``,
  ``full``, ``random``, ``urandom``.
* no network (no interface is up), so no socket reaches anything outside; the host's UNIX sockets
  are outside the view and its abstract ones in another network namespace. System V objects it
  makes live in its own IPC namespace and end with the call.
* a seccomp filter (libseccomp through ``pyseccomp``) refuses new processes, new namespaces,
  mounts, ptrace, ``memfd_create`` and io_uring: the code is one process with threads.
* one memory bound for the whole call: the address space of that one process (``memory_mb``,
  shared by all its threads), its ``/tmp`` (``tmp_mb``; ``/dev/shm`` is the same place) and 16 MB
  of System V shared memory in its IPC namespace (where the kernel lets the namespace set that;
  otherwise ``shmget`` and ``msgget`` are refused): at most ``memory_mb + tmp_mb + 16`` MB. Its
  tasks (threads) are bounded by ``threads``, by the PID namespace's own ``pid_max`` on Linux >=
  6.14, otherwise by ``RLIMIT_NPROC`` in its own user namespace (Linux >= 5.14; the kernel does
  not enforce it for the host's root); limits on CPU time, file size and open files; past its
  time every process it started is killed, and none outlives the call.
* an environment of ``PATH``, ``HOME`` and ``LANG`` only.

The driver reads what the program prints with a cap (``output_kb`` of stdout's head and of
stderr's tail; the rest is read and dropped, and counted), so its memory stays bounded whatever the
code prints. Where the host cannot set this up the run is refused before it starts
(:func:`check_confinement`), naming the cause and ``rollout.agent.sandbox.mode=none``: running the
code unconfined is only ever chosen explicitly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bpo_megatron.rollout.agents import sandbox_init

INIT = Path(sandbox_init.__file__)
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
# what every program needs besides the Python installation: the system's libraries and programs
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                "/etc/localtime")
KILL_MARGIN_S = 10.0  # beyond the sandbox's own timeout, before the caller kills unshare itself
READ_CHUNK = 1 << 16
MAX_SYMLINK_HOPS = 40  # as the kernel's ELOOP


class SandboxUnavailable(RuntimeError):
    """This host cannot confine model-written code (``rollout.agent.sandbox=none`` runs it unconfined)."""


@dataclass(frozen=True)
class SandboxConfig:
    """``rollout.agent.sandbox``: ``mode`` ``confined`` (see the module docstring) or ``none`` (a
    separate ``python -I`` process, nothing more: only where the model's code may do anything the
    training user may). The limits bound one call: the memory of the whole call (``memory_mb``: the
    address space of its one process, all threads together), its threads (``threads``, the main one
    included), the size of any file it writes, of its ``/tmp`` and its open files; ``output_kb``:
    how much of its stdout (the head) and stderr (the tail) the driver keeps, in either mode."""

    mode: Literal["confined", "none"] = "confined"
    memory_mb: int = 1024  # the address space of the call's one process, all its threads together
    threads: int = 64  # threads one call may run, its main one included
    file_mb: int = 64  # the largest file one call may write
    tmp_mb: int = 64  # the size of its /tmp
    open_files: int = 256  # files it may hold open
    output_kb: int = 64  # how much of its stdout (the head) and stderr (the tail) the driver keeps

    def __post_init__(self) -> None:
        for name in ("memory_mb", "threads", "file_mb", "tmp_mb", "open_files", "output_kb"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.agent.sandbox.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Finished:
    """How a program ended: its exit status and output (stdout's first and stderr's last
    ``output_kb``; ``stdout_bytes``: all it printed), or cut by its time."""

    returncode: int
    stdout: str
    stderr: str
    stdout_bytes: int = 0
    stdout_cut: bool = False
    timed_out: bool = False


def _resolved(path: str) -> tuple[list[tuple[str, str]], str]:
    """The symbolic links met on the way to ``path`` (each as (link, its text)) and where it ends."""
    links: list[tuple[str, str]] = []
    pending = list(Path(os.path.abspath(path)).parts[1:])
    current = "/"
    while pending:
        candidate = os.path.join(current, pending.pop(0))
        if os.path.islink(candidate):
            if len(links) == MAX_SYMLINK_HOPS:
                raise SandboxUnavailable(f"{path}: more than {MAX_SYMLINK_HOPS} symbolic links on its way")
            target = os.readlink(candidate)
            links.append((candidate, target))
            pending = list(Path(os.path.normpath(os.path.join(current, target))).parts[1:]) + pending
            current = "/"
        else:
            current = candidate
    return links, current


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def view() -> dict:
    """What the program may read (:data:`SYSTEM_PATHS` and the driver's Python installation):
    ``bind``, real paths bound read-only at their place; ``symlink``, the links on the way to them."""
    binds: set[str] = set()
    links: dict[str, str] = {}
    for path in (*SYSTEM_PATHS, sys.executable, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix):
        if not os.path.lexists(path):
            continue
        hops, real = _resolved(path)
        if real == "/":
            raise SandboxUnavailable(f"{path} is the root directory: the sandbox's view would hold every file")
        links.update(hops)
        if os.path.exists(real):
            binds.add(real)
    kept: list[str] = []
    for path in sorted(binds):  # parents first; what lies inside a kept directory comes with it
        if not any(_inside(path, directory) for directory in kept):
            kept.append(path)
    return {"bind": kept, "symlink": sorted([link, target] for link, target in links.items()
                                           if not any(_inside(link, directory) for directory in kept))}


def check_run_dir_unseen(run_dir: str | Path | None, seen: dict) -> None:
    """The run's directory must lie outside what the code sees (the view holds no deny-list)."""
    if run_dir is None:
        return
    where = str(Path(run_dir).resolve())
    holding = [path for path in seen["bind"] if _inside(where, path)]
    if holding:
        raise SandboxUnavailable(f"the run directory {where} lies inside {holding[0]}, which model-written code may "
                                 "read (the Python installation or the system's files): choose logging.run_dir "
                                 "elsewhere")


def task_bound() -> str:
    """How this host bounds the sandbox's tasks (threads included): ``pid_max`` or ``nproc`` (see
    the module docstring), else :class:`SandboxUnavailable` naming why neither holds."""
    if sandbox_init.kernel_at_least(6, 14):
        return "pid_max"
    if os.getuid() != 0 and sandbox_init.kernel_at_least(5, 14):
        return "nproc"
    why = "the training user is root, for whom the kernel does not enforce RLIMIT_NPROC" if os.getuid() == 0 \
        else "RLIMIT_NPROC is counted per user namespace only from Linux 5.14"
    raise SandboxUnavailable(f"the code's threads cannot be bounded: Linux {os.uname().release} keeps no pid_max per "
                             f"PID namespace (6.14+) and {why}; run as another user or on a newer kernel")


class _CappedReader(threading.Thread):
    """Reads a pipe to its end, keeping its first (or last) ``cap`` bytes and counting all."""

    def __init__(self, stream, cap: int, keep_tail: bool) -> None:
        super().__init__(daemon=True)
        self.stream, self.cap, self.keep_tail = stream, cap, keep_tail
        self.kept = bytearray()
        self.total = 0

    def run(self) -> None:
        fd = self.stream.fileno()
        while chunk := os.read(fd, READ_CHUNK):
            self.total += len(chunk)
            if self.keep_tail:
                self.kept += chunk
                del self.kept[:-self.cap]
            elif len(self.kept) < self.cap:
                self.kept += chunk[:self.cap - len(self.kept)]

    def text(self) -> str:
        return self.kept.decode(errors="replace")

    @property
    def cut(self) -> bool:
        return self.total > len(self.kept)


def _run_capped(command: list[str], settings: SandboxConfig, *, timeout_s: float, env: dict[str, str] | None,
                stdin: bytes = b"", pass_fds: tuple[int, ...] = ()) -> tuple[int | None, _CappedReader, _CappedReader]:
    """``command`` in a session of its own with ``env`` (None: this process's), ``stdin`` written to
    it; its exit status (None: killed with its session past ``timeout_s``) and its output read with
    the cap."""
    cap = settings.output_kb << 10
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=env, pass_fds=pass_fds, start_new_session=True)
    readers = _CappedReader(process.stdout, cap, keep_tail=False), _CappedReader(process.stderr, cap, keep_tail=True)
    for reader in readers:
        reader.start()
    try:
        process.stdin.write(stdin)
        process.stdin.close()
    except BrokenPipeError:  # it ended without reading: its status says why
        pass
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        returncode = None
    for reader in readers:  # every writer is gone with the session (or the sandbox's namespace)
        reader.join(KILL_MARGIN_S)
    process.stdout.close()
    process.stderr.close()
    return returncode, *readers


def run_unconfined(argv: list[str], settings: SandboxConfig, *, timeout_s: float) -> Finished:
    """``argv`` as a plain process (``mode=none``), killed with its session past ``timeout_s``."""
    returncode, stdout, stderr = _run_capped(argv, settings, timeout_s=timeout_s, env=None)
    return Finished(-1 if returncode is None else returncode, stdout.text(), stderr.text(), stdout.total,
                    stdout.cut, timed_out=returncode is None)


def run_confined(argv: list[str], settings: SandboxConfig, *, timeout_s: float,
                 run_dir: str | Path | None = None) -> Finished:
    """``argv`` (an absolute program path first) confined by ``settings`` within ``timeout_s``.
    :class:`SandboxUnavailable` when the sandbox cannot be set up here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("the 'unshare' program (util-linux) is not installed")
    seen = view()
    check_run_dir_unseen(run_dir, seen)
    status_read, status_write = os.pipe()
    spec = {"argv": argv, "env": ENVIRONMENT, "timeout_s": timeout_s, "status_fd": status_write, "view": seen,
            "tmp_bytes": settings.tmp_mb << 20, "task_bound": task_bound(),
            "limits": {"memory_bytes": settings.memory_mb << 20, "cpu_s": math.ceil(timeout_s) + 1,
                       "file_bytes": settings.file_mb << 20, "open_files": settings.open_files,
                       "tasks": settings.threads}}
    command = [unshare, "--user", "--map-root-user", "--net", "--pid", "--ipc", "--uts", "--fork", "--mount",
               "--mount-proc", "--kill-child", sys.executable, "-I", str(INIT)]
    try:
        returncode, stdout, stderr = _run_capped(command, settings, timeout_s=timeout_s + KILL_MARGIN_S,
                                                 env=ENVIRONMENT, stdin=json.dumps(spec).encode(),
                                                 pass_fds=(status_write,))
    finally:
        os.close(status_write)
    os.set_blocking(status_read, False)
    with os.fdopen(status_read, "rb") as status:
        said = (status.read() or b"").decode(errors="replace").splitlines()
    if "started" not in said:  # refused before its first process ran
        last = stderr.text().strip().splitlines()[-1:] or [f"exit status {returncode}"]
        if "unshare: " in last[0]:
            raise SandboxUnavailable(f"{last[0]}: this host does not let the training user create user namespaces; "
                                     "allow them (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces "
                                     "> 0, kernel.apparmor_restrict_unprivileged_userns=0, or a container started "
                                     "with them)")
        raise SandboxUnavailable(f"the sandbox's first process did not start: {last[0]}")
    refusal = [line.removeprefix("setup: ") for line in said if line.startswith("setup: ")]
    if refusal:
        raise SandboxUnavailable(refusal[0])
    timed_out = returncode is None or "timeout" in said
    return Finished(-1 if returncode is None else returncode, stdout.text(), stderr.text(), stdout.total,
                    stdout.cut, timed_out=timed_out)


def check_confinement(settings: SandboxConfig, run_dir: str | Path | None = None) -> str | None:
    """Before a run whose tool executes model output starts: the sandbox works on this host (a
    confined ``print`` runs and prints, ``run_dir`` out of its sight), else
    :class:`SandboxUnavailable` naming the cause and the opt-out. A note saying how the code will run."""
    if settings.mode == "none":
        return ("rollout.agent.sandbox.mode=none: model-written code runs unconfined, with the training user's "
                "rights (network, files, environment)")
    opt_out = "or set rollout.agent.sandbox.mode=none to run it unconfined"
    try:
        finished = run_confined([sys.executable, "-I", "-c", "print('confined')"], settings, timeout_s=30.0,
                                run_dir=run_dir)
    except SandboxUnavailable as exc:
        raise SandboxUnavailable(f"model-written code cannot be confined on this host ({exc}); the run would execute "
                                 f"it with the training user's rights: fix that, {opt_out}") from exc
    if finished.stdout.strip() != "confined":
        raise SandboxUnavailable(f"the sandbox's trial run printed {finished.stdout!r} (status {finished.returncode}, "
                                 f"{finished.stderr.strip()[-300:]!r}); {opt_out}")
    return None
