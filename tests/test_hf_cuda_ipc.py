"""The embedded engine's ``cuda_ipc`` transport up to the CUDA IPC boundary, on a CPU: a flat
bucket shared by value (where the GPU maps the trainer's buffer) opens as the same tensors, and
the trainer ranks each hand over to the engine beside them, all reporting the same failures. The
engines' actors loading such buckets, fingerprints checked after the sync:
``tests/test_engine_group_faults.py``. CUDA IPC itself (the handle, the mapping, 2 TB/s between
processes) runs in the GPU kit."""

from __future__ import annotations

import pickle

import pytest
import torch

from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.weights.flat_bucket import ALIGN, FlatBucket
from bpo_megatron.weights.shared_bucket import DEVICE_ARG, SharedBucket, by_value, device_handle


def _named() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=gen)), ("b.weight", torch.randn(7, generator=gen).bfloat16()),
            ("c.bias", torch.randn(2, 2, generator=gen).double())]


def test_a_shared_bucket_opens_as_the_bucket_that_was_packed():
    named = _named()
    flat = FlatBucket.pack(named)
    assert all(entry.start_idx % ALIGN == 0 for entry in flat.entries)  # SGLang's flattened_bucket layout
    shared = pickle.loads(pickle.dumps(SharedBucket(by_value(flat.buffer), flat.entries)))  # as Ray carries it
    with shared.opened() as received:
        assert [name for name, _ in received] == [name for name, _ in named]
        assert all(torch.equal(got, sent) and got.dtype == sent.dtype for (_, got), (_, sent) in zip(received, named))


def test_only_device_memory_gets_an_ipc_handle():
    from bpo_megatron.rollout.sglang.ipc_pickle import DEVICE_ARG as SGLANG_DEVICE_ARG

    with pytest.raises(ValueError, match=r"a CUDA IPC handle maps device memory; this buffer is on cpu"):
        device_handle(torch.zeros(8, dtype=torch.uint8))
    # the storage's device in torch's reduction, where SGLang's patched rebuild also puts its UUID
    assert DEVICE_ARG == SGLANG_DEVICE_ARG == 6


def _two_ranks_two_engines() -> dict:
    """Trainer ranks 0 and 1 beside engines 0 and 1; engine 1 dies receiving the first bucket."""
    import torch.distributed as dist

    from bpo_megatron.rollout.hf import cuda_ipc
    from bpo_megatron.weight_sync.transport import EngineEndpoint

    received: dict[int, list[str]] = {}

    def load(shared, engines):
        lost = []
        for i in engines:
            if i == 1:
                lost.append(i)
                continue
            with shared.opened() as flat:
                received.setdefault(i, []).extend(name for name, _ in flat)
        return lost

    cuda_ipc._load = load  # the engines' actors, stood in for (this process only)
    sender = cuda_ipc.CudaIpc(share=by_value)
    sender.prepare([EngineEndpoint(0, actor="engine 0"), EngineEndpoint(1, actor="engine 1")])
    mine = dict(sender._mine)
    report = sender.send([_named()[:2], _named()[2:]], version=3)
    return {"rank": dist.get_rank(), "mine": mine, "received": received, "report": report}


def test_each_trainer_rank_hands_over_to_the_engine_beside_it_and_all_report_the_same_failures():
    results = run_gloo_world(_two_ranks_two_engines, 2, timeout=120)
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[0]["mine"] == {0: "engine 0"} and by_rank[1]["mine"] == {1: "engine 1"}
    assert by_rank[0]["received"] == {0: ["a.weight", "b.weight", "c.bias"]}
    assert by_rank[1]["received"] == {}  # its engine died at the first bucket: none sent after it
    sent = sum(t.numel() * t.element_size() for _, t in _named())
    assert by_rank[0]["report"] == by_rank[1]["report"] == {"bytes": sent, "failed": [1]}


def test_an_engine_without_a_trainer_rank_beside_it_is_refused():
    from bpo_megatron.rollout.hf.cuda_ipc import beside

    assert beside(1, 2) == 1
    with pytest.raises(ValueError, match=r"colocated engine 2 needs trainer rank 2 beside it, the trainer has 2 "
                                         r"\(rollout.num_engines ≤ cluster.trainer_ranks\)"):
        beside(2, 2)
