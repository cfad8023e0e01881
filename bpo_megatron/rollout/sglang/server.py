"""Starting, watching and restarting one ``sglang.launch_server`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bpo_megatron.rollout.sglang.options import SGLangConfig
from bpo_megatron.rollout.sglang.http import RequestTimeout, ServerError, ServerUnavailable, request_json


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    def __init__(self, cfg: SGLangConfig, log_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        env = dict(os.environ)
        if self.cfg.visible_devices:
            # Ray shows the engine's actor only the GPU share it was given; the server runs on every
            # GPU of the engine's slots, as TP ranks 0..t-1 (its base GPU id is then 0)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.cfg.visible_devices))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.cfg.launch_command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)  # its own group: stop() kills workers too
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
                request_json("GET", f"{self.cfg.base_url}/health", timeout=5.0)
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
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait(timeout=30)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
