"""Training-side choices for the Megatron model that a Hugging Face config does not carry."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch

from bpo_megatron import platform

ParamsDtype = Literal["fp32", "bf16"]
Recompute = Literal["none", "full"]
TokenDispatcher = Literal["alltoall", "allgather"]
ExpertGemm = Literal["grouped", "sequential"]
CoreAttention = Literal["auto", "fused", "unfused"]
MoeDispatch = Literal["sorted", "megatron"]
LayerSpec = Literal["local", "transformer_engine"]

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def default_params_dtype(gpu: bool | None = None) -> ParamsDtype:
    """bf16 on GPUs (what the clusters train in); fp32 on CPU, where bf16 matmuls are slow and
    the tests compare against fp32 references. ``gpu`` None: whether the calling process has one,
    so call it where the model is built (:meth:`ModelOptions.resolved`), never on a driver."""
    return "bf16" if (platform.has_cuda() if gpu is None else gpu) else "fp32"


# The local spec's fast paths (the model without transformer-engine): name -> (the options that
# turn it on, those that turn it off: Megatron's reference modules). Each is on by default where it
# applies; the GPU kit times a step without each in turn (train_fast_paths), tests compare all of
# them on against all off.
FAST_PATHS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "grouped_experts": ({"expert_gemm": "grouped"}, {"expert_gemm": "sequential"}),
    "fused_attention": ({"attention": "fused"}, {"attention": "unfused"}),
    "sorted_dispatch": ({"moe_dispatch": "sorted"}, {"moe_dispatch": "megatron"}),
}


def fast_path_options(*, on: bool) -> dict[str, str]:
    """The options that turn every fast path of :data:`FAST_PATHS` on (or off)."""
    return {key: value for paths in FAST_PATHS.values() for key, value in paths[0 if on else 1].items()}


_LOCAL_FALLBACK = "or set model.layer_spec=local, the supported path (docs/guide.md#the-trainers-layer-spec)"


def layer_spec_device_refusal(layer_spec: LayerSpec, *, gpu: bool) -> str | None:
    """Why ``model.layer_spec`` cannot run on a trainer with GPUs (``gpu``) or without, naming the
    fix; None when it can: transformer-engine's runs on GPUs only."""
    _check_choice("layer_spec", layer_spec, LayerSpec)
    if layer_spec == "transformer_engine" and not gpu:
        return ("model.layer_spec=transformer_engine runs on GPUs only and this trainer runs on CPUs "
                f"(cluster.gpus_per_trainer_rank=0, or no GPU in this process): give its ranks GPUs, {_LOCAL_FALLBACK}")
    return None


def layer_spec_install_refusal(layer_spec: LayerSpec) -> str | None:
    """Why ``model.layer_spec`` cannot be built in this environment, naming the fix; None when it
    can: transformer-engine's needs the package (a GPU-only extra)."""
    _check_choice("layer_spec", layer_spec, LayerSpec)
    if layer_spec == "transformer_engine" and not platform.has_transformer_engine():
        return ("model.layer_spec=transformer_engine needs transformer-engine, which this environment does not "
                "have: install it (pip install -e \".[gpu]\", or tools/gpu/requirements-cluster.txt: "
                f"docs/gpu-environment.md), {_LOCAL_FALLBACK}")
    return None


def layer_spec_refusal(layer_spec: LayerSpec, *, gpu: bool) -> str | None:
    """Why ``model.layer_spec`` cannot be built here for a trainer with GPUs (``gpu``) or without;
    None when it can. The local spec builds everywhere."""
    return layer_spec_device_refusal(layer_spec, gpu=gpu) or layer_spec_install_refusal(layer_spec)


def describe_layer_spec(options: ModelOptions, *, gpu: bool) -> str:
    """The trainer's decoder modules as ``train --check`` and ``bpo-megatron plan`` state them, for
    ranks on GPUs (``gpu``) or CPUs."""
    if options.layer_spec == "transformer_engine":
        return ("model.layer_spec=transformer_engine: transformer-engine's modules and fused kernels (an optional "
                "accelerator, not yet validated on a GPU: the GPU kit's trainer_step_te runs it where "
                "transformer-engine is installed)")
    attention = local_core_attention(options.attention, gpu=gpu)
    return (f"model.layer_spec=local: Megatron's torch modules with core attention {attention} "
            f"(model.attention={options.attention}), experts {options.expert_gemm}, dispatch {options.moe_dispatch} "
            "(the supported path, validated on GPUs by the GPU kit)")


def local_core_attention(choice: CoreAttention, gpu: bool | None = None) -> CoreAttention:
    """The core attention of the local spec that ``choice`` names: ``"auto"`` is torch's fused
    kernels on GPUs (where the unfused one's score matrices cost memory and time) and Megatron's
    unfused reference on CPU (what the CPU tests compare against). ``gpu`` None: whether the
    calling process has one, so call it where the model is built, never on a driver."""
    _check_choice("attention", choice, CoreAttention)
    if choice != "auto":
        return choice
    return "fused" if (platform.has_cuda() if gpu is None else gpu) else "unfused"


@dataclass(frozen=True)
class ModelOptions:
    """How the policy model is built and trained, independent of its architecture.

    ``moe_aux_loss_coeff`` defaults to 0 (load balancing off): in RL post-training the policy loss
    is the only objective, and an auxiliary balancing gradient would move the policy away from the
    rollout policy for reasons unrelated to reward. It also keeps the router's behaviour identical
    to what the rollout engine runs. Set it (e.g. to the checkpoint's ``router_aux_loss_coef``)
    only to continue pre-training-style balancing.

    ``params_dtype`` unset (None) is the platform default of the process that builds the model
    (:func:`default_params_dtype`): options travel from a driver without a GPU to trainer ranks
    with one, and a default taken on the driver would train the GPUs in fp32. ``attention="auto"``
    is decided the same way. Builders call :meth:`resolved` first.
    """

    params_dtype: ParamsDtype | None = None
    routing_replay: bool = False  # R3: replay the rollout engine's expert choices (MoE only)
    moe_aux_loss_coeff: float = 0.0
    recompute: Recompute = "none"  # "full": recompute every layer in backward (1 layer per unit)
    # Megatron's MoE token dispatcher type (moe_dispatch=sorted covers alltoall, and allgather at EP=1)
    moe_token_dispatcher: TokenDispatcher = "alltoall"
    # the embedding and output rows are padded to a multiple of this × parallel.tp (padding rows are
    # never a token: log-probs exclude them)
    make_vocab_size_divisible_by: int = 128
    # the local spec's MoE experts (no transformer-engine): "grouped": two torch._grouped_mm calls
    # per layer; "sequential": Megatron's SequentialMLP, one expert at a time after a host sync.
    # Same parameters and checkpoints either way.
    expert_gemm: ExpertGemm = "grouped"
    # the local spec's core attention (no transformer-engine; TE's attention is TE's): "fused":
    # torch's SDPA for padded batches and FlashAttention's varlen kernel for packed ones on CUDA in
    # bf16 (models.fused_attention); "unfused": Megatron's DotProductAttention, packed rows one
    # sample at a time; "auto": fused on GPUs, unfused on CPU (local_core_attention). No parameters.
    attention: CoreAttention = "auto"
    # the local spec's MoE token dispatch (no transformer-engine): "sorted": tokens permuted by sorting
    # their expert ids, no host sync per layer at EP=1 and only the all-to-all's split sizes at EP>1
    # (models.sorted_dispatch); "megatron": Megatron's dispatchers as they are. Same parameters either way.
    moe_dispatch: MoeDispatch = "sorted"
    # the decoder's modules: "local": Megatron's torch modules with the fast paths above, the
    # supported path on CPUs and GPUs (what the tests and the GPU kit validate); "transformer_engine":
    # transformer-engine's modules and fused kernels (its attention, experts, permutation and fused
    # router; the three options above then do nothing), an optional accelerator for GPUs with
    # transformer-engine installed, chosen only here and refused where it cannot run. Same
    # parameters and checkpoints either way.
    layer_spec: LayerSpec = "local"

    def __post_init__(self) -> None:
        if self.params_dtype is not None:
            _check_choice("params_dtype", self.params_dtype, ParamsDtype)
        _check_choice("recompute", self.recompute, Recompute)
        _check_choice("moe_token_dispatcher", self.moe_token_dispatcher, TokenDispatcher)
        _check_choice("expert_gemm", self.expert_gemm, ExpertGemm)
        _check_choice("attention", self.attention, CoreAttention)
        _check_choice("moe_dispatch", self.moe_dispatch, MoeDispatch)
        _check_choice("layer_spec", self.layer_spec, LayerSpec)
        if not isinstance(self.routing_replay, bool):
            raise ValueError(f"model.routing_replay={self.routing_replay!r} must be true or false")
        coeff = self.moe_aux_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
            raise ValueError(f"model.moe_aux_loss_coeff={coeff!r} must be a non-negative number")
        divisor = self.make_vocab_size_divisible_by
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
            raise ValueError(
                f"model.make_vocab_size_divisible_by={divisor!r} must be a positive integer"
            )

    def resolved(self) -> ModelOptions:
        """These options with an unset ``params_dtype`` and ``attention="auto"`` decided by this
        process's devices."""
        if self.params_dtype is not None and self.attention != "auto":
            return self
        return replace(self, params_dtype=self.params_dtype or default_params_dtype(),
                       attention=local_core_attention(self.attention))

    def params_dtype_on(self, *, gpu: bool) -> ParamsDtype:
        """The dtype a rank with (``gpu``) or without a GPU builds the model in: for planning
        an allocation from a machine that is not part of it."""
        return self.params_dtype if self.params_dtype is not None else default_params_dtype(gpu)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.params_dtype is None:
            raise ValueError("model.params_dtype is unset (the platform default): call ModelOptions.resolved() in the "
                             "process that builds the model to decide it there")
        return TORCH_DTYPES[self.params_dtype]


def _check_choice(name: str, value: object, choices: object) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"model.{name}={value!r} must be one of {', '.join(map(repr, allowed))}")
