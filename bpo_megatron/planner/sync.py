"""Expected time of one weight sync on GPUs, per transport, from the model's size and stated
link speeds (docs/benchmarks.md, "Weight sync on GPUs", derives the same figures by hand).

Assumptions (H100 nodes): ≈ 40 GB/s between nodes on one GPU's NIC, ≈ 150 GB/s over NVLink within
a node, ≈ 30 µs per collective or point-to-point call, ≈ 5 ms per HTTP call to a server, ≈ 15 ms
per colocated bucket hand-over (flatten, gather of the IPC handles, one post per engine), SGLang
loading at ≥ 20 GB/s per TP rank (overlapping the transfer).

A delta sync (:func:`expected_delta_sync`) sends only the elements whose bf16 bytes changed, sparse or
dense per bucket (:mod:`bpo_megatron.weight_sync.delta_estimate`), at an assumed changed share of
``DELTA_CHANGED_SHARE`` per sync. Each trainer rank first compares the part of the model its
distributed optimizer updates (its shard / dp for dense weights, / expert dp for experts) with the
bf16 copy the engines hold: on its GPU (``DEVICE_DIFF_GBPS``, an assumption: ≈ 7 passes over the
bf16 bytes, compare, compaction and the copy's update, at ≈ 3.35 TB/s of H100 memory bandwidth) or
in host memory (the shard leaves the GPU at ``D2H_GBPS``, ≈ 32 GB/s measured on an H100 as the
trainer's offload, and is compared at a host rate that ``bpo-megatron bench sync`` measures); the
sparse pieces then take the full sync's path. Only a path whose engine accepts a partial update
can take a delta (``DELTA_TRANSPORTS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bpo_megatron.weight_sync.delta_estimate import delta_wire_bytes
from bpo_megatron.weights.names import hf_tensor_count

INTER_NODE_GBPS, NVLINK_GBPS = 40.0, 150.0
CALL_S, HTTP_S, IPC_BUCKET_S = 30e-6, 5e-3, 15e-3
D2H_GBPS = 32.0  # a trainer rank's weights to host memory (measured on an H100: the offload's rate)
DEVICE_DIFF_GBPS = 500.0  # bf16 bytes compared with the held copy on the GPU, per second (assumed)
# the changed share of bf16 weights per sync the plan assumes: verl's measurement on Qwen3-30B-A3B and
# 235B-A22B (0.8-1.1% a step); this project's own measurements are in docs/benchmarks.md
DELTA_CHANGED_SHARE = 0.01


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
# GPU transports whose SGLang path accepts a partial update: update_weights_from_tensor hands its
# tensors to a registered custom loader (--custom-weight-loader), which can scatter sparse pieces;
# update_weights_from_distributed receives whole tensors of the announced shapes and loads them
# with the model's load_weights, so a delta over NCCL would send every tensor with a change (all
# of them at a changed share of 1%)
DELTA_TRANSPORTS = {"cuda_ipc"}


def sync_transport(cfg) -> str | None:
    """The GPU transport a recipe's weight sync takes (None: not over GPUs)."""
    transport = cfg.rollout.spec.transport(cfg.rollout.options, cfg.cluster.colocate, cfg.cluster.gpus_per_engine > 0)
    return transport if transport in GPU_TRANSPORTS and cfg.cluster.gpus_per_node else None


def _transfer(cfg, hf, payload: int) -> _Transfer:
    """``payload`` bytes from the trainer's ranks to rank 0, in buckets of ``weight_sync.bucket_bytes``."""
    tensors = hf_tensor_count(hf)
    # one collective per tensor, except experts: one gather brings one from every expert-parallel rank
    expert_tensors = 3 * hf.num_experts * len(set(hf.moe_layers))
    gathers = tensors - expert_tensors + math.ceil(expert_tensors / cfg.parallel.ep)
    nodes = max(1, math.ceil(cfg.cluster.trainer_ranks / cfg.cluster.gpus_per_node))
    remote = (nodes - 1) / nodes  # the share of the pieces rank 0 receives from other nodes
    gather = payload * remote / (INTER_NODE_GBPS * 1e9) + payload * (1 - remote) / (NVLINK_GBPS * 1e9) + gathers * CALL_S
    return _Transfer(nbytes=payload, buckets=math.ceil(payload / cfg.weight_sync.bucket_bytes), tensors=tensors,
                     gather=gather)


def expected_sync(cfg, hf, total_params: int) -> SyncEstimate | None:
    """None for engines that do not sync over a GPU transport (the embedded engine, vLLM)."""
    transport = sync_transport(cfg)
    if transport is None:
        return None
    parts = GPU_TRANSPORTS[transport](_transfer(cfg, hf, total_params * 2))  # bf16
    return SyncEstimate(transport, sum(parts.values()), parts)


@dataclass(frozen=True)
class DeltaEstimate:
    transport: str
    changed_share: float
    wire_bytes: int  # what the trainer sends (a full sync: 2 bytes a parameter)
    diff_bytes: int  # bf16 bytes the busiest trainer rank compares with the engines' copy
    seconds: float | None  # None: the transport's engine path takes no partial update
    parts: dict[str, float]


def diffed_params(plan) -> int:
    """Parameters the busiest trainer rank compares at a delta sync: what its distributed
    optimizer updates (dense weights / dp, its experts / expert dp)."""
    return max((math.ceil(s.params.dense / plan.dp) + math.ceil(s.params.expert / plan.expert_dp)
                for s in plan.stages), default=0)


def expected_delta_sync(cfg, hf, total_params: int, diffed: int, *, changed_share: float = DELTA_CHANGED_SHARE,
                        host_diff_gbps: float | None = None) -> DeltaEstimate | None:
    """A delta sync's bytes and seconds at ``changed_share``, the busiest trainer rank comparing
    ``diffed`` parameters (:func:`diffed_params`) with the engines' copy on its GPU, or in host
    memory at ``host_diff_gbps`` when given; None where :func:`expected_sync` is None."""
    transport = sync_transport(cfg)
    if transport is None:
        return None
    bucket_elements = cfg.weight_sync.bucket_bytes // 2
    payload = delta_wire_bytes(total_params, bucket_elements, changed_share)
    diff_bytes = diffed * 2
    if transport not in DELTA_TRANSPORTS:
        return DeltaEstimate(transport, changed_share, payload, diff_bytes, None, {})
    if host_diff_gbps is None:
        diff = {"diff on the GPU": diff_bytes / (DEVICE_DIFF_GBPS * 1e9)}
    else:
        diff = {"to host memory": diff_bytes / (D2H_GBPS * 1e9), "diff in host memory": diff_bytes / (host_diff_gbps * 1e9)}
    parts = {**diff, **GPU_TRANSPORTS[transport](_transfer(cfg, hf, payload))}
    return DeltaEstimate(transport, changed_share, payload, diff_bytes, sum(parts.values()), parts)
