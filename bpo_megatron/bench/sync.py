"""Benchmark: a full against a delta weight sync at scale, simulated from the recipes' planned layouts.

For each recipe (default: Qwen3-30B-A3B colocated and disaggregated, GLM-4.5-Air, Qwen3-235B-A22B)
and its planned layout (``bpo-megatron plan``): the bytes the trainer sends, the update calls each
SGLang engine takes (posts, and the weight-loader calls each of its TP ranks makes), and the
seconds of a full sync and of a delta sync at each ``--changed-share``, beside what peers measured
at these sizes. Nothing here runs a cluster: the transfer is the planner's model
(bpo_megatron/planner/sync.py, whose link speeds are printed), the delta's bytes are the encoding
rule of bpo_megatron/weight_sync/delta_estimate.py, and the host's copy and diff rates are measured
on this machine at the start (``--host-copy-gbps`` / ``--host-diff-gbps`` give them instead).

The engine side, read from SGLang 0.5.23 (``model_executor/model_runner_components/weight_updater.py``,
``models/qwen3_moe.py``): ``update_weights_from_distributed`` (NCCL broadcast),
``update_weights_from_disk`` and ``update_weights_from_tensor`` in its default and
``flattened_bucket`` formats (what this project's transports send) hand Hugging Face-named whole
tensors to the model's ``load_weights``, which makes one weight-loader call per tensor, and per
expert: a MoE layer's experts cost 3 calls per expert the rank holds (its ``ep_size`` share),
whatever a post carries. Only ``update_weights_from_tensor`` (the colocated CUDA IPC path, one
payload per TP rank) goes further: ``load_format="direct"`` copies whole SGLang parameters by their
own names (a layer's local experts in 2 calls, ``w13_weight`` and ``w2_weight``, in the rank's own
layout), and a loader registered at the server's start (``--custom-weight-loader``) receives the
payload as it is sent: the one path that can apply a partial (sparse) update, here one call per
bucket.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = ("qwen3_30b_a3b_bpo.yaml", "qwen3_30b_a3b_bpo_disaggregated.yaml", "glm4_5_air_bpo.yaml",
           "qwen3_235b_a22b_bpo.yaml")
SGLANG_LOAD_GBPS = 20.0  # an engine TP rank writing received bytes into its weights (planner/sync.py)
APPLY_CALL_US = 30.0  # one weight-loader call in SGLang (a narrow and a copy: launch-bound), assumed
# verl's 30B-A3B measurement: ≈ 55 s of a sync applying ≈ 18k expert tensors one by one
VERL_APPLY_S, VERL_EXPERT_TENSORS = 55.0, 18_432
ANCHORS = (
    "NeMo-RL: 0.74-1.5 s a sync (Qwen3-30B-A3B, disaggregated reshard, H100)",
    "slime: ≈ 3 s the update loop, 21-26 s in all (colocated, 8 × H200)",
    "verl delta_sharded: Qwen3-30B-A3B ≈ 32 s full → 5.8-7.9 s delta; Qwen3-235B-A22B 246-266 s full → "
    "11.4-14.9 s delta (NCCL broadcast, H100); 0.8-1.1% of bf16 weights changed a step, 61 GB → 1.8 GB",
    f"verl: ≈ {VERL_APPLY_S:.0f} s of its 30B sync in SGLang applying ≈ 18k expert tensors one by one "
    f"(≈ {1e3 * VERL_APPLY_S / VERL_EXPERT_TENSORS:.1f} ms a tensor)",
    "slime: ≈ 3% of elements changed a step, ≈ 5 GB a delta for a 355B model",
)


@dataclass(frozen=True)
class HostRates:
    copy_gbps: float  # bf16 bytes copied per second, one thread
    diff_gbps: float  # bf16 bytes compared with a held copy per second (indices and values out, copy updated)
    measured: bool


def measure_host_rates(mib: int = 64, changed_share: float = 0.01, repeats: int = 3) -> HostRates:
    """This machine's host copy and delta-diff rates on one thread (the best of ``repeats``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        elements = mib * 2**20 // 2
        held = torch.randn(elements).to(torch.bfloat16)
        new = held.clone()
        new[torch.randperm(elements)[: int(elements * changed_share)]] += 1.0

        def diff() -> None:
            changed = torch.nonzero(new.view(torch.int16) != held.view(torch.int16)).squeeze(1)
            changed.to(torch.int32), new[changed]
            held.copy_(new)

        def best(fn) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return 2 * elements / min(times) / 1e9

        copy_gbps = best(lambda: held.copy_(new))
        return HostRates(copy_gbps, best(diff), True)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class EngineCalls:
    posts: int  # update requests each engine receives
    loader_calls: int  # weight-loader calls each engine TP rank makes
    expert_calls_per_layer: int  # of those, for one MoE layer's experts


def full_sync_calls(cfg, hf, buckets: int) -> EngineCalls:
    """A full sync through SGLang's load_weights: one post per bucket; one loader call per tensor
    a TP rank holds a part of, experts only for the rank's ``ep_size`` share."""
    from bpo_megatron.weights.names import hf_tensor_count

    options = cfg.rollout.options
    expert_tensors = 3 * hf.num_experts * len(set(hf.moe_layers))
    per_layer = math.ceil(3 * hf.num_experts / options.ep_size)
    loader = hf_tensor_count(hf) - expert_tensors + per_layer * len(set(hf.moe_layers))
    return EngineCalls(buckets, loader, per_layer)


def delta_sync_calls(wire_buckets: int) -> EngineCalls:
    """A delta sync through a custom loader: one post and one scatter per bucket of sparse pieces
    (a layer's experts inside it included)."""
    return EngineCalls(wire_buckets, wire_buckets, 0)


@dataclass(frozen=True)
class Row:
    sync: str
    changed_share: float | None
    wire_bytes: int
    calls: EngineCalls | None
    transfer_s: float | None  # the planner's parts: diff, gather, spread, hand-over
    apply_s: float | None  # in each engine TP rank: its bytes at SGLANG_LOAD_GBPS and its loader calls

    @property
    def total_s(self) -> float | None:
        return None if self.transfer_s is None else self.transfer_s + self.apply_s


def recipe_rows(path: Path, shares: list[float], rates: HostRates, apply_call_s: float):
    """The plan of a recipe, and its rows: full, then per share a delta with the engines' copy on
    the GPU and one in host memory."""
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.models.hf_config import HFModelConfig
    from bpo_megatron.planner.layout import Allocation
    from bpo_megatron.planner.plan import make_plan
    from bpo_megatron.planner.sync import diffed_params, expected_delta_sync, expected_sync

    cfg = load_experiment(path, [], check_model=False)
    hf = HFModelConfig.load(cfg.model.path)
    plan = make_plan(cfg, hf, Allocation.of(cfg))
    total = plan.model_size[0]
    tp = cfg.rollout.options.tp_size
    full = expected_sync(cfg, hf, total)
    if full is None:
        raise ValueError(f"{path}: its engines do not sync over a GPU transport; bench sync needs an SGLang recipe")
    buckets = math.ceil(2 * total / cfg.weight_sync.bucket_bytes)
    calls = full_sync_calls(cfg, hf, buckets)
    rows = [Row("full", None, 2 * total, calls, full.seconds,
                2 * total / tp / (SGLANG_LOAD_GBPS * 1e9) + calls.loader_calls * apply_call_s)]
    if transport_takes_whole_tensors(full.transport):
        # every tensor holds a change at these shares, so a delta of whole changed tensors is the full sync
        return cfg, hf, plan, full, [*rows, replace(rows[0], sync="delta: whole changed tensors, all of them")]
    for share in shares:
        for held, host in (("GPU", None), ("host", rates.diff_gbps)):
            delta = expected_delta_sync(cfg, hf, total, diffed_params(plan), changed_share=share, host_diff_gbps=host)
            wire_buckets = math.ceil(delta.wire_bytes / cfg.weight_sync.bucket_bytes)
            apply = delta.wire_bytes / tp / (SGLANG_LOAD_GBPS * 1e9) + wire_buckets * apply_call_s
            rows.append(Row(f"delta, copy on the {held}", share, delta.wire_bytes, delta_sync_calls(wire_buckets),
                            delta.seconds, apply))
    return cfg, hf, plan, full, rows


def transport_takes_whole_tensors(transport: str) -> bool:
    from bpo_megatron.planner.sync import DELTA_TRANSPORTS

    return transport not in DELTA_TRANSPORTS


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def format_recipe(path: Path, shares: list[float], rates: HostRates, apply_call_s: float) -> str:
    from bpo_megatron.planner.sync import diffed_params

    cfg, hf, plan, full, rows = recipe_rows(path, shares, rates, apply_call_s)
    options, p = cfg.rollout.options, cfg.parallel
    calls = rows[0].calls
    expert_tensors = 3 * hf.num_experts * len(set(hf.moe_layers))
    lines = [f"### {cfg.name} ({path.name})",
             f"{plan.model_size[0] / 1e9:.2f} B parameters ({2 * plan.model_size[0] / 1e9:.1f} GB in bf16), "
             f"{expert_tensors:,} of its Hugging Face tensors experts; trainer {cfg.cluster.trainer_ranks} ranks "
             f"(tp {p.tp}, pp {p.pp}, ep {p.ep}, dp {plan.dp}, expert dp {plan.expert_dp}); "
             f"{cfg.rollout.num_engines} engines of tp {options.tp_size} (ep {options.ep_size}); transport "
             f"{full.transport}; buckets of {cfg.weight_sync.bucket_bytes / 2**20:.0f} MiB; a delta's busiest "
             f"rank compares {2 * diffed_params(plan) / 1e9:.2f} GB (its optimizer shard)",
             "",
             "| sync | changed share | bytes sent | posts per engine | loader calls per engine rank | transfer s "
             "| apply s | total s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        share = "—" if row.changed_share is None else f"{row.changed_share:.2%}"
        posts = "—" if row.calls is None else f"{row.calls.posts:,}"
        loader = "—" if row.calls is None else f"{row.calls.loader_calls:,}"
        lines.append(f"| {row.sync} | {share} | {row.wire_bytes / 1e9:.2f} GB | {posts} | {loader} | "
                     f"{_fmt(row.transfer_s)} | {_fmt(row.apply_s)} | {_fmt(row.total_s)} |")
    verl_apply = calls.loader_calls * VERL_APPLY_S / VERL_EXPERT_TENSORS
    lines += ["",
              f"full sync: {calls.expert_calls_per_layer} loader calls per MoE layer's experts on each engine rank "
              f"({3 * hf.num_experts} expert tensors a layer, {options.ep_size}-way expert parallel); at verl's "
              f"≈ {1e3 * VERL_APPLY_S / VERL_EXPERT_TENSORS:.1f} ms a tensor its {calls.loader_calls:,} calls would "
              f"take ≈ {verl_apply:.0f} s"]
    return "\n".join(lines)


def format_assumptions(rates: HostRates, apply_call_s: float) -> str:
    from bpo_megatron.planner import sync

    how = "measured here, one thread" if rates.measured else "given"
    return "\n".join([
        "assumptions (each named; the planner's in bpo_megatron/planner/sync.py):",
        f"  links: {sync.INTER_NODE_GBPS:g} GB/s between nodes on one GPU's NIC, {sync.NVLINK_GBPS:g} GB/s over "
        f"NVLink; {1e6 * sync.CALL_S:g} µs a collective call, {1e3 * sync.HTTP_S:g} ms an HTTP call, "
        f"{1e3 * sync.IPC_BUCKET_S:g} ms a colocated bucket hand-over",
        f"  device rates (stated): {sync.D2H_GBPS:g} GB/s GPU to host (an H100's offload, measured 2026-11-24), "
        f"{sync.DEVICE_DIFF_GBPS:g} GB/s a diff on the GPU, {SGLANG_LOAD_GBPS:g} GB/s an engine rank's load "
        f"(not overlapped here: apply is added to the transfer), {apply_call_s * 1e6:g} µs a loader call",
        f"  host rates ({how}): copy {rates.copy_gbps:.2f} GB/s, diff {rates.diff_gbps:.2f} GB/s of bf16 bytes "
        "(compare, indices and values out, held copy updated)",
        "  a delta's bytes: per bucket the cheaper of int32 index + bf16 value per changed element and the whole "
        "bucket (bpo_megatron/weight_sync/delta_estimate.py); every bucket changed at the same share",
    ])


def main(argv: list[str], parser: argparse.ArgumentParser) -> int:
    from bpo_megatron.planner.sync import DELTA_CHANGED_SHARE

    parser.add_argument("--recipes", nargs="+", default=[str(CONFIGS / name) for name in RECIPES],
                        help="experiment YAMLs with SGLang engines (default: the 30B-A3B, GLM-4.5-Air and 235B-A22B "
                             "recipes)")
    parser.add_argument("--changed-share", type=float, nargs="+", default=[0.001, DELTA_CHANGED_SHARE, 0.03],
                        help="shares of bf16 elements changed per sync to simulate (default: 0.1%%, verl's 1%%, "
                             "slime's 3%%; docs/benchmarks.md has this project's measured ones)")
    parser.add_argument("--host-copy-gbps", type=float, help="host copy rate instead of measuring it")
    parser.add_argument("--host-diff-gbps", type=float, help="host diff rate instead of measuring it")
    parser.add_argument("--apply-call-us", type=float, default=APPLY_CALL_US,
                        help=f"microseconds of one weight-loader call in SGLang (default {APPLY_CALL_US:g})")
    args = parser.parse_args(argv)
    for share in args.changed_share:
        if not 0.0 <= share <= 1.0:
            parser.error(f"--changed-share must be within [0, 1], got {share}")
    given = (args.host_copy_gbps, args.host_diff_gbps)
    if (given[0] is None) != (given[1] is None) or any(rate is not None and rate <= 0 for rate in given):
        parser.error("--host-copy-gbps and --host-diff-gbps go together, both > 0 (or neither: measured)")
    rates = HostRates(*given, False) if given[0] is not None else measure_host_rates()
    apply_call_s = args.apply_call_us * 1e-6
    print(format_assumptions(rates, apply_call_s))
    for recipe in args.recipes:
        print()
        print(format_recipe(Path(recipe), args.changed_share, rates, apply_call_s))
    print()
    print("anchors (peers' measurements at these sizes):")
    print("\n".join(f"  {anchor}" for anchor in ANCHORS))
    return 0
