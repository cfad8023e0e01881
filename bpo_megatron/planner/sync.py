"""Expected time of one weight sync on GPUs, per transport, from the model's size and stated
link speeds (docs/benchmarks.md, "Weight sync on GPUs", derives the same figures by hand).

Assumptions (H100 nodes): ≈ 40 GB/s between nodes on one GPU's NIC, ≈ 150 GB/s over NVLink within
a node, ≈ 30 µs per collective or point-to-point call, ≈ 5 ms per HTTP call to a server, ≈ 15 ms
per colocated bucket hand-over (flatten, gather of the IPC handles, one post per engine), SGLang
loading at ≥ 20 GB/s per TP rank (overlapping the transfer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bpo_megatron.weights.names import hf_tensor_count

INTER_NODE_GBPS, NVLINK_GBPS = 40.0, 150.0
CALL_S, HTTP_S, IPC_BUCKET_S = 30e-6, 5e-3, 15e-3


@dataclass(frozen=True)
class SyncEstimate:
    transport: str
    seconds: float
    parts: dict[str, float]  # what the time is made of


@dataclass(frozen=True)
class _Transfer:
    """What every GPU transport's estimate starts from."""

    nbytes: int  # the model in bf16
    buckets: int
    tensors: int  # Hugging Face tensors
    gather: float  # seconds to bring every piece to trainer rank 0


def _broadcast_parts(t: _Transfer) -> dict[str, float]:
    """``nccl_broadcast``: rank 0 broadcasts each tensor to every engine's TP ranks; each bucket is
    announced to every server over HTTP."""
    return {"gather to trainer rank 0": t.gather,
            "broadcast to the engines": t.nbytes / (INTER_NODE_GBPS * 1e9) + t.tensors * CALL_S,
            "announcements": t.buckets * HTTP_S}


def _ipc_parts(t: _Transfer) -> dict[str, float]:
    """``cuda_ipc``: every trainer rank holds each bucket (one collective per bucket) and hands the
    engine TP rank beside it a CUDA IPC handle."""
    return {"gather to trainer rank 0": t.gather,
            "spread to every trainer rank": t.nbytes / (INTER_NODE_GBPS * 1e9) + t.buckets * CALL_S,
            "hand-over to the engines": t.buckets * IPC_BUCKET_S}


# transport name -> what one sync over it is made of; transports not named here do not sync over
# GPUs (the embedded engine's shared memory, Ray's object store) and get no estimate
GPU_TRANSPORTS = {"nccl_broadcast": _broadcast_parts, "cuda_ipc": _ipc_parts}


def expected_sync(cfg, hf, total_params: int) -> SyncEstimate | None:
    """None for engines that do not sync over a GPU transport (the embedded engine, vLLM)."""
    transport = cfg.rollout.spec.transport(cfg.rollout.options, cfg.cluster.colocate, cfg.cluster.gpus_per_engine > 0)
    parts_of = GPU_TRANSPORTS.get(transport)
    if parts_of is None or not cfg.cluster.gpus_per_node:
        return None
    nbytes = total_params * 2  # bf16
    tensors = hf_tensor_count(hf)
    # one collective per tensor, except experts: one gather brings one from every expert-parallel rank
    expert_tensors = 3 * hf.num_experts * len(set(hf.moe_layers))
    gathers = tensors - expert_tensors + math.ceil(expert_tensors / cfg.parallel.ep)
    nodes = max(1, math.ceil(cfg.cluster.trainer_ranks / cfg.cluster.gpus_per_node))
    remote = (nodes - 1) / nodes  # the share of the pieces rank 0 receives from other nodes
    gather = nbytes * remote / (INTER_NODE_GBPS * 1e9) + nbytes * (1 - remote) / (NVLINK_GBPS * 1e9) + gathers * CALL_S
    parts = parts_of(_Transfer(nbytes=nbytes, buckets=math.ceil(nbytes / cfg.weight_sync.bucket_bytes),
                               tensors=tensors, gather=gather))
    return SyncEstimate(transport, sum(parts.values()), parts)
