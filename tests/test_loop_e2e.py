"""The RL loop end to end through Ray: EP=2 trainer with R3, embedded engine, resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from bpo_megatron.experiment import load_experiment
from bpo_megatron.observability.metrics import read_metrics

DEMO = Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml"
SMALL = ["train.prompts_per_step=4", "rollout.group_size=4", "train.minibatches_per_step=2", "train.micro_batch_size=4",
         "train.sft_warmup_steps=2", "train.sft_batch_size=8", "eval.every=1", "eval.limit=8", "eval.k=2",
         "checkpoint.every=1", "checkpoint.keep_last=2", "train.verify_weight_sync=true"]


def _run(run_dir: Path, steps: int) -> tuple[dict, list[str]]:
    from bpo_megatron.loop.rl_loop import run

    lines: list[str] = []
    cfg = load_experiment(DEMO, [*SMALL, f"train.steps={steps}", f"logging.run_dir={run_dir}"])
    return run(cfg, echo=lines.append), lines


def test_a_few_steps_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    result, lines = _run(run_dir, steps=2)
    assert result["step"] == 2
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records if "reward_mean" in r]
    assert steps == [1, 2]
    last = [r for r in records if r["step"] == 2 and "reward_mean" in r][0]
    for key in ("loss", "clip_frac", "grad_norm", "routing_agreement", "abs_logp_diff_mean", "sync_bytes",
                "eval/mean_avg@2", "time/rollout_s"):
        assert key in last, key
    assert last["routing_agreement"] == 1.0  # the trainer routes like the engine on the same weights
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000002"
    assert (run_dir / "curves.png").is_file() and (run_dir / "config.yaml").is_file()
    assert any(line.startswith("[####################] step 2/2 | reward") for line in lines)

    result, lines = _run(run_dir, steps=3)  # killed after step 2, started again with a longer budget
    assert lines[0] == f"resumed from step 2 ({run_dir / 'checkpoints'})"
    assert not any(line.startswith("sft") for line in lines), "the warm start is not repeated"
    steps = [r["step"] for r in read_metrics(run_dir) if "reward_mean" in r]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path):
    _run(tmp_path / "a", steps=2)
    _run(tmp_path / "a", steps=3)
    _run(tmp_path / "b", steps=3)
    resumed = [r for r in read_metrics(tmp_path / "a") if r["step"] == 3 and "reward_mean" in r][0]
    straight = [r for r in read_metrics(tmp_path / "b") if r["step"] == 3 and "reward_mean" in r][0]
    for key in ("reward_mean", "loss", "grad_norm", "clip_frac", "eval/mean_avg@2"):
        assert resumed[key] == straight[key], key
