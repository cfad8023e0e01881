"""Activation memory of one training micro-batch on one rank: what the local spec with the fused
core attention keeps for backward, term by term, measured.

Every term below is what autograd saves during a forward of the local spec (Megatron's torch
modules, ``model.attention: fused``, the grouped experts and the sorted dispatch of
``bpo_megatron.models``), counted by buffer: views of one buffer (the key and value split from the
fused QKV output, the gate and up halves of fc1's output) are one. ``tests/test_activation_memory.py``
measures it (``bpo_megatron.testing.activations``: a ``saved_tensors_hooks`` pack hook over one
forward, fp32, on CPU, at two lengths and layer counts, TP 1 and TP 2 with sequence parallelism)
and checks every per-token term and per-layer constant here against it within 1%; they agree to the
byte. (Megatron's dispatchers, ``model.moe_dispatch: megatron``, keep a boolean routing map and one
int64 index per routed row where the sorted dispatch keeps two and the top-k ids: up to 0.5% less
per MoE layer in the measured shapes.)

Per token of the micro-batch and layer on one rank, with ``b`` bytes per activation (the model
dtype), tensor parallelism ``tp`` with sequence parallelism (norms, residuals and routers work on a
sequence shard; attention heads, MLP columns and expert rows are split), ``h`` hidden size,
``q``/``kv`` query/key-value heads of width ``d``, ``ffn`` the dense MLP's width, ``E`` experts of
width ``I``, top-``k`` routing, ``etp`` expert tensor parallelism, and no dropout:

attention   (2h·b + 2·norm(h)          the input norm's and the pre-MLP norm's inputs, with what
                                       each norm keeps beyond its input
             + b·h                     the QKV linear's input (the input norm's output)
             + b·(q + 2kv)·d           the fused QKV output (the k norm's input and flash
                                       attention's v are views of it)
             + b·q·d if kv/tp > 1      the query copied out of it (grouped heads are interleaved
                                       with their keys; with one group per rank it is a view),
                                       kept as the q norm's input: without QK-norm nothing keeps it
                                       (RoPE multiplies by constant cos and sin, saving only those)
             + q·norm(d) + kv·norm(d)  the q and k norms (per head, beyond their inputs; without
                                       QK-norm, as in GLM-4.5-Air, none)
             + b·(q + kv)·d            the rotated q and k that flash attention keeps
             + b·q·d + 4q) / tp        its output (the output projection's input, the same
                                       buffer) and its fp32 log-sum-exp per head
            + 4·b·r                    RoPE's cos and sin of the query's and the key's call over
                                       the r = d·rotary_percent rotated dims (not split: every TP
                                       rank rotates the whole sequence)
dense MLP   b·(h + 5·ffn) / tp         fc1's input and output (gate and up), SiLU(gate), up +
                                       glu_linear_offset (a new buffer even at 0), their product
                                       (fc2's input)
MoE MLP     (b·h + 4E + 20k) / tp      the router's input, the fp32 probabilities ``[T, E]`` (the
                                       dispatcher's gather keeps them) and per top-k slot the
                                       router's int64 id, fp32 probability and the dispatcher's
                                       int64 id
            + 4·(E + 1) / tp           with sigmoid scoring (GLM-4.5): the fp32 sigmoid scores
                                       ``[T, E]`` and the renormalisation's denominator
            + k·etp/tp · (b·(h + 6·I/etp) + 20)
                                       per routed row (``k·etp/tp`` rows per token: each row on
                                       the ``etp`` ranks of its expert): the dispatched hidden
                                       state, fc1's output (2·I/etp), SiLU, up + offset, their
                                       product, the product times the row's probability (fc2's
                                       input), the fp32 probability and two int64 permutation
                                       indices. Routing is assumed balanced (R3 replays the
                                       engine's routing; there is no capacity dropping).
            + b·5·S / tp               a shared expert of width S (GLM-4.5): a dense MLP whose
                                       input is the router's

latent      (2h·b + 2·norm(h)          multi-head latent attention (DeepSeek-V3) instead of the
attention    + b·h + b·r               attention above: the layer norms; the down projections' input
             + 2b·c + norm(c)          and the shared key part RoPE rotates (r dims); the key/value
             + 2b·c_q + norm(c_q)      latent (c = kv_lora_rank) and, with a compressed query, the
             + heads·(4b·k + b·v + 4)) query latent (c_q), each as its norm's input and output; per
              / tp                     head of query/key width k = nope + r and value width v: the
            + 4·b·r                    query, the key, the value zero-padded to k, the padded output
                                       (and its fp32 log-sum-exp), the output cut to v; RoPE's cos
                                       and sin as above

The tiny GLM-4.5 shape (no QK-norm, Q/K/V biases, RoPE over half of each head, a shared expert,
sigmoid routing with a bias and a scale, the first layer dense) is measured as well.

``norm(w)`` is what an RMSNorm over ``w`` features keeps beyond its input: its fp32 ``rstd``, 4
bytes, on a GPU (torch's fused ``_fused_rms_norm`` saves the input and ``rstd``); on a CPU torch
composes it of elementwise ops, which also keep ``x·rstd``, ``b·w`` more (``gpu=False``; the
measurement runs there). The plan counts what the ranks of its allocation run.

Per layer and micro-batch, whatever its length: the grouped experts (``model.expert_gemm:
grouped``) keep the int32 group offsets of their two ``torch._grouped_mm`` calls, 4 bytes per
local expert, until the micro-batch's backward; the layer's expert weights are saved as the
stacked parameters they are (no copy).

The ends of the model, per token: the first stage's int64 token ids (and the boolean vocabulary
mask of the vocab-parallel embedding under TP, 1 byte), the last stage's final norm
(``b·h + norm(h)``) and output layer's input (``b·h``), both ``/ tp``.

Recompute ``full`` (one layer per checkpoint) keeps only each layer's input, ``b·h / tp`` per
token, and the rotary angles ``[T, 1, 1, d]`` in fp32 once for all checkpoints (latent attention
computes its own inside each layer: none), and rebuilds one layer at a time in backward, so one
layer's full set is added once. The MoE dispatch adds the dispatched and the combined rows,
``2 · b · k · h / tp`` per token, live for one layer at a time (not kept for backward, so not
measured).

Transformer-engine's spec (``model.layer_spec: transformer_engine``) is assumed to keep no more than this: its norms are
fused into the following linear (input, rstd and the normalised output it multiplies), its fused
RoPE keeps no cos and sin, its attention keeps q, k, v, the output and the log-sum-exp as flash
attention does here, and its grouped experts keep no weight copy; the plan's figure is an upper
bound there. ``model.attention: unfused`` (Megatron's reference, the CPU default) keeps every
head's ``[s, s]`` probabilities, which is not modelled: the plan assumes the fused attention.

With pipeline parallelism, 1F1B keeps ``pp − stage`` micro-batches in flight on a stage (at most
the number of micro-batches).

A micro-batch's ``tokens`` are its input positions as the model reads them: padded, the
micro-batch size × its longest sample; packed (``trainer.max_tokens_per_micro_batch``), at most the
budget; either rounded up to a multiple of TP under sequence parallelism
(:func:`micro_batch_positions`). Under context parallelism (``cp > 1``, packed only) the budget
counts one rank's positions, ``1/cp`` of each sample, so every term above is per local position
as before, and the CP attention (``bpo_megatron.models.context_attention``) adds the one term not
measured but counted from its code: each local chunk's key prefix, keys and values gathered from
the CP group, which attention keeps for backward, ``(cp + ½)`` positions' worth per local position
(a sample's ``2·cp`` chunks of ``c`` rows: the prefixes of chunks ``r`` and ``2cp − 1 − r`` hold
``(2cp + 1)·c`` rows), ``b · 2 · kv · d · (cp + ½) / tp`` per token. Transformer-engine's ring
attention is assumed to keep no more.

R3 (routing replay) adds, per micro-batch, its routed experts ``[T, MoE layers, top-k]`` moved
whole to every rank (the smallest integer dtype that holds an expert id), and the int64 ids each
router of the stage is handed for its sequence shard (``T / tp`` under sequence parallelism).
Megatron's ``RouterReplay`` keeps those ids until activation recomputation pops them in backward,
so with ``recompute`` they live as long as their micro-batch's activations; a pass without
recomputation (training with ``recompute: none``, and every forward-only pass) keeps the ids of
all its micro-batches until the trainer clears them after the pass.
"""

from __future__ import annotations

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.models.options import ExpertGemm
from bpo_megatron.models.routing import expert_id_dtype
from bpo_megatron.ops.vocab_parallel import _CHUNK_BYTES
from bpo_megatron.parallel import ParallelConfig

FP32, INT32, INT64 = 4, 4, 8  # routers, norm and softmax statistics, and indices, whatever the model dtype


def norm_kept_bytes(width: int, act_bytes: int, *, gpu: bool) -> float:
    """What an RMSNorm over ``width`` features keeps for backward beyond its input: the fp32
    ``rstd``; on a CPU, where torch composes the norm of elementwise ops, also ``x·rstd``."""
    return FP32 + (0 if gpu else act_bytes * width)


def attention_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int, *, gpu: bool = True
                              ) -> float:
    """The attention half of a layer (with both layer norms), per token on one rank (module
    docstring)."""
    if hf.multi_latent_attention:
        return latent_attention_bytes_per_token(hf, parallel, act_bytes, gpu=gpu)
    h, d, tp, b = hf.hidden_size, hf.head_dim, parallel.tp, act_bytes
    q, kv = hf.num_attention_heads, hf.num_key_value_heads
    norms = 2 * (b * h + norm_kept_bytes(h, b, gpu=gpu))
    qkv = b * h + b * (q + 2 * kv) * d + (b * q * d if kv // tp > 1 and hf.qk_norm else 0)
    qk_norms = (q + kv) * norm_kept_bytes(d, b, gpu=gpu) if hf.qk_norm else 0
    flash = b * (q + kv) * d + b * q * d + FP32 * q
    rope = 4 * b * int(d * hf.rotary_percent)
    return (norms + qkv + qk_norms + flash) / tp + rope + context_key_bytes(hf, parallel, act_bytes)


def context_key_bytes(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int) -> float:
    """Under context parallelism: the gathered key prefixes and values attention keeps, per local
    token and layer on one rank (module docstring); 0 without."""
    if parallel.cp == 1:
        return 0.0
    return act_bytes * 2 * hf.num_key_value_heads * hf.head_dim * (parallel.cp + 0.5) / parallel.tp


def context_gather_bytes(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int, *, tokens: int,
                         layers: int) -> float:
    """Bytes of keys and values one rank receives from the other CP ranks in a micro-batch's forward
    (``tokens`` local positions, ``layers`` layers): every other rank's ``tokens`` keys and values
    per layer; the backward sums their gradients over the group (an all-reduce of the same size)."""
    if parallel.cp == 1:
        return 0.0
    per_token = act_bytes * 2 * hf.num_key_value_heads * hf.head_dim / parallel.tp
    return (parallel.cp - 1) * tokens * per_token * layers


def latent_attention_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int, *,
                                     gpu: bool = True) -> float:
    """Multi-head latent attention (with both layer norms), per token on one rank (module docstring)."""
    h, tp, b, r = hf.hidden_size, parallel.tp, act_bytes, hf.head_dim
    heads, qk, v = hf.num_attention_heads, hf.query_key_head_dim, hf.value_head_dim
    norms = 2 * (b * h + norm_kept_bytes(h, b, gpu=gpu))
    # the down projections' shared input (a sequence shard); each latent's norm input and what the
    # norm keeps, and its output, the up projection's input; the shared key part RoPE rotates (split
    # off the key/value latent's projection, saved as that sequence shard)
    latents = b * h + b * hf.kv_lora_rank + norm_kept_bytes(hf.kv_lora_rank, b, gpu=gpu) + b * hf.kv_lora_rank \
        + b * r
    if hf.q_lora_rank is not None:
        latents += 2 * b * hf.q_lora_rank + norm_kept_bytes(hf.q_lora_rank, b, gpu=gpu)
    # per head: the query and key assembled from their parts, the value zero-padded to their width
    # (the fused kernels take one head size), the padded attention output and its fp32
    # log-sum-exp, the output cut to the value's width (the output projection's input)
    heads_kept = heads * (4 * b * qk + b * v + FP32)
    rope = 4 * b * r  # RoPE's cos and sin of the query's and the key's call, every TP rank the whole sequence
    return (norms + latents + heads_kept) / tp + rope


def mlp_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, layer: int, act_bytes: int) -> float:
    """The MLP of ``layer`` (dense or MoE), per token on one rank (module docstring)."""
    h, tp, b = hf.hidden_size, parallel.tp, act_bytes
    if layer not in set(hf.moe_layers):
        return b * (h + 5 * hf.intermediate_size) / tp
    k, etp = hf.num_experts_per_tok, parallel.expert_tp
    router = b * h + FP32 * hf.num_experts + k * (INT64 + FP32 + INT64)
    if hf.router_score == "sigmoid":
        router += FP32 * (hf.num_experts + 1)
    row = b * (h + 6 * hf.moe_intermediate_size / etp) + FP32 + 2 * INT64
    shared = b * 5 * hf.shared_expert_intermediate_size
    return (router + k * etp * row + shared) / tp


def layer_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, layer: int, act_bytes: int, *,
                          gpu: bool = True) -> float:
    """Bytes kept for backward per token by one decoder layer without recomputation."""
    return attention_bytes_per_token(hf, parallel, act_bytes, gpu=gpu) + mlp_bytes_per_token(hf, parallel, layer,
                                                                                             act_bytes)


def layer_constant_bytes(hf: HFModelConfig, parallel: ParallelConfig, layer: int, *,
                         expert_gemm: ExpertGemm = "grouped") -> float:
    """Bytes one decoder layer keeps per micro-batch whatever its length: the grouped experts'
    int32 group offsets, one per local expert (their stacked weights are parameters, which
    ``torch._grouped_mm`` saves without a copy); nothing for a dense layer or Megatron's sequential
    experts."""
    if layer not in set(hf.moe_layers) or expert_gemm != "grouped":
        return 0.0
    return hf.num_experts // parallel.ep * INT32


def checkpoint_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int) -> float:
    """Bytes a layer keeps per token under full recompute: its input (a sequence shard under
    TP), which its checkpoint saves to rebuild the layer in backward."""
    return act_bytes * hf.hidden_size / parallel.tp


def ends_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int, *, first: bool, last: bool,
                         recompute: str, gpu: bool = True) -> float:
    """Bytes kept per token outside the decoder layers on a stage: the first stage's token ids
    (and the vocab-parallel embedding's mask under TP), the last stage's final norm and output
    layer's input, and under full recompute the rotary angles the checkpoints share."""
    h, tp, b = hf.hidden_size, parallel.tp, act_bytes
    kept = 0.0
    if first:
        kept += INT64 + (1 if tp > 1 else 0)
    if last:
        kept += (2 * b * h + norm_kept_bytes(h, b, gpu=gpu)) / tp
    if recompute == "full" and not hf.multi_latent_attention:  # latent attention makes its own angles per layer
        kept += FP32 * int(hf.head_dim * hf.rotary_percent)
    return kept


def dispatch_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int) -> float:
    if not hf.is_moe:
        return 0.0
    return 2 * act_bytes * hf.num_experts_per_tok * hf.hidden_size / parallel.tp


def micro_batches_in_flight(pp: int, stage: int, num_micro_batches: int) -> int:
    return max(1, min(pp - stage, num_micro_batches))


def stage_activation_bytes(hf: HFModelConfig, parallel: ParallelConfig, layers: tuple[int, ...], *,
                           tokens: int, recompute: str, act_bytes: int, in_flight: int, first: bool = False,
                           last: bool = False, expert_gemm: ExpertGemm = "grouped", gpu: bool = True) -> float:
    """Activation bytes of a pipeline stage holding ``layers`` (the ``first`` and/or ``last``
    stage: with the model's ends), ``in_flight`` micro-batches of ``tokens`` tokens each, on a GPU
    or (``gpu=False``) a CPU."""
    per_layer = [tokens * layer_bytes_per_token(hf, parallel, layer, act_bytes, gpu=gpu)
                 + layer_constant_bytes(hf, parallel, layer, expert_gemm=expert_gemm) for layer in layers]
    if recompute == "full":
        kept = len(layers) * tokens * checkpoint_bytes_per_token(hf, parallel, act_bytes)
        rebuilt_once = max(per_layer, default=0.0)
    else:
        kept = sum(per_layer)
        rebuilt_once = 0.0
    ends = tokens * ends_bytes_per_token(hf, parallel, act_bytes, first=first, last=last, recompute=recompute, gpu=gpu)
    transient = tokens * dispatch_bytes_per_token(hf, parallel, act_bytes) if layers else 0.0
    return in_flight * (kept + ends) + rebuilt_once + transient


def logits_bytes(vocab_rows: int, tokens: int, act_bytes: int) -> float:
    """The output layer's logits ``[tokens, V/tp]`` in the model dtype (the log-prob op works in
    place and writes the gradient into the same buffer) plus its fp32 row-chunk scratch on a GPU
    (two chunks while the entropy is computed too)."""
    return tokens * vocab_rows * act_bytes + 2 * _CHUNK_BYTES["cuda"]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def micro_batch_positions(parallel: ParallelConfig, *, longest: int, micro_batch_size: int, budget: int) -> int:
    """Input positions of the largest micro-batch the trainer builds: ``budget`` when packing
    (> 0), otherwise ``micro_batch_size`` rows of the ``longest`` sample; rounded up to a
    multiple of TP under sequence parallelism, as the trainer pads them."""
    pad = parallel.tp if parallel.sequence_parallel else 1
    if budget:
        return round_up(budget, pad)
    return micro_batch_size * round_up(longest, pad)


def replay_id_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, layers: tuple[int, ...]) -> float:
    """R3: the int64 top-k ids the routers of a stage holding ``layers`` are handed, per token
    of a micro-batch (each TP rank its sequence shard under sequence parallelism)."""
    moe_layers = set(hf.moe_layers)
    local = sum(1 for layer in layers if layer in moe_layers)
    shard = parallel.tp if parallel.sequence_parallel else 1
    return local * hf.num_experts_per_tok * 8 / shard


def routed_experts_bytes_per_token(hf: HFModelConfig) -> int:
    """R3: a micro-batch's routed experts on the device, every MoE layer and top-k slot."""
    return len(hf.moe_layers) * hf.num_experts_per_tok * expert_id_dtype(hf.num_experts).itemsize


def stage_replay_bytes(hf: HFModelConfig, parallel: ParallelConfig, layers: tuple[int, ...], *,
                       tokens: int, held_tokens: float) -> float:
    """R3 memory of a stage: the routed experts of the micro-batch being loaded (``tokens``
    positions) and the router ids of ``held_tokens`` positions (those of the micro-batches in
    flight with recomputation; of the running one without)."""
    if not hf.is_moe:
        return 0.0
    return tokens * routed_experts_bytes_per_token(hf) + held_tokens * replay_id_bytes_per_token(hf, parallel, layers)


def forward_only_activation_bytes(hf: HFModelConfig, parallel: ParallelConfig, layers: tuple[int, ...], *,
                                  tokens: int, act_bytes: int, expert_gemm: ExpertGemm = "grouped",
                                  gpu: bool = True) -> float:
    """A forward-only pass (no autograd): one layer's activations live at a time, plus the MoE
    dispatch buffers."""
    if not layers:
        return 0.0
    per_layer = max(tokens * layer_bytes_per_token(hf, parallel, layer, act_bytes, gpu=gpu)
                    + layer_constant_bytes(hf, parallel, layer, expert_gemm=expert_gemm)
                    for layer in layers)
    return per_layer + tokens * dispatch_bytes_per_token(hf, parallel, act_bytes)
