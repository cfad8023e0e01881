"""The first process of a sandbox (see :mod:`bpo_megatron.rollout.agents.sandbox`), run as a script
(standard library only) by ``unshare --user --map-root-user --net --pid --fork --mount
--mount-proc``: it is process 1 of a fresh PID namespace, root of a fresh user namespace, with a
network namespace of its own (no interface up: nothing can be reached) and a mount namespace.

Usage: sandbox_init.py SPEC_JSON -- PROGRAM ARG...

It makes every mount read-only, mounts a fresh size-limited tmpfs on /tmp (the one writable
place, the program's home and working directory) and hides what SPEC names (the run directory,
credential files: an empty read-only tmpfs over a directory, /dev/null over a file), then starts the program in a nested user and
mount namespace (which locks those mounts: the program cannot undo them), with resource limits,
no new privileges and only the environment SPEC gives. As process 1 it then counts the
namespace's processes and watches the clock: past the process limit or the timeout it exits, and
the kernel kills every process of the namespace with it (also one that started its own session).

Exit status: the program's, or 124 (timeout), 125 (process limit), 126 (the sandbox could not be
set up: the reason on stderr, prefixed ``sandbox:``).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time

TIMEOUT, TOO_MANY_PROCESSES, SETUP_FAILED = 124, 125, 126
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 0x400, 0x800, 0x200000, 0x1000000
# mount options a user namespace may not change on an inherited mount: kept as they are
KEPT = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
        "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_NO_NEW_PRIVS = 38
POLL_S = 0.01

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(why: str) -> None:
    print(f"sandbox: {why}", file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED)


def _mount(source, target, fstype, flags: int, data=None) -> None:
    encode = lambda v: None if v is None else v.encode()  # noqa: E731
    if _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target} ({fstype or 'remount'}): {os.strerror(errno)}")


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, its per-mount options) of every mount, parents first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            out.append((point, set(fields[5].split(","))))
    return out


def _confine_filesystem(spec: dict) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's namespace
    for point, options in _mounts():
        if "ro" in options or point.startswith("/proc"):
            continue
        kept = sum(flag for name, flag in KEPT.items() if name in options)
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
    for hidden in spec["hidden"]:  # a directory: an empty one over it; a file: /dev/null over it
        if os.path.isdir(hidden):
            _mount("sandbox-hidden", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
        elif os.path.exists(hidden):
            _mount("/dev/null", hidden, None, MS_BIND)
    _mount("sandbox-tmp", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmp_bytes']},mode=1777")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _run_program(spec: dict, argv: list[str]) -> None:
    """In the forked child: lock the mounts, limit, exec (never returns)."""
    try:
        if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare of the program's user namespace")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", "0 0 1")
        _write("/proc/self/gid_map", "0 0 1")
        limits = spec["limits"]
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.chdir("/tmp")
        os.execve(argv[0], argv, spec["env"])
    except OSError as exc:
        print(f"sandbox: {exc}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)


def _processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        _fail("usage: sandbox_init.py SPEC_JSON -- PROGRAM ARG...")
    spec = json.loads(argv[0])
    if os.getpid() != 1:
        _fail("not the first process of its own PID namespace (run it through unshare --pid --fork)")
    try:
        _confine_filesystem(spec)
    except OSError as exc:
        _fail(f"cannot confine the file system: {exc}")
    child = os.fork()
    if child == 0:
        _run_program(spec, argv[2:])
    deadline = time.monotonic() + spec["timeout_s"]
    status = None
    while status is None:
        while True:  # reap: the program, and orphans handed to process 1
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == child:
                status = os.waitstatus_to_exitcode(code)
        if status is not None:
            break
        if time.monotonic() > deadline:
            return TIMEOUT
        if _processes() > spec["limits"]["processes"] + 1:  # + this one
            return TOO_MANY_PROCESSES
        time.sleep(POLL_S)
    return status if status >= 0 else 128 - status  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(TIMEOUT))
    code = main(sys.argv[1:])
    os._exit(code)  # process 1 exits: the kernel kills what is left of the namespace
