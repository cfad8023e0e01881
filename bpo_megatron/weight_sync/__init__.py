"""Trainer → rollout-engine weight transports, chosen from the engine's spec and the placement.

* ``shared_memory`` (the embedded engine): trainer rank 0 writes each Hugging Face-named tensor
  straight into the weights of every engine on its node (kept in a shared-memory segment); other
  engines get the buckets through Ray's object store.
* ``object_store`` (vLLM): trainer rank 0 puts each bucket of host tensors into Ray's object store
  once; every engine actor loads it.
* ``nccl_broadcast`` (SGLang on its own GPUs): trainer rank 0, on its own GPU, and every TP rank of
  every engine form one process group, joined as SGLang joins it; each bucket is announced to
  every server (``/update_weights_from_distributed``) and broadcast once from the trainer's GPU
  memory to all of them (gloo and host memory on a CPU).
* ``cuda_ipc`` (SGLang on the trainer's GPUs): every trainer rank holds each bucket on its own GPU
  and hands the engine TP rank beside it a CUDA IPC handle of it (SGLang's flattened buckets).

A transport class says where its buckets live (``host_tensors``), whether they may view the
trainer's parameters (``views``: the transport copies them before training resumes), whether every trainer rank
sends (``every_rank``) or rank 0 alone, whether it must reach all engines at once
(``whole_group``), and what it addresses (``destinations(engines, indices)``).

The driver (:mod:`bpo_megatron.weight_sync.session`) opens each engine's update session,
lets the trainer send, and closes the sessions; the transports only move bytes.
"""

from __future__ import annotations

from bpo_megatron.registry import LazyRegistry

# transport name -> its class
TRANSPORTS = LazyRegistry({
    "shared_memory": "bpo_megatron.weight_sync.shared_memory:SharedMemory",
    "object_store": "bpo_megatron.weight_sync.object_store:ObjectStore",
    "nccl_broadcast": "bpo_megatron.weight_sync.nccl_broadcast:NcclBroadcast",
    "cuda_ipc": "bpo_megatron.weight_sync.cuda_ipc:CudaIpc",
}, unknown="no weight transport {name!r}; there are {sorted}")


def transport_class(name: str) -> type:
    return TRANSPORTS.load(name)
