"""Plain-text reports of a plan and of a layout sweep (GB = 10^9 bytes)."""

from __future__ import annotations

from bpo_megatron.models.options import describe_layer_spec
from bpo_megatron.planner.layout import Allocation
from bpo_megatron.planner.plan import (RESERVED_BYTES, Plan, StagePlan, largest_budget, longest_sample, longest_share,
                                       suggested_context_parallelism)
from bpo_megatron.trainer.packing import rank_positions
from bpo_megatron.planner.search import SweepResult

_DTYPE_NAMES = {2: "bf16", 4: "fp32"}


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


def billions(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n:,.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), *[line(r) for r in rows]]


def _verdict(total: float, allocation: Allocation) -> str:
    if not allocation.gpus_per_node:
        return "(CPU allocation: no GPU budget)"
    spare = allocation.gpu_bytes - total
    if spare >= 0:
        return f"fits in {allocation.gpu_memory_gb:g} GB, {gb(spare)} GB spare"
    return f"does NOT fit in {allocation.gpu_memory_gb:g} GB: {gb(-spare)} GB over"


def _shown_stages(plan: Plan) -> list[StagePlan]:
    if len(plan.stages) <= 4:
        return plan.stages
    peak = max(plan.stages, key=lambda s: s.total)
    keep = sorted({0, peak.params.stage, len(plan.stages) - 1})
    return [plan.stages[i] for i in keep]


def _header(plan: Plan) -> list[str]:
    cfg, hf, a = plan.cfg, plan.hf, plan.allocation
    total, active = plan.model_size
    p = cfg.parallel
    experts = f", {hf.num_experts} experts (top {hf.num_experts_per_tok})" if hf.is_moe else ""
    where = f"{a.nodes} node(s) × {a.gpus_per_node} GPUs × {a.gpu_memory_gb:g} GB" if a.gpus_per_node \
        else f"{a.nodes} node(s), CPU"
    optimizer = "distributed optimizer" if plan.distributed_optimizer else "replicated optimizer"
    lines = [
        f"plan: {cfg.name} on {where}",
        f"model: {hf.architecture}, {billions(total)} parameters ({billions(active)} active per token), "
        f"{hf.num_hidden_layers} layers{experts}",
        f"trainer: {cfg.cluster.trainer_ranks} ranks = tp {p.tp} × pp {p.pp} × cp {p.cp} × dp {plan.dp}; ep {p.ep}, "
        f"etp {p.expert_tp} (expert dp {plan.expert_dp}); sequence parallel {'on' if p.sequence_parallel else 'off'}; "
        f"recompute {cfg.model.options.recompute}; {_DTYPE_NAMES[plan.precision.param_bytes]} weights, {optimizer}",
        f"         {_micro_batches(plan)}",
        f"         {describe_layer_spec(cfg.model.options, gpu=a.gpus_per_node > 0)}",
    ]
    if p.cp > 1:
        lines.append(f"         context parallel: each sample split over cp {p.cp} ranks (2 × {p.cp} chunks, one from "
                     f"each end a rank); every layer all-gathers keys and values over the CP group: "
                     f"{gb(plan.context_gather)} GB received per rank and micro-batch in forward, as much reduced "
                     "in backward")
    if plan.rollout:
        r = plan.rollout
        placement = "colocated with the trainer" if cfg.cluster.colocate else "on their own GPUs"
        lines.append(f"rollout: {cfg.rollout.num_engines} {cfg.rollout.engine} engine(s) × tp {r.profile.tp} "
                     f"({placement}), {r.inflight} requests in flight each")
    return lines


def _micro_batches(plan: Plan) -> str:
    cfg = plan.cfg
    budget = cfg.trainer.max_tokens_per_micro_batch
    b = cfg.trainer.micro_batch_size
    if not budget:
        return (f"micro-batches of {b} × {plan.tokens_per_micro_batch // b} tokens, {plan.micro_batches} per DP rank "
                "and optimizer step")
    padded = f" (padded to {plan.tokens_per_micro_batch})" if plan.tokens_per_micro_batch != budget else ""
    return (f"packed micro-batches of ≤ {budget} input positions{padded} (trainer.max_tokens_per_micro_batch; memory sized "
            f"for a full one), up to {plan.micro_batches} per DP rank and optimizer step")


def _training(plan: Plan) -> list[str]:
    stages = _shown_stages(plan)
    # a CPU demo's model is a few MB: GB would show zeros
    fmt, unit = (gb, "GB") if plan.allocation.gpus_per_node else (mb, "MB")
    precision = plan.precision
    dtype = _DTYPE_NAMES[precision.param_bytes]
    master = "fp32 master + " if precision.master_bytes else ""
    expert_dp = f", expert dp {plan.expert_dp}" if plan.hf.is_moe else ""
    dp = f"dp {plan.dp}" if plan.cfg.parallel.cp == 1 else f"dp × cp {plan.optimizer_dp}"
    shard = f" / {dp}{expert_dp}" if plan.distributed_optimizer else ""
    rows = [
        ["parameters (dense + expert)", *[f"{billions(s.params.dense)} + {billions(s.params.expert)}" for s in stages]],
        [f"weights ({dtype})", *[fmt(s.static.weights) for s in stages]],
        ["gradients (fp32 main grads)", *[fmt(s.static.grads) for s in stages]],
        [f"optimizer ({master}2 Adam moments{shard})", *[fmt(s.static.optimizer) for s in stages]],
        ["  without the distributed optimizer" if plan.distributed_optimizer
         else "  with the distributed optimizer",
         *[fmt(s.static.optimizer_replicated if plan.distributed_optimizer else s.static.optimizer_distributed)
           for s in stages]],
        [f"activations (recompute {plan.cfg.model.options.recompute}, micro-batches in flight: "
         f"{'/'.join(str(s.in_flight) for s in stages)})", *[fmt(s.activations) for s in stages]],
        ["logits (last stage, in place)", *[fmt(s.logits) for s in stages]],
    ]
    if plan.cfg.model.options.routing_replay:
        held = ("the micro-batches in flight" if plan.cfg.model.options.recompute != "none"
                else "every micro-batch of the pass: no recompute pops them")
        rows.append([f"R3 routed experts and router ids ({held})", *[fmt(s.routing) for s in stages]])
    if plan.cfg.train.recompute_old_logprobs:
        ids = ", R3 ids of the running micro-batch" if plan.cfg.model.options.routing_replay else ""
        rows.append([f"log-prob pass instead of the above (forward only: one layer, logits{ids})",
                     *[fmt(s.logprob_pass) for s in stages]])
    rows += [
        ["reserved (CUDA context, NCCL, fragmentation)", *[fmt(s.reserved) for s in stages]],
        ["total", *[fmt(s.total) for s in stages]],
    ]
    header = [f"training memory per {'GPU' if plan.allocation.gpus_per_node else 'rank'} ({unit})", *[f"stage {s.params.stage}" for s in stages]]
    peak = max(s.total for s in plan.stages)
    return [*_table(header, rows), f"  → {_verdict(peak, plan.allocation)}", *_budget_room(plan)]


def _budget_room(plan: Plan) -> list[str]:
    """How far the token budget could go: choosing it is trading memory for fewer micro-batches."""
    if not plan.allocation.gpus_per_node:
        return []
    largest = largest_budget(plan)
    cp = plan.cfg.parallel.cp
    longest, share = longest_sample(plan.cfg), longest_share(plan.cfg)
    needs = f"{longest}" if cp == 1 else f"{share} of its {longest} on each of cp {cp} ranks"
    if largest is None:
        suggestion = suggested_context_parallelism(plan)
        split = "" if suggestion is None else (
            f"; parallel.cp={suggestion} fits it, {rank_positions(longest, suggestion)} positions a rank "
            f"(trainer.max_tokens_per_micro_batch ≥ that)")
        what = "one" if cp == 1 else "a share"
        return [f"  → no token budget fits: not even {what} of the longest sample ({needs} positions) does{split}"]
    return [f"  → memory allows trainer.max_tokens_per_micro_batch up to {largest} (the longest sample needs {needs})"]


def _rollout(plan: Plan) -> list[str]:
    r = plan.rollout
    if r is None:
        return []
    rows = [
        [f"weights (bf16, / tp {r.profile.tp})", gb(r.weights)],
        [f"KV cache ({r.profile.sequences} seq × {r.tokens_per_sequence} tokens × "
         f"{r.kv_bytes_per_token / 1024:.1f} KiB)" if r.resident_sequences is None else
         f"KV pool (the rest of the engine's pool: {r.resident_sequences} sequences of {r.tokens_per_sequence} "
         f"tokens at once; {r.inflight} requests in flight, the rest wait their turn)", gb(r.kv_cache)],
        ["engine runtime outside its pool (CUDA graphs, sampling, decode activations)", gb(RESERVED_BYTES)],
    ]
    residual = plan.trainer_residual
    if residual is not None:
        rows.append([f"colocated trainer's residual when offloaded (CUDA context, {residual.communicators} NCCL "
                     f"communicators: {', '.join(residual.groups) or 'none'})", gb(residual.total)])
    rows.append(["total", gb(plan.rollout_peak)])
    header = [f"rollout memory per GPU (GB, {plan.cfg.rollout.engine})", "engine"]
    lines = [*_table(header, rows), f"  → {_verdict(plan.rollout_peak, plan.allocation)}"]
    pool = plan.rollout_pool
    if pool is not None:
        ok = r.total <= pool
        ok = ok and r.resident_sequences != 0
        lines.append(f"  → weights + KV cache {gb(r.total)} GB {'within' if ok else 'EXCEED'} the engine's pool of "
                     f"{r.profile.pool_fraction:g} × {plan.allocation.gpu_memory_gb:g} GB = {gb(pool)} GB"
                     + ("" if ok else " (fewer sequences in flight, or more engine TP)" if r.resident_sequences is None
                        else " (it holds no full-length sequence: raise mem_fraction_static or engine TP)"))
        rest = plan.allocation.gpu_bytes - pool
        fits = plan.rollout_outside_pool <= rest
        lines.append(f"  → outside the pool {gb(plan.rollout_outside_pool)} GB {'within' if fits else 'EXCEED'} the "
                     f"(1 − {r.profile.pool_fraction:g}) × {plan.allocation.gpu_memory_gb:g} GB = {gb(rest)} GB it "
                     f"leaves" + ("" if fits else ": lower mem_fraction_static"))
    if r.inflight_cap is not None:
        lines.append(_inflight_line(plan))
    return lines


def _inflight_line(plan: Plan) -> str:
    r, engine = plan.rollout, plan.cfg.rollout.engine
    asked = r.profile.requested_inflight
    rule = (f"at most the {r.inflight_cap} full-length sequences its KV pool holds, so none is retracted for space "
            "(a response retracted for space leaves the loss)")
    if asked is None:
        return f"  → requests in flight per engine: {r.inflight} (rollout.{engine}.max_inflight unset: {rule})"
    if r.inflight_ok:
        return f"  → requests in flight per engine: {asked} (rollout.{engine}.max_inflight), within the rule: {rule}"
    return (f"  → requests in flight per engine: rollout.{engine}.max_inflight={asked} EXCEEDS the rule: {rule}; "
            f"set it ≤ {r.inflight_cap} or null")


# how each choice of cluster.offload reads in the report
_OFFLOAD_NAMES = {"nothing": "nothing: trainer and engines hold the GPU together",
                  "optimizer": "optimizer: its state to host memory, the weights stay",
                  "everything": "everything: weights and optimizer state to host memory"}


def _offload(plan: Plan) -> list[str]:
    """The colocated trainer's choices of what to hand the engines (planner/offload.py)."""
    offload = plan.offload
    if offload is None or not offload.options:
        return []
    chosen = offload.chosen
    rows = [[_OFFLOAD_NAMES[o.parts] + ("  ← chosen" if o is chosen else ""), gb(o.moved), gb(o.rollout_phase),
             gb(o.train_phase)] for o in offload.options]
    header = [f"colocated offload per GPU (GB; cluster.offload={offload.setting})", "moved each way",
              "engines generate", "trainer computes"]
    return [*_table(header, rows), f"  → {offload.describe()}"]


def _pass_cells(stats) -> list[str]:
    if stats is None:
        return ["-", "-", "-"]
    if stats.micro_batches == stats.most_micro_batches:  # the same in every simulated pass
        count = f"{stats.most_micro_batches}"
    else:
        count = f"{stats.micro_batches:.1f} (≤ {stats.most_micro_batches})"
    return [count, f"{stats.imbalance:.2f}", f"{stats.useful:.1%}"]


def _batches(plan: Plan) -> list[str]:
    estimate = plan.batches
    if estimate is None:
        return []
    cfg = plan.cfg
    budget = cfg.trainer.max_tokens_per_micro_batch
    runs = "runs" if cfg.train.recompute_old_logprobs else "off: train.recompute_old_logprobs"
    rows = [
        [f"minibatch of {estimate.minibatch.samples} ({cfg.train.minibatches_per_step} per step)",
         *_pass_cells(estimate.minibatch.padded), *_pass_cells(estimate.minibatch.packed)],
        [f"log-prob pass over the step's {estimate.logprob.samples} ({runs})",
         *_pass_cells(estimate.logprob.padded), *_pass_cells(estimate.logprob.packed)],
    ]
    packed = f"packed (≤ {budget})" if budget else "packed (off)"
    header = [f"micro-batches per DP rank, lengths {estimate.lengths}", f"padded (b={cfg.trainer.micro_batch_size})",
              "imbalance", "useful", packed, "imbalance", "useful"]
    return [*_table(header, rows),
            f"  → lengths {estimate.lengths}: {estimate.description}; mean {estimate.mean_positions:,.0f} "
            f"positions a sample; means of {estimate.steps} simulated steps (seed {estimate.seed}); imbalance = "
            "busiest DP rank's cost / the mean's, useful = real / paid positions (the trainer's own balancer on "
            "the drawn lengths: bpo_megatron/planner/batches.py)"]


def _writers(ranks, distributed: bool) -> str:
    kinds = {}
    for r in ranks:
        kind = ("dense and expert" if r.dense_writer and r.expert_writer else "dense" if r.dense_writer
                else "expert" if r.expert_writer else None)
        kinds[kind] = kinds.get(kind, 0) + 1
    parts = [f"{n} write {kind} weights{'' if distributed else ' and optimizer state'}"
             for kind, n in kinds.items() if kind]
    if None in kinds:
        parts.append(f"{kinds[None]} no weights")
    return ("each writes its own optimizer shard; " if distributed else "") + ", ".join(parts)


def _host(plan: Plan) -> list[str]:
    from bpo_megatron.planner.host import HOST_MARGIN_FRACTION, HOST_PROCESS_BYTES_PER_GPU

    host = plan.host
    if host is None:
        return []
    ranks = host.save_ranks
    counted = host.counted_at_save
    if plan.offload is None:
        pinned = "pinned offload buffers (not colocated: none)"
    else:
        kept = "kept across saves" if host.fits else "dropped before each save, counted"
        pinned = f"pinned offload buffers (cluster.offload: {plan.offload.parts}; allocated before step 1, {kept})"
    state_row = ("fp32 master weights + 2 Adam moments, each rank its own shard (12 B per parameter it owns)"
                 if plan.distributed_optimizer else
                 "fp32 master weights + 2 Adam moments, DP rank 0 of each optimizer (12 B per parameter)")
    rows = [
        [pinned, gb(sum(r.pinned for r in ranks))],
        [state_row, gb(sum(r.fp32_state for r in ranks))],
        ["model weights written (DP rank 0 of each optimizer), staged from the GPU",
         gb(sum(r.weights for r in ranks))],
        [f"margin ({HOST_MARGIN_FRACTION:.0%} + {gb(HOST_PROCESS_BYTES_PER_GPU)} GB per GPU)",
         gb(host.at_save - counted)],
        ["at a checkpoint save (blocking or background: the staged copy is held until written)", gb(host.at_save)],
        ["at a load (every rank: its shard's fp32 state, 12 B per parameter) + margin", gb(host.at_load)],
    ]
    writers = _writers(ranks, plan.distributed_optimizer)
    header = [f"host memory of the busiest trainer node (GB; {len(ranks)} ranks: {writers})", "node"]
    where = f"{plan.allocation.host_memory_gb:g} GB per node (plan --host-memory-gb)"
    spare = host.node_bytes - host.peak
    verdict = (f"fits in {where}, {gb(spare)} GB spare" if spare >= 0
               else f"does NOT fit in {where}: {gb(-spare)} GB over")
    return [*_table(header, rows), f"  → {verdict}"]


def _driver(plan: Plan) -> list[str]:
    from bpo_megatron.planner.host import DRIVER_BASE_GIB, driver_memory_gib, sampler_head_bytes, step_sample_bytes

    samples = step_sample_bytes(plan.cfg) / 2**30
    head = sampler_head_bytes(plan.cfg)
    centering = (f", score centering's top-{plan.cfg.loss.score_centering_top_k} included ({head} bytes a response "
                 "token)") if head else ""
    return [f"driver host memory: {driver_memory_gib(plan.cfg)} GiB (a step's samples, {samples:.1f} GiB at their "
            f"longest{centering}, held twice, + {DRIVER_BASE_GIB} GiB); each data-parallel share written to the object "
            "store once"]


def _pace(plan: Plan) -> list[str]:
    """Engines on GPUs of their own: the estimated rollout and training times of a step, and the
    engines that keep pace (bpo_megatron/planner/overlap.py)."""
    from bpo_megatron.planner.overlap import step_times

    if plan.cfg.cluster.colocate:
        return []
    times = step_times(plan)
    if times is None:
        return []
    need = (f"{times.engines_to_keep_pace} engine(s) keep pace" if times.engines_to_keep_pace is not None
            else "no engine count keeps pace")
    asynchronous = plan.cfg.train.asynchronous.max_staleness
    mode = (f"train.async.max_staleness={asynchronous}: the slower side sets the step" if asynchronous
            else "synchronous (train.async.max_staleness=0): each side waits for the other, the step is their sum")
    return [f"pace (engines on their own GPUs; an estimate, assumptions in bpo_megatron/planner/overlap.py): rollout "
            f"≈ {times.rollout_s:.0f} s per step on {times.engines} engine(s), training ≈ {times.train_s:.0f} s on "
            f"{plan.cfg.cluster.trainer_ranks} ranks, so {times.waits}; {need} (rollout.num_engines); {mode}"]


def _sync(plan: Plan) -> list[str]:
    from bpo_megatron.planner.sync import diffed_params, expected_delta_sync, expected_sync

    estimate = expected_sync(plan.cfg, plan.hf, plan.model_size[0])
    if estimate is None:
        return []
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in estimate.parts.items())
    delta = expected_delta_sync(plan.cfg, plan.hf, plan.model_size[0], diffed_params(plan))
    sent = (f"{delta.wire_bytes / 1e9:.2f} of {plan.model_size[0] * 2 / 1e9:.1f} GB at {delta.changed_share:.1%} of the "
            "bf16 weights changed")
    if delta.seconds is None:
        delta_line = (f"delta weight sync ({delta.transport}): none; SGLang's update_weights_from_distributed loads "
                      f"whole tensors only, and every tensor has a change ({sent} if it took sparse pieces)")
    else:
        delta_parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in delta.parts.items())
        delta_line = (f"delta weight sync ({delta.transport} with sparse pieces through a custom loader; not built: weight_sync.delta sends SGLang the changed tensors whole, and colocated engines drop their weights, so it is refused there): ≈ {delta.seconds:.1f} s per step, {sent} "
                      f"({delta_parts}, the busiest rank comparing {delta.diff_bytes / 1e9:.1f} GB held on its GPU; "
                      "bpo-megatron bench sync sets it beside full syncs and measured anchors)")
    return [f"weight sync ({estimate.transport}): ≈ {estimate.seconds:.1f} s per step ({parts}; assumptions in "
            "bpo_megatron/planner/sync.py)", delta_line]


def format_plan(plan: Plan) -> str:
    lines = _header(plan) + ["", "layout checks"]
    lines += [f"  {'ok  ' if c.ok else 'FAIL'}  {c.message}" for c in plan.checks]
    if plan.stages:
        lines += ["", *_training(plan)]
    if plan.batches:
        lines += ["", *_batches(plan)]
    if plan.rollout:
        lines += ["", *_rollout(plan)]
    if plan.offload is not None and plan.offload.options:
        lines += ["", *_offload(plan)]
    if plan.host:
        lines += ["", *_host(plan)]
    lines += ["", *_driver(plan), *_sync(plan), *_pace(plan)]
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    why = [] if plan.fits else [
        "layout checks failed" if not plan.layout_ok else "",
        "memory exceeds the GPU" if not plan.memory_ok else "",
        "host memory exceeds the node" if not plan.host_ok else "",
        "requests in flight exceed the KV pool" if not plan.inflight_ok else "",
    ]
    reasons = "; ".join(w for w in why if w)
    lines += ["", f"verdict: {verdict}" + (f" ({reasons})" if reasons else "")]
    return "\n".join(lines)


def format_sweep(result: SweepResult, allocation: Allocation, limit: int | None = None) -> str:
    title = (f"layouts that fit on {allocation.nodes} node(s) × {allocation.gpus_per_node} GPUs × "
             f"{allocation.gpu_memory_gb:g} GB (best first: fewer pipeline stages, less TP, less CP, less "
             f"expert TP, lower peak)")
    plans = result.plans
    if not plans:
        reasons = [f"  {count} × {why}" for why, count in list(result.rejected.items())[:5]]
        return "\n".join([title, "  none; rejected layouts:", *reasons])
    shown = plans if limit is None else plans[:limit]
    rows = [[str(pl.cfg.parallel.tp), str(pl.cfg.parallel.pp), str(pl.cfg.parallel.cp), str(pl.cfg.parallel.ep),
             str(pl.cfg.parallel.expert_tp), str(pl.dp), gb(pl.train_peak), gb(pl.rollout_peak)]
            for pl in shown]
    lines = [title, *_table(["tp", "pp", "cp", "ep", "etp", "dp", "train GB", "rollout GB"], rows)]
    if len(shown) < len(plans):
        lines.append(f"  ... and {len(plans) - len(shown)} more (--limit)")
    return "\n".join(lines)
