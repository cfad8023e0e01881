"""A full disk names itself: a run whose run directory fills up mid-save stops with exit 1 saying
"no space left" on that directory and how to resume, the checkpoint before it kept; with space
freed, the same command resumes from that checkpoint and finishes. The run directory is a small
tmpfs mounted in a user and mount namespace of the test's own (unshare), so no real disk fills."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")


@pytest.mark.slow  # two demo runs / a demo run killed (≈ 50–95 s): CI time; run with -m slow
@pytest.mark.timeout(400)
def test_a_full_disk_stops_the_run_with_its_name_and_the_run_resumes_once_space_is_freed(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux) here")
    mount = tmp_path / "disk"
    mount.mkdir()
    run_dir = mount / "run"
    train = shlex.join([sys.executable, "-m", "bpo_megatron.cli", "train", DEMO, "train.steps=2",
                        "train.sft_warmup_steps=0", "eval.every=0", "checkpoint.every=1", "checkpoint.keep_last=1",
                        "logging.tensorboard=false", f"logging.run_dir={run_dir}"])
    newest = shlex.join([sys.executable, "-c", "import sys; from bpo_megatron.trainer.checkpoint import select; "
                         f"print('newest', select(sys.argv[1]).path.name)", str(run_dir / "checkpoints")])
    # 3.2 MB: the initial weights and one checkpoint fit, a second one beside it does not
    script = (f"mount -t tmpfs -o size=3200k tmpfs {shlex.quote(str(mount))} || exit 77; "
              f"{train}; echo status $?; {newest}; "
              f"mount -o remount,size=64m {shlex.quote(str(mount))}; {train}; echo status $?")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          capture_output=True, text=True, timeout=380, cwd=ROOT)
    if done.returncode == 77:
        pytest.skip(f"this host lets no user namespace mount a tmpfs: {done.stderr.strip()[-200:]}")
    out = done.stdout + done.stderr
    first, second = out.split("status ")[1:3]
    assert first.startswith("1\n"), out[-3000:]
    assert (f"bpo-megatron train: no space left on the device holding {run_dir / 'checkpoints'}; what was being written is "
            "incomplete and never read") in out
    assert f"Free space there, then resume the run with: bpo-megatron train {DEMO} train.steps=2" in out
    assert "newest step-00000001" in out  # the checkpoint before the failed save, intact (checksums verified)
    assert "resumed from step 1" in out and second.startswith("0\n"), out[-3000:]
    assert "done: 2 steps" in out
