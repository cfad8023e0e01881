"""Model-written code runs confined (``rollout.agent.sandbox``): probes run as the Python tool's
code try what a hostile or careless model could — read the user's secrets, another run's
checkpoints or the training data, write outside its temporary directory, reach the network or a
host's UNIX socket, open namespaces, mount, trace, exhaust memory, threads or the driver's memory
with its output, outlast its timeout, leave System V objects behind — and each is refused, cut or
killed, with nothing of it outliving the call. A host that cannot confine is refused before a run
starts, naming why."""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bpo_megatron.rollout.agents import sandbox, sandbox_init
from bpo_megatron.rollout.agents.python_tool import MAX_OUTPUT_CHARS, run_python
from bpo_megatron.rollout.agents.sandbox import SandboxConfig, SandboxUnavailable, check_confinement

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")
SECRET = "s3cr3t-token-4711"
EPERM = 1


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """Files of the training user the code must not read, outside /tmp where the host has
    /var/tmp (the sandbox's own /tmp hides the host's anyway): a home with a .bashrc exporting a
    token and a shell history, another run's checkpoint, the training data, this run's directory."""
    base = Path(tempfile.mkdtemp(prefix="bpo-sandbox-", dir="/var/tmp")) if os.access("/var/tmp", os.W_OK) \
        else tmp_path_factory.mktemp("host")
    files = {"bashrc": base / "home" / ".bashrc", "history": base / "home" / ".bash_history",
             "checkpoint": base / "runs" / "other" / "checkpoints" / "step_4" / "model.safetensors",
             "data": base / "data" / "train.jsonl", "run": base / "runs" / "this" / "metrics.jsonl"}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"export HF_TOKEN={SECRET}\n")
    yield base, files
    shutil.rmtree(base)


def _survivors(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def test_model_code_reads_only_the_python_installation_and_its_own_tmp(confinable, host, monkeypatch):
    base, files = host
    monkeypatch.setenv("HOME", str(base / "home"))
    monkeypatch.setenv("BPO_PROBE_SECRET", SECRET)  # the training process's environment
    run_dir = files["run"].parent
    unconfined = SandboxConfig(mode="none")
    for path in files.values():  # the training user can read each: the probes below are meaningful
        assert SECRET in run_python(f"print(open({str(path)!r}).read())", timeout_s=20, sandbox=unconfined)
        answer = run_python(f"print(open({str(path)!r}).read())", timeout_s=20, run_dir=run_dir)
        assert answer.startswith("FileNotFoundError"), (path, answer)
    # what is there at all: the system's directories, /tmp, /proc, /dev, a few /etc entries, and the
    # directories on the way to the Python installation
    allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "tmp"}
    python = {Path(p).resolve().parts[1] for p in (sys.executable, sys.prefix, sys.base_prefix)}
    top = set(run_python("import os; print(' '.join(os.listdir('/')))", timeout_s=20).split())
    assert {"usr", "tmp", "proc", "dev"} <= top <= allowed | python | {Path(sys.executable).parts[1]}
    assert run_python("import os; print(sorted(os.listdir('/etc')))", timeout_s=20) in (
        "['ld.so.cache', 'localtime']", "['ld.so.cache']", "['localtime']", "[]")
    assert run_python("import os; print(os.getcwd(), os.environ['HOME'], sorted(os.environ))", timeout_s=20) == \
        "/tmp /tmp ['HOME', 'LANG', 'PATH']"
    # the installation is there, read-only
    assert run_python("import json, sys; print(sys.prefix)", timeout_s=20) == sys.prefix
    answer = run_python(f"open({str(Path(sys.prefix) / 'sandbox-probe.txt')!r}, 'w')", timeout_s=20)
    assert answer.startswith("OSError: [Errno 30] Read-only file system"), answer
    # no process of the host, and process 1's command line and environment say nothing of the run
    for code in ("print(open('/proc/1/cmdline').read())",
                 "import os; print([open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()])",
                 "print(open('/proc/1/environ').read())", "import os; print(os.environ)"):
        answer = run_python(code, timeout_s=20, run_dir=run_dir)
        assert str(run_dir) not in answer and str(base) not in answer and SECRET not in answer, (code, answer)
    assert run_python("print(open('/proc/1/environ').read())", timeout_s=20).startswith("PermissionError")
    # a run directory inside what the code may read is refused, not hidden: the view has no exceptions
    inside = Path(sys.prefix) / "runs" / "r1"
    with pytest.raises(SandboxUnavailable, match=rf"the run directory {re.escape(str(inside.resolve()))} lies inside "
                                                 rf"{re.escape(str(Path(sys.prefix).resolve()))}, which model-written "
                                                 r"code may read .*choose logging.run_dir elsewhere"):
        run_python("print(1)", timeout_s=20, run_dir=inside)


def test_writes_go_to_its_own_tmp_only(confinable, host):
    base, files = host
    for path in (ROOT / "sandbox-probe.txt", base / "sandbox-probe.txt", Path("/proc/sys/kernel/hostname")):
        answer = run_python(f"open({str(path)!r}, 'w').write('x')", timeout_s=20)
        assert re.match(r"(OSError: \[Errno 30\] Read-only file system|FileNotFoundError)", answer), (path, answer)
    assert not (ROOT / "sandbox-probe.txt").exists() and not (base / "sandbox-probe.txt").exists()
    note = f"/tmp/bpo-sandbox-note-{os.getpid()}"
    code = (f"import math, pathlib; pathlib.Path({note!r}).write_text(str(math.factorial(20))); "
            f"print(int(open({note!r}).read()) // math.comb(20, 10), sorted(__import__('os').listdir('/tmp')))")
    assert run_python(code, timeout_s=20) == f"13168189440000 ['{Path(note).name}']"  # 20! / C(20, 10)
    assert not Path(note).exists()
    # a file larger than the file-size limit (64 MB; Python ignores SIGXFSZ, so the write fails)
    assert run_python("open('/tmp/big', 'wb').write(b'0' * (100 << 20))", timeout_s=20) == \
        "OSError: [Errno 27] File too large"


def test_no_socket_reaches_the_host(confinable, host):
    base, _ = host
    path = str(base / "host.sock")
    abstract = f"\0bpo-sandbox-probe-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as unix, socket.socket(socket.AF_UNIX) as hidden, socket.socket() as tcp:
        for listener, address in ((unix, path), (hidden, abstract), (tcp, ("127.0.0.1", 0))):
            listener.bind(address)
            listener.listen(1)
            listener.settimeout(0.2)
        port = tcp.getsockname()[1]
        assert run_python(f"import socket; socket.socket(socket.AF_UNIX).connect({path!r})", timeout_s=20) == \
            f"FileNotFoundError: [Errno 2] No such file or directory"
        assert run_python(f"import socket; socket.socket(socket.AF_UNIX).connect({abstract!r})", timeout_s=20) == \
            "ConnectionRefusedError: [Errno 111] Connection refused"
        answer = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)", timeout_s=20)
        assert answer.startswith("OSError: [Errno 101] Network is unreachable"), answer
        for listener in (unix, hidden, tcp):
            with pytest.raises(socket.timeout):
                listener.accept()


def test_no_new_namespaces_mounts_or_ptrace(confinable):
    clone = {"x86_64": 56, "aarch64": 220}.get(platform.machine())
    if clone is None:
        pytest.skip(f"the clone system call's number is not listed for {platform.machine()}")
    calls = {"unshare(CLONE_NEWUSER)": "libc.unshare(0x10000000)",
             "unshare(CLONE_NEWNET)": "libc.unshare(0x40000000)",
             "clone(CLONE_NEWUSER | SIGCHLD)": f"libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0)",
             "clone(CLONE_NEWPID | SIGCHLD)": f"libc.syscall({clone}, 0x20000000 | 17, 0, 0, 0, 0)",
             "setns": "libc.setns(os.open('/proc/self/ns/user', os.O_RDONLY), 0)",
             "mount": "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
             "umount": "libc.umount2(b'/usr', 2)",
             "ptrace(PTRACE_TRACEME)": "libc.ptrace(0, 0, 0, 0)",
             "fork": "libc.fork()"}
    code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n" + "".join(
        f"print({name!r}, {call}, ctypes.get_errno())\n" for name, call in calls.items())
    assert run_python(code, timeout_s=20).splitlines() == [f"{name} -1 {EPERM}" for name in calls]


def test_one_memory_bound_for_the_whole_call_and_a_bound_on_threads(confinable):
    small = SandboxConfig(memory_mb=256)
    children = ("import os\nfor _ in range(5):\n    if os.fork() == 0:\n        x = bytearray(200 << 20)\n"
                "        os._exit(0)\nprint('forked')")
    assert run_python(children, timeout_s=20, sandbox=small) == "PermissionError: [Errno 1] Operation not permitted"
    threads = ("import threading\nkept = []\ndef take():\n    kept.append(bytearray(200 << 20))\n"
               "workers = [threading.Thread(target=take) for _ in range(5)]\n[w.start() for w in workers]\n"
               "[w.join() for w in workers]\nprint(len(kept))")
    assert run_python(threads, timeout_s=20, sandbox=small) in ("0", "1")  # 2 x 200 MB > 256 MB: not both
    assert run_python("x = bytearray(200 << 20); print(len(x) >> 20)", timeout_s=20, sandbox=small) == "200"
    assert run_python("x = bytearray(300 << 20)", timeout_s=20, sandbox=small) == "MemoryError"
    # 1,000 threads: the task bound stops them at `threads`, the main one included (small stacks and a
    # large memory bound, so that the address space is not what stops them)
    many = SandboxConfig(memory_mb=4096, threads=48)
    code = ("import threading, time\nthreading.stack_size(1 << 16)\nstarted = 0\ntry:\n"
            "    for _ in range(1000):\n        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()\n"
            "        started += 1\nexcept RuntimeError as exc:\n    print(started, exc)")
    assert run_python(code, timeout_s=20, sandbox=many) == f"{many.threads - 1} can't start new thread"


def test_system_v_objects_end_with_the_call(confinable):
    key = 0x4711_0000 + os.getpid() % 0xFFFF
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"shm = libc.shmget({key}, 1 << 20, 0o1600)\nqueue = libc.msgget({key + 1}, 0o1600)\n"
            f"semaphores = libc.semget({key + 2}, 1, 0o1600)\n"
            "print(shm >= 0, queue >= 0, semaphores >= 0, ctypes.get_errno())")
    made = run_python(code, timeout_s=20)
    # made inside, or (where the kernel does not let the namespace bound its System V memory) refused
    assert made in ("True True True 0", f"False False True {EPERM}"), made

    def listed(kind: str) -> list[str]:
        with open(f"/proc/sysvipc/{kind}") as f:
            return [line for line in f.readlines()[1:] if int(line.split()[0]) in (key, key + 1, key + 2)]

    found = {kind: listed(kind) for kind in ("shm", "msg", "sem")}
    for kind, lines in found.items():  # whatever the outcome, none stays on this host
        for line in lines:
            subprocess.run(["ipcrm", f"-{kind[0]}", line.split()[1]], check=False)
    assert found == {"shm": [], "msg": [], "sem": []}


def _resident_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_the_driver_reads_the_output_with_a_cap(confinable):
    settings = SandboxConfig()
    cap_kb = settings.output_kb
    code = "import sys\nfor _ in range(400):\n    sys.stdout.write('x' * (1 << 20))\nsys.stdout.flush()"
    run_python("print(1)", timeout_s=20)  # the readers' code and buffers once, before measuring
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident size (VmHWM) to the present one
    before = _resident_kb("VmRSS")
    answer = run_python(code, timeout_s=60)
    growth_kb = _resident_kb("VmHWM") - before
    assert answer == "x" * MAX_OUTPUT_CHARS + f"... (cut: the code printed {400 << 20} bytes)"
    assert growth_kb <= 2 * cap_kb + 1024, growth_kb  # stdout's head, stderr's tail, 1 MB of the interpreter's noise
    # an endless print: cut at the timeout, the driver's memory as bounded
    assert run_python("while True: print('y' * 4096)", timeout_s=2) == "TimeoutError: the code ran past 2 s"
    assert _resident_kb("VmHWM") - before <= 2 * cap_kb + 1024
    # stderr keeps its tail: the error's last line survives any amount of output before it
    assert run_python("import sys\nfor _ in range(100):\n    sys.stderr.write('z' * (1 << 20))\n1 / 0",
                      timeout_s=20) == "ZeroDivisionError: division by zero"


def test_time_bound_and_nothing_outlives_the_call(confinable):
    start = time.monotonic()
    assert run_python("import time; time.sleep(300.4712)", timeout_s=2.0) == "TimeoutError: the code ran past 2 s"
    assert time.monotonic() - start < 10
    assert run_python("import subprocess; subprocess.Popen(['sleep', '300.4713'], start_new_session=True)",
                      timeout_s=20) == "PermissionError: [Errno 1] Operation not permitted"
    time.sleep(0.5)
    assert _survivors("300.471") == [] and _survivors("sandbox_init.py") == []


def test_a_python_installation_under_tmp_runs_confined(confinable, tmp_path):
    """A virtual environment under /tmp (a fresh clone's) is visible at its place inside, though the
    sandbox's /tmp is its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    import pyseccomp
    (site / "driver.pth").write_text(f"{ROOT}\n{Path(pyseccomp.__file__).parent}\n")
    code = ("from bpo_megatron.rollout.agents.python_tool import run_python; "
            "print(run_python('import sys, os; print(sys.prefix, sorted(os.listdir(\"/tmp\")))', timeout_s=20))")
    done = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == f"{venv} ['{tmp_path.parts[2]}']", done.stderr[-2000:]


def test_a_host_that_cannot_confine_is_refused_before_the_run_unless_told_not_to(tmp_path, monkeypatch, capsys):
    from bpo_megatron.cli import main
    from bpo_megatron.loop import rl_loop

    monkeypatch.setattr(rl_loop, "execute", lambda *a, **k: (_ for _ in ()).throw(AssertionError("the run started")))
    with monkeypatch.context() as patched:  # user namespaces refused: unshare's own error, and what to allow
        fake = tmp_path / "unshare"
        fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
        fake.chmod(0o755)
        patched.setattr(sandbox.shutil, "which", lambda name: str(fake))
        with pytest.raises(SandboxUnavailable, match=r"cannot be confined on this host \(unshare: unshare failed: "
                                                     r"Operation not permitted: this host does not let the training "
                                                     r"user create user namespaces; allow them .*mode=none"):
            check_confinement(SandboxConfig())
    with monkeypatch.context() as patched:  # no way to bound threads: said so, with the kernel and the user
        patched.setattr(sandbox_init, "kernel_at_least", lambda major, minor: False)
        patched.setattr(sandbox.os, "getuid", lambda: 0)
        with pytest.raises(SandboxUnavailable, match=r"the code's threads cannot be bounded: Linux .* keeps no "
                                                     r"pid_max per PID namespace \(6.14\+\) and the training user is "
                                                     r"root, for whom the kernel does not enforce RLIMIT_NPROC"):
            check_confinement(SandboxConfig())
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
    assert run_python("print('w' * 5000)", timeout_s=20, sandbox=SandboxConfig(mode="none", output_kb=1)) == \
        "w" * 1024 + "... (cut: the code printed 5001 bytes)"  # the driver kept 1 kB
    assert not (tmp_path / "r").exists()


def test_sandbox_settings_are_checked():
    with pytest.raises(ValueError, match="rollout.agent.sandbox.threads must be >= 1, got 0"):
        SandboxConfig(threads=0)
    with pytest.raises(ValueError, match="rollout.agent.sandbox.output_kb must be >= 1, got 0"):
        SandboxConfig(output_kb=0)
    assert os.path.isfile(sandbox.INIT)
