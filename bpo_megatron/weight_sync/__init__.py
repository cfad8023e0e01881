"""Trainer → rollout-engine weight sync: the generic seam between the trainer and the engines.

* :mod:`~bpo_megatron.weight_sync.transport`: what a transport is (``prepare(endpoints)``,
  ``send(buckets, version)``, ``close()``) and the endpoint records it receives;
* :mod:`~bpo_megatron.weight_sync.session`: the driver, which opens each engine's update session,
  gathers the engines' endpoints, lets the trainer send, closes the sessions and replaces engines
  lost on the way;
* :mod:`~bpo_megatron.weight_sync.object_store`: the one transport no engine owns: trainer rank 0
  puts each bucket of host tensors into Ray's object store once; every engine actor loads it
  (vLLM; the embedded engine's engines off the trainer's node).

The engines' own transports live in their folders, named by the engine's spec
(``EngineSpec.transport``) and found through :data:`TRANSPORTS` by dotted path, so nothing here
imports an engine:

* ``shared_memory`` (:mod:`bpo_megatron.rollout.hf.shared_memory`, the embedded engine): trainer
  rank 0 writes each Hugging Face-named tensor straight into the weights of every engine on its
  node (kept in a shared-memory segment); other engines get the buckets through Ray's object store.
* ``nccl_broadcast`` (:mod:`bpo_megatron.rollout.sglang.nccl_broadcast`, SGLang on its own GPUs):
  trainer rank 0, on its own GPU, and every TP rank of every engine form one process group, joined
  as SGLang joins it; each bucket is announced to every server (``/update_weights_from_distributed``)
  and broadcast once from the trainer's GPU memory to all of them (gloo and host memory on a CPU).
* ``cuda_ipc`` (:mod:`bpo_megatron.rollout.sglang.cuda_ipc`, SGLang on the trainer's GPUs): every
  trainer rank holds each bucket on its own GPU and hands the engine TP rank beside it a CUDA IPC
  handle of it (SGLang's flattened buckets).
"""

from __future__ import annotations

from bpo_megatron.registry import LazyRegistry

# transport name -> its class (an engine's transports live in its folder)
TRANSPORTS = LazyRegistry({
    "shared_memory": "bpo_megatron.rollout.hf.shared_memory:SharedMemory",
    "object_store": "bpo_megatron.weight_sync.object_store:ObjectStore",
    "nccl_broadcast": "bpo_megatron.rollout.sglang.nccl_broadcast:NcclBroadcast",
    "cuda_ipc": "bpo_megatron.rollout.sglang.cuda_ipc:CudaIpc",
}, unknown="no weight transport {name!r}; there are {sorted}")


def transport_class(name: str) -> type:
    return TRANSPORTS.load(name)
