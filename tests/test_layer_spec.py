"""The trainer's layer spec (``model.layer_spec``): the local spec is the supported path on CPUs and
GPU clusters, what every shipped recipe resolves to and what `plan`, `train --check` and the docs
state; transformer-engine's is an optional accelerator, taken only when named, refused where it
cannot run, and trained by the GPU kit's trainer_step where it can."""

from __future__ import annotations

from pathlib import Path

import pytest

from bpo_megatron.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


def test_every_shipped_recipe_resolves_to_the_local_spec():
    assert len(RECIPES) >= 10
    specs = {path.stem: load_experiment(path, check_model=False).model.options.layer_spec for path in RECIPES}
    assert set(specs.values()) == {"local"}, specs


def test_the_docs_state_the_local_spec_as_the_supported_path():
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide[guide.index("### The trainer's layer spec"):]
    section = section[:section.index("\n#", 1)]
    assert "`model.layer_spec: local` (the default) is the supported path" in section
    assert "`model.layer_spec: transformer_engine`" in section and "trainer_step" in section
    reference = (ROOT / "docs" / "config-reference.md").read_text()
    assert '**`model.layer_spec`** ("local" \\| "transformer_engine"; default `"local"`)' in reference
    for page in ("README.md", "docs/internals.md"):
        text = (ROOT / page).read_text()
        assert "model.layer_spec" in text, page
        assert "On GPUs the model uses the transformer-engine layer spec" not in text, page


def test_plan_and_train_check_state_the_spec(capsys, tmp_path):
    from bpo_megatron.cli import main

    assert main(["plan", str(ROOT / "configs" / "qwen3_30b_a3b_bpo.yaml")]) == 0
    plan = capsys.readouterr().out
    assert ("model.layer_spec=local: Megatron's torch modules with core attention fused (model.attention=auto), "
            "experts grouped, dispatch sorted (the supported path") in plan
    assert main(["train", str(ROOT / "configs" / "tiny_moe_cpu.yaml"), f"logging.run_dir={tmp_path / 'run'}",
                 "--check"]) == 0
    check = capsys.readouterr().out
    assert "trainer: model.layer_spec=local: Megatron's torch modules with core attention unfused" in check
    assert main(["train", str(ROOT / "configs" / "tiny_moe_cpu.yaml"), "model.layer_spec=transformer_engine",
                 "--check"]) == 2
    assert "model.layer_spec=transformer_engine runs on GPUs only" in capsys.readouterr().err


def test_a_rank_refuses_transformer_engines_spec_before_building_anything():
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.models.megatron_model import transformer_config
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.testing import tiny_moe

    with pytest.raises(ValueError, match="model.layer_spec=transformer_engine runs on GPUs only .*"
                                         "set model.layer_spec=local"):
        transformer_config(tiny_moe(), ParallelConfig(), ModelOptions(params_dtype="fp32",
                                                                      layer_spec="transformer_engine"))
    with pytest.raises(ValueError, match="model.layer_spec='te' must be one of 'local', 'transformer_engine'"):
        ModelOptions(layer_spec="te")


def test_the_gpu_kit_trains_transformer_engines_spec_where_it_is_installed_and_says_which_ran(monkeypatch):
    from bpo_megatron import platform
    from bpo_megatron.gpu_smoke.checks.trainer_step import layer_specs_here
    from bpo_megatron.gpu_smoke.round_report import layer_specs_line

    assert layer_specs_here() == ["local"]  # no GPU here
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    monkeypatch.setattr(platform, "has_transformer_engine", lambda: False)
    assert layer_specs_here() == ["local"]
    monkeypatch.setattr(platform, "has_transformer_engine", lambda: True)
    assert layer_specs_here() == ["local", "transformer_engine"]

    step = {"name": "trainer_step", "numbers": {"layer_specs": "local"},
            "notes": ["model.layer_spec=transformer_engine not run: model.layer_spec=transformer_engine needs "
                      "transformer-engine, which this environment does not have"]}
    assert layer_specs_line([step]) == (
        "Layer specs trained (trainer_step): local; model.layer_spec=transformer_engine not run: "
        "model.layer_spec=transformer_engine needs transformer-engine, which this environment does not have.")
    both = {"name": "trainer_step", "numbers": {"layer_specs": "local, transformer_engine"}, "notes": []}
    assert layer_specs_line([both]) == "Layer specs trained (trainer_step): local, transformer_engine."
    assert layer_specs_line([]) == "Layer specs trained: none (trainer_step did not run)."
    round_sh = (ROOT / "tools" / "gpu" / "round.sh").read_text()
    assert "'transformer-engine'" in round_sh and "[round] layer specs trained:" in round_sh
