"""The bpo-megatron command line: the command registry and refusals before any work."""

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
    """Peak (the best evaluation, the paper's checkpoint rule) and final accuracy, mean ± sample
    standard deviation over seeds, the best peak in bold, and the overlaid curves."""
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
    # BPO peaks 0.5, 0.6, 0.4 -> 50.0 ± 10.0; finals 0.4, 0.6, 0.2 -> 40.0 ± 20.0
    assert "| BPO | **50.0 ± 10.0** | 40.0 ± 20.0 |" in table
    assert "| GRPO-ClipHigher | 40.0 ± 10.0 | 40.0 ± 10.0 |" in table  # peaks 0.4, 0.3, 0.5
    assert "over seeds 1, 2, 3" in table
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert table.strip() in capsys.readouterr().out


def test_paired_bootstrap_interval_of_the_mean_difference():
    from bpo_megatron.commands.compare import paired_delta

    # equal differences: the interval collapses onto them
    assert paired_delta([0.5, 0.6, 0.7], [0.4, 0.5, 0.6]) == pytest.approx((0.1, 0.1, 0.1))
    values, reference = [0.50, 0.42, 0.61, 0.38, 0.55], [0.45, 0.44, 0.50, 0.36, 0.49]
    mean, low, high = paired_delta(values, reference)
    deltas = [v - r for v, r in zip(values, reference)]
    assert mean == pytest.approx(sum(deltas) / 5)
    assert min(deltas) <= low < mean < high <= max(deltas)
    assert paired_delta(values, reference) == (mean, low, high)  # a fixed resampling seed
    with pytest.raises(ValueError):
        paired_delta([0.1, 0.2], [0.1])


def test_compare_grows_a_staleness_axis_with_paired_differences(tmp_path, capsys):
    """--staleness: one table per train.async.max_staleness, then each method's paired per-seed
    difference of peak accuracy from the first method's with its bootstrap interval; GRPO + TIS
    is one of the methods."""
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
                 "--out", str(tmp_path), "--summarise-only"]) == 0
    table = (tmp_path / "results.md").read_text()
    assert "### train.async.max_staleness = 0" in table and "### train.async.max_staleness = 1" in table
    assert "| BPO | **50.0 ± 10.0** | 20.0 ± 0.0 |" in table and "| BPO | **45.0 ± 10.0** | 20.0 ± 0.0 |" in table
    assert "| GRPO + TIS | -10.0 [-10.0, -10.0] | -10.0 [-10.0, -10.0] |" in table


def test_compare_staleness_runs_are_checked_with_engines_apart(tmp_path, capsys):
    assert main(["compare", DEMO, "--losses", "bpo,grpo_tis", "--staleness", "0,2", "--seeds", "1",
                 "--out", str(tmp_path), "--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 4 - 1  # one summary per run: 2 methods × 2 staleness values
    assert not any(tmp_path.iterdir())  # a check writes nothing


@pytest.mark.timeout(300)
def test_compare_runs_every_method_then_summarises(tmp_path, capsys, ray_session):
    """Not only the summary: the runs themselves (2 methods × 1 staleness × 1 seed, 1 step each),
    then the table from what they wrote."""
    small = ["train.steps=1", "train.prompts_per_step=4", "rollout.group_size=4", "train.minibatches_per_step=2",
             "train.micro_batch_size=4", "train.sft_warmup_steps=0", "eval.limit=8", "eval.k=2", "eval.every=1",
             "checkpoint.every=0", "logging.tensorboard=false"]
    assert main(["compare", DEMO, *small, "--losses", "bpo,grpo", "--staleness", "1", "--seeds", "1",
                 "--out", str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    assert "### train.async.max_staleness = 1" in table and "| GRPO-ClipHigher |" in table
    assert (tmp_path / "bpo-k1-s1" / "metrics.jsonl").is_file() and (tmp_path / "grpo-k1-s1" / "metrics.jsonl").is_file()
