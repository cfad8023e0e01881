"""No process of a run outlives its driver: a driver killed with SIGKILL mid-run (it cannot shut
Ray down) leaves its reaper, which ends everything the driver had started — Ray's GCS, raylet,
workers and agents — within its grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")


def _alive(known: dict[int, float]) -> list[str]:
    left = []
    for pid, started in known.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(process.cmdline())[:120]}")
        except psutil.Error:
            continue
    return left


@pytest.mark.slow  # two demo runs / a demo run killed (≈ 50–95 s): CI time; run with -m slow
@pytest.mark.timeout(300)
def test_a_killed_driver_leaves_no_process_behind(tmp_path):
    driver = subprocess.Popen([sys.executable, "-m", "bpo_megatron.cli", "train", DEMO, "train.steps=200",
                               "train.sft_warmup_steps=0", "eval.every=0", f"logging.run_dir={tmp_path / 'run'}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    known: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 240
        for line in driver.stdout:  # until the first RL step: Ray, trainer and engine all run
            if " step 1/200" in line or line.startswith("step 1/200"):
                break
            assert time.monotonic() < deadline, "no step within 240 s"
        else:
            pytest.fail(f"the run ended before its first step (status {driver.wait()})")
        parent = psutil.Process(driver.pid)
        for child in parent.children(recursive=True):
            known[child.pid] = child.create_time()
        commands = " ".join(" ".join(psutil.Process(pid).cmdline()) for pid in known if psutil.pid_exists(pid))
        assert "raylet" in commands and "gcs_server" in commands and "bpo_megatron.orchestration.reaper" in commands
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _alive(known) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _alive(known) == []
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        for pid in known:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass


def test_a_run_that_stops_in_order_ends_its_reaper():
    # in a process of its own: the test session's shared Ray (and its reaper) must stay up
    script = (
        "from bpo_megatron.orchestration import cluster\n"
        "cluster.start_reaper()\n"
        "(reaper,) = cluster._reapers\n"
        "assert reaper.poll() is None, 'the reaper ended on its own'\n"
        "cluster.stop_ray()\n"
        "assert reaper.poll() is not None and cluster._reapers == [], 'stop_ray left the reaper running'\n"
        "print('reaper', reaper.pid, 'ended with', reaper.returncode)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ended with" in done.stdout
