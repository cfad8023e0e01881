"""The bpo-megatron command line: the command registry and refusals before any work."""

import csv
from pathlib import Path

import pytest

from bpo_megatron.cli import COMMANDS, main

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml")


def test_commands_are_registered(capsys):
    assert {"bench", "convert", "train", "eval", "plot", "compare"} <= set(COMMANDS)
    assert main(["--help"]) == 0
    assert "train" in capsys.readouterr().out


def test_train_refuses_a_bad_config_naming_the_field(capsys):
    assert main(["train", DEMO, "loss.name=ppo"]) == 2
    assert "PolicyLossConfig.name='ppo' is unknown" in capsys.readouterr().err
    assert main(["train", DEMO, "parallel.ep=8", "cluster.trainer_ranks=8"]) == 2
    assert "parallel.ep=8 must divide the model's 4 experts" in capsys.readouterr().err


def test_plot_of_a_directory_without_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_compare_refuses_a_bad_sweep(capsys):
    assert main(["compare", DEMO, "--sweep", "loss.bpo_eps"]) == 2
    assert "must look like section.key=v1,v2" in capsys.readouterr().err


def test_compare_summarises_runs_into_the_papers_table(tmp_path, capsys):
    """One number per run (the mean of its last 3 evaluations by default, its peak with --stat
    peak), mean ± sample standard deviation over seeds, each method against the first paired by
    seed with a t-interval, the runs written to runs.csv, and the overlaid curves."""
    from bpo_megatron.observability.metrics import MetricsWriter

    curves = {  # (loss, seed) -> evaluation accuracy every 10 steps
        ("bpo", 1): [0.30, 0.50, 0.40], ("bpo", 2): [0.30, 0.60, 0.60], ("bpo", 3): [0.30, 0.40, 0.20],
        ("grpo", 1): [0.30, 0.40, 0.40], ("grpo", 2): [0.30, 0.30, 0.30], ("grpo", 3): [0.30, 0.50, 0.50],
    }
    for (loss, seed), accuracy in curves.items():
        writer = MetricsWriter(tmp_path / f"{loss}-s{seed}", tensorboard=False)
        for index, value in enumerate(accuracy):
            writer.write(10 * index, {"reward_mean": value, "eval/mean_avg@4": value})
        writer.close()
    assert main(["compare", DEMO, "--losses", "bpo,grpo", "--seeds", "1,2,3", "--out", str(tmp_path),
                 "--summarise-only"]) == 0
    table = (tmp_path / "results.md").read_text()
    # BPO's runs average 0.4, 0.5, 0.3 over their 3 evaluations -> 40.0 ± 10.0
    assert "| BPO | 3 | 40.0 ± 10.0 | reference | | | |" in table
    assert "over seeds 1, 2, 3" in table and "last 3 evaluations (steps 0, 10, 20)" in table
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "runs.csv").is_file()
    assert table.strip() in capsys.readouterr().out
    assert main(["compare", DEMO, "--losses", "bpo,grpo", "--seeds", "1,2,3", "--out", str(tmp_path),
                 "--summarise-only", "--stat", "peak"]) == 0
    table = (tmp_path / "results.md").read_text()
    # peaks: BPO 0.5, 0.6, 0.4; GRPO 0.4, 0.3, 0.5 -> differences -0.1, -0.3, +0.1: mean -10 points,
    # sd 20, t(0.975, 2) = 4.302653 -> ±49.7 points; t = -0.866 on 2 degrees of freedom: p = 0.478
    assert "| BPO | 3 | 50.0 ± 10.0 | reference | | | |" in table
    assert "| GRPO-ClipHigher | 3 | 40.0 ± 10.0 | -10.0 [-59.7, +39.7] | 3 | 0.478 | 0.478 |" in table


def test_compare_grows_a_staleness_axis_with_paired_differences(tmp_path, capsys):
    """--staleness: one table per train.async.max_staleness, each method's paired per-seed
    difference from the first method's with its t-interval; GRPO + TIS is one of the methods,
    decoupled PPO at k > 0 (said under the tables)."""
    from bpo_megatron.observability.metrics import MetricsWriter

    peaks = {"bpo": (0.5, 0.6, 0.4), "grpo_tis": (0.4, 0.5, 0.3)}  # GRPO + TIS exactly 10 points lower
    for k in (0, 1):
        for loss, values in peaks.items():
            for seed, peak in zip((1, 2, 3), values):
                writer = MetricsWriter(tmp_path / f"{loss}-k{k}-s{seed}", tensorboard=False)
                for index, value in enumerate((0.1, peak - 0.05 * k, 0.2)):
                    writer.write(10 * index, {"reward_mean": value, "eval/mean_avg@4": value})
                writer.close()
    assert main(["compare", DEMO, "--losses", "bpo,grpo_tis", "--staleness", "0,1", "--seeds", "1,2,3",
                 "--out", str(tmp_path), "--summarise-only", "--stat", "peak"]) == 0
    table = (tmp_path / "results.md").read_text()
    assert "### train.async.max_staleness = 0" in table and "### train.async.max_staleness = 1" in table
    assert "| BPO | 3 | 50.0 ± 10.0 | reference |" in table and "| BPO | 3 | 45.0 ± 10.0 | reference |" in table
    assert table.count("| GRPO + TIS | 3 | ") == 2 and table.count(" | -10.0 [-10.0, -10.0] | 3 | < 0.001 |") == 2
    assert "Holm's method over the 2 contrasts of these tables" in table
    assert "GRPO + TIS at train.async.max_staleness > 0: π_old is the trainer's weights" in table


def test_compare_staleness_runs_are_checked_with_engines_apart(tmp_path, capsys):
    assert main(["compare", DEMO, "--losses", "bpo,grpo_tis", "--staleness", "0,2", "--seeds", "1",
                 "--out", str(tmp_path), "--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 4 - 1  # one summary per run: 2 methods × 2 staleness values
    assert not any(tmp_path.iterdir())  # a check writes nothing


# two loop runs (CI time): the table from runs' records and its staleness axis are the compare tests
# above; the asynchronous loop, test_loop_e2e's one-step-off run
@pytest.mark.ci
@pytest.mark.timeout(300)
def test_compare_runs_every_method_then_summarises(tmp_path, capsys, ray_session):
    """Not only the summary: the runs themselves (2 methods × 1 staleness × 1 seed, 1 step each),
    then the table from what they wrote."""
    small = ["train.steps=1", "train.prompts_per_step=4", "rollout.group_size=4", "train.minibatches_per_step=2",
             "trainer.micro_batch_size=4", "train.sft_warmup_steps=0", "eval.limit=8", "eval.k=2", "eval.every=1",
             "checkpoint.every=0", "logging.tensorboard=false"]
    assert main(["compare", DEMO, *small, "--losses", "bpo,grpo", "--staleness", "1", "--seeds", "1",
                 "--out", str(tmp_path), "--window", "2"]) == 0  # 2 evaluations: steps 0 and 1
    table = (tmp_path / "results.md").read_text()
    assert "### train.async.max_staleness = 1" in table and "| GRPO-ClipHigher |" in table
    assert (tmp_path / "bpo-k1-s1" / "metrics.jsonl").is_file() and (tmp_path / "grpo-k1-s1" / "metrics.jsonl").is_file()
    with (tmp_path / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["step"], r["total"], r["trained_steps"]) for r in rows] == [
        ("bpo-k1-s1", "0", "16", "0"), ("bpo-k1-s1", "1", "16", "1"),  # 8 questions × 2 responses
        ("grpo-k1-s1", "0", "16", "0"), ("grpo-k1-s1", "1", "16", "1")]
    assert rows[1]["clip_frac"] != "" and rows[1]["async/staleness_mean"] != ""
