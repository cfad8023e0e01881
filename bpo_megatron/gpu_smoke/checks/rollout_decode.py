"""The embedded engine's decode loop, run op by op (``eager``) and, on a GPU in bf16, as one CUDA graph
per step (``cuda_graph``; at the largest size also with its layers through ``torch.compile``), on the
throughput model (random weights), and its step timed at set contexts.

1. Generations, at each batch size of the profile, every response running to the same length:
   rollout tokens/s, the decode step time (the difference between a full-length and a one-token
   generation of the same rows over the steps between them, so prefill is left out; both on the
   decode state a full-length warm-up built, so graph capture and compilation are too) and the
   memory bandwidth that step achieves: the bytes a decode step must read — every weight once (the
   input embedding only for the rows fed; all experts counted, as a batch of this size touches all
   of them) and each row's keys and values so far — over the step time, against the device's
   data-sheet bandwidth. The eager loop runs shorter responses (``decode_scored_tokens``): it is
   there for its step time (``speedup_<rows>``: its step time over the graphed step's) and as the
   reference the graph is scored against.
2. Scores, on the same rows (the largest size's first rows, their first ``decode_scored_tokens``
   response tokens) for every path: log μ and the routed experts against a teacher-forced recompute
   (transformers' own forward over the whole sequence, the trainer's view) in fp32 — a bf16
   recompute runs SDPA and would favour neither path; its numbers are reported beside. Eager and
   graphed steps run the same kernels (FlashAttention on a GPU in bf16, graphed or not:
   ``decode.attention_for``), so the graph must agree with the recompute as often as the eager loop
   does — capture changes no number. (Until 2026-11 the eager loop ran SDPA over the whole slot with
   a mask — for a masked grouped-query call torch picks another kernel than FlashAttention, and its
   math kernel computes bf16 attention in fp32 — and the compiled step was scored on other prompts
   than the two others: the H200's 93.3% graphed vs 94.9% eager compared attention kernels, not the
   capture.)
3. Decode points (:mod:`bpo_megatron.gpu_smoke.decode_steps`): at the largest size, the step replayed
   with every row at each context of ``decode_points`` (today's 192 and RL-shaped 576 and 1,088 on a
   GPU), with plain sampling and with top-k/top-p on (rows alternating top-p 0.95 and top-k 50), on
   every graphed variant (on a CPU the eager step): step time and HBM fraction; one replay of each
   plain-sampling variant profiled at the middle point (kernels, GPU-busy time, the trace under the
   work directory's ``traces/``). The goals: the best graphed variant at ≥ 40% of the data-sheet HBM
   bandwidth at context 576 and ≥ 33% at 192, top-k/top-p costing at most 10% more a step.
"""

from __future__ import annotations

import copy
import gc
import math
from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import device_name, timed
from bpo_megatron.gpu_smoke.decode_steps import WARMUP, build_state, profile_step, time_step
from bpo_megatron.gpu_smoke.profiles import Profile, hbm_peak_bytes_per_s
from bpo_megatron.gpu_smoke.report import Outcome
from bpo_megatron.testing.recompute import teacher_forced
from bpo_megatron.testing import random_tokens, same_expert_sets

TEMPERATURE = 1.0
HBM_GOALS = {"ctx576": 0.40, "ctx192": 0.33}  # of the data-sheet bandwidth, the best graphed variant
FILTERED_COST = 1.10  # a step with top-k/top-p on, against plain sampling (best graphed variant, ctx576)
COST_POINT = "ctx576"
COMPILED_SUFFIX = "+compile"
COMPILED = "cuda_graph" + COMPILED_SUFFIX
RECOMPUTE_ROWS = 4  # rows per teacher-forced forward (full-vocabulary fp32 log-softmax per position)
SAMPLINGS = ("plain", "filtered")


def decode_model(profile: Profile):
    """The throughput model with random weights spread far from routing ties, on the device in the
    profile's precision."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.testing.models import spread_weights_

    config = AutoConfig.for_model(**profile.large_model)
    torch.manual_seed(0)
    with torch.device(platform.device()):  # random weights initialised where they live
        model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[profile.dtype])
    spread_weights_(model)  # routing far from ties, so a recompute can be compared expert by expert
    return model.requires_grad_(False).eval()


def step_bytes(model: torch.nn.Module, rows: int, mean_context: float) -> float:
    """Bytes one decode step of ``rows`` rows reads: every weight once (the input embedding only
    for the rows fed) and ``mean_context`` keys and values per row and layer."""
    config = model.config
    embedding = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= embedding.numel() * embedding.element_size() * (0 if config.tie_word_embeddings else 1)
    weights += rows * config.hidden_size * embedding.element_size()
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * embedding.element_size()
    return weights + rows * mean_context * kv_per_token


def _recompute(model: torch.nn.Module, samples: list, scored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """|log μ − recomputed log μ| of the first ``scored`` response tokens of every sample, and for
    every (token, MoE layer) processed up to them whether the recompute routed it to the same
    experts; samples of one prompt length."""
    gaps, same = [], []
    for start in range(0, len(samples), RECOMPUTE_ROWS):
        group = samples[start:start + RECOMPUTE_ROWS]
        prompt = group[0].prompt_tokens.numel()
        tokens = torch.stack([torch.cat([s.prompt_tokens, s.response_tokens[:scored]]) for s in group])
        logprobs, routed = teacher_forced(model, tokens.to(platform.device()), TEMPERATURE, start=prompt - 1)
        recomputed = logprobs.gather(2, tokens[:, prompt:, None].to(logprobs.device))[..., 0].cpu()
        gaps.append((recomputed - torch.stack([s.rollout_logprobs[:scored] for s in group])).abs().flatten())
        if routed is not None:
            routed = routed.cpu()
            same += [same_expert_sets(routed[i], s.routed_experts[:prompt + scored - 1]).flatten()
                     for i, s in enumerate(group)]
        del logprobs
    return torch.cat(gaps), torch.cat(same) if same else torch.ones(0, dtype=torch.bool)


def _generations(model, profile: Profile, paths: tuple[str, ...], compiled: tuple[str, ...], peak: float | None,
                 out: Outcome) -> tuple[list[dict], dict[str, list]]:
    """Part 1: the table of generations, and each path's samples at the largest size."""
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    largest = max(profile.decode_sequences)
    table, samples_of = [], {}
    for sequences in profile.decode_sequences:
        prompts = random_tokens(sequences, profile.decode_prompt_tokens, model.config.vocab_size, seed=sequences)

        def requests(max_new_tokens: int) -> list:
            return [GenerationRequest(f"p{i}", p, SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new_tokens,
                                                                  seed=i))
                    for i, p in enumerate(prompts)]

        for path in paths + (compiled if sequences == largest else ()):
            steps = profile.decode_scored_tokens if path == "eager" else profile.decode_new_tokens
            engine = HFEngine(model, capture_routing=True, max_batch_rows=sequences,
                              decode=path.removesuffix(COMPILED_SUFFIX), compile_layers=path.endswith(COMPILED_SUFFIX))
            # warm-up at full length: builds (captures, compiles) the decode state the timed runs
            # use — the engine keeps it, and the one-token run is served by it too
            engine.generate(requests(steps))
            times: dict[str, float] = {}
            with timed(times, "full_s"):
                samples = engine.generate(requests(steps))
            with timed(times, "one_s"):
                engine.generate(requests(1))
            engine.shutdown()
            generated = sum(s.response_tokens.numel() for s in samples)
            # a difference of two timings: on a CPU at the kit's tiny size it can be noise (nan then)
            step_s = (times["full_s"] - times["one_s"]) / (steps - 1)
            step_s = step_s if step_s > 0 else float("nan")
            bandwidth = step_bytes(model, sequences, profile.decode_prompt_tokens + steps / 2) / step_s
            table.append(dict(sequences=sequences, path=path, new_tokens=steps, rollout_s=times["full_s"],
                              tokens_per_s=generated / times["full_s"], decode_step_ms=1e3 * step_s,
                              achieved_gb_per_s=bandwidth / 1e9, hbm_fraction=bandwidth / peak if peak else float("nan")))
            out.require(generated == sequences * steps,
                        f"{path}, {sequences} sequences: every response ran to {steps} tokens ({generated})")
            if sequences == largest:
                samples_of[path] = samples[:profile.decode_sequences[0]]
    return table, samples_of


def _decode_points(model, profile: Profile, variants: list[tuple[str, bool, bool]], peak: float | None,
                   traces: Path, out: Outcome) -> list[dict]:
    """Part 3: each variant's step replayed at every decode point, plain and filtered; one plain
    replay of each profiled at the middle point."""
    from bpo_megatron.rollout.hf.slots import MIN_LENGTH, bucket

    rows, steps = max(profile.decode_sequences), profile.decode_point_steps
    length = bucket(max(p.context for p in profile.decode_points) + steps + WARMUP + 1, MIN_LENGTH)
    profiled = profile.decode_points[len(profile.decode_points) // 2]
    table = []
    for path, cuda_graph, compile_layers in variants:
        for sampling in SAMPLINGS:
            state = build_state(model, rows, length, cuda_graph=cuda_graph, compile_layers=compile_layers,
                                filtered=sampling == "filtered")
            for point in profile.decode_points:
                step_s = time_step(state, point.context, steps, model.config.vocab_size)
                bandwidth = step_bytes(model, rows, point.context) / step_s
                table.append(dict(point=point.label, context=point.context, sampling=sampling, path=path,
                                  decode_step_ms=1e3 * step_s, achieved_gb_per_s=bandwidth / 1e9,
                                  hbm_fraction=bandwidth / peak if peak else float("nan")))
                if sampling == "plain" and point == profiled:
                    slug = path.replace("+", "_")
                    numbers = profile_step(state, traces / f"decode_step_{slug}_{point.label}.json.gz")
                    out.numbers.update({f"{path}_{key}_per_step" if key != "profiled_ms" else f"{path}_profiled_ms": v
                                        for key, v in numbers.items()})
            del state
            gc.collect()  # a state and its graph refer to each other
            platform.release_cached_memory()
    return table


def run(profile: Profile, workdir: Path) -> Outcome:
    out = Outcome("rollout_decode")
    model = decode_model(profile)
    graphs = platform.has_cuda() and profile.dtype == "bf16"
    paths = ("eager",) + (("cuda_graph",) if graphs else ())
    new_path = paths[-1]
    # the graphed step with its layers through torch.compile (rollout.hf.compile), at the largest
    # size only: compiling once per shape costs tens of seconds
    compiled = (COMPILED,) if graphs else ()
    peak = hbm_peak_bytes_per_s(device_name()) if platform.has_cuda() else None
    rows_table, samples_of = _generations(model, profile, paths, compiled, peak, out)
    out.tables["rollout tokens/s by decode path"] = rows_table
    for row in rows_table:
        key = f"{row['path']}_{row['sequences']}"
        out.numbers.update({f"{key}_tokens_per_s": row["tokens_per_s"], f"{key}_step_ms": row["decode_step_ms"],
                            f"{key}_hbm_gb_per_s": row["achieved_gb_per_s"], f"{key}_hbm_fraction": row["hbm_fraction"]})
    step_ms = {(r["path"], r["sequences"]): r["decode_step_ms"] for r in rows_table}
    speedups = {n: step_ms[("eager", n)] / step_ms[(new_path, n)] for n in profile.decode_sequences}
    for sequences, speedup in speedups.items():
        out.numbers[f"speedup_{sequences}"] = speedup
    out.numbers["hbm_peak_tb_per_s"] = (peak or float("nan")) / 1e12

    # part 2: every path scored on the same rows and tokens, in fp32 (the exact routing the bf16
    # paths approximate) and in the model's dtype
    scored = profile.decode_scored_tokens
    exact_model = model if profile.dtype == "fp32" else copy.deepcopy(model).float()
    agreement = {path: _recompute(exact_model, samples, scored) for path, samples in samples_of.items()}
    same_dtype = agreement if exact_model is model else {path: _recompute(model, samples, scored)
                                                           for path, samples in samples_of.items()}
    del exact_model
    platform.release_cached_memory()  # the fp32 copy's memory, before the decode points' caches
    exact = profile.dtype == "fp32"  # fp32: summation order only; bf16 kernels may flip near-ties
    for path, (gaps, same) in agreement.items():
        out.numbers[f"{path}_logp_mean_abs_diff"] = float(gaps.mean())
        out.numbers[f"{path}_logp_max_abs_diff"] = float(gaps.max())
        out.numbers[f"{path}_routing_agreement"] = float(same.float().mean())
        if same_dtype is not agreement:  # against a recompute in the loop's own dtype (bf16), for reference
            out.numbers[f"{path}_logp_mean_abs_diff_{profile.dtype}_recompute"] = float(same_dtype[path][0].mean())
            out.numbers[f"{path}_routing_agreement_{profile.dtype}_recompute"] = float(same_dtype[path][1].float().mean())
    gaps, same = agreement[new_path]
    out.require(float(gaps.mean()) <= profile.logp_mean_tol,
                f"{new_path}: mean |log μ − recompute| ≤ {profile.logp_mean_tol:g} (got {float(gaps.mean()):.2e})")
    reference = float(agreement["eager"][1].float().mean())
    # bf16: the decode kernels round differently from the fp32 recompute, so near-tied routers may
    # flip; the graphed step runs the eager step's kernels, half a percentage point of slack
    wanted = 1.0 if exact else reference - 0.005
    out.require(float(same.float().mean()) >= wanted,
                f"{new_path}: the routing it records is the fp32 recompute's "
                f"{'on every (token, layer)' if exact else 'as often as in the eager loop (−0.5 pt)'} "
                f"({float(same.float().mean()):.4%} of {same.numel()}; eager {reference:.4%})")
    if graphs:
        equal = [torch.equal(g.response_tokens[:scored], e.response_tokens)
                 for g, e in zip(samples_of[new_path], samples_of["eager"])]
        out.numbers[f"{new_path}_rows_equal_to_eager"] = sum(equal) / len(equal)
        out.require(all(s > 1.0 for s in speedups.values()),
                    f"cuda_graph's step is faster than the eager loop's at every size ({speedups})")
        gaps, same = agreement[COMPILED]
        out.require(float(gaps.mean()) <= profile.logp_mean_tol and float(same.float().mean()) >= wanted,
                    f"{COMPILED}: log μ and routing against the recompute as for cuda_graph (mean |Δ| "
                    f"{float(gaps.mean()):.2e}, routing {float(same.float().mean()):.4%})")

    # part 3: the decode points
    variants = [("cuda_graph", True, False), (COMPILED, True, True)] if graphs else [("eager", False, False)]
    points = _decode_points(model, profile, variants, peak, workdir / "traces", out)
    out.tables["decode step by context (replayed, largest size)"] = points
    for row in points:
        key = f"{row['path']}_{row['point']}_{row['sampling']}"
        out.numbers.update({f"{key}_step_ms": row["decode_step_ms"], f"{key}_hbm_fraction": row["hbm_fraction"]})
    for point in profile.decode_points:
        plain = {r["path"]: r for r in points if r["point"] == point.label and r["sampling"] == "plain"}
        graphed = [path for path in plain if path != "eager"]
        best = max(graphed, key=lambda p: plain[p]["hbm_fraction"]) if graphed else None
        out.numbers[f"best_graph_hbm_fraction_{point.label}"] = plain[best]["hbm_fraction"] if best else float("nan")
        if best is None:
            continue
        filtered = next(r for r in points if (r["point"], r["sampling"], r["path"]) == (point.label, "filtered", best))
        ratio = filtered["decode_step_ms"] / plain[best]["decode_step_ms"]
        out.numbers[f"filtered_step_ratio_{point.label}"] = ratio
        if point.label in HBM_GOALS:
            out.require(plain[best]["hbm_fraction"] >= HBM_GOALS[point.label],
                        f"the best graphed step at {max(profile.decode_sequences)} rows, context {point.context}, "
                        f"reaches ≥ {HBM_GOALS[point.label]:.0%} of the data-sheet HBM bandwidth (best: {best}, "
                        f"{plain[best]['hbm_fraction']:.1%} of {(peak or math.nan) / 1e12:.2f} TB/s, "
                        f"{plain[best]['decode_step_ms']:.2f} ms a step)")
        if point.label == COST_POINT:
            out.require(ratio <= FILTERED_COST,
                        f"{best} at context {point.context}: top-k/top-p on costs ≤ {FILTERED_COST - 1:.0%} more a "
                        f"step (×{ratio:.3f})")
    if not graphs:
        out.notes.append(f"Not required here (no CUDA graph on {platform.device().type} in {profile.dtype}): a graphed "
                         f"loop faster than eager, and the HBM goals at the decode points "
                         f"({', '.join(f'{v:.0%} at {k}' for k, v in HBM_GOALS.items())}).")
    out.notes.append("HBM bandwidth counts the bytes a step must read (weights once, all experts; "
                     "each row's keys and values so far, at the mean context), not what a loop actually "
                     "moves (the sampling, the routing capture and the slot bookkeeping read more). Decode "
                     "points replay the step with every row at the context; the traces: "
                     "traces/decode_step_*.json.gz.")
    return out
