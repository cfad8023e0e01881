"""The embedded engine as the rest of the system sees it (registered in ``rollout.engine.ENGINES``)."""

from __future__ import annotations

from bpo_megatron.rollout.engine import EngineContext, EngineProfile, EngineSpec, RolloutEngine
from bpo_megatron.rollout.hf.options import HFEngineOptions


def _build(options: HFEngineOptions, context: EngineContext) -> RolloutEngine:
    from bpo_megatron import platform
    from bpo_megatron.models.options import TORCH_DTYPES
    from bpo_megatron.rollout.hf.engine import HFEngine

    # in process, on this process's own device: the GPU its placement gave it, else the CPU
    return HFEngine(context.model_dir, capture_routing=context.routing is not None, threads=context.threads,
                    device=platform.device(),
                    dtype=TORCH_DTYPES[options.dtype], max_batch_rows=options.max_batch_rows,
                    decode=options.decode, refill_every=options.refill_every,
                    compile_layers=options.compile, quantization=options.quantization)


def _profile(options: HFEngineOptions, requests: int, gpus_per_engine: float) -> EngineProfile:
    # one device; rows decode together up to max_batch_rows (their KV cache lives at once); a
    # release drops the decode states (KV slots, buffers, graphs), the weights stay
    return EngineProfile(tp=1, sequences=min(requests, options.max_batch_rows), released=("kv_cache",))


SPEC = EngineSpec(
    name="hf",
    options=HFEngineOptions,
    build=_build,
    profile=_profile,
    # on the trainer's GPU: the trainer's device buffers mapped by CUDA IPC; otherwise in place
    # through shared memory on the trainer's node, Ray's object store elsewhere
    transport=lambda options, colocated, gpus: "cuda_ipc" if colocated and gpus else "shared_memory",
    transports={"shared_memory": "bpo_megatron.rollout.hf.shared_memory:SharedMemory",
                "cuda_ipc": "bpo_megatron.rollout.hf.cuda_ipc:CudaIpc"},
    # weights are sent in the engine's own precision, so what it holds is exactly what was sent
    weight_dtype=lambda options: options.dtype,
    weight_quantization=lambda options: None if options.quantization == "none" else options.quantization,
    # a delta's sparse pieces are written in place over every transport (rollout/hf/weights.py, shared_memory.py)
    weight_delta=lambda options, transport: "sparse",
    exposes_weights=True,
    partial_rollouts=True,  # its forward gate (rollout/hf/engine.py)
    top_logprobs="drawn",  # of the distribution it drew from (rollout/hf/sampling.py)
)
