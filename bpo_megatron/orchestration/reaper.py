"""``python -m bpo_megatron.orchestration.reaper --parent PID``: when process PID ends — however it
ends, ``kill -9`` included — end every process it had started, and theirs.

A run that starts a private Ray (``cluster.ray_address: null``) starts Ray's processes as its own
descendants: the GCS, the raylet, its workers, the dashboard and runtime-env agents. A driver that
exits normally shuts Ray down; one that is killed cannot, and some of them (the agents) outlive
it. The run starts this reaper in a session of its own beside Ray: it notes the driver's
descendants every ``--interval`` seconds and, once the driver is gone, sends each one still alive
(the same process: its start time is checked, so a reused PID is left alone) SIGTERM, then
SIGKILL after ``--grace`` seconds. Then it exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import psutil


def _descendants(parent: psutil.Process) -> dict[int, float]:
    found = {}
    for child in parent.children(recursive=True):
        try:
            found[child.pid] = child.create_time()
        except psutil.Error:
            continue
    found.pop(os.getpid(), None)
    return found


def _running(parent: psutil.Process) -> bool:
    try:
        return parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(known: dict[int, float], grace: float) -> int:
    """End the processes of ``known`` (pid -> start time) that still run; how many there were."""
    left = []
    for pid, started in known.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                left.append(process)
        except psutil.Error:
            continue
    for process in left:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    return len(left)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reaper")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        parent = psutil.Process(args.parent)
    except psutil.Error:
        return 0
    known: dict[int, float] = {}
    while _running(parent):
        known.update(_descendants(parent))
        time.sleep(args.interval)
    reap(known, args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
