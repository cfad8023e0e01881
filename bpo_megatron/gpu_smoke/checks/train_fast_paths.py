"""Training with and without each fast path of the local spec (the model without transformer-engine):
one optimizer step of the throughput model per variant, on the same weights and samples — every
fast path on, each one off in turn, and all of them off (Megatron's reference modules) — with its
time, tokens per second and MFU side by side, and its loss and grad norm against the reference
variant's within the profile's bf16 tolerance.

The all-on variant's step over one micro-batch is then profiled (``torch.profiler``): kernels
launched, host syncs (the CUDA runtime's synchronize calls; on a CPU the scalar reads), the share of
the step's wall time the GPU ran no kernel, and the trace itself (gzipped Chrome trace) under the
work directory's ``traces/``, which the GPU round copies into its report folder.

The variants are built one after another from the same seeded initialisation (the fast paths change
modules, never parameters: the check compares every variant's weights with the first one's before
it steps).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.checks.rl_throughput import forward_flops
from bpo_megatron.gpu_smoke.common import build_actor, device_name, single_rank_world, synchronize, timed
from bpo_megatron.gpu_smoke.profiles import Profile, bf16_peak_flops, finite
from bpo_megatron.gpu_smoke.report import Outcome
from bpo_megatron.testing.samples import samples_of_lengths
from bpo_megatron.trainer.samples import TrainSample

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def variants() -> dict[str, dict[str, Any]]:
    """Every fast path on (also on a CPU, where some are off by default), each one off in turn, all
    off: name -> model options."""
    from bpo_megatron.models.options import FAST_PATHS, fast_path_options

    on_all = fast_path_options(on=True)
    return {"all fast paths": on_all,
            **{f"without {name}": {**on_all, **off} for name, (_, off) in FAST_PATHS.items()},
            "reference (none)": fast_path_options(on=False)}


def _samples(profile: Profile, hf) -> list[TrainSample]:
    """RL-shaped samples (the kit's): the throughput profile's prompt and response lengths, R3
    routing, advantages of both signs."""
    count = 2 * profile.rl_micro_batch
    positions = profile.rl_prompt_tokens + profile.rl_new_tokens - 1
    return samples_of_lengths((positions,) * count, (profile.rl_prompt_tokens,) * count, seed=3, old_spread=0.0,
                              hf=hf)


def _fingerprint(actor) -> float:
    """A weighted sum of every parameter (same weights, same number; a different layout or init
    would differ), the grouped experts' stacked ones expert by expert as SequentialMLP holds them."""
    from bpo_megatron.testing.trainer import flat_params

    total = 0.0
    for i, (_, param) in enumerate(sorted(flat_params(actor).items())):
        total += (i + 1) * float(param.detach().double().sum())
    return total


def profile_step(actor, samples: list[TrainSample], trace: Path) -> dict[str, float]:
    """One training step over ``samples`` under ``torch.profiler``: kernels, host syncs, the GPU's
    idle share of the step's wall time; the trace written gzipped to ``trace``."""
    import torch.profiler

    cuda = platform.has_cuda()
    activity = torch.profiler.ProfilerActivity
    synchronize()
    with torch.profiler.profile(activities=[activity.CPU] + ([activity.CUDA] if cuda else [])) as prof:
        actor.train_step(samples)
        synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = [e for e in events if e.name.startswith("aten::")]
    sync_names = SYNC_CALLS if cuda else ("aten::_local_scalar_dense",)
    syncs = sum(1 for e in events if e.name in sync_names)
    span = _span(events)
    busy = covered_length(sorted((e.time_range.start, e.time_range.end) for e in kernels))
    trace.parent.mkdir(parents=True, exist_ok=True)
    raw = trace.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return {"kernels": float(len(kernels)), "aten_ops": float(len(ops)), "host_syncs": float(syncs),
            "gpu_idle_share": (1.0 - busy / span) if cuda and span > 0 else float("nan"),
            "profiled_ms": span / 1e3}


def _span(events) -> float:
    starts = [e.time_range.start for e in events]
    ends = [e.time_range.end for e in events]
    return (max(ends) - min(starts)) if starts else 0.0


def covered_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by sorted ``intervals`` (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.weights.names import parameter_counts

    out = Outcome("train_fast_paths")
    config = profile.large_model
    hf = HFModelConfig.load(config)
    _, active_params = parameter_counts(hf)
    peak = bf16_peak_flops(device_name()) if platform.has_cuda() else None
    samples = _samples(profile, hf)
    positions = [s.tokens.numel() - 1 for s in samples]
    budget = profile.rl_micro_batch * (profile.rl_prompt_tokens + profile.rl_new_tokens)
    flops = 3.0 * forward_flops(hf, positions, active_params)
    rows: list[dict[str, Any]] = []
    fingerprints: dict[str, float] = {}
    results: dict[str, dict[str, float]] = {}
    with single_rank_world():
        for name, options in variants().items():
            times: dict[str, float] = {}
            torch.manual_seed(0)
            actor = build_actor(profile, config, replay=True, micro_batch_size=profile.rl_micro_batch, lr=1e-6,
                                max_tokens_per_micro_batch=budget, model_options=options)
            fingerprints[name] = _fingerprint(actor)
            initial = [param.detach().clone() for param in actor.model.parameters()]
            actor.train_step(samples[: profile.rl_micro_batch])  # warm-up: kernels, allocator, optimizer state
            with torch.no_grad():  # the warm-up's update undone: the timed step's loss and grad norm
                for param, value in zip(actor.model.parameters(), initial):  # are the initial weights'
                    param.copy_(value)
            actor.reload_optimizer_params()  # (and the optimizer's fp32 main copies refreshed)
            with timed(times, "train_s"):
                metrics = actor.train_step(samples)
            results[name] = metrics
            row = {"variant": name, "train_s": times["train_s"],
                   "tokens_per_s": sum(positions) / times["train_s"],
                   "mfu": flops / times["train_s"] / peak if peak else float("nan"),
                   "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
            if name == "all fast paths":
                row.update(profile_step(actor, samples[: profile.rl_micro_batch],
                                        workdir / "traces" / "train_micro_batch.json.gz"))
            rows.append(row)
            actor.close()
            del actor, initial
            if platform.has_cuda():
                torch.cuda.empty_cache()
    out.tables["train step with and without each fast path"] = rows
    reference = results["reference (none)"]
    fast = rows[0]
    out.numbers.update(
        model=f"{hf.num_hidden_layers} layers, hidden {hf.hidden_size}, {hf.num_experts} experts "
              f"top-{hf.num_experts_per_tok}",
        positions=sum(positions), micro_batch_budget=budget,
        fast_train_mfu=fast["mfu"], reference_train_mfu=rows[-1]["mfu"],
        speedup=rows[-1]["train_s"] / fast["train_s"],
        kernels_per_micro_batch=fast["kernels"], host_syncs_per_micro_batch=fast["host_syncs"],
        gpu_idle_share=fast["gpu_idle_share"],
    )
    first = next(iter(fingerprints.values()))
    out.require(all(abs(f - first) <= 1e-9 * max(1.0, abs(first)) for f in fingerprints.values()),
                "every variant starts from the same weights")
    out.require(all(finite(m["loss"], m["grad_norm"]) for m in results.values()), "every variant's step is finite")
    for name, metrics in results.items():
        loss_gap = abs(metrics["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-6)
        norm_gap = abs(metrics["grad_norm"] - reference["grad_norm"]) / max(abs(reference["grad_norm"]), 1e-6)
        out.require(loss_gap <= profile.loss_rel_tol and norm_gap <= profile.loss_rel_tol,
                    f"{name}: loss and grad norm within {profile.loss_rel_tol} of the reference "
                    f"(relative {loss_gap:.1e}, {norm_gap:.1e})")
    out.notes.append("One optimizer step of packed micro-batches (R3 on, BPO) per variant; MFU counts the "
                     "matrix products and causal attention a token needs, ×3 for forward and backward, against "
                     "the device's data-sheet bf16 peak. The trace: traces/train_micro_batch.json.gz.")
    return out
