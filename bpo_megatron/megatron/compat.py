"""Run megatron-core 0.16.x–0.19.x on CPU over gloo.

Megatron-Core's model code assumes CUDA in a handful of places (device queries, a side stream, the
CUDA RNG, a few ``device="cuda"`` allocations) and has one bug that shows without
transformer-engine on any platform (:func:`ensure_megatron_fixes` mends it, on GPUs too). On a
machine without a GPU, :func:`ensure_megatron_cpu_compat` replaces exactly
those spots with CPU equivalents by setting module attributes at runtime. Nothing on disk is
modified and no environment variable is read or written; with CUDA present it does nothing.

The same holds for Megatron's optimizer stack in fp32 without the distributed optimizer:
``get_megatron_optimizer`` (FP32Optimizer per parameter kind, chained), its grad norm over the
model-parallel and expert groups, clipping and zero counting, on top of Megatron's
``DistributedDataParallel`` and ``finalize_model_grads`` (which need nothing beyond the model
patches).

Each patch is a small function registered with :func:`_patch`, with a comment saying why it is
needed. Every one was checked against the 0.16.1 source, and removing any one of them makes
``tests/test_megatron_cpu.py`` or ``tests/test_optimizer.py`` fail; 0.19.2 needs the same ones
(its Megatron tests pass with them, ``.ci/run``), less the fix 0.17 made upstream. Versions
outside :data:`SUPPORTED_MINORS` are refused: a patch could miss its target silently there.

The distributed optimizer (ZeRO-1: master weights and moments sharded over data parallelism) runs
on CPU in fp32 with one patch (its params' ``type()`` check), so its sharded checkpoint format is
tested here (``OptimizerSettings.distributed``). Out of scope: the float16 optimizers (bf16/fp16
training); they accept only CUDA params and are the GPU path.
"""

from __future__ import annotations

import copy
import importlib.metadata
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from bpo_megatron import platform

SUPPORTED_MINORS = range(16, 20)  # megatron-core 0.16.x to 0.19.x


@dataclass(frozen=True)
class CompatPatch:
    """One runtime patch: a name for reports, the function that applies it, and the first
    megatron-core minor version that no longer needs it (None: every supported one does)."""

    name: str
    apply: Callable[[], None]
    fixed_upstream_in: int | None = None


_PATCHES: list[CompatPatch] = []
_applied: list[str] = []
_done = False


def _patch(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` as a compat patch; patches are applied in registration order."""
    _PATCHES.append(CompatPatch(name=fn.__name__.lstrip("_"), apply=fn))
    return fn


def megatron_version() -> str:
    """The installed megatron-core version, read from package metadata (no import)."""
    return importlib.metadata.version("megatron-core")


def megatron_minor() -> int:
    major, minor = (int(part) for part in megatron_version().split(".")[:2])
    return minor if major == 0 else -1


def _check_supported_version() -> None:
    # The patches name private functions and literal allocations of these versions; on another
    # one they could silently miss, so refuse instead.
    if megatron_minor() not in SUPPORTED_MINORS:
        raise RuntimeError(
            f"bpo-megatron supports megatron-core 0.{SUPPORTED_MINORS[0]}.x to 0.{SUPPORTED_MINORS[-1]}.x; "
            f"found {megatron_version()}"
        )


def needs_cpu_compat() -> bool:
    """True when the compat layer has work to do: no usable CUDA device."""
    return not platform.has_cuda()


def applied_patches() -> tuple[str, ...]:
    """Names of the patches applied in this process (empty with CUDA or before the first call)."""
    return tuple(_applied)


def ensure_megatron_cpu_compat() -> tuple[str, ...]:
    """Make megatron-core usable on CPU; a no-op with CUDA and on every call after the first.

    Call it before creating Megatron process groups or models. Returns :func:`applied_patches`.
    """
    global _done
    if _done or not needs_cpu_compat():
        return applied_patches()
    _check_supported_version()
    ensure_megatron_fixes()
    for patch in _PATCHES:
        if patch.name in _applied:  # applied by an earlier call that failed further on
            continue
        patch.apply()
        _applied.append(patch.name)
    _done = True
    return applied_patches()


_FIXES: list[CompatPatch] = []
_fixed: list[str] = []


def _fix(fixed_upstream_in: int | None = None) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register a fix of a megatron-core bug that shows on every platform (until the minor
    version ``fixed_upstream_in``)."""
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        _FIXES.append(CompatPatch(name=fn.__name__.lstrip("_"), apply=fn, fixed_upstream_in=fixed_upstream_in))
        return fn

    return register


def applied_fixes() -> tuple[str, ...]:
    """Names of the platform-independent fixes applied in this process."""
    return tuple(_fixed)


def ensure_megatron_fixes() -> tuple[str, ...]:
    """Fix the megatron-core bugs that show on GPUs as well (e.g. without transformer-engine).

    Idempotent; :func:`ensure_megatron_cpu_compat` applies them too. Returns :func:`applied_fixes`.
    """
    _check_supported_version()
    minor = megatron_minor()
    for fix in _FIXES:
        if fix.fixed_upstream_in is not None and minor >= fix.fixed_upstream_in:
            continue
        if fix.name not in _fixed:
            fix.apply()
            _fixed.append(fix.name)
    return applied_fixes()


@_fix(fixed_upstream_in=17)
def _define_te_general_gemm_without_te() -> None:
    # megatron-core 0.16.1 bug (fixed in 0.17): moe_utils binds te_general_gemm only inside its
    # transformer-engine import block, but RouterGatingLinearFunction tests
    # `te_general_gemm is not None` unconditionally, so every MoE router forward raises
    # NameError without TE, on a GPU as on a CPU (seen on an H100 by the GPU smoke run). None
    # selects the plain torch.mm path the code intends.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@_fix(fixed_upstream_in=17)  # 0.19 sets HAVE_TE from TE itself (latent attention is built on 0.16 only)
def _latent_attention_without_te() -> None:
    # Without transformer-engine, megatron.core.extensions.transformer_engine still imports (its TE
    # names are mocks), so multi_latent_attention sets HAVE_TE=True and its constructor's
    # `isinstance(self.linear_proj, TELinear)` raises TypeError: MLA cannot be built on the local
    # spec. HAVE_TE=False there skips only that TE-specific fp8 setting.
    if platform.has_transformer_engine():
        return
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False


def foreach_l2_norm(_chunk_size: int, _noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                    _per_tensor: bool, *_args: Any) -> tuple[torch.Tensor, None]:
    """The L2 norm of every tensor of ``tensor_lists`` together, as a one-element fp32 tensor on
    their device: ``amp_C.multi_tensor_l2norm``'s contract, from torch's foreach norm (no host
    read). Megatron's own fallback reads each tensor's norm back to the host."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=platform.device()), None
    # each tensor's norm accumulated and returned in fp32 (a bf16 tensor's too: Megatron's fallback
    # rounded those to bf16 before summing)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(_chunk_size: int, _noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                  scale: float) -> None:
    """``dst = src * scale`` for the pairs of ``tensor_lists = [srcs, dsts]``
    (``amp_C.multi_tensor_scale``'s contract) with torch's foreach kernels."""
    sources, targets = tensor_lists
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


@_fix()
def _multi_tensor_ops_without_per_tensor_syncs() -> None:
    # Without apex or transformer-engine, Megatron's grad norm is megatron.core.utils'
    # local_multi_tensor_l2_norm: `torch.tensor([norm of each tensor])` reads every tensor's norm
    # back to the host (1,145 syncs a step on the GPU kit's model), and local_multi_tensor_scale
    # runs two kernels per tensor (clipping, and the distributed optimizer's main → model copy).
    # The same values from foreach kernels; the modules bound the fallbacks at import.
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mcore_optimizer
    from megatron.core import utils as mcore_utils

    for module in (clip_grads, mcore_optimizer):
        if getattr(module, "l2_norm_impl", None) is mcore_utils.local_multi_tensor_l2_norm:
            module.l2_norm_impl = foreach_l2_norm
        if getattr(module, "multi_tensor_scale_impl", None) is mcore_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def packed_rotary_embedding(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Megatron's ``_apply_rotary_pos_emb_thd`` (RoPE over a packed row) without host reads: each
    position's frequencies are gathered by its position within its segment, computed on the
    device from ``cu_seqlens`` (``searchsorted``), and the row is rotated at once by Megatron's own
    ``_apply_rotary_pos_emb_bshd``, the function Megatron applies to each segment's slice: the
    same values, element for element. Megatron's version reads the segment lengths back to the host
    (``tolist``) and slices the row once per segment, for queries and keys of every layer. Context
    parallelism and multi-latent attention's interleaving keep Megatron's version."""
    from megatron.core.models.common.embeddings import rope_utils

    def rotate(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
               *args: Any, mscale: float = 1.0, cp_group=None, **kwargs: Any) -> torch.Tensor:
        mla = args or any(kwargs.values())
        if cp_group is None or cp_group.size() != 1 or mla:
            return original(t, cu_seqlens, freqs, rotary_interleaved, *args, mscale=mscale, cp_group=cp_group,
                            **kwargs)
        total = t.shape[0]
        if freqs.size(0) == total:  # frequencies of the whole packed row (Megatron's "exact mapping")
            packed = freqs[:total]
        else:  # frequencies of the longest segment: each segment starts again at position 0
            index = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
            starts = cu_seqlens[torch.searchsorted(cu_seqlens, index, right=True) - 1]
            packed = freqs[(index - starts).to(freqs.device)]
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                     mscale=mscale).squeeze(1)

    rotate.megatron = original
    return rotate


@_fix()
def _packed_rotary_embedding_without_host_reads() -> None:
    # Packed micro-batches (thd) rotate queries and keys with _apply_rotary_pos_emb_thd, which
    # reads the segment lengths to the host and loops over the segments: 2 host syncs and ops in
    # proportion to the samples of a micro-batch in every layer (apply_rotary_pos_emb finds it by
    # its module name at each call). Same values without either.
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils._apply_rotary_pos_emb_thd = packed_rotary_embedding(rope_utils._apply_rotary_pos_emb_thd)


# --------------------------------------------------------------------------------------------
# torch.cuda entry points that Megatron calls unconditionally
# --------------------------------------------------------------------------------------------


@_patch
def _cuda_current_device_is_cpu() -> None:
    # Megatron allocates with device=torch.cuda.current_device() throughout the model code (RoPE
    # frequencies, MoE routing buffers, pipeline p2p shape tensors, ...). Answering with the CPU
    # device makes those allocations land where the model lives.
    torch.cuda.current_device = platform.device  # type: ignore[assignment]


@_patch
def _cuda_synchronize_is_a_no_op() -> None:
    # Pipeline p2p communication calls torch.cuda.synchronize() after batched isend/irecv
    # (batch_p2p_sync, on by default) and the dist_checkpointing writer after staging tensors to
    # host memory. Gloo requests are complete once wait() returns and CPU kernels are
    # synchronous, so there is nothing to wait for.
    torch.cuda.synchronize = lambda *_args, **_kwargs: None  # type: ignore[assignment]


class _HostEvent:
    """Stand-in for a CUDA event: CPU work is synchronous, so an event is always reached."""

    def record(self, *_args: object, **_kwargs: object) -> None:
        pass

    def wait(self, *_args: object, **_kwargs: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """Stand-in for a CUDA stream: on CPU the calling thread is the only, in-order queue."""

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        pass

    def wait_stream(self, _other: object) -> None:
        pass

    def wait_event(self, _event: object) -> None:
        pass

    def record_event(self, event: _HostEvent | None = None) -> _HostEvent:
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _HostStream()


@_patch
def _cuda_streams_are_host_streams() -> None:
    # The alltoall MoE dispatcher creates a side stream when it is built
    # (MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()), and in every forward
    # compares it with torch.cuda.current_stream(), makes it wait for the current stream and
    # synchronises on an event recorded on it. (torch.cuda.stream(...) and torch.cuda.Event
    # already degrade to no-ops without CUDA.) Streams that are always idle are exact on CPU.
    torch.cuda.Stream = _HostStream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *_args, **_kwargs: _CURRENT_STREAM  # type: ignore[assignment]


@_patch
def _cuda_rng_uses_cpu_generator() -> None:
    # Megatron keeps one RNG stream per parallel group (data, tensor, expert) in
    # CudaRNGStatesTracker, seeded by model_parallel_cuda_manual_seed. Without CUDA,
    # torch.cuda.get_rng_state raises, while torch.cuda.manual_seed and
    # random._set_cuda_rng_state queue a lazy call that never runs, so every tracked stream
    # would silently be the same unseeded state. On CPU, dropout and init draw from the default
    # CPU generator: the tracker must seed, save and restore that one.
    # (torch.cuda.set_rng_state is not patched: Megatron's model path goes through
    # random._set_cuda_rng_state.)
    import megatron.core.tensor_parallel.random as mcore_random

    def get_rng_state(*_args: object, **_kwargs: object) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, *_args: object, **_kwargs: object) -> None:
        torch.set_rng_state(state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    torch.cuda.get_rng_state = get_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = manual_seed  # type: ignore[assignment]
    mcore_random._get_cuda_rng_state = get_rng_state
    mcore_random._set_cuda_rng_state = set_rng_state


# --------------------------------------------------------------------------------------------
# Megatron-Core functions that hard-code CUDA or break without transformer-engine
# --------------------------------------------------------------------------------------------


@_patch
def _default_causal_mask_on_cpu() -> None:
    # The unfused softmax (the only one without CUDA kernels) builds its causal mask with
    # transformer.utils.get_default_causal_mask, which allocates on device="cuda".
    # fused_softmax imported the function by name, so both module attributes are replaced.
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        ones = torch.ones(sq, sq, dtype=torch.bool, device=platform.device())
        return torch.triu(ones, diagonal=1)

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


@_patch
def _torch_norm_supports_sequence_parallel() -> None:
    # Without TE or apex the layer specs fall back to WrappedTorchNorm, which refuses
    # sequence_parallel; yet Megatron requires sequence parallelism for MoE with TP > 1. A norm
    # is pointwise over the hidden dimension, so it runs unchanged on a sequence shard; only its
    # weight gradient is partial per TP rank. Tagging the parameters `.sequence_parallel = True`
    # (as apex's FusedLayerNorm and TE do) makes finalize_model_grads all-reduce them over TP.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build_norm = WrappedTorchNorm.__new__

    def new_norm(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return build_norm(cls, config, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = build_norm(cls, config_without_sp, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new_norm)  # type: ignore[method-assign,assignment]


@_patch
def _moe_split_sizes_reach_host_as_numpy() -> None:
    # The alltoall dispatcher hands its all-to-all split sizes to the host with
    # moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True), which only acts on CUDA tensors.
    # On CPU the sizes stay torch tensors and all_to_all_single rejects them where it expects a
    # sequence of ints (TypeError). Convert CPU tensors the way CUDA ones are converted.
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    move_to_host = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(
        tensor: Any, as_numpy: bool = False, record_stream: bool = False
    ) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()  # a private copy, like the device-to-host copy
        return move_to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _on_host(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a tensor factory with a ``device="cuda"`` literal redirected to the CPU."""
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = platform.device()
    return kwargs


class _TorchOnHost(types.ModuleType):
    """``torch`` as one module sees it, except that ``zeros(device="cuda")`` and
    ``tensor(..., device="cuda")`` allocate on the CPU; every other attribute is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **_on_host(kwargs))

    @staticmethod
    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **_on_host(kwargs))


@_patch
def _pipeline_schedules_count_tokens_on_cpu() -> None:
    # Every forward_backward_* schedule starts with
    # `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`. The device is a
    # literal, not a lookup that could be redirected, so the schedules module gets its own view
    # of torch whose zeros() maps that device to the CPU; every other attribute is torch's own.
    import megatron.core.pipeline_parallel.schedules as schedules

    schedules.torch = _TorchOnHost()  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------
# The fp32 optimizer stack (FP32Optimizer, ChainedOptimizer, clip_grads)
# --------------------------------------------------------------------------------------------


@_patch
def _fp32_optimizer_loss_scale_on_host() -> None:
    # FP32Optimizer.__init__ stores its (constant) loss scale as
    # `torch.tensor([1.0], device='cuda')`, so get_megatron_optimizer fails while building the
    # optimizer. Same literal-device situation as in the schedules: optimizer.py gets a view of
    # torch that allocates that scalar on the CPU.
    import megatron.core.optimizer.optimizer as mcore_optimizer

    mcore_optimizer.torch = _TorchOnHost()  # type: ignore[assignment]


@_patch
def _grad_stats_allocate_on_host() -> None:
    # get_grad_norm_fp32 allocates its overflow flag with `torch.zeros(1, device='cuda')` before
    # every L2 norm (and the inf-norm result with torch.tensor(device='cuda')); count_zeros_fp32
    # starts its count the same way. The flag is only read by fused kernels, the results are
    # all-reduced over the model-parallel group: on CPU they belong on the CPU.
    import megatron.core.optimizer.clip_grads as clip_grads

    clip_grads.torch = _TorchOnHost()  # type: ignore[assignment]


@_patch
def _clip_grads_accept_host_fp32_grads() -> None:
    # clip_grad_by_total_norm_fp32 asserts `param.grad.type() == 'torch.cuda.FloatTensor'`, a
    # check of dtype *and* device, so clipping fails for every CPU gradient. This is the same
    # function with the check reduced to the dtype. optimizer.py imported it by name (FP32Optimizer
    # and ChainedOptimizer clip through that binding), so both module attributes are replaced.
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mcore_optimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        grad_attr = "decoupled_grad" if use_decoupled_grad else "grad"
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        grads = []
        for param in parameters:
            grad = getattr(param, grad_attr, None)
            if grad is not None:
                assert grad.dtype in allowed, f"clipping expects {allowed} grads, got {grad.dtype}"
                grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)  # Megatron's epsilon, kept for parity
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


@_patch
def _tied_output_layer_stays_on_host() -> None:
    # With tied embeddings and pp > 1, LanguageModule.setup_embeddings_and_output_layer moves the
    # last stage's copy of the embedding to CUDA (`weight.data = weight.data.cuda()`) before
    # all-reducing it with the first stage's. On CPU the copy must stay where it is: during that
    # one call, Tensor.cuda() returns the tensor itself.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self: Any) -> Any:
        to_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *_args, **_kwargs: tensor  # type: ignore[method-assign]
        try:
            return setup(self)
        finally:
            torch.Tensor.cuda = to_cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


@_patch
def _distributed_optimizer_accepts_host_fp32_params() -> None:
    # DistributedOptimizer sorts the model's params by `param.type()`, a check of dtype *and*
    # device: 'torch.cuda.FloatTensor' is an fp32 param whose shard is the optimizer's main param,
    # anything else but the CUDA half types is refused. A CPU fp32 param reports 'torch.FloatTensor'.
    # During that one call (where the shards are built) a host fp32 tensor reports the CUDA name;
    # everything after it (reduce-scatter of the grads, the parameter all-gather, the checkpoint
    # formats) is device-neutral and runs over gloo as it is.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    build = DistributedOptimizer._build_model_and_main_param_groups.__func__

    def build_model_and_main_param_groups(cls: type, *args: Any, **kwargs: Any) -> Any:
        type_of = torch.Tensor.type

        def host_fp32_as_cuda(tensor: torch.Tensor, *type_args: Any, **type_kwargs: Any) -> Any:
            name = type_of(tensor, *type_args, **type_kwargs)
            return "torch.cuda.FloatTensor" if not type_args and not type_kwargs and name == "torch.FloatTensor" \
                else name

        torch.Tensor.type = host_fp32_as_cuda  # type: ignore[method-assign,assignment]
        try:
            return build(cls, *args, **kwargs)
        finally:
            torch.Tensor.type = type_of  # type: ignore[method-assign]

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build_model_and_main_param_groups)
