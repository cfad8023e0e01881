"""Training MFU three ways, at a micro-batch size the recipe trains at (``train_fast_paths``' rows):

* **wall-clock**: a training step's FLOPs (:mod:`bpo_megatron.gpu_smoke.flops`, forward and
  backward) over the step's wall time, against the device's data-sheet bf16 peak;
* **GPU-busy**: one micro-batch's FLOPs over the time the GPU ran kernels in it (from the
  profiler's trace, :mod:`bpo_megatron.gpu_smoke.trace`): what the kernels reach once the host is
  taken out, so wall against busy says how much the host costs;
* **transformer layers** (without the output layer): the same model at half its depth trains the
  same samples, and the layers the full depth adds account for the difference of the two steps'
  times (their share of the optimizer's work and the host's per-layer work included, as a deeper
  model of the same layers pays them); their FLOPs over that difference is what a model of many
  such layers would reach, whatever a shallow model's large vocabulary costs.

Every step is one optimizer step of ``MICRO_BATCHES`` packed micro-batches of RL-shaped samples (the
throughput profile's prompt and response lengths, R3 routing), each micro-batch filled to its
position budget, after a warm-up micro-batch at the same budget (kernels, the allocator, the
optimizer's state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import build_actor, timed
from bpo_megatron.gpu_smoke.flops import train_flops
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.trace import Analysis

MICRO_BATCHES = 2  # a step of the one-GPU recipe packs its 128 samples into 2–3 micro-batches


@dataclass(frozen=True)
class MfuCase:
    """A model measured at some micro-batch budgets (input positions a micro-batch)."""

    key: str  # the numbers' suffix: "kit", "30b_slice"
    title: str
    config: dict[str, Any]
    budgets: dict[str, int]  # label ("4k", "32k") -> positions a micro-batch


def rl_samples(profile: Profile, hf, budget: int, *, seed: int = 3) -> tuple[list, int]:
    """``MICRO_BATCHES`` micro-batches of RL-shaped samples, each filled to ``budget`` positions,
    and how many samples make one micro-batch."""
    from bpo_megatron.testing.samples import samples_of_lengths

    positions = profile.rl_prompt_tokens + profile.rl_new_tokens - 1
    per_micro_batch = budget // positions
    if per_micro_batch < 1:
        raise ValueError(f"a micro-batch budget of {budget} positions holds no sample of {positions}")
    count = MICRO_BATCHES * per_micro_batch
    samples = samples_of_lengths((positions,) * count, (profile.rl_prompt_tokens,) * count, seed=seed,
                                 old_spread=0.0, hf=hf)
    return samples, per_micro_batch


def half_depth(config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    if layers < 2:
        raise ValueError(f"num_hidden_layers={layers}: the layers' MFU needs a model of at least 2 layers")
    return {**config, "num_hidden_layers": layers // 2}


def _step_times(profile: Profile, config: dict[str, Any], budgets: dict[str, int],
                traces: str | None, profile_step) -> dict[str, dict[str, Any]]:
    """label -> the timed step (seconds, positions, FLOPs, micro-batches) and, with ``traces``, the
    analysis of one profiled micro-batch (its trace written to ``<traces>-<label>.json.gz``) and its FLOPs."""
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.models.options import fast_path_options

    hf = HFModelConfig.load(config)
    torch.manual_seed(0)
    actor = build_actor(profile, config, replay=True, micro_batch_size=profile.rl_micro_batch, lr=1e-6,
                        max_tokens_per_micro_batch=max(budgets.values()), model_options=fast_path_options(on=True))
    results: dict[str, dict[str, Any]] = {}
    try:
        for label, budget in budgets.items():
            actor.trainer_cfg = replace(actor.trainer_cfg, max_tokens_per_micro_batch=budget)
            samples, per_micro_batch = rl_samples(profile, hf, budget)
            actor.train_step(samples[:per_micro_batch])  # warm-up at this size
            times: dict[str, float] = {}
            with timed(times, "train_s"):
                metrics = actor.train_step(samples)
            positions = [s.tokens.numel() - 1 for s in samples]
            result = {"train_s": times["train_s"], "positions": sum(positions),
                      "flops": train_flops(hf, positions), "micro_batches": int(metrics["num_micro_batches"]),
                      "finite": math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])}
            if traces is not None:
                one = samples[:per_micro_batch]
                result["profiled"] = profile_step(actor, one, Path(f"{traces}-{label}.json.gz"))
                result["profiled_flops"] = train_flops(hf, [s.tokens.numel() - 1 for s in one])
            results[label] = result
    finally:
        actor.close()
        del actor
        if platform.has_cuda():
            torch.cuda.empty_cache()
    return results


def measure(profile: Profile, case: MfuCase, traces: Path, peak: float | None, profile_step) -> list[dict[str, Any]]:
    """One row per budget of ``case``: wall-clock, GPU-busy and the layers' MFU, the profiled
    micro-batch's kernels, host syncs and idle share. ``profile_step(actor, samples, path) ->
    Analysis`` profiles one micro-batch and writes its trace to ``path``, here
    ``traces/train-<case>-<label>.json.gz``."""
    full = _step_times(profile, case.config, case.budgets, str(traces / f"train-{case.key}"), profile_step)
    half = _step_times(profile, half_depth(case.config), case.budgets, None, profile_step)
    mfu = (lambda flops, seconds: flops / seconds / peak) if peak else (lambda flops, seconds: float("nan"))
    rows = []
    for label, budget in case.budgets.items():
        step, shallow = full[label], half[label]
        analysis: Analysis = step["profiled"]
        added_layers = step["flops"].transformer - shallow["flops"].transformer
        added_seconds = step["train_s"] - shallow["train_s"]
        rows.append({
            "model": case.title, "case": case.key, "label": label, "layers": case.config["num_hidden_layers"],
            "micro_batch_positions": budget, "step_positions": step["positions"],
            "micro_batches": step["micro_batches"], "train_s": step["train_s"],
            "tokens_per_s": step["positions"] / step["train_s"],
            "mfu": mfu(step["flops"].total, step["train_s"]),
            "busy_mfu": mfu(step["profiled_flops"].total, analysis.busy / 1e6) if analysis.busy > 0 else float("nan"),
            "layer_mfu": mfu(added_layers, added_seconds) if added_seconds > 0 else float("nan"),
            "half_depth_train_s": shallow["train_s"],
            "lm_head_flops_share": step["flops"].lm_head / step["flops"].total,
            "kernels": analysis.kernels, "host_syncs": len(analysis.syncs),
            "gpu_idle_share": analysis.idle_share, "profiled_ms": analysis.span / 1e3,
            "finite": step["finite"] and shallow["finite"], "phases": analysis.phase_rows(),
        })
    return rows
