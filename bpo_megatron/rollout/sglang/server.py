"""Starting, watching and stopping one ``sglang.launch_server`` process.

The server is started through :mod:`bpo_megatron.rollout.sglang.supervise`, so it never outlives
the process that started it (a killed engine actor takes its server along), on a port found free
at each start (a port a dead server may still hold is never reused).

Each start gets a fresh secret (SGLang's ``--api-key``): a server reachable from the cluster
network would otherwise take weight updates from anyone on it. The key reaches SGLang in a
private config file (``--config``, mode 0600, removed once the server answers), so it is never on
a command line, in the run directory, in a message or in the server's log: SGLang logs its
arguments, the key among them, and the supervisor writes that output to the log with the key
replaced (``--redact-key-in``). ``/health`` runs no generation
(``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` in the server's environment): a generation
while the server's KV cache is released would kill it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bpo_megatron.platform import free_port
from bpo_megatron.rollout.sglang.options import SGLangConfig
from bpo_megatron.rollout.sglang.http import RequestTimeout, ServerError, ServerUnavailable, request_json


class ServerStartError(RuntimeError):
    pass


STOP_GRACE_S = 20.0  # the server's time to exit on SIGTERM before it is killed
# what the server's own environment must say (SGLang reads these, we never do)
SERVER_ENVIRONMENT = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}

# A server started on GPUs whose previous server (of an engine killed and being replaced) has not
# exited yet would size its memory from what that one still holds: each server's supervisor holds
# an exclusive lock per GPU until the server it stops is gone, and a start waits for the locks.
GPU_LOCK_DIR = Path(tempfile.gettempdir())
# Run as a file: ``-m`` would import the packages above it first (``bpo_megatron.rollout`` brings
# torch and Megatron: seconds of CPU before every server starts), and it needs the standard library
# only; ``-P`` keeps its own directory off ``sys.path``, where ``http.py`` would shadow the library's.
SUPERVISOR = Path(__file__).with_name("supervise.py")
GPU_RELEASE_TIMEOUT_S = 2 * STOP_GRACE_S + 60.0  # the predecessor's grace, its SIGKILL, and slack


def gpu_lock_path(node: str, gpu: str) -> Path:
    return GPU_LOCK_DIR / f"bpo-sglang-{node}-gpu{gpu.strip()}.lock"


def gpu_locks(node: str, gpus: list[str], *, timeout_s: float, poll_s: float = 0.2) -> list[int]:
    """Exclusive locks on ``gpus`` (GPU ids of the node at address ``node``), as open file
    descriptors to hand to the server's supervisor; waits up to ``timeout_s`` for a previous
    holder to exit, then raises :class:`ServerStartError` naming the GPUs still held."""
    import fcntl

    deadline = time.monotonic() + timeout_s
    held: list[int] = []
    try:
        for gpu in gpus:
            fd = os.open(gpu_lock_path(node, gpu), os.O_RDWR | os.O_CREAT, 0o600)
            held.append(fd)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ServerStartError(
                            f"GPU {gpu.strip()} is still held by another SGLang server (a replaced engine's, "
                            f"still stopping) after {timeout_s:.0f} s; its process holds {gpu_lock_path(node, gpu)}"
                        ) from None
                    time.sleep(poll_s)
    except BaseException:
        for fd in held:
            os.close(fd)
        raise
    return held



class ServerProcess:
    def __init__(self, cfg: SGLangConfig, log_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="sglang-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.port = cfg.port
        self.starts = 0
        self.api_key: str | None = None
        self._key_file: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.advertised_address}:{self.port}"

    def command(self) -> list[str]:
        """The supervised server command line (the key is in the config file, not here)."""
        config = [] if self._key_file is None else ["--config", str(self._key_file)]
        redact = [] if self._key_file is None else ["--redact-key-in", str(self._key_file)]
        return [sys.executable, "-P", str(SUPERVISOR), "--parent", str(os.getpid()),
                "--grace", str(STOP_GRACE_S), *redact, "--", *self.cfg.launch_command(self.port), *config]

    def _write_key(self) -> None:
        # hex: SGLang merges the config file into its argv, where a value starting with "-" (as a
        # URL-safe token may) is read as a flag and the server refuses to start
        self.api_key = secrets.token_hex(32)
        handle, path = tempfile.mkstemp(prefix="sglang-key-", suffix=".yaml")
        with os.fdopen(handle, "w") as out:  # mkstemp: readable by this user only
            yaml.safe_dump({"api-key": self.api_key}, out)  # the flag's own spelling
        self._key_file = Path(path)

    def _remove_key_file(self) -> None:
        if self._key_file is not None:
            self._key_file.unlink(missing_ok=True)
            self._key_file = None

    def start(self) -> None:
        self.port = self.cfg.port or free_port(self.cfg.bind_address)
        env = {**os.environ, **SERVER_ENVIRONMENT}
        if self.cfg.visible_devices:
            # Ray shows the engine's actor only the GPU share it was given; the server runs on every
            # GPU of the engine's slots, as TP ranks 0..t-1 (its base GPU id is then 0)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.cfg.visible_devices))
        gpus = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        locks = gpu_locks(self.cfg.advertised_address, gpus, timeout_s=GPU_RELEASE_TIMEOUT_S)  # a killed predecessor's server gone first
        self._write_key()
        try:
            with open(self.log_path, "ab") as log:
                # The supervisor's own session: Ray kills a dead actor's process group, and the
                # supervisor must outlive the actor by the moment it takes to stop the server. It
                # holds the GPUs' locks (inherited) until the server it stops is gone.
                self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True, pass_fds=locks)
        finally:
            for fd in locks:
                os.close(fd)
        self.starts += 1
        try:
            self.wait_healthy()
        finally:
            self._remove_key_file()  # read at start-up only

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.server_start_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerStartError(f"SGLang server exited with code {self.process.returncode} while "
                                       f"starting; last output:\n{self.log_tail()}")
            try:
                request_json("GET", f"{self.base_url}/health", timeout=5.0, api_key=self.api_key)
                return
            except (ServerUnavailable, RequestTimeout, ServerError):
                time.sleep(0.2)
        self.stop()
        bound = "rollout.sglang.startup_timeout_s" + (" + deep_gemm_compile_s" if self.cfg.quantization == "fp8" else "")
        raise ServerStartError(f"SGLang server not healthy within {self.cfg.server_start_s:.0f}s ({bound}); "
                               f"last output:\n{self.log_tail()}")

    def stop(self) -> None:
        self._remove_key_file()
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
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
