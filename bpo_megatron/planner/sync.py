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


def expected_sync(cfg, hf, total_params: int) -> SyncEstimate | None:
    """None for engines that do not sync over a GPU transport (the embedded engine, vLLM)."""
    transport = cfg.rollout.spec.transport(cfg.rollout.options, cfg.cluster.colocate)
    if transport not in ("nccl_broadcast", "cuda_ipc") or not cfg.cluster.gpus_per_node:
        return None
    nbytes = total_params * 2  # bf16
    buckets = math.ceil(nbytes / (cfg.weight_sync.bucket_bytes))
    tensors = hf_tensor_count(hf)
    # one collective per tensor, except experts: one gather brings one from every expert-parallel rank
    expert_tensors = 3 * hf.num_experts * len(set(hf.moe_layers))
    gathers = tensors - expert_tensors + math.ceil(expert_tensors / cfg.parallel.ep)
    nodes = max(1, math.ceil(cfg.cluster.trainer_ranks / cfg.cluster.gpus_per_node))
    remote = (nodes - 1) / nodes  # the share of the pieces rank 0 receives from other nodes
    gather = nbytes * remote / (INTER_NODE_GBPS * 1e9) + nbytes * (1 - remote) / (NVLINK_GBPS * 1e9) + gathers * CALL_S
    if transport == "nccl_broadcast":
        parts = {"gather to trainer rank 0": gather,
                 "broadcast to the engines": nbytes / (INTER_NODE_GBPS * 1e9) + tensors * CALL_S,
                 "announcements": buckets * HTTP_S}
    else:
        parts = {"gather to trainer rank 0": gather,
                 "spread to every trainer rank": nbytes / (INTER_NODE_GBPS * 1e9) + buckets * CALL_S,  # one per bucket
                 "hand-over to the engines": buckets * IPC_BUCKET_S}
    return SyncEstimate(transport, sum(parts.values()), parts)
