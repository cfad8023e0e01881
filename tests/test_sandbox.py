"""Model-written code runs confined (``rollout.agent.sandbox``): probes run as the Python tool's
code try what a hostile or careless model could — read the run's files and the training process's
secrets, write outside its temporary directory, reach the network, exhaust memory or processes,
outlast its timeout, leave a process behind — and each is refused or killed, with no process of it
outliving the call. A host that cannot confine is refused before a run starts."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from bpo_megatron.rollout.agents import sandbox
from bpo_megatron.rollout.agents.python_tool import run_python
from bpo_megatron.rollout.agents.sandbox import SandboxConfig, SandboxUnavailable, check_confinement

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")
SECRET = "s3cr3t-token-4711"


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    (path / "metrics.jsonl").write_text(f'{{"token": "{SECRET}"}}\n')
    return path


def _survivors(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def test_model_code_is_confined(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("BPO_PROBE_SECRET", SECRET)  # the training process's environment
    run = lambda code, timeout_s=20.0: run_python(code, timeout_s=timeout_s, run_dir=run_dir)  # noqa: E731
    assert run("print(6 * 7)") == "42"

    # the run's files: not there, by absolute path or relative to where the tool runs
    assert run(f"print(open({str(run_dir / 'metrics.jsonl')!r}).read())").startswith("FileNotFoundError")
    assert run("import os; print(os.getcwd(), sorted(os.listdir('.')))") == "/tmp []"
    # the environment: its own holds PATH, HOME and LANG only; its parent's and the trainer's are out of sight
    assert run("import os; print(sorted(os.environ))") == "['HOME', 'LANG', 'PATH']"
    for code in ("import os; print(open(f'/proc/{os.getppid()}/environ').read())",
                 f"print(open('/proc/{os.getpid()}/environ').read())", "print(open('/proc/1/environ').read())"):
        answer = run(code)
        assert SECRET not in answer and ("Error" in answer or "BPO_PROBE_SECRET" not in answer), (code, answer)
    assert SECRET not in run("import os; print([open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') "
                             "if p.isdigit()])")
    # writes: /tmp only, and that /tmp is the call's own (nothing reaches the host's)
    outside = [ROOT / "sandbox-probe.txt", tmp_path / "sandbox-probe.txt", run_dir / "sandbox-probe.txt"]
    for path in outside:
        answer = run(f"open({str(path)!r}, 'w').write('x')")
        assert re.match(r"(OSError: \[Errno 30\] Read-only file system|FileNotFoundError)", answer), (path, answer)
        assert not path.exists()
    note = f"/tmp/bpo-sandbox-note-{os.getpid()}"
    assert run(f"open({note!r}, 'w').write('kept'); print(open({note!r}).read())") == "kept"
    assert not Path(note).exists()
    # the network: a listener on 127.0.0.1 is not reached
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        answer = run(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)")
        assert answer.startswith("OSError: [Errno 101] Network is unreachable"), answer
        with pytest.raises(socket.timeout):
            listener.accept()
    # memory, processes, time, a process left behind in its own session
    assert run("x = bytearray(3 << 30)") == "MemoryError"
    forks = ("import os, time\nfor _ in range(64):\n    if os.fork() == 0:\n        time.sleep(300.4711)\n"
             "        os._exit(0)\nprint('forked')")
    assert run(forks) == "RuntimeError: the code started more than 16 processes"
    start = time.monotonic()
    assert run("import time; time.sleep(300.4712)", timeout_s=2.0) == "TimeoutError: the code ran past 2 s"
    assert time.monotonic() - start < 10
    left = "import subprocess; subprocess.Popen(['sleep', '300.4713'], start_new_session=True); print('left')"
    assert run(left) == "left"
    time.sleep(0.5)
    assert _survivors("300.471") == [] and _survivors("sandbox_init.py") == []
    # a file larger than the limit: cut (SIGXFSZ), not written on
    assert run("open('/tmp/big', 'wb').write(b'0' * (100 << 20))") != ""


def test_a_host_that_cannot_confine_is_refused_before_the_run_unless_told_not_to(tmp_path, monkeypatch, capsys):
    from bpo_megatron.cli import main
    from bpo_megatron.loop import rl_loop

    monkeypatch.setattr(rl_loop, "execute", lambda *a, **k: (_ for _ in ()).throw(AssertionError("the run started")))
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)  # no unshare here
    with pytest.raises(SandboxUnavailable, match=r"cannot be confined on this host \(the 'unshare' program "
                                                 r"\(util-linux\) is not installed\).*rollout.agent.sandbox.mode=none"):
        check_confinement(SandboxConfig())
    args = ["train", DEMO, "rollout.agent.name=python_tool", "rollout.agent.call_token=$", f"logging.run_dir={tmp_path}/r"]
    assert main([*args, "--check"]) == 2
    err = capsys.readouterr().err
    assert "bpo-megatron train: rollout.agent.name=python_tool: model-written code cannot be confined on this host" in err
    # the opt-out is explicit, and said
    assert main([*args, "rollout.agent.sandbox.mode=none", "--check"]) == 0
    assert "rollout.agent.sandbox.mode=none: model-written code runs unconfined" in capsys.readouterr().out
    assert run_python("import os; print(os.environ.get('HOME') != '/tmp')", timeout_s=20,
                      sandbox=SandboxConfig(mode="none")) == "True"
    assert not (tmp_path / "r").exists()


def test_sandbox_settings_are_checked():
    with pytest.raises(ValueError, match="rollout.agent.sandbox.processes must be >= 1, got 0"):
        SandboxConfig(processes=0)
    assert os.path.isfile(sandbox.INIT)
