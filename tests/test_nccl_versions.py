"""One NCCL in the weight group: trainer rank 0's version and each SGLang server's (asked of the
server's interpreter) are compared before the first broadcast, and a mismatch is refused naming
both; and the GPU node's one environment (tools/gpu/check_cluster_env.py) holds one torch, one NCCL.

No GPU here: an interpreter "running" another NCCL is this Python with torch's CUDA and NCCL
queries answered as a CUDA build with that NCCL would answer them (``fake_interpreter``); the
weight group itself is real (gloo, 127.0.0.1, one process per member).
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bpo_megatron.rollout.sglang.nccl import (
    UNKNOWN,
    NcclVersionMismatch,
    NcclVersionUnknown,
    check_nccl_versions,
    nccl_version,
    server_nccl_version,
)

ROOT = Path(__file__).resolve().parents[1]
STEP_TIMEOUT_S = 120  # each wait on a member process (a loaded 2-core machine imports torch slowly)
GROUP = "bpo-weight-sync-test"

# An interpreter of another environment: this Python, its torch a CUDA build with NCCL `version`
# (CUDA only where the process is shown GPUs, as a real one). Runs `-c CODE` or a script.
FAKE_INTERPRETER = '''#!{python}
import os, runpy, sys
import torch, torch.distributed
torch.cuda.is_available = lambda: os.environ.get("CUDA_VISIBLE_DEVICES", "") != ""
torch.distributed.is_nccl_available = lambda: True
torch.cuda.nccl.version = lambda: {version!r}
if sys.argv[1] == "-c":
    code = sys.argv[2]
    sys.argv = ["-c", *sys.argv[3:]]
    exec(compile(code, "<string>", "exec"), {{"__name__": "__main__"}})
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
'''

# Trainer rank 0: hosts the group (on a port the OS assigns, which it prints), reports its NCCL
# version, then broadcasts one tensor or not.
SENDER = '''
import datetime, json, sys, torch, torch.distributed as dist
from bpo_megatron.rollout.sglang.weights import DistributedWeightSender
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print(f"port {store.port}", flush=True)
sender = DistributedWeightSender(store, 2, "gloo", sys.argv[1], timeout_s=60)
print("version " + json.dumps(sender.nccl_version()), flush=True)
if sys.stdin.readline().strip() == "broadcast":
    sender.broadcast([("w", torch.arange(8, dtype=torch.float32))])
    print("sent", flush=True)
sender.close()
'''

# An engine's TP rank: joins as rank 1 with the sender's key chain (SGLang's own join is checked in
# tests/sglang_contract), then receives one broadcast or not.
MEMBER = '''
import datetime, json, sys, torch, torch.distributed as dist
torch.set_num_threads(1)
port, name, timeout = int(sys.argv[1]), sys.argv[2], datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", dist.PrefixStore(name + "/", dist.PrefixStore(name, store))),
                              1, 2, timeout)
print("joined", flush=True)
if sys.stdin.readline().strip() == "receive":
    flat = torch.zeros(32, dtype=torch.uint8)  # the bucket packed as SGLang's flattened_bucket receives it
    group.broadcast(flat, 0).wait()
    print("received " + json.dumps(flat.view(torch.float32).tolist()), flush=True)
else:
    print("received nothing", flush=True)
'''


def fake_interpreter(directory: Path, version: tuple[int, ...]) -> Path:
    path = directory / f"python-nccl-{'.'.join(map(str, version))}"
    path.write_text(FAKE_INTERPRETER.format(python=sys.executable, version=version))
    path.chmod(0o755)
    return path


class Member:
    """One member process of the weight group, its output (stderr too: a full pipe would stall it)
    read line by line with a deadline."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def line(self, prefix: str) -> str:
        while True:
            try:
                line = self.lines.get(timeout=STEP_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {STEP_TIMEOUT_S} s") from None
            if line is None:
                raise AssertionError(f"exited before a {prefix!r} line: {''.join(self.output)[-3000:]}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def tell(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def finish(self) -> int:
        return self.process.wait(timeout=STEP_TIMEOUT_S)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # this member's PID only
            self.process.wait(timeout=30)


@pytest.fixture
def weight_group(tmp_path):
    """``start(trainer_python, engine_python)``: trainer rank 0 and one engine rank, each run by
    the given interpreter, joined in one gloo group; every process is killed at the end."""
    members: list[Member] = []
    (tmp_path / "sender.py").write_text(SENDER)
    (tmp_path / "member.py").write_text(MEMBER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0"}

    def start(trainer_python: Path, engine_python: Path) -> tuple[Member, Member]:
        members.append(Member([str(trainer_python), str(tmp_path / "sender.py"), GROUP], env))
        port = members[-1].line("port")  # the port its rendezvous got as it bound
        members.append(Member([str(engine_python), str(tmp_path / "member.py"), port, GROUP], env))
        members[-1].line("joined")
        return members[-2], members[-1]

    yield start
    for member in members:
        member.kill()


def test_a_member_with_another_nccl_is_refused_before_any_broadcast(tmp_path, weight_group):
    """The group forms (process groups start lazily; NCCL would fail only at the first broadcast):
    the check, on trainer rank 0's version and the engine server's interpreter's, refuses it
    naming both versions, the member and the fix, and nothing is broadcast."""
    trainer_python = fake_interpreter(tmp_path, (2, 28, 9))
    engine_python = fake_interpreter(tmp_path, (2, 30, 7))
    sender, member = weight_group(trainer_python, engine_python)
    trainer_version = tuple(json.loads(sender.line("version")))
    engine_version = server_nccl_version((str(engine_python), "-m", "sglang.launch_server"), visible_devices=(0,))
    assert (trainer_version, engine_version) == ((2, 28, 9), (2, 30, 7))
    with pytest.raises(NcclVersionMismatch) as refused:
        check_nccl_versions(trainer_version, [engine_version])
    message = str(refused.value)
    assert "trainer rank 0 runs NCCL 2.28.9" in message
    assert "rollout engine 0's SGLang server runs NCCL 2.30.7" in message
    assert "tools/gpu/requirements-cluster.txt" in message
    sender.tell("close")
    member.tell("close")
    assert member.line("received") == "nothing"
    assert sender.finish() == 0 and member.finish() == 0


def test_members_with_the_same_nccl_are_admitted_and_the_broadcast_arrives(tmp_path, weight_group):
    python = fake_interpreter(tmp_path, (2, 30, 7))
    sender, member = weight_group(python, python)
    trainer_version = tuple(json.loads(sender.line("version")))
    engine_version = server_nccl_version((str(python), "-m", "sglang.launch_server"), visible_devices=(0,))
    check_nccl_versions(trainer_version, [engine_version])  # admitted
    sender.tell("broadcast")
    member.tell("receive")
    assert json.loads(member.line("received")) == list(range(8))
    assert sender.line("sent") == ""
    assert sender.finish() == 0 and member.finish() == 0


def test_the_launchers_python_is_asked_with_the_servers_gpus(tmp_path):
    """The server's interpreter answers, not this one; with the GPUs the server will see (an
    engine actor may be shown none of them itself)."""
    python = fake_interpreter(tmp_path, (2, 30, 7))
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    assert server_nccl_version((str(python), "-m", "sglang.launch_server"), visible_devices=(2, 3), env=hidden) \
        == (2, 30, 7)
    assert server_nccl_version((str(python), "-m", "sglang.launch_server"), env=hidden) is None
    # this interpreter (CPU torch here) answers what it answers in this process
    assert server_nccl_version((sys.executable, "-m", "sglang.launch_server")) == nccl_version()


def test_a_launcher_that_cannot_answer_is_named(tmp_path):
    with pytest.raises(NcclVersionUnknown, match=r"could not be started.*rollout.sglang.launcher must begin"):
        server_nccl_version((str(tmp_path / "no-such-python"), "-m", "sglang.launch_server"))
    with pytest.raises(NcclVersionUnknown, match=r"exit 1.*rollout.sglang.launcher must begin with a Python"):
        server_nccl_version(("false", "-m", "sglang.launch_server"))
    hung = tmp_path / "hung-python"
    hung.write_text("#!/bin/sh\nexec sleep 60\n")
    hung.chmod(0o755)
    with pytest.raises(NcclVersionUnknown, match=r"did not report its NCCL version within 1 s"):
        server_nccl_version((str(hung),), timeout_s=1)


def test_the_check_refuses_every_member_that_differs_and_only_those():
    check_nccl_versions((2, 30, 7), [(2, 30, 7), (2, 30, 7, "+cuda13.0"), UNKNOWN])  # a suffix is no other NCCL
    check_nccl_versions(None, [(2, 30, 7), None])  # a trainer without NCCL broadcasts with gloo
    with pytest.raises(NcclVersionMismatch) as refused:
        check_nccl_versions((2, 30, 7), [(2, 30, 7), None, (2, 28, 9)])
    message = str(refused.value)
    assert "rollout engine 1's SGLang server runs no NCCL" in message
    assert "rollout engine 2's SGLang server runs NCCL 2.28.9" in message
    assert "rollout engine 0" not in message


# ------------------------------------------------------------------------------ the node's environment
def _cluster_check():
    spec = importlib.util.spec_from_file_location("check_cluster_env", ROOT / "tools" / "gpu" / "check_cluster_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(*distributions: tuple[str, str, list[str]]) -> dict:
    return {"install": [{"metadata": {"name": name, "version": version, "requires_dist": requires}}
                        for name, version, requires in distributions]}


ONE_ENVIRONMENT = (
    ("torch", "2.14.1", ['nvidia-nccl-cu13==2.30.7; platform_system == "Linux"']),
    ("nvidia-nccl-cu13", "2.30.7", []),
    ("sglang", "0.5.23", ["torch==2.14.1"]),
    ("bpo-megatron", "0.1.0", ["megatron-core<0.20,>=0.16"]),
    ("megatron-core", "0.19.2", []),
    ("transformer_engine", "2.20.2", []),
    ("transformer_engine_cu13", "2.20.2", []),
)


def test_the_cluster_check_admits_one_torch_and_one_nccl_and_nothing_else():
    check = _cluster_check()
    shown, problems = check.summarise(_report(*ONE_ENVIRONMENT))
    assert problems == []
    assert shown["torch"] == "2.14.1" and shown["NCCL"] == "nvidia-nccl-cu13 2.30.7"
    two_nccls = check.summarise(_report(*ONE_ENVIRONMENT, ("nvidia-nccl-cu12", "2.28.9", [])))[1]
    assert two_nccls == ["expected exactly one NCCL distribution (nvidia-nccl-cu*), found "
                         "['nvidia-nccl-cu12', 'nvidia-nccl-cu13']"]
    other_torch = [d if d[0] != "torch" else ("torch", "2.13.0", d[2]) for d in ONE_ENVIRONMENT]
    assert check.summarise(_report(*other_torch))[1] == ["torch 2.13.0 is not what sglang requires (torch==2.14.1)"]
    other_nccl = [d if d[0] != "nvidia-nccl-cu13" else (d[0], "2.28.9", []) for d in ONE_ENVIRONMENT]
    assert check.summarise(_report(*other_nccl))[1] == [
        "torch 2.14.1 requires nvidia-nccl-cu13==2.30.7, the set has nvidia-nccl-cu13 2.28.9"]
    # what pip before 23.3 resolves: transformer-engine without its [core_cu13] extra's core library
    dropped_extra = [d for d in ONE_ENVIRONMENT if d[0] != "transformer_engine_cu13"]
    assert check.summarise(_report(*dropped_extra))[1] == [
        "transformer-engine 2.20.2 needs one core library of the same version, found [] (pip before 23.3 drops the "
        "[core_cu13] extra without a word: python -m pip install -U 'pip>=23.3')"]


@pytest.mark.slow
def test_the_cluster_requirements_resolve_to_one_environment():
    """pip's resolver over tools/gpu/requirements-cluster.txt (network: the package index)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "check_cluster_env.py")], capture_output=True,
                          text=True, timeout=2000)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "one torch, one NCCL" in done.stdout
