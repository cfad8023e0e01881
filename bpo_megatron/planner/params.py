"""Parameters held by one trainer rank, counted from the Hugging Face config and the layout.

The count mirrors what :func:`bpo_megatron.models.build_gpt_model` builds (Megatron-Core's
``GPTModel``; the local and the transformer-engine specs hold the same parameters, TE only fuses
the norms into the following linear layer):

* every layer: fused QKV ``[(heads + 2·kv_heads)·head_dim / tp, hidden]`` (and its bias
  ``(heads + 2·kv_heads)·head_dim / tp`` with ``attention_bias``), output projection
  ``[hidden, heads·head_dim / tp]``, the q/k RMSNorms over ``head_dim`` (with QK-norm) and the two
  layer norms over ``hidden`` (norms are replicated over TP: sequence parallelism keeps them whole);
  with multi-head latent attention (DeepSeek-V3) instead: the down projections to the query latent
  ``[q_lora, hidden]`` (or a plain query projection ``[heads·(nope + rope) / tp, hidden]``) and to the
  key/value latent and shared rotated key ``[kv_lora + rope, hidden]`` (whole on every TP rank),
  the latents' RMSNorms, the up projections ``[heads·(nope + rope) / tp, q_lora]`` and
  ``[heads·(nope + v) / tp, kv_lora]``, and the output projection ``[hidden, heads·v / tp]``;
* dense MLP: SwiGLU ``fc1 [2·ffn / tp, hidden]`` and ``fc2 [hidden, ffn / tp]``;
* MoE MLP: the router ``[experts, hidden]`` (replicated, a dense parameter; its expert bias is a
  buffer, not a parameter), a shared expert where the family has one (a SwiGLU of
  ``shared_ffn / tp``, dense: split over TP and reduced over DP like a dense MLP) and
  ``experts / ep`` local experts, each a SwiGLU of ``moe_ffn / etp``;
* first pipeline stage: the word embeddings over the padded vocabulary, split over TP;
* last stage: the final norm and the output layer (also when the embeddings are tied but the
  model spans several stages: Megatron keeps a copy of the embedding on the last stage).

Layers are split evenly and contiguously over pipeline stages, as Megatron-Core does.
"Dense" parameters are reduced over data parallelism, "expert" parameters over the smaller
expert-data-parallel group, which is why the two are kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.models.options import ModelOptions
from bpo_megatron.models.megatron_model import model_vocab_size
from bpo_megatron.parallel import ParallelConfig


@dataclass(frozen=True)
class StageParams:
    """Parameters on one rank of pipeline stage ``stage`` (all ranks of a stage hold as many)."""

    stage: int
    layers: tuple[int, ...]  # global indices of this stage's decoder layers
    dense: int  # non-expert parameters (embeddings, attention, norms, routers, dense MLPs)
    expert: int  # this rank's share of the MoE experts

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_layers(hf: HFModelConfig, pp: int, stage: int) -> tuple[int, ...]:
    per_stage = hf.num_hidden_layers // pp
    return tuple(range(stage * per_stage, (stage + 1) * per_stage))


def _attention(hf: HFModelConfig, tp: int) -> int:
    if hf.multi_latent_attention:
        return _latent_attention(hf, tp)
    q_width = hf.num_attention_heads * hf.head_dim
    qkv_rows = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * hf.head_dim // tp
    qkv = qkv_rows * hf.hidden_size + (qkv_rows if hf.attention_bias else 0)
    proj = hf.hidden_size * (q_width // tp)
    qk_norms = 2 * hf.head_dim if hf.qk_norm else 0
    return qkv + proj + qk_norms


def _latent_attention(hf: HFModelConfig, tp: int) -> int:
    heads, hidden = hf.num_attention_heads // tp, hf.hidden_size
    query_rows = heads * hf.query_key_head_dim
    if hf.q_lora_rank is None:
        query = query_rows * hidden
    else:
        query = hf.q_lora_rank * hidden + hf.q_lora_rank + query_rows * hf.q_lora_rank
    key_value = (hf.kv_lora_rank + hf.head_dim) * hidden + hf.kv_lora_rank \
        + heads * (hf.qk_nope_head_dim + hf.v_head_dim) * hf.kv_lora_rank
    return query + key_value + hidden * heads * hf.v_head_dim


def _swiglu(hidden: int, ffn: int, split: int) -> int:
    return 3 * hidden * (ffn // split)  # fc1 holds gate and up, fc2 projects back


def layer_params(hf: HFModelConfig, parallel: ParallelConfig, layer: int) -> tuple[int, int]:
    """``(dense, expert)`` parameters of decoder layer ``layer`` on one rank."""
    norms = 2 * hf.hidden_size  # input and pre-MLP RMSNorm
    dense = _attention(hf, parallel.tp) + norms
    if layer in set(hf.moe_layers):
        router = hf.num_experts * hf.hidden_size
        if hf.shared_expert_intermediate_size:
            router += _swiglu(hf.hidden_size, hf.shared_expert_intermediate_size, parallel.tp)
        local_experts = hf.num_experts // parallel.ep
        expert = local_experts * _swiglu(hf.hidden_size, hf.moe_intermediate_size, parallel.expert_tp)
        return dense + router, expert
    return dense + _swiglu(hf.hidden_size, hf.intermediate_size, parallel.tp), 0


def rank_parameters(hf: HFModelConfig, parallel: ParallelConfig, options: ModelOptions) -> list[StageParams]:
    """Parameters per rank, one entry per pipeline stage."""
    vocab_rows = model_vocab_size(hf, parallel, options) // parallel.tp
    stages = []
    for stage in range(parallel.pp):
        layers = stage_layers(hf, parallel.pp, stage)
        dense = expert = 0
        for layer in layers:
            d, e = layer_params(hf, parallel, layer)
            dense, expert = dense + d, expert + e
        first, last = stage == 0, stage == parallel.pp - 1
        if first:
            dense += vocab_rows * hf.hidden_size
        if last:
            dense += hf.hidden_size  # final norm
            if not (hf.tie_word_embeddings and first):
                dense += vocab_rows * hf.hidden_size
        stages.append(StageParams(stage=stage, layers=layers, dense=dense, expert=expert))
    return stages
