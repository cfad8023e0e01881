"""Starting, watching and stopping one ``sglang.launch_server`` process.

The server is started through :mod:`bpo_megatron.rollout.sglang.supervise`, so it never outlives
the process that started it (a killed engine actor takes its server along), on a port found free
at each start (a port a dead server may still hold is never reused).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bpo_megatron.rollout.sglang.options import SGLangConfig
from bpo_megatron.rollout.sglang.http import RequestTimeout, ServerError, ServerUnavailable, request_json


class ServerStartError(RuntimeError):
    pass


STOP_GRACE_S = 20.0  # the server's time to exit on SIGTERM before it is killed


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, cfg: SGLangConfig, log_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.port = cfg.port
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def command(self) -> list[str]:
        """The supervised server command line."""
        return [sys.executable, "-m", "bpo_megatron.rollout.sglang.supervise", "--parent", str(os.getpid()),
                "--grace", str(STOP_GRACE_S), "--", *self.cfg.launch_command(self.port)]

    def start(self) -> None:
        self.port = self.cfg.port or _free_port(self.cfg.host)
        env = dict(os.environ)
        if self.cfg.visible_devices:
            # Ray shows the engine's actor only the GPU share it was given; the server runs on every
            # GPU of the engine's slots, as TP ranks 0..t-1 (its base GPU id is then 0)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.cfg.visible_devices))
        with open(self.log_path, "ab") as log:
            # The supervisor's own session: Ray kills a dead actor's process group, and the
            # supervisor must outlive the actor by the moment it takes to stop the server.
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self.starts += 1
        self.wait_healthy()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerStartError(f"SGLang server exited with code {self.process.returncode} while "
                                       f"starting; last output:\n{self.log_tail()}")
            try:
                request_json("GET", f"{self.base_url}/health", timeout=5.0)
                return
            except (ServerUnavailable, RequestTimeout, ServerError):
                time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"SGLang server not healthy within {self.cfg.startup_timeout_s:.0f}s; "
                               f"last output:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:  # the supervisor stops the server's whole process group, then exits
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout=2 * STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self.process = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
