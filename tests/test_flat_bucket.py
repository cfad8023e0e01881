"""One copy per bucket on the colocated route: the layout every trainer rank receives a bucket in is
SGLang's ``flattened_bucket`` layout, rank 0 packs into it once, one broadcast per bucket fills it
on the others whatever its dtypes, and ``cuda_ipc`` hands that very buffer to the IPC payload."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.rollout.sglang.weights import ALIGN, DistributedWeightSender, flattened_bucket
from bpo_megatron.weights.flat_bucket import FlatBucket, layout

TIMEOUT = 180.0


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order (bit-for-bit comparison, NaNs and -0.0 included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """bf16, fp32 and int64 of odd sizes (none a multiple of 16 bytes), a transposed (strided) one,
    a scalar, an empty one, and bit patterns torch.equal would not compare (NaN, -0.0)."""
    g = torch.Generator().manual_seed(7)
    special = torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float32)
    return [("embed.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),   # 30 bytes
            ("norm.weight", torch.randn(7, generator=g)),                          # 28 bytes
            ("router.count", torch.randint(-2**62, 2**62, (2, 3), generator=g)),   # 48 bytes
            ("bias", torch.randn(11, generator=g).to(torch.bfloat16)),             # 22 bytes
            ("proj.weight", torch.randn(4, 3, generator=g).t()),                   # 48 bytes, strided
            ("step", torch.tensor(-5, dtype=torch.int64)),                         # 8 bytes, 0-dim
            ("empty", torch.empty(0, 4, dtype=torch.bfloat16)),                    # 0 bytes
            ("special", special)]                                                  # 12 bytes


# Where each tensor above lies: back to back, each start rounded up to 16 bytes.
WANT_RANGES = [(0, 30), (32, 60), (64, 112), (112, 134), (144, 192), (192, 200), (208, 208), (208, 220)]
WANT_BYTES = 224


# ---------------------------------------------------------------------------------- (a) layout
def test_the_layout_is_sglangs_flattened_bucket_read_back_bit_for_bit():
    named = mixed_tensors()
    flat = FlatBucket.pack(named)
    assert ALIGN == 16
    assert flat.buffer.dtype == torch.uint8 and flat.buffer.dim() == 1 and flat.buffer.numel() == WANT_BYTES
    assert [(e.start_idx, e.end_idx) for e in flat.entries] == WANT_RANGES
    for (name, tensor), entry in zip(named, flat.entries):
        # the fields SGLang's FlattenedTensorMetadata is built from, and nothing else
        assert isinstance(entry, SimpleNamespace)
        assert vars(entry).keys() == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
        assert entry.name == name and entry.dtype == tensor.dtype
        assert isinstance(entry.shape, torch.Size) and entry.shape == tensor.shape
        assert entry.start_idx % ALIGN == 0
        assert entry.numel == entry.end_idx - entry.start_idx == tensor.numel() * tensor.element_size()
        # SGLang's reader: buffer[start:end].view(dtype), shaped
        read = flat.buffer[entry.start_idx:entry.end_idx].view(entry.dtype).view(entry.shape)
        assert read.dtype == tensor.dtype and read.shape == tensor.shape
        assert torch.equal(bits(read), bits(tensor))
    # the special values survive as bits: NaN, -0.0 (sign bit set), inf
    special = dict(flat.named())["special"]
    assert bits(special).tolist() == [0, 0, 192, 127, 0, 0, 0, 128, 0, 0, 128, 127]
    assert dict(flat.named())["step"].item() == -5


def test_flattened_bucket_is_the_flat_bucket_layout_and_hands_a_flat_bucket_over_uncopied():
    named = mixed_tensors()
    packed = flattened_bucket(named)
    flat = FlatBucket.pack(named)
    assert set(packed) == {"flattened_tensor", "metadata"}
    assert [vars(e) for e in packed["metadata"]] == [vars(e) for e in flat.entries]
    # padding bytes are never read; every tensor's bytes are equal
    for e in flat.entries:
        assert torch.equal(packed["flattened_tensor"][e.start_idx:e.end_idx], flat.buffer[e.start_idx:e.end_idx])
    again = flattened_bucket(flat)
    assert again["flattened_tensor"] is flat.buffer and again["metadata"] is flat.entries


def test_a_flat_bucket_reads_as_named_views_into_its_buffer():
    named = mixed_tensors()
    flat = FlatBucket.pack(named)
    assert len(flat) == 8 and [name for name, _ in flat] == [name for name, _ in named]
    for (_, view), entry in zip(flat, flat.entries):
        assert view.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr()
        if view.numel():
            assert view.data_ptr() == flat.buffer.data_ptr() + entry.start_idx
    dict(flat.named())["norm.weight"][0] = 123.0  # writes through to the buffer: a view, not a copy
    assert flat.buffer[32:36].view(torch.float32).item() == 123.0


def test_filling_refuses_a_tensor_of_another_dtype_or_shape_rather_than_casting_it():
    flat = FlatBucket.empty([("w", (2, 3), torch.bfloat16)], "cpu")
    assert flat.buffer.numel() == 16  # 12 bytes, padded to 16
    with pytest.raises(ValueError, match=r"w: got \(2, 3\) torch.float32, the bucket holds \(2, 3\) torch.bfloat16"):
        flat.fill([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"w: got \(3, 2\)"):
        flat.fill([torch.zeros(3, 2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="1 tensors for a bucket of 2"):
        FlatBucket.empty([("a", (1,), torch.int64), ("b", (1,), torch.int64)], "cpu").fill([torch.zeros(1)])


def test_unpadded_layout_refuses_a_misaligned_order():
    entries, nbytes = layout([("a", (3,), torch.float32), ("b", (1,), torch.int64)], align=8)
    assert [(e.start_idx, e.end_idx) for e in entries] == [(0, 12), (16, 24)] and nbytes == 24
    with pytest.raises(ValueError, match=r"b \(torch.int64\) would start at byte 12"):
        layout([("a", (3,), torch.float32), ("b", (1,), torch.int64)], align=1)


def test_the_nccl_route_still_broadcasts_the_bucket_unpadded_in_its_announced_order():
    """``update_weights_from_distributed``: SGLang allocates the announced names/dtypes/shapes back to
    back with no padding and receives one broadcast into it; the bytes sent are exactly that."""
    named = mixed_tensors()
    sent = []
    sender = DistributedWeightSender.__new__(DistributedWeightSender)
    sender.group_name = "g"
    sender._group = SimpleNamespace(broadcast=lambda tensor, src: sent.append((tensor.clone(), src))
                                    or SimpleNamespace(wait=lambda: None))
    body = sender.metadata(named)
    sender.broadcast(named)
    [(buffer, src)] = sent
    ordered = sorted(named, key=lambda item: -item[1].element_size())
    assert src == 0 and buffer.dtype == torch.uint8
    assert torch.equal(buffer, torch.cat([bits(t) for _, t in ordered]))  # what the former torch.cat sent
    assert buffer.numel() == 30 + 28 + 48 + 22 + 48 + 8 + 0 + 12
    assert body["names"] == [n for n, _ in ordered]
    assert body["names"][:4] == ["router.count", "step", "norm.weight", "proj.weight"]  # int64, then fp32
    assert body["dtypes"] == ["int64", "int64", "float32", "float32", "float32", "bfloat16", "bfloat16", "bfloat16"]
    assert body["shapes"] == [[2, 3], [], [7], [3, 4], [3], [3, 5], [11], [0, 4]]
    assert body["load_format"] == "flattened_bucket"
    # SGLang's receiver reads each tensor at its unpadded offset
    offset = 0
    for (_, tensor), dtype, shape in zip(ordered, body["dtypes"], body["shapes"]):
        nbytes = tensor.numel() * tensor.element_size()
        got = buffer[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)
        assert torch.equal(bits(got), bits(tensor))
        offset += nbytes


# --------------------------------------------- (b), (c): 3 trainer ranks, export to the IPC payload
BUCKET_BYTES = 110  # the tensors below make 2 buckets, each of bf16, fp32 and int64


def _stream_items(rank: int):
    from bpo_megatron.weights import StreamedTensor

    # the first 6 of mixed_tensors(): 30 + 28 + 48 | 22 + 48 + 8 bytes
    return [StreamedTensor(name, tuple(t.shape), t.dtype, t if rank == 0 else None)
            for name, t in mixed_tensors()[:6]]


def _export_and_send(world: int) -> dict:
    """On every rank: the real ``export_weights(all_ranks=True)`` over a stand-in weight stream (the
    tensors on rank 0 only, as the gather leaves them), fed to ``CudaIpc`` (prepared, then sent)
    for one engine of TP ``world``, whose server and IPC serializer are stand-ins recording what
    they got."""
    import torch.distributed as dist

    from bpo_megatron.rollout.sglang.cuda_ipc import CudaIpc
    from bpo_megatron.weight_sync.transport import EngineEndpoint
    from bpo_megatron.weights import export

    rank = dist.get_rank()
    export.weight_stream = lambda model, hf, **_: iter(_stream_items(rank))
    broadcasts: list[int] = []
    original = dist.broadcast

    def counted(tensor, *args, **kwargs):
        broadcasts.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.broadcast = counted

    exported, handed = [], []

    def recorded(buckets):
        for bucket in buckets:
            exported.append({"type": type(bucket).__name__, "ptr": bucket.buffer.data_ptr(),
                             "buffer": bucket.buffer.clone(), "named": [(n, t.clone()) for n, t in bucket],
                             "views": all(t.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
                                          for _, t in bucket)})
            yield bucket

    def serializer(payload: dict) -> str:
        handed.append({"ptr": payload["flattened_tensor"].data_ptr(),
                       "bytes": payload["flattened_tensor"].numel(),
                       "ranges": [(e.start_idx, e.end_idx) for e in payload["metadata"]]})
        return f"rank{rank}-bucket{len(handed)}"

    posted = []

    class Server:
        url = "http://stand-in"
        tp_size = world

        def post(self, path, body, timeout):
            posted.append((path, body["serialized_named_tensors"], body["weight_version"]))
            return {"success": True}

    stream = export.export_weights(torch.nn.Linear(1, 1), None, BUCKET_BYTES, all_ranks=True, views=True)
    sender = CudaIpc(serializer=serializer)
    sender.prepare([EngineEndpoint(index=0, details=Server())])  # beside trainer ranks 0 … world − 1
    report = sender.send(recorded(stream), version=3)
    return {"exported": exported, "handed": handed, "broadcasts": broadcasts, "posted": posted, "report": report}


def test_every_rank_receives_each_bucket_in_one_broadcast_and_hands_that_buffer_to_ipc():
    world = 3
    ranks = run_gloo_world(_export_and_send, world, world, timeout=TIMEOUT)
    want = mixed_tensors()[:6]
    want_buckets = [want[:3], want[3:]]
    reference = [FlatBucket.pack(bucket) for bucket in want_buckets]
    assert [b.buffer.numel() for b in reference] == [112, 96]  # 30→32, 28→32, 48 | 22→32, 48, 8→16

    for rank, got in enumerate(ranks):
        # (b) one broadcast per bucket (of the whole bucket's bytes), though each holds 3 dtypes
        assert got["broadcasts"] == [112, 96], f"rank {rank}"
        assert [b["type"] for b in got["exported"]] == ["FlatBucket", "FlatBucket"]
        for bucket, ref, want_named in zip(got["exported"], reference, want_buckets):
            assert bucket["views"], f"rank {rank}: the named tensors are views of the bucket's buffer"
            for e in ref.entries:  # every byte any tensor occupies is rank 0's
                assert torch.equal(bucket["buffer"][e.start_idx:e.end_idx], ref.buffer[e.start_idx:e.end_idx])
            assert [n for n, _ in bucket["named"]] == [n for n, _ in want_named]
            for (_, t), (_, w) in zip(bucket["named"], want_named):
                assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(bits(t), bits(w))
        # (c) the payload is the exported buffer itself: no second copy on any rank
        assert [h["ptr"] for h in got["handed"]] == [b["ptr"] for b in got["exported"]], f"rank {rank}"
        assert [h["bytes"] for h in got["handed"]] == [112, 96]
        assert [h["ranges"] for h in got["handed"]] == [[(0, 30), (32, 60), (64, 112)], [(0, 22), (32, 80), (80, 88)]]
        assert got["report"] == {"bytes": 30 + 28 + 48 + 22 + 48 + 8, "failed": []}
    # the engine's TP rank t gets trainer rank t's handle, one post per bucket, from rank 0 (beside TP rank 0)
    assert ranks[0]["posted"] == [("update_weights_from_tensor", [f"rank{r}-bucket{b}" for r in range(world)], "3")
                                  for b in (1, 2)]
    assert ranks[1]["posted"] == ranks[2]["posted"] == []
