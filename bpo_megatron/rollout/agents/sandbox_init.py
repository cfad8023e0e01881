"""The first process of a sandbox (see :mod:`bpo_megatron.rollout.agents.sandbox`), run as a script
by ``unshare --user --map-root-user --net --pid --ipc --uts --fork --mount --mount-proc``: process 1
of a fresh PID namespace, root of a fresh user namespace, with network, IPC and UTS namespaces of
its own (no interface up: nothing can be reached; System V objects die with the namespace) and a
mount namespace.

Usage: ``sandbox_init.py`` with the spec (JSON) on stdin; ``spec["status_fd"]`` is a pipe to the
caller on which this process says ``started`` first and, where it cannot confine, ``setup: REASON``
(the program never holds that pipe: the caller tells a refused setup from the program's own exit).
Nothing of the spec is on the command line, where ``/proc/1/cmdline`` would show it to the program.

Set-up, in order (this process is made not dumpable first: the program cannot read its memory,
descriptors or environment):

* The task bound: on Linux >= 6.14 the PID namespace's own ``pid_max`` (``RESERVED_PIDS`` + the
  bound, the next PID set past the reserved ones: the program's tasks get PIDs from a range of
  exactly ``tasks``); otherwise ``RLIMIT_NPROC`` in the program's own user namespace (counted per
  user namespace since Linux 5.14; not enforced for the host's root). The caller chose which.
* The IPC namespace's System V limits (16 MB of shared memory, 16 message queues of 16 kB); where
  the kernel does not let this namespace set them, ``shmget``/``msgget`` are refused instead.
* The file system: a fresh root holding only what ``spec["view"]`` lists (bound read-only: the
  Python installation, the system's libraries), a size-limited tmpfs on ``/tmp`` (the one writable
  place), a fresh read-only ``/proc`` of this PID namespace, ``/dev`` with ``null``, ``zero``,
  ``full``, ``random`` and ``urandom``; the host's root is detached.
* Then the program is started in a nested user and mount namespace (which locks the mounts), with
  rlimits (address space: one process shares it with all its threads, so this is the memory bound
  of the whole call; CPU time; file size; open files), no new privileges, stdin ``/dev/null``, the
  environment of ``spec["env"]`` and a seccomp filter (libseccomp through ``pyseccomp``) that
  refuses new processes (threads only), new namespaces, mounts, ptrace, ``memfd_create`` and
  io_uring. This process waits for it, past the timeout exits, and the kernel kills every process
  of the namespace with it.

Exit status: the program's, 124 (timeout, also said on the status pipe) or 126 (the sandbox could
not be set up).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import resource
import signal
import sys
import time

TIMEOUT, SETUP_FAILED = 124, 126
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
CLONE_THREAD = 0x00010000
# the namespace flags clone() takes (CLONE_NEWTIME is clone3/unshare only: its bit is the exit signal's in clone)
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 0x400, 0x800, 0x200000, 0x1000000
MNT_DETACH = 0x2
# mount options a user namespace may not change on an inherited mount: kept as they are
KEPT = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
        "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
RESERVED_PIDS = 300  # the kernel's: once a namespace's PIDs pass it, new ones come from [300, pid_max)
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSV_SHM_BYTES = 16 << 20  # System V shared memory of the whole namespace (it outlives a detach)
MESSAGE_QUEUES = 16  # of 16 kB each (msgmnb's default)
# refused for the program (EPERM): each opens a way around the confinement or the memory bound
DENIED_SYSCALLS = (
    "unshare", "setns",  # new namespaces (clone's namespace flags: below)
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",  # mounts
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",  # other processes' memory
    "fork", "vfork",  # new processes: threads only (clone without CLONE_THREAD: below)
    "memfd_create",  # anonymous files: memory outside the address-space bound
    "io_uring_setup", "io_uring_enter", "io_uring_register",  # requests seccomp does not see
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key")
POLL_S = 0.01

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox cannot be set up here (the reason goes to the caller)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(source, target, fstype, flags: int, data=None) -> None:
    encode = lambda v: None if v is None else os.fsencode(v)  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)),
           f"mount {target} ({fstype or 'bind/remount'})")


def _mounts(proc: str) -> list[tuple[str, set[str]]]:
    """(mount point, its per-mount options) of every mount, parents first (``proc``: where /proc is)."""
    out = []
    with open(f"{proc}/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal[1], 8)), fields[4])  # \040: a space
            out.append((point, set(fields[5].split(","))))
    return out


def _write(path: str, text: str, dir_fd: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def kernel_at_least(major: int, minor: int) -> bool:
    """This host's Linux is ``major.minor`` or newer."""
    numbers = os.uname().release.split("-")[0].split(".")
    return (int(numbers[0]), int(numbers[1])) >= (major, minor)


def _bound_tasks(spec: dict) -> None:
    """The PID namespace's pid_max (Linux >= 6.14 keeps one per namespace: only then is it written,
    an older kernel's is the host's) and its next PID past the reserved range."""
    if spec["task_bound"] != "pid_max":
        return
    if not kernel_at_least(6, 14):
        raise SetupError(f"Linux {os.uname().release} has no pid_max per PID namespace")
    _write("/proc/sys/kernel/pid_max", str(RESERVED_PIDS + spec["limits"]["tasks"]))
    _write("/proc/sys/kernel/ns_last_pid", str(RESERVED_PIDS))


def _limit_ipc() -> bool:
    """This IPC namespace's System V memory bounded (:data:`SYSV_SHM_BYTES`, :data:`MESSAGE_QUEUES`);
    False where the kernel does not let the namespace's root set its limits (then shmget/msgget are
    refused)."""
    try:
        _write("/proc/sys/kernel/shmall", str(SYSV_SHM_BYTES // os.sysconf("SC_PAGE_SIZE")))
        _write("/proc/sys/kernel/shmmax", str(SYSV_SHM_BYTES))
        _write("/proc/sys/kernel/msgmni", str(MESSAGE_QUEUES))
    except OSError:
        return False
    return True


def _bind(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "x").close()
    _mount(source, target, None, MS_BIND | MS_REC)


def _pivot_root(new_root: str, put_old: str) -> None:
    number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, "pivot_root")  # glibc has no wrapper
    _check(_libc.syscall(number, os.fsencode(new_root), os.fsencode(put_old)), f"pivot_root into {new_root}")


def _build_root(spec: dict) -> int:
    """The program's file system (see the module docstring), this process inside it; returns a
    descriptor of this namespace's writable ``/proc``, through which the program's user namespace
    is mapped (the view's own ``/proc`` is read-only)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's namespace
    # a scratch root; pivoting into it uncovers the host's whole tree at /old, its /tmp included
    _mount("sandbox-base", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700")
    os.mkdir("/tmp/old")
    os.mkdir("/tmp/new")
    _pivot_root("/tmp", "/tmp/old")
    os.chdir("/")
    new = "/new"
    _mount("sandbox-root", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.mkdir(f"{new}/tmp")
    _mount("sandbox-tmp", f"{new}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmp_bytes']},mode=1777")
    for path in spec["view"]["bind"]:  # one under /tmp lands in the sandbox's own /tmp
        _bind(f"/old{path}", f"{new}{path}")
    for path, target in spec["view"]["symlink"]:
        os.makedirs(os.path.dirname(f"{new}{path}"), exist_ok=True)
        os.symlink(target, f"{new}{path}")
    os.makedirs(f"{new}/dev", exist_ok=True)
    for device in DEVICES:
        _bind(f"/old/dev/{device}", f"{new}/dev/{device}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, f"{new}/dev/{name}")
    os.mkdir(f"{new}/proc")
    try:
        _mount("proc", f"{new}/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        raise SetupError(f"a fresh /proc cannot be mounted ({exc.strerror}): this host masks parts of its /proc, "
                         "as a container's default profile does") from exc
    for point, options in _mounts("/old/proc"):  # every mount of the view read-only, but its /tmp and /proc
        if not point.startswith(f"{new}/") or point in (f"{new}/tmp", f"{new}/proc") or "ro" in options:
            continue
        kept = sum(flag for name, flag in KEPT.items() if name in options)
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
    _mount(None, new, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    proc = os.open("/old/proc", os.O_DIRECTORY)  # close-on-exec: the program never holds it
    os.chdir(new)
    _pivot_root(".", ".")  # the view over the scratch root, which is then detached with the host's tree
    _check(_libc.umount2(b".", MNT_DETACH), "detaching the host's tree")
    os.chdir("/")
    return proc


def _syscall_filter(ipc_limited: bool) -> "seccomp.SyscallFilter":
    """Everything allowed but what the module docstring lists (EPERM; clone3 ENOSYS, so that the C
    library falls back to clone, whose flags the filter can read)."""
    refused = seccomp.ERRNO(errno.EPERM)
    names = DENIED_SYSCALLS + (() if ipc_limited else ("shmget", "msgget"))
    unknown = [name for name in names if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) < 0]
    if unknown:
        raise SetupError(f"this libseccomp does not know the system calls {unknown}: install libseccomp2 >= 2.5")
    rules = seccomp.SyscallFilter(seccomp.ALLOW)  # its default: a call of another architecture kills
    for name in names:
        rules.add_rule(refused, name)
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.add_rule(refused, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    for flag in CLONE_NEW_FLAGS:
        rules.add_rule(refused, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    return rules


def _run_program(spec: dict, proc: int, ipc_limited: bool) -> None:
    """In the forked child: its own user and mount namespace (locking the view), limits, the
    filter, exec (never returns)."""
    status_fd = spec["status_fd"]
    try:
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare of the program's user namespace")
        _write("self/setgroups", "deny", dir_fd=proc)
        _write("self/uid_map", "0 0 1", dir_fd=proc)
        _write("self/gid_map", "0 0 1", dir_fd=proc)
        limits = spec["limits"]
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"],) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if spec["task_bound"] == "nproc":  # counted in the user namespace just made: the program's tasks only
            resource.setrlimit(resource.RLIMIT_NPROC, (limits["tasks"],) * 2)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir("/tmp")
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        rules = _syscall_filter(ipc_limited)
        rules.load()
    except (OSError, SetupError) as exc:
        _report(status_fd, f"setup: {exc}")
        os._exit(SETUP_FAILED)
    try:
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as exc:
        _report(status_fd, f"setup: cannot start {spec['argv'][0]} in the sandbox: {exc.strerror}")
        os._exit(SETUP_FAILED)


def _report(status_fd: int, line: str) -> None:
    os.write(status_fd, (line.replace("\n", " ") + "\n").encode())


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)  # the program's exec closes it
    _report(status_fd, "started")
    global seccomp
    try:
        if os.getpid() != 1:
            raise SetupError("not the first process of its own PID namespace (run it through unshare --pid --fork)")
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program may not read this process's memory, fds or environ
        try:
            import pyseccomp as seccomp  # noqa: PLC0415 - its import finds libseccomp (ldconfig): before the view
        except (ImportError, RuntimeError) as exc:
            raise SetupError(f"seccomp is not available ({exc}): install libseccomp2 (the system's) and the "
                             "Python package pyseccomp") from exc
        _bound_tasks(spec)
        ipc_limited = _limit_ipc()
        proc = _build_root(spec)
    except (OSError, SetupError) as exc:
        _report(status_fd, f"setup: {exc}")
        return SETUP_FAILED
    except Exception as exc:  # noqa: BLE001 - any other failure of the set-up is named as one too
        _report(status_fd, f"setup: {type(exc).__name__}: {exc}")
        return SETUP_FAILED
    child = os.fork()
    if child == 0:
        _run_program(spec, proc, ipc_limited)
    os.close(proc)
    deadline = time.monotonic() + spec["timeout_s"]
    while True:
        pid, code = os.waitpid(child, os.WNOHANG)
        if pid == child:
            status = os.waitstatus_to_exitcode(code)
            return status if status >= 0 else 128 - status  # killed by a signal: as a shell reports it
        if time.monotonic() > deadline:
            _report(status_fd, "timeout")
            return TIMEOUT
        time.sleep(POLL_S)


seccomp = None  # pyseccomp, imported by main (its import fails where libseccomp is missing)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(TIMEOUT))
    code = main()
    os._exit(code)  # process 1 exits: the kernel kills what is left of the namespace
