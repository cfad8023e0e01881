"""The embedded engine's decode loop, run op by op (``eager``) and, on a GPU in bf16, as one CUDA graph
per step with FlashAttention (``cuda_graph``), side by side on the throughput model (random weights)
at each batch size of the profile, every response running to the same length. ``eager`` on the GPU
separates what the kernels change from what graph capture could break.

Per run: rollout tokens/s, the decode step time (the difference between a full-length and a one-
token generation of the same rows, over the steps between them, so prefill is left out; both run on
the decode state a full-length warm-up built, so graph capture and compilation are too) and the
memory bandwidth that step achieves: the bytes a decode step must read — every weight once (the
input embedding only for the rows fed; all experts counted, as a batch of this size touches all of
them) and each row's keys and values so far — over the step time, against the device's data-sheet
bandwidth. Both are scored against a teacher-forced recompute (transformers' own forward over the
whole sequence, the trainer's view) in fp32 — a bf16 recompute runs the eager loop's attention
kernel (SDPA) and would favour it over the graphed step's FlashAttention; its numbers are reported
beside — : log μ and the routed experts. On CUDA the graphed step also
runs with its layers through ``torch.compile`` (``rollout.hf.compile``) at the largest size, scored
on as many rows as the first size; the better graphed variant must reach ``HBM_FLOOR`` of the data-
sheet bandwidth there.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import device_name, timed
from bpo_megatron.gpu_smoke.profiles import Profile, hbm_peak_bytes_per_s
from bpo_megatron.gpu_smoke.report import Outcome
from bpo_megatron.testing.recompute import teacher_forced
from bpo_megatron.testing import random_tokens, same_expert_sets

TEMPERATURE = 1.0
HBM_FLOOR = 0.40  # of the data-sheet bandwidth the graphed loop reaches at the largest batch (CUDA)
COMPILED_SUFFIX = "+compile"
COMPILED = "cuda_graph" + COMPILED_SUFFIX
RECOMPUTE_ROWS = 4  # rows per teacher-forced forward (full-vocabulary fp32 log-softmax per position)


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


def _recompute(model: torch.nn.Module, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """|log μ − recomputed log μ| of every response token, and for every processed (token, MoE
    layer) whether the recompute routed it to the same experts; samples of one length."""
    gaps, same = [], []
    for start in range(0, len(samples), RECOMPUTE_ROWS):
        group = samples[start:start + RECOMPUTE_ROWS]
        tokens = torch.stack([s.tokens for s in group]).to(platform.device())
        prompt = group[0].prompt_tokens.numel()
        logprobs, routed = teacher_forced(model, tokens, TEMPERATURE, start=prompt - 1)
        response = tokens[:, prompt:]
        recomputed = logprobs.gather(2, response[..., None])[..., 0].cpu()
        gaps.append((recomputed - torch.stack([s.rollout_logprobs for s in group])).abs().flatten())
        if routed is not None:
            routed = routed.cpu()
            same += [same_expert_sets(routed[i], s.routed_experts).flatten() for i, s in enumerate(group)]
        del logprobs
    return torch.cat(gaps), torch.cat(same) if same else torch.ones(0, dtype=torch.bool)


def run(profile: Profile, workdir: Path) -> Outcome:
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    out = Outcome("rollout_decode")
    model = decode_model(profile)
    graphs = platform.has_cuda() and profile.dtype == "bf16"
    paths = ("eager",) + (("cuda_graph",) if graphs else ())
    new_path = paths[-1]
    largest = max(profile.decode_sequences)
    # the graphed step with its layers through torch.compile (rollout.hf.compile), at the largest
    # size only: compiling once per shape costs tens of seconds
    compiled = (COMPILED,) if graphs else ()
    peak = hbm_peak_bytes_per_s(device_name()) if platform.has_cuda() else None
    steps = profile.decode_new_tokens
    rows_table, speedups, scored = [], {}, {}
    for sequences in profile.decode_sequences:
        prompts = random_tokens(sequences, profile.decode_prompt_tokens, model.config.vocab_size, seed=sequences)

        def requests(max_new_tokens: int) -> list:
            return [GenerationRequest(f"p{i}", p, SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new_tokens,
                                                                  seed=i))
                    for i, p in enumerate(prompts)]

        per_path = {}
        for path in paths + (compiled if sequences == largest else ()):
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
            mean_context = profile.decode_prompt_tokens + steps / 2
            bandwidth = step_bytes(model, sequences, mean_context) / step_s
            per_path[path] = (samples, times["full_s"])
            rows_table.append(dict(sequences=sequences, path=path, rollout_s=times["full_s"],
                                   tokens_per_s=generated / times["full_s"], decode_step_ms=1e3 * step_s,
                                   achieved_gb_per_s=bandwidth / 1e9,
                                   hbm_fraction=bandwidth / peak if peak else float("nan")))
            out.require(generated == sequences * steps,
                        f"{path}, {sequences} sequences: every response ran to {steps} tokens ({generated})")
        speedups[sequences] = per_path["eager"][1] / per_path[new_path][1]
        if sequences == profile.decode_sequences[0]:  # scored against the recompute at the first size
            scored.update({path: samples for path, (samples, _) in per_path.items()})
        if COMPILED in per_path:  # and the compiled step on as many of its rows
            scored[COMPILED] = per_path[COMPILED][0][:profile.decode_sequences[0]]
    # the recompute in fp32 (the exact routing the bf16 paths approximate), and in the model's dtype
    exact_model = model if profile.dtype == "fp32" else copy.deepcopy(model).float()
    agreement = {path: _recompute(exact_model, samples) for path, samples in scored.items()}
    same_dtype = agreement if exact_model is model else {path: _recompute(model, samples)
                                                           for path, samples in scored.items()}
    del exact_model

    out.tables["rollout tokens/s by decode path"] = rows_table
    for row in rows_table:
        key = f"{row['path']}_{row['sequences']}"
        out.numbers.update({f"{key}_tokens_per_s": row["tokens_per_s"], f"{key}_step_ms": row["decode_step_ms"],
                            f"{key}_hbm_gb_per_s": row["achieved_gb_per_s"]})
    for sequences, speedup in speedups.items():
        out.numbers[f"speedup_{sequences}"] = speedup
    out.numbers["hbm_peak_tb_per_s"] = (peak or float("nan")) / 1e12
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
    # flip; the graphed step (FlashAttention) must do no worse than the same step op by op (SDPA),
    # half a percentage point of slack
    wanted = 1.0 if exact else reference - 0.005
    out.require(float(same.float().mean()) >= wanted,
                f"{new_path}: the routing it records is the fp32 recompute's "
                f"{'on every (token, layer)' if exact else 'as often as in the eager loop (−0.5 pt)'} "
                f"({float(same.float().mean()):.4%} of {same.numel()}; eager {reference:.4%})")
    fractions = {r["path"]: r["hbm_fraction"] for r in rows_table if r["sequences"] == largest}
    for path, value in fractions.items():
        out.numbers[f"{path}_{largest}_hbm_fraction"] = value
    fraction = fractions[new_path]
    if graphs:
        out.require(all(s > 1.0 for s in speedups.values()),
                    f"cuda_graph is faster than the eager loop at every size ({speedups})")
        gaps, same = agreement[COMPILED]
        out.require(float(gaps.mean()) <= profile.logp_mean_tol and float(same.float().mean()) >= wanted,
                    f"{COMPILED}: log μ and routing against the recompute as for cuda_graph (mean |Δ| "
                    f"{float(gaps.mean()):.2e}, routing {float(same.float().mean()):.4%})")
        best = max((COMPILED, new_path), key=lambda p: fractions[p])
        out.require(fractions[best] >= HBM_FLOOR,
                    f"the graphed step at {largest} sequences reaches ≥ {HBM_FLOOR:.0%} of the data-sheet HBM "
                    f"bandwidth (best: {best}, {fractions[best]:.1%} of {(peak or float('nan')) / 1e12:.2f} TB/s; "
                    f"cuda_graph {fractions[new_path]:.1%}, {COMPILED} {fractions[COMPILED]:.1%})")
    else:
        out.notes.append(f"Not required here (no CUDA graph on {platform.device().type} in {profile.dtype}): a graphed "
                         f"loop faster than eager and ≥ {HBM_FLOOR:.0%} of the HBM bandwidth at {largest} sequences; "
                         f"{new_path} reached {fraction:.1%} of {'the data sheet' if peak else 'no known peak (nan)'}.")
    out.notes.append("HBM bandwidth counts the bytes a step must read (weights once, all experts; "
                     "each row's keys and values so far, at the mean context), not what a loop actually "
                     "moves (the sampling, the routing capture and the slot bookkeeping read more).")
    return out
