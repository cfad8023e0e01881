"""What a colocated trainer hands its engines (cluster.offload): every choice's device memory in
both phases follows its closed form from the plan's own terms; auto takes the least offload that
fits; a choice that does not fit is refused naming the setting; ``bpo-megatron plan`` and the run's
preflight say what was chosen; the offload's host buffers stay across saves when the node holds
them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bpo_megatron.config import ConfigError
from bpo_megatron.experiment import load_experiment
from bpo_megatron.planner import make_plan
from bpo_megatron.planner.offload import ORDER, RULES
from bpo_megatron.planner.plan import RESERVED_BYTES

ROOT = Path(__file__).resolve().parents[1]
ONE_GPU = ROOT / "configs" / "qwen3_moe_1gpu.yaml"


def _plan(*overrides: str):
    cfg = load_experiment(ONE_GPU, list(overrides))
    return make_plan(cfg, cfg.hf_config())


def test_every_choice_is_a_part_the_trainer_can_offload():
    from bpo_megatron.trainer.offload import OFFLOAD_PARTS

    assert set(RULES) == set(ORDER) == set(OFFLOAD_PARTS)


def test_the_one_gpu_recipe_needs_nothing_offloaded_and_each_choice_has_its_closed_form():
    """On its 80 GB the trainer's training peak (≈ 69 GB) and the embedded engine (weights, KV
    cache, runtime: ≈ 8.6 GB) fit together: auto offloads nothing."""
    plan = _plan()
    [stage] = plan.stages
    r, static = plan.rollout, stage.static
    engine = r.total + RESERVED_BYTES
    residual = plan.trainer_residual.total
    nothing, optimizer, everything = plan.offload.options
    assert [o.parts for o in plan.offload.options] == list(ORDER)
    # together throughout: the training peak beside the whole engine
    assert nothing.moved == 0 and nothing.rollout_phase == nothing.train_phase == stage.total + engine
    # the embedded engine's release drops its decode states; its weights stay beside the trainer
    assert plan.engine_kept == r.weights
    assert optimizer.moved == static.optimizer and optimizer.rollout_phase == engine + residual + static.weights
    assert everything.moved == static.weights + static.optimizer and everything.rollout_phase == plan.rollout_peak
    assert optimizer.train_phase == everything.train_phase == stage.total + r.weights
    assert plan.offload.chosen is nothing and plan.offload.parts == "nothing" and plan.fits
    assert 69e9 < stage.total < 70e9 and 8e9 < engine < 9e9 and nothing.peak <= 80e9
    # nothing offloaded: no host buffers to pin
    assert plan.host.save_ranks[0].pinned == 0


def test_auto_takes_the_least_offload_that_fits_and_a_choice_that_does_not_is_refused():
    from bpo_megatron.loop.preflight import colocated_offload
    from bpo_megatron.loop.run_dir import RunRefused

    # 77 GB: the engine no longer fits beside the training peak; beside the weights it does
    plan = _plan("cluster.gpu_memory_gb=77")
    assert plan.offload.parts == "optimizer" and plan.fits
    # 72 GB: the training peak and the engine's weights only
    assert _plan("cluster.gpu_memory_gb=72").offload.parts == "optimizer"
    assert _plan("cluster.gpu_memory_gb=71").offload.chosen is None and not _plan("cluster.gpu_memory_gb=71").fits
    # a choice that does not fit: refused, naming the setting and what fits instead
    tight = _plan("cluster.gpu_memory_gb=77", "cluster.offload=nothing")
    assert not tight.fits and tight.offload.parts == "nothing"
    assert tight.offload.refusal() == (
        "cluster.offload=nothing does not fit: 77.86 GB while the engines generate and 77.86 GB while the trainer "
        "computes, on GPUs of 77.00 GB; cluster.offload=optimizer fits (auto takes the least offload that fits)")
    cfg = load_experiment(ONE_GPU, ["cluster.gpu_memory_gb=77", "cluster.offload=nothing"])
    with pytest.raises(RunRefused, match=r"^cluster.offload=nothing does not fit: "):
        colocated_offload(cfg, cfg.hf_config())
    none_fits = _plan("cluster.gpu_memory_gb=60")
    assert none_fits.offload.refusal().startswith("cluster.offload=auto: no choice fits 60.00 GB per GPU (even "
                                                  "everything, offloading the most, needs 71.65 GB)")
    # what the run takes, and the note it prints
    cfg = load_experiment(ONE_GPU, ["cluster.gpu_memory_gb=77"])
    offload, notes = colocated_offload(cfg, cfg.hf_config())
    assert (offload.parts, offload.keep_across_saves) == ("optimizer", True)
    assert notes == ["cluster.offload=auto: the trainer offloads optimizer for each rollout phase (the least offload "
                     "that fits, 14.41 GB to host memory and back each step; peak 71.65 of 77.00 GB per GPU)"]


def test_plan_prints_every_choice_and_marks_the_chosen_one(capsys):
    from bpo_megatron.cli import main

    assert main(["plan", str(ONE_GPU)]) == 0
    out = capsys.readouterr().out
    assert "nothing: trainer and engines hold the GPU together  ← chosen" in out
    assert ("→ cluster.offload=auto: the trainer offloads nothing for each rollout phase (the least offload that "
            "fits; peak 77.86 of 80.00 GB per GPU)") in out
    assert "pinned offload buffers (cluster.offload: nothing; allocated before step 1, kept across saves)" in out
    assert main(["plan", str(ONE_GPU), "cluster.offload=nothing", "--gpu-memory-gb", "77"]) == 1
    out = capsys.readouterr().out
    assert "→ cluster.offload=nothing does not fit" in out and "verdict: DOES NOT FIT (memory exceeds the GPU)" in out


def test_a_cpu_allocation_offloads_what_it_is_told_everything_by_default():
    from bpo_megatron.loop.preflight import colocated_offload

    cfg = load_experiment(ROOT / "configs" / "tiny_moe_cpu.yaml", [])
    assert cfg.cluster.colocate and not cfg.cluster.gpus_per_node
    offload, notes = colocated_offload(cfg, cfg.hf_config())
    assert (offload.parts, offload.keep_across_saves, notes) == ("everything", True, [])  # nothing to plan against
    cfg = load_experiment(ROOT / "configs" / "tiny_moe_cpu.yaml", ["cluster.offload=optimizer"])
    assert colocated_offload(cfg, cfg.hf_config())[0].parts == "optimizer"
    apart = load_experiment(ROOT / "configs" / "tiny_moe_cpu.yaml", ["cluster.colocate=false"])
    assert colocated_offload(apart, apart.hf_config()) == (None, [])


def test_the_setting_is_checked_when_the_config_loads():
    tiny = ROOT / "configs" / "tiny_moe_cpu.yaml"
    with pytest.raises(ConfigError, match=r"cluster.offload='some': choose auto or one of \['everything', "
                                          r"'nothing', 'optimizer'\]"):
        load_experiment(tiny, ["cluster.offload=some"])
    with pytest.raises(ConfigError, match=r"cluster.offload=nothing chooses what a trainer sharing its devices .* "
                                          r"with cluster.colocate=false nothing is shared: leave it auto"):
        load_experiment(tiny, ["cluster.offload=nothing", "cluster.colocate=false"])


def test_the_host_buffers_are_dropped_at_saves_only_when_the_node_cannot_hold_them_beside_a_save(monkeypatch):
    from bpo_megatron.loop.preflight import colocated_offload
    from bpo_megatron.planner.layout import Allocation

    cfg = load_experiment(ONE_GPU, ["cluster.offload=everything"])
    plan = make_plan(cfg, cfg.hf_config())
    at_save = plan.host.at_save
    assert plan.host.save_ranks[0].pinned == plan.offload.options[-1].moved  # 16.81 GB: weights + optimizer state
    assert colocated_offload(cfg, cfg.hf_config())[0].keep_across_saves  # 1000 GB, the planner's default node
    of = Allocation.of
    monkeypatch.setattr(Allocation, "of", classmethod(lambda cls, c: dataclasses.replace(
        of(c), host_memory_gb=at_save / 1e9 - 1)))
    offload, notes = colocated_offload(cfg, cfg.hf_config())
    assert offload == type(offload)("everything", False)
    assert notes[-1] == (f"the offload's host buffers are dropped before each checkpoint save and allocated again "
                         f"after it (slowly, pinned): with them a save needs {at_save / 1e9:.1f} GB of host memory on "
                         f"the busiest trainer node, more than its {at_save / 1e9 - 1:.0f} GB (bpo-megatron plan, "
                         "--host-memory-gb)")
