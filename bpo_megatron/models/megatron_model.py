"""The supported Hugging Face families (Qwen3, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3) as Megatron-Core
``GPTModel``s.

The mapping follows transformers' modeling code exactly: pre-norm RMSNorm blocks, grouped-query
attention with optional RMSNorm on each query/key head (QK-norm), optional Q/K/V biases and RoPE on
all or the leading part of each head, or multi-head latent attention (Megatron's
``MLASelfAttention``, with :mod:`~bpo_megatron.models.latent_attention` as its local core
attention), SwiGLU MLPs, and for MoE layers a softmax or sigmoid top-k
router (with a fixed expert bias, group limits and a scaling factor where the family has them) and an
optional shared expert. It reads only :class:`HFModelConfig`'s family-neutral description
(:mod:`bpo_megatron.models.families`). Megatron imports stay inside the
functions, so importing this package does not pull in Megatron (callers silence its warnings first).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch.nn.functional as F

from bpo_megatron import platform
from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.models.options import (CoreAttention, ExpertGemm, LayerSpec, ModelOptions, MoeDispatch,
                                         layer_spec_refusal, local_core_attention)
from bpo_megatron.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def uses_transformer_engine(layer_spec: LayerSpec) -> bool:
    """The one switch between transformer-engine's modules and kernels and Megatron's own torch
    modules: ``model.layer_spec``, chosen explicitly (the local spec unless it names
    transformer-engine; never picked for being installed). Every TE-or-local choice of the model
    goes through it; a transformer-engine spec this process cannot run is refused, naming the
    setting."""
    refusal = layer_spec_refusal(layer_spec, gpu=platform.has_cuda())
    if refusal is not None:
        raise ValueError(refusal)
    return layer_spec == "transformer_engine"


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocabulary padding: round up to a multiple of ``divisible_by × tp``, so every
    tensor-parallel shard of the embedding and output layer has the same, aligned number of rows."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"vocab_size={vocab_size}, tp={tp} and divisible_by={divisible_by} "
                         "must be positive")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def model_vocab_size(hf: HFModelConfig, parallel: ParallelConfig, options: ModelOptions) -> int:
    """Rows of the Megatron embedding and output layer (the padded vocabulary).

    Rows from ``hf.vocab_size`` on are padding: no token id reaches them, but their logits exist,
    so log-probabilities over the model's output must exclude them.
    """
    return padded_vocab_size(hf.vocab_size, parallel.tp, options.make_vocab_size_divisible_by)


# The megatron-core minor versions whose multi-head latent attention this package builds (its
# conversion, logits and R3 checked against transformers): megatron-core 0.19 binds the plain
# Linear MLA's down projections take only where transformer-engine imports, and refuses the query
# norm a model without a query latent leaves unused, so its MLA does not build on the local spec.
LATENT_ATTENTION_MEGATRON_MINORS = (16,)


def check_megatron_builds(hf: HFModelConfig) -> None:
    """Refuse, naming the version, an architecture the installed megatron-core does not build
    here (multi-head latent attention outside :data:`LATENT_ATTENTION_MEGATRON_MINORS`). Reads
    package metadata only: callable on a driver before any model or Ray starts."""
    from bpo_megatron.megatron.compat import megatron_minor, megatron_version

    if hf.multi_latent_attention and megatron_minor() not in LATENT_ATTENTION_MEGATRON_MINORS:
        raise ValueError(f"{hf.architecture} (multi-head latent attention) is built with megatron-core 0.16 only; "
                         f"megatron-core {megatron_version()} is installed: install megatron-core==0.16.1")


def transformer_config(
    hf: HFModelConfig, parallel: ParallelConfig, options: ModelOptions
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for ``hf`` split as ``parallel``, built as ``options`` say.

    The RoPE base is not a ``TransformerConfig`` field in megatron-core 0.16 (GPTModel takes it as
    an argument), so :func:`build_gpt_model` passes ``hf.rope_theta`` there.
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    check_megatron_builds(hf)
    options = options.resolved()  # an unset dtype: this process's platform default
    parallel.validate_model(
        num_layers=hf.num_hidden_layers,
        num_experts=hf.num_experts if hf.is_moe else 0,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
    )
    te = uses_transformer_engine(options.layer_spec)
    config_class = MLATransformerConfig if hf.multi_latent_attention else TransformerConfig
    return config_class(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,  # the dense MLPs (all layers, or mlp_only_layers)
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.query_key_head_dim,  # Qwen3 sets head_dim independently of hidden/heads
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        qk_layernorm=_qk_layernorm(hf),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        # the families that take attention_bias=True put it on q/k/v only (HFModelConfig refuses others)
        add_qkv_bias=hf.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # parallel layout
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.sequence_parallel,
        # precision
        params_dtype=options.torch_dtype,
        pipeline_dtype=options.torch_dtype,
        bf16=options.params_dtype == "bf16",
        fp16=False,
        # Fused kernels come from transformer-engine / CUDA; the unfused paths are exact on CPU.
        # gradient_accumulation_fusion writes into main_grad, which Megatron's DDP wrapper owns.
        use_cpu_initialization=not platform.has_cuda(),
        gradient_accumulation_fusion=te,
        bias_activation_fusion=te,
        bias_dropout_fusion=te,
        masked_softmax_fusion=te,
        # Megatron's fused MLA RoPE takes YaRN only (HFModelConfig admits plain RoPE)
        apply_rope_fusion=te and not hf.multi_latent_attention,
        persist_layer_norm=False,
        **_latent_attention_fields(hf),
        **_recompute_fields(options),
        **_moe_fields(hf, options, te=te),
    )


def _qk_layernorm(hf: HFModelConfig) -> bool:
    """Megatron's ``qk_layernorm``: QK-norm, or with latent attention the RMSNorms of the query and
    key/value latents (without it the local spec makes them identities)."""
    return hf.qk_norm or hf.multi_latent_attention


def _latent_attention_fields(hf: HFModelConfig) -> dict[str, object]:
    if not hf.multi_latent_attention:
        return {}
    return {
        "multi_latent_attention": True,
        "q_lora_rank": hf.q_lora_rank,
        "kv_lora_rank": hf.kv_lora_rank,
        "qk_head_dim": hf.qk_nope_head_dim,
        "qk_pos_emb_head_dim": hf.head_dim,
        "v_head_dim": hf.v_head_dim,
        # RoPE on the rotated dims, interleaved pairs as transformers' rope_interleave=True: plain
        # (a scaling factor of 1 leaves the softmax scale at 1/sqrt(query-key head dims)) or YaRN
        "rotary_base": hf.rope_theta,
        **({"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
           if hf.yarn is None else
           {"rope_type": "yarn", "rotary_scaling_factor": float(hf.yarn.factor),
            "original_max_position_embeddings": hf.yarn.original_max_position_embeddings,
            "beta_fast": float(hf.yarn.beta_fast), "beta_slow": float(hf.yarn.beta_slow),
            "mscale": hf.yarn.mscale, "mscale_all_dim": hf.yarn.mscale_all_dim}),
    }


def _recompute_fields(options: ModelOptions) -> dict[str, object]:
    if options.recompute == "full":
        # uniform, one layer per checkpoint: only layer inputs are kept for the backward
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    return {"recompute_granularity": None}


def _moe_fields(hf: HFModelConfig, options: ModelOptions, *, te: bool) -> dict[str, object]:
    if not hf.is_moe:
        if options.routing_replay:
            raise ValueError("model.routing_replay=True needs a Mixture-of-Experts model; "
                             f"{hf.architecture} here has no MoE layers")
        return {"num_moe_experts": None}
    if hf.num_experts_per_tok == 1 and hf.norm_topk_prob:
        # Renormalised top-1 weights are constantly 1 (no router gradient); Megatron refuses
        # top-1 without pre-softmax, and pre-softmax would not renormalise.
        raise ValueError("config.json: num_experts_per_tok=1 with norm_topk_prob=true has no "
                         "Megatron equivalent")
    moe_layers = set(hf.moe_layers)
    coeff = float(options.moe_aux_loss_coeff)
    return {
        **_router_fields(hf),
        "num_moe_experts": hf.num_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_layer_freq": [int(layer in moe_layers) for layer in range(hf.num_hidden_layers)],
        "moe_shared_expert_intermediate_size": hf.shared_expert_intermediate_size or None,
        "moe_router_dtype": "fp32",  # transformers routes in fp32 as well
        "moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none",
        "moe_aux_loss_coeff": coeff,
        "moe_token_dispatcher_type": options.moe_token_dispatcher,
        "moe_enable_routing_replay": options.routing_replay,
        # the fused router computes its own top-k and would bypass the replayed expert choices
        "moe_router_fusion": te and not options.routing_replay,
        "moe_permute_fusion": te,
        "moe_grouped_gemm": te,  # TE's grouped GEMM; the local spec's experts: layer_spec(experts=...)
    }


def _router_fields(hf: HFModelConfig) -> dict[str, object]:
    """The router of ``hf``'s MoE layers: scoring, the expert bias, group limits, the scaling."""
    fields: dict[str, object] = {
        "moe_router_score_function": hf.router_score,
        # softmax with norm_topk_prob: softmax over all experts, then renormalise the top k =
        # softmax over the top-k logits, which is Megatron's default (top-k first). Without
        # renormalisation the probabilities are taken from the full softmax: pre-softmax. Sigmoid
        # scores are renormalised either way (HFModelConfig refuses sigmoid without norm_topk_prob).
        "moe_router_pre_softmax": not hf.norm_topk_prob,
        # applied to the renormalised weights, as transformers does; 1.0 is left unset
        "moe_router_topk_scaling_factor": (hf.routed_scaling_factor if hf.routed_scaling_factor != 1.0
                                           else None),
    }
    if hf.router_expert_bias:
        # The checkpoint's e_score_correction_bias is a fixed buffer the rollout engine routes
        # with; an update rate of 0 keeps Megatron's load-balancing update from moving it, so the
        # trainer chooses the experts the engine chose (and it is not a parameter: no optimizer
        # touches it).
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if hf.n_group > 1:  # HFModelConfig admits only group limits Megatron scores like transformers
        fields.update(moe_router_num_groups=hf.n_group, moe_router_group_topk=hf.topk_group)
    return fields


def layer_spec(hf: HFModelConfig, config: TransformerConfig, *, attention: CoreAttention = "auto",
               experts: ExpertGemm = "grouped", dispatch: MoeDispatch = "sorted",
               transformer_engine: bool = False) -> TransformerBlockSubmodules:
    """The decoder's module spec: transformer-engine's modules with ``transformer_engine``
    (:func:`uses_transformer_engine` of ``model.layer_spec``, as ``config`` was made), Megatron's
    local torch modules otherwise, with the local core attention ``attention`` names
    (:func:`~bpo_megatron.models.options.local_core_attention`: ``"fused"``, torch's fused kernels,
    :class:`~bpo_megatron.models.fused_attention.FusedDotProductAttention`; ``"unfused"``,
    Megatron's extended to packed sequences,
    :class:`~bpo_megatron.models.packed_attention.PackedDotProductAttention`) and, with
    ``experts="grouped"``, the local MoE experts as grouped GEMMs
    (:class:`~bpo_megatron.models.grouped_experts.GroupedSequentialMLP`; ``"sequential"``:
    Megatron's ``SequentialMLP``, one expert at a time) and, with ``dispatch="sorted"``, the MoE
    layers' tokens dispatched by sorting
    (:class:`~bpo_megatron.models.sorted_dispatch.SortedDispatchMoELayer`; ``"megatron"``: Megatron's
    dispatchers). TE's experts and TE's fused permutation are TE's own either way.
    ``config.moe_layer_freq`` picks a dense or MoE spec per layer, and only this pipeline stage's
    layers are kept."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if config.num_layers != hf.num_hidden_layers or config.qk_layernorm != _qk_layernorm(hf):
        raise ValueError("layer_spec: config was not made by transformer_config for this model")
    if experts not in ("grouped", "sequential"):
        raise ValueError(f"layer_spec: experts={experts!r} must be 'grouped' or 'sequential'")
    attention = local_core_attention(attention)
    if dispatch not in ("sorted", "megatron"):
        raise ValueError(f"layer_spec: dispatch={dispatch!r} must be 'sorted' or 'megatron'")
    te = transformer_engine
    # normalization="RMSNorm" makes the local spec use torch.nn.RMSNorm (WrappedTorchNorm) for
    # the layer and QK norms; TE's norms read config.normalization themselves.
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if not te:
        # The local block's final norm is apex's FusedLayerNorm whenever apex is installed, and
        # that refuses RMSNorm; use the same torch RMSNorm as the layers.
        spec.layer_norm = WrappedTorchNorm
        # Megatron's local core attention refuses packed sequences (TE's takes them natively)
        # and keeps every score matrix; both replacements take packed rows
        spec.layer_specs = [_with_core_attention(layer, attention, latent=hf.multi_latent_attention)
                            for layer in spec.layer_specs]
        if hf.multi_latent_attention:
            spec.layer_specs = [_with_duplicated_latent_down_projections(layer) for layer in spec.layer_specs]
        if experts == "grouped":
            # SequentialMLP loops over the experts after a host sync; the same modules and
            # parameters run as two grouped GEMMs instead
            spec.layer_specs = [_with_grouped_experts(layer) for layer in spec.layer_specs]
        if dispatch == "sorted":
            # Megatron's dispatchers read token counts on the host in every MoE layer; sorting the
            # expert ids needs none at EP=1
            spec.layer_specs = [_with_sorted_dispatch(layer) for layer in spec.layer_specs]
    return spec


def _with_grouped_experts(layer: ModuleSpec) -> ModuleSpec:
    """``layer`` with :class:`~bpo_megatron.models.grouped_experts.GroupedSequentialMLP` as the
    experts of its MoE layer (dense layers unchanged). Megatron 0.16 describes the MoE layer and its
    experts as ``ModuleSpec``s, 0.19 as ``functools.partial``s; both are copied, not edited."""
    from functools import partial

    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from bpo_megatron.models.grouped_experts import GroupedSequentialMLP

    mlp = layer.submodules.mlp
    if _built_class(mlp) is not MoELayer:
        return layer
    moe = mlp.keywords["submodules"] if isinstance(mlp, partial) else mlp.submodules
    experts = moe.experts
    if _built_class(experts) is not SequentialMLP:
        raise RuntimeError(f"the local layer spec's experts are {experts!r}, not the SequentialMLP that "
                           "GroupedSequentialMLP replaces")
    if isinstance(experts, partial):
        experts = partial(GroupedSequentialMLP, *experts.args, **experts.keywords)
    else:
        experts = replace(experts, module=GroupedSequentialMLP)
    moe = replace(moe, experts=experts)
    if isinstance(mlp, partial):
        mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe})
    else:
        mlp = replace(mlp, submodules=moe)
    return replace(layer, submodules=replace(layer.submodules, mlp=mlp))


def _with_sorted_dispatch(layer: ModuleSpec) -> ModuleSpec:
    """``layer`` with :class:`~bpo_megatron.models.sorted_dispatch.SortedDispatchMoELayer` as its
    MoE layer (dense layers unchanged; a copy, as in :func:`_with_grouped_experts`)."""
    from functools import partial

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from bpo_megatron.models.sorted_dispatch import SortedDispatchMoELayer

    mlp = layer.submodules.mlp
    if _built_class(mlp) is not MoELayer:
        return layer
    if isinstance(mlp, partial):
        mlp = partial(SortedDispatchMoELayer, *mlp.args, **mlp.keywords)
    else:
        mlp = replace(mlp, module=SortedDispatchMoELayer)
    return replace(layer, submodules=replace(layer.submodules, mlp=mlp))


def _built_class(spec: object) -> object:
    """The class a ``ModuleSpec`` or a ``functools.partial`` builds."""
    from functools import partial

    return spec.func if isinstance(spec, partial) else getattr(spec, "module", None)


def _with_core_attention(layer: ModuleSpec, attention: CoreAttention, *, latent: bool) -> ModuleSpec:
    """``layer`` with the core attention ``attention`` names:
    :class:`~bpo_megatron.models.fused_attention.FusedDotProductAttention` (``"fused"``) or
    :class:`~bpo_megatron.models.packed_attention.PackedDotProductAttention` (``"unfused"``), both
    Megatron's ``DotProductAttention`` taking packed sequences, or with ``latent`` attention their
    variants for MLA's wider query/key than value heads
    (:mod:`~bpo_megatron.models.latent_attention`). Copies: the specs Megatron returns may be
    shared between layers."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from bpo_megatron.models.fused_attention import FusedDotProductAttention
    from bpo_megatron.models.latent_attention import LatentDotProductAttention, LatentFusedDotProductAttention
    from bpo_megatron.models.packed_attention import PackedDotProductAttention

    core = ({"fused": LatentFusedDotProductAttention, "unfused": LatentDotProductAttention} if latent else
            {"fused": FusedDotProductAttention, "unfused": PackedDotProductAttention})[attention]
    attention_spec = layer.submodules.self_attention
    if attention_spec.submodules.core_attention is not DotProductAttention:
        raise RuntimeError(f"the local layer spec's core attention is {attention_spec.submodules.core_attention!r}, "
                           f"not the DotProductAttention that {core.__name__} extends")
    attention_spec = replace(attention_spec, submodules=replace(attention_spec.submodules, core_attention=core))
    return replace(layer, submodules=replace(layer.submodules, self_attention=attention_spec))


def _with_duplicated_latent_down_projections(layer: ModuleSpec) -> ModuleSpec:
    """``layer`` with MLA's down projections (to the query and key/value latents) whole on every TP
    rank, as transformer-engine's spec has them (``duplicated``), instead of the local spec's
    column-parallel ones. Those gather their output over TP and leave the rotated key part whole on
    every rank, whose gradient then holds only this rank's heads' share (Megatron-Core 0.16 sums it
    over TP only on the duplicated path, where it is gathered from the sequence-parallel region).
    Megatron's plain duplicated ``Linear`` (its weights' gradients summed over TP under sequence
    parallelism, as TE's) is what ``MLASelfAttention`` takes besides the parallel ones."""
    from megatron.core.post_training.modelopt.layers import Linear

    attention_spec = layer.submodules.self_attention
    submodules = replace(attention_spec.submodules, linear_q_down_proj=Linear, linear_kv_down_proj=Linear)
    return replace(layer, submodules=replace(layer.submodules,
                                             self_attention=replace(attention_spec, submodules=submodules)))


def _check_process_groups(parallel: ParallelConfig) -> None:
    """Megatron's process groups must have been set up for the same layout."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model: Megatron's model-parallel groups are not "
                           "initialised (call parallel_state.initialize_model_parallel first)")
    actual = {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
    }
    wanted = {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "etp": parallel.expert_tp}
    if actual != wanted:
        raise ValueError(f"build_gpt_model: parallel config {wanted} does not match Megatron's "
                         f"initialised process groups {actual}")


def build_gpt_model(
    hf: HFModelConfig,
    parallel: ParallelConfig,
    options: ModelOptions,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
) -> GPTModel:
    """This rank's part of the model (its pipeline stage, TP and EP shards), freshly initialised.

    ``pre_process``/``post_process`` (embedding / final norm and output layer) default to whether
    this rank is the first / last pipeline stage.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    _check_process_groups(parallel)
    options = options.resolved()  # an unset dtype: this rank's platform default (bf16 with a GPU)
    config = transformer_config(hf, parallel, options)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(hf, config, attention=options.attention,
                                          experts=options.expert_gemm, dispatch=options.moe_dispatch,
                                          transformer_engine=uses_transformer_engine(options.layer_spec)),
        vocab_size=model_vocab_size(hf, parallel, options),
        max_sequence_length=hf.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        parallel_output=True,  # logits stay vocab-sharded: log-probs are computed per shard
        share_embeddings_and_output_weights=hf.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=hf.rotary_percent,  # the leading int(head_dim × percent) dims rotate, as in transformers
        rotary_base=hf.rope_theta,
    )
    # The local spec's torch norms are created in fp32 whatever params_dtype says (TE's follow
    # it). Megatron's own training casts every parameter when it wraps a bf16 model in
    # Float16Module; without that cast the norms run in mixed precision (unfused) and hand fp32
    # activations on. Parameters are cast here rather than by the wrapper, whose fp32 copy of the
    # logits the in-place log-prob op avoids; buffers (e.g. router token counts) keep their dtype.
    for param in model.parameters():
        if param.dtype != options.torch_dtype:
            param.data = param.data.to(options.torch_dtype)
    if hf.multi_latent_attention and not uses_transformer_engine(options.layer_spec) and platform.has_cuda():
        # the local spec's duplicated down projections are torch Linears, made on the host
        model.to(platform.device())
    return model
