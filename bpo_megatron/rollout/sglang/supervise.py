"""``python -P supervise.py --parent PID -- COMMAND...`` (as :mod:`.server` starts it, without
importing the package; ``python -m bpo_megatron.rollout.sglang.supervise`` works too): run COMMAND
(an SGLang server) for as long as process PID lives.

A server runs in its own process group so that stopping it stops its TP workers too; but then a
killed engine actor (``ray.kill``, an OOM kill) would leave it running, holding its port and its
GPUs. This supervisor sits between the two: it starts the server's group, and when the parent
disappears (checked every ``--interval`` seconds) or it is told to stop (SIGTERM), it ends the
whole group (SIGTERM, then SIGKILL after ``--grace`` seconds). It exits with the server's status.
Should the supervisor itself be killed (Ray kills the children of an actor it kills), the kernel
kills the server with it (``PR_SET_PDEATHSIG``), and SGLang's workers follow their server the
same way.

With ``--redact-key-in FILE`` (the server's private ``--config`` file holding its ``api-key``),
the supervisor reads the key before the server starts and passes the server's output on line by
line with the key replaced by ``<api-key>``: SGLang logs its arguments, the key among them, and the
server's log must never hold it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import yaml

REDACTED = b"<api-key>"


def _parent_gone(parent: int) -> bool:
    # A dead parent's children are handed to another process at once, even while the dead parent
    # waits, a zombie, to be reaped (a zombie still answers os.kill(pid, 0)).
    return os.getppid() != parent


def _die_with_this_process() -> None:
    """In the server's process before it runs: its own session, and SIGKILL when we die."""
    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _stop(server: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it after ``grace``."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        server.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # its workers, and the server itself if it hung
    except ProcessLookupError:
        pass


def _read_key(config: str) -> bytes:
    with open(config) as f:
        key = (yaml.safe_load(f) or {}).get("api-key")
    if not key:
        raise SystemExit(f"supervise: {config} holds no api-key to redact")
    return str(key).encode()


def _copy_redacted(source, key: bytes) -> None:
    """The server's output to ours, each line with ``key`` replaced (a thread: until the pipe closes)."""
    out = sys.stdout.buffer
    for line in iter(source.readline, b""):
        out.write(line.replace(key, REDACTED))
        out.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: supervise --parent PID [--interval S] [--grace S] -- COMMAND...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="supervise")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--grace", type=float, default=20.0)
    parser.add_argument("--redact-key-in", default="", metavar="FILE")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    key = _read_key(args.redact_key_in) if args.redact_key_in else b""
    server = subprocess.Popen(command, preexec_fn=_die_with_this_process,  # noqa: PLW1509 - before any thread
                              stdout=subprocess.PIPE if key else None, stderr=subprocess.STDOUT if key else None)
    copier = None
    if key:
        copier = threading.Thread(target=_copy_redacted, args=(server.stdout, key), daemon=True)
        copier.start()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while server.poll() is None:
        if stopping or _parent_gone(args.parent):
            _stop(server, args.grace)
            break
        time.sleep(args.interval)
    status = server.wait()
    if copier is not None:
        copier.join(timeout=10)  # the rest of the server's output (its workers may hold the pipe: bounded)
    return status


if __name__ == "__main__":
    sys.exit(main())
