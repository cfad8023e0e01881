"""Training with and without each fast path of the local spec (the model without transformer-engine),
and the training MFU the fast paths reach.

**Fast paths**: one optimizer step of the throughput model per variant, on the same weights and
samples — every fast path on, each one off in turn, and all of them off (Megatron's reference
modules) — with its time, tokens per second and MFU side by side, and its loss and grad norm against
the reference variant's within the profile's bf16 tolerance. The variants are built one after another
from the same seeded initialisation (the fast paths change modules, never parameters: the check
compares every variant's weights with the first one's before it steps).

**MFU** (:mod:`bpo_megatron.gpu_smoke.train_mfu`): every fast path on, wall-clock, GPU-busy and the
transformer layers' MFU of the throughput model at the kit's 4,352-position micro-batches and at the
one-GPU recipe's 32,768, and of a slice of Qwen3-30B-A3B (its exact layer shapes: hidden 2,048, 128
experts top-8 of FFN 768, 32 query and 4 key-value heads of 128 dims; 4 layers and its vocabulary of
151,936) at 32,768. Each row's one profiled micro-batch (``torch.profiler``: kernels, host syncs,
the GPU's idle share, the phase table of :mod:`bpo_megatron.gpu_smoke.trace`) leaves its gzipped
Chrome trace under the work directory's ``traces/``, which the GPU round brings back with its report.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import build_actor, device_name, single_rank_world, synchronize, timed
from bpo_megatron.gpu_smoke.flops import train_flops
from bpo_megatron.gpu_smoke.profiles import Profile, bf16_peak_flops, finite
from bpo_megatron.gpu_smoke.report import Outcome
from bpo_megatron.gpu_smoke.trace import Analysis, analyse, load
from bpo_megatron.gpu_smoke.train_mfu import MfuCase, measure, rl_samples
from bpo_megatron.trainer.samples import TrainSample

def variants() -> dict[str, dict[str, Any]]:
    """Every fast path on (also on a CPU, where some are off by default), each one off in turn, all
    off: name -> model options."""
    from bpo_megatron.models.options import FAST_PATHS, fast_path_options

    on_all = fast_path_options(on=True)
    return {"all fast paths": on_all,
            **{f"without {name}": {**on_all, **off} for name, (_, off) in FAST_PATHS.items()},
            "reference (none)": fast_path_options(on=False)}


def _fingerprint(actor) -> float:
    """A weighted sum of every parameter (same weights, same number; a different layout or init
    would differ), the grouped experts' stacked ones expert by expert as SequentialMLP holds them."""
    from bpo_megatron.testing.trainer import flat_params

    total = 0.0
    for i, (_, param) in enumerate(sorted(flat_params(actor).items())):
        total += (i + 1) * float(param.detach().double().sum())
    return total


def profile_step(actor, samples: list[TrainSample], trace: Path) -> Analysis:
    """One training step over ``samples`` under ``torch.profiler``, read back from its Chrome trace
    (kernels, host syncs, busy time, phases); the trace written gzipped to ``trace``."""
    import torch.profiler

    activity = torch.profiler.ProfilerActivity
    synchronize()
    with torch.profiler.profile(activities=[activity.CPU] + ([activity.CUDA] if platform.has_cuda() else [])) as prof:
        actor.train_step(samples)
        synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    raw = trace.with_suffix("")
    prof.export_chrome_trace(str(raw))
    analysis = analyse(load(raw))
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    analysis.events = []  # read; not kept
    return analysis


def kit_budget(profile: Profile) -> int:
    """The kit's micro-batch budget: ``rl_micro_batch`` samples of the RL shape (4,352 positions on a GPU)."""
    return profile.rl_micro_batch * (profile.rl_prompt_tokens + profile.rl_new_tokens)


def mfu_cases(profile: Profile) -> list[MfuCase]:
    """The throughput model at the kit's and the recipe's micro-batch sizes, the 30B slice at the recipe's."""
    return [MfuCase("kit", "throughput model", profile.large_model,
                    {"4k": kit_budget(profile), "32k": profile.recipe_micro_batch_positions}),
            MfuCase("30b_slice", "Qwen3-30B-A3B slice", profile.slice_model,
                    {"32k": profile.recipe_micro_batch_positions})]


def _variant_steps(profile: Profile, peak: float | None) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]],
                                                                   dict[str, float], int]:
    """One timed step of each variant at the kit's micro-batch size: the table's rows, each
    variant's step metrics, its initial weights' fingerprint, and the step's input positions."""
    from bpo_megatron.models import HFModelConfig

    config = profile.large_model
    hf = HFModelConfig.load(config)
    budget = kit_budget(profile)
    samples, per_micro_batch = rl_samples(profile, hf, budget)
    positions = [s.tokens.numel() - 1 for s in samples]
    flops = train_flops(hf, positions).total
    rows: list[dict[str, Any]] = []
    fingerprints: dict[str, float] = {}
    results: dict[str, dict[str, float]] = {}
    for name, options in variants().items():
        times: dict[str, float] = {}
        torch.manual_seed(0)
        actor = build_actor(profile, config, replay=True, micro_batch_size=profile.rl_micro_batch, lr=1e-6,
                            max_tokens_per_micro_batch=budget, model_options=options)
        fingerprints[name] = _fingerprint(actor)
        initial = [param.detach().clone() for param in actor.model.parameters()]
        actor.train_step(samples[:per_micro_batch])  # warm-up: kernels, allocator, optimizer state
        with torch.no_grad():  # the warm-up's update undone: the timed step's loss and grad norm
            for param, value in zip(actor.model.parameters(), initial):  # are the initial weights'
                param.copy_(value)
        actor.reload_optimizer_params()  # (and the optimizer's fp32 main copies refreshed)
        with timed(times, "train_s"):
            metrics = actor.train_step(samples)
        results[name] = metrics
        rows.append({"variant": name, "train_s": times["train_s"], "tokens_per_s": sum(positions) / times["train_s"],
                     "mfu": flops / times["train_s"] / peak if peak else float("nan"),
                     "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})
        actor.close()
        del actor, initial
        if platform.has_cuda():
            torch.cuda.empty_cache()
    return rows, results, fingerprints, sum(positions)


def mfu_numbers(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The MFU rows as the numbers tracked across rounds: ``{train,busy,layer}_mfu_<label>`` for the
    throughput model (``train_mfu_32k``), ``..._30b_slice`` for the slice, and each row's profiled
    micro-batch (kernels, host syncs, idle share)."""
    numbers: dict[str, float] = {}
    for row in rows:
        suffix = row["label"] if row["case"] == "kit" else row["case"]
        numbers.update({f"train_mfu_{suffix}": row["mfu"], f"busy_mfu_{suffix}": row["busy_mfu"],
                        f"layer_mfu_{suffix}": row["layer_mfu"],
                        f"micro_batch_positions_{suffix}": row["micro_batch_positions"],
                        f"kernels_per_micro_batch_{suffix}": row["kernels"],
                        f"host_syncs_per_micro_batch_{suffix}": row["host_syncs"],
                        f"gpu_idle_share_{suffix}": row["gpu_idle_share"]})
    return numbers


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.models import HFModelConfig

    out = Outcome("train_fast_paths")
    hf = HFModelConfig.load(profile.large_model)
    peak = bf16_peak_flops(device_name()) if platform.has_cuda() else None
    with single_rank_world():
        mfu_rows, phase_tables, unmeasured = [], {}, []
        for case in mfu_cases(profile):  # first: the numbers the training goals are judged by
            try:
                case_rows = measure(profile, case, workdir / "traces", peak, profile_step)
            except torch.OutOfMemoryError as exc:  # the rest of the check still runs and reports
                unmeasured.append(f"{case.title} at {case.budgets}: out of device memory ({str(exc)[:300]})")
                continue
            for row in case_rows:
                phase_tables[f"phases of one profiled micro-batch: {row['model']}, {row['label']}"] = row.pop("phases")
                mfu_rows.append(row)
        rows, results, fingerprints, positions = _variant_steps(profile, peak)
    out.tables["training MFU, every fast path on"] = mfu_rows
    out.tables.update(phase_tables)
    out.tables["train step with and without each fast path"] = rows
    reference = results["reference (none)"]
    fast = rows[0]
    out.numbers.update(
        model=f"{hf.num_hidden_layers} layers, hidden {hf.hidden_size}, {hf.num_experts} experts "
              f"top-{hf.num_experts_per_tok}",
        positions=positions, micro_batch_budget=kit_budget(profile),
        fast_train_mfu=fast["mfu"], reference_train_mfu=rows[-1]["mfu"],
        speedup=rows[-1]["train_s"] / fast["train_s"],
        **mfu_numbers(mfu_rows),
    )
    first = next(iter(fingerprints.values()))
    out.require(not unmeasured and all(row["finite"] for row in mfu_rows),
                "every MFU row measured and its steps finite" + (f" (not measured: {'; '.join(unmeasured)})"
                                                                  if unmeasured else ""))
    out.require(all(abs(f - first) <= 1e-9 * max(1.0, abs(first)) for f in fingerprints.values()),
                "every variant starts from the same weights")
    out.require(all(finite(m["loss"], m["grad_norm"]) for m in results.values()), "every variant's step is finite")
    for name, metrics in results.items():
        loss_gap = abs(metrics["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-6)
        norm_gap = abs(metrics["grad_norm"] - reference["grad_norm"]) / max(abs(reference["grad_norm"]), 1e-6)
        out.require(loss_gap <= profile.loss_rel_tol and norm_gap <= profile.loss_rel_tol,
                    f"{name}: loss and grad norm within {profile.loss_rel_tol} of the reference "
                    f"(relative {loss_gap:.1e}, {norm_gap:.1e})")
    out.notes.append(
        "One optimizer step of 2 packed micro-batches (R3 on, BPO) per row and variant. MFU counts the matrix "
        "products and causal attention the model defines (bpo_megatron/gpu_smoke/flops.py), ×3 for forward and "
        "backward, against the device's data-sheet bf16 peak: mfu over the step's wall time, busy_mfu a step of one "
        "micro-batch (its optimizer step included) under the profiler over the GPU's kernel time in it, layer_mfu the transformer layers' FLOPs (no output layer) "
        "that the full depth adds to the same model at half its depth, over the time they add. Traces: "
        "traces/train-<model>-<size>.json.gz (python tools/gpu/trace_summary.py TRACE).")
    return out
