"""The bpo-megatron command line: the command registry and refusals before any work."""

from pathlib import Path

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
