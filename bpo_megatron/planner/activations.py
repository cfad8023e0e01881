"""Activation memory of one training micro-batch on one rank: an estimate, documented term by term.

Per token and layer, with ``b`` bytes per activation (the model dtype), tensor parallelism ``tp``
with sequence parallelism (every activation below is split over TP, either by sequence or by
heads/columns), flash attention (no ``[s, s]`` score matrix is kept) and no dropout:

attention   b · (4h + (q + 2kv)·d + (q + kv)·d + q·d) / tp
            the input norm's input and output, the fused QKV output, the normalised and rotated
            q and k that flash attention keeps, and its output (the output projection's input);
dense MLP   b · 3·ffn / tp                      fc1's output (gate and up) and the SwiGLU output;
MoE MLP     (b · k · (2h·etp + 3·I) + 8·E) / tp  per routed copy of a token (top-k): the
            dispatched hidden state and the combine input (whole ``h``, gathered over the
            ``etp`` ranks of an expert), fc1's output and the SwiGLU output (I / etp columns on
            each of the etp ranks), and the router's fp32 logits and probabilities. Routing is
            assumed balanced (R3 replays the engine's routing; there is no capacity dropping).

``h`` hidden size, ``q``/``kv`` query/key-value heads of width ``d``, ``E`` experts, ``I`` the
expert FFN size. Recompute ``full`` (one layer per checkpoint) keeps only each layer's input,
``b·h / tp`` per token, and rebuilds one layer at a time in backward, so one layer's full set is
added once. The MoE all-to-all adds send and receive buffers of the dispatched tokens,
``2 · b · k · h / tp`` per token, live for one layer at a time.

With pipeline parallelism, 1F1B keeps ``pp − stage`` micro-batches in flight on a stage (at most
the number of micro-batches).

A micro-batch's ``tokens`` are its input positions as the model reads them: padded, the
micro-batch size × its longest sample; packed (``trainer.max_tokens_per_micro_batch``), at most the
budget; either rounded up to a multiple of TP under sequence parallelism
(:func:`micro_batch_positions`).

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
from bpo_megatron.models.routing import expert_id_dtype
from bpo_megatron.ops.vocab_parallel import _CHUNK_BYTES
from bpo_megatron.parallel import ParallelConfig


def layer_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, layer: int, act_bytes: int) -> float:
    """Bytes kept for backward per token by one decoder layer without recomputation."""
    h, d, tp = hf.hidden_size, hf.head_dim, parallel.tp
    q, kv = hf.num_attention_heads, hf.num_key_value_heads
    attention = act_bytes * (4 * h + (q + 2 * kv) * d + (q + kv) * d + q * d)
    if layer in set(hf.moe_layers):
        k, etp = hf.num_experts_per_tok, parallel.expert_tp
        mlp = act_bytes * k * (2 * h * etp + 3 * hf.moe_intermediate_size) + 8 * hf.num_experts
    else:
        mlp = act_bytes * 3 * hf.intermediate_size
    return (attention + mlp) / tp


def dispatch_bytes_per_token(hf: HFModelConfig, parallel: ParallelConfig, act_bytes: int) -> float:
    if not hf.is_moe:
        return 0.0
    return 2 * act_bytes * hf.num_experts_per_tok * hf.hidden_size / parallel.tp


def micro_batches_in_flight(pp: int, stage: int, num_micro_batches: int) -> int:
    return max(1, min(pp - stage, num_micro_batches))


def stage_activation_bytes(hf: HFModelConfig, parallel: ParallelConfig, layers: tuple[int, ...], *,
                           tokens: int, recompute: str, act_bytes: int, in_flight: int) -> float:
    """Activation bytes of a pipeline stage holding ``layers``, ``in_flight`` micro-batches of
    ``tokens`` tokens each."""
    per_layer = [layer_bytes_per_token(hf, parallel, layer, act_bytes) for layer in layers]
    if recompute == "full":
        kept = len(layers) * act_bytes * hf.hidden_size / parallel.tp
        rebuilt_once = max(per_layer, default=0.0)
    else:
        kept = sum(per_layer)
        rebuilt_once = 0.0
    transient = dispatch_bytes_per_token(hf, parallel, act_bytes) if layers else 0.0
    return tokens * (in_flight * kept + rebuilt_once + transient)


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
                                  tokens: int, act_bytes: int) -> float:
    """A forward-only pass (no autograd): one layer's activations live at a time, plus the MoE
    dispatch buffers."""
    if not layers:
        return 0.0
    per_layer = max(layer_bytes_per_token(hf, parallel, layer, act_bytes) for layer in layers)
    return tokens * (per_layer + dispatch_bytes_per_token(hf, parallel, act_bytes))
