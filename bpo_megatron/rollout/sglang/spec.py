"""The SGLang engine as the rest of the system sees it (registered in ``rollout.engine.ENGINES``)."""

from __future__ import annotations

from dataclasses import asdict, replace

from bpo_megatron.rollout.engine import EngineContext, EngineProfile, EngineSpec, RolloutEngine
from bpo_megatron.rollout.sglang.options import SGLangConfig, SGLangOptions


def engine_config(options: SGLangOptions, context: EngineContext) -> SGLangConfig:
    """Engine ``i`` of a run: its checkpoint, port (``port + i``, or free at each start), capture
    and memory saver as the run decides."""
    return SGLangConfig(**asdict(options), model_path=context.model_dir,
                        capture_routed_experts=context.routing is not None,
                        memory_saver=context.colocated, node_address=context.node_address,
                        visible_devices=context.devices, sequence_tokens=context.longest_sequence,
                        weight_bucket_bytes=context.weight_bucket_bytes).with_port(
                            None if options.port is None else options.port + context.index)


def _build(options: SGLangOptions, context: EngineContext) -> RolloutEngine:
    from bpo_megatron.rollout.sglang.engine import SGLangEngine

    config = engine_config(options, context)
    if options.quantization == "fp8" and options.url is None:  # a server it starts: from a block-FP8 checkpoint
        from bpo_megatron.models.hf_config import HFModelConfig
        from bpo_megatron.rollout.sglang.fp8_layout import unquantized_modules
        from bpo_megatron.weights import fp8

        # the layers SGLang cannot build in FP8 at this engine's layout stay bf16 in the copy (its ignored_layers)
        unquantized = unquantized_modules(options, HFModelConfig.load(context.model_dir))
        served = fp8.served_checkpoint(context.model_dir, options.fp8_checkpoint_dir, unquantized=unquantized,
                                       timeout_s=options.fp8_copy_timeout_s)
        config = replace(config, model_path=str(served))
    return SGLangEngine(config, routing=context.routing)


def _profile(options: SGLangOptions, requests: int, gpus_per_engine: float) -> EngineProfile:
    # requests in flight: max_inflight, or (unset) as many as its KV pool holds at full length
    # (bpo_megatron/planner/rollout.py); the server admits them as its pool allows
    inflight = options.max_inflight or requests
    return EngineProfile(tp=options.tp_size, sequences=min(inflight, requests),
                         pool_fraction=options.mem_fraction_static, admits_by_pool=True,
                         requested_inflight=options.max_inflight)


DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def _notes(options: SGLangOptions) -> list[str]:
    # every response's seed goes out as sampling_params.sampling_seed (protocol.sampling_params);
    # SGLang 0.5.23 builds its per-request seeds only under deterministic inference
    # (sampling/sampling_batch_info.py) and otherwise draws from its own generator
    if DETERMINISTIC_FLAG in options.extra_args:
        return []
    return [f"rollout.seed reaches SGLang as each response's sampling_seed, which SGLang samples with only when its "
            f"servers run {DETERMINISTIC_FLAG} (rollout.sglang.extra_args; its batch-invariant kernels cost "
            "throughput): without it responses do not repeat from rollout.seed"]


def _quantized_layout(options: SGLangOptions, hf):
    from bpo_megatron.rollout.sglang.fp8_layout import quantized_layout

    return quantized_layout(options, hf)


SPEC = EngineSpec(
    name="sglang",
    options=SGLangOptions,
    build=_build,
    profile=_profile,
    # on the trainer's GPUs: CUDA IPC handles; on its own: one broadcast from the trainer's GPU
    transport=lambda options, colocated, gpus: "cuda_ipc" if colocated else "nccl_broadcast",
    transports={"cuda_ipc": "bpo_megatron.rollout.sglang.cuda_ipc:CudaIpc",
                "nccl_broadcast": "bpo_megatron.rollout.sglang.nccl_broadcast:NcclBroadcast"},
    # the server captures routing wherever it runs (it may be attached by url from a CPU driver)
    # pause_generation (retract) keeps requests under way; meta_info.weight_versions dates each token
    partial_rollouts=True,
    # top_logprobs_num: log-softmax(logits / T), before SGLang's top-k/top-p (layers/sampler.py)
    top_logprobs="unfiltered",
    # block FP8: each linear weight sent as e4m3 values and its block scales (weights/fp8.py)
    weight_quantization=lambda options: "fp8-blocks" if options.quantization == "fp8" else None,
    # its NCCL broadcast path loads whole Hugging Face-named tensors only (update_weights_from_distributed
    # reads no load format), and this project's IPC path posts flattened buckets of whole tensors:
    # a delta skips the unchanged tensors (docs/internals.md, "Weight sync")
    weight_delta=lambda options, transport: "tensors",
    # release_memory_occupation frees the weights too (this project starts SGLang without
    # --enable-weights-cpu-backup), so colocated, every sync after a train phase is full
    drops_weights_when_released=True,
    # the layers SGLang builds in block FP8 at rollout.sglang's tp_size/ep_size, those served in bf16
    quantized_layout=_quantized_layout,
    notes=_notes,
)
