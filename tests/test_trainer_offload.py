"""The trainer hands its memory back and takes it again (colocation): parameters and optimizer
state leave for host memory, gradient buffers (dead between steps) are freed without a copy, every
storage really shrinks to zero bytes, and after onload parameters and state are bit for bit what
they were and gradients zero, so training continues exactly as an uninterrupted run. Checked on
CPU storages; the GPU smoke run repeats it with ``torch.cuda.memory_allocated``."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world

TIMEOUT = 180


def _optimizer_state(actor) -> dict[str, torch.Tensor]:
    from bpo_megatron.trainer.offload import torch_optimizers

    out = {}
    for k, inner in enumerate(torch_optimizers(actor.optimizer)):
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                out[f"{k}.{g}.{p}.param"] = param.detach().clone()
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        out[f"{k}.{g}.{p}.{key}"] = value.detach().clone()
    return out


def _offload_round_trip(ep: int) -> dict:
    actor = th.build_actor(replay=True, ep=ep)
    twin = None
    samples = th.make_samples(8, seed=3, routing=True)
    actor.train_step(samples)  # Adam moments exist from here on
    params, state = th.flat_params(actor), _optimizer_state(actor)
    grads = {n: p.main_grad.clone() for n, p in actor.model.named_parameters()}
    moved = actor.offload()
    freed = {n: p.untyped_storage().nbytes() for n, p in actor.model.named_parameters()}
    freed_grads = {n: p.main_grad.untyped_storage().nbytes() for n, p in actor.model.named_parameters()}
    from bpo_megatron.trainer.offload import torch_optimizers

    freed_state = [v.untyped_storage().nbytes() for inner in torch_optimizers(actor.optimizer)
                   for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    try:
        actor.train_step(samples)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    back = actor.onload()
    same_params = all(torch.equal(params[n], p) for n, p in th.flat_params(actor).items())
    same_state = all(torch.equal(state[k], v) for k, v in _optimizer_state(actor).items())
    grads_were_set = any(bool(g.any()) for g in grads.values())
    zero_grads = all(not p.main_grad.any() for _, p in actor.model.named_parameters())
    after = actor.train_step(th.make_samples(8, seed=4, routing=True))
    logps = actor.compute_logprobs(samples).logprobs
    actor.close()
    # the same two steps without offloading in between
    twin = th.build_actor(replay=True, ep=ep)
    twin.train_step(samples)
    twin_after = twin.train_step(th.make_samples(8, seed=4, routing=True))
    twin_logps = twin.compute_logprobs(samples).logprobs
    twin.close()
    return {"moved": moved, "back": back, "param_bytes_left": sum(freed.values()),
            "grad_bytes_left": sum(freed_grads.values()), "state_bytes_left": sum(freed_state),
            "state_tensors": len(freed_state), "refused": refused, "same_params": same_params,
            "same_state": same_state, "grads_were_set": grads_were_set, "zero_grads": zero_grads,
            "loss": after["loss"],
            "twin_loss": twin_after["loss"],
            "logp_gap": max(float((a - b).abs().max()) for a, b in zip(logps, twin_logps)),
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values())}


@pytest.mark.parametrize("ep", [1, 2])
def test_offload_frees_every_storage_and_onload_restores_it_bit_for_bit(ep):
    for got in run_gloo_world(_offload_round_trip, ep, ep, timeout=TIMEOUT):
        # parameters, main grads and Adam moments: every storage is empty while offloaded
        assert got["param_bytes_left"] == 0 and got["grad_bytes_left"] == 0, got
        assert got["state_tensors"] > 0 and got["state_bytes_left"] == 0, got
        # what moved: the parameters and two Adam moments (the fp32 optimizer updates the
        # parameters themselves), not their gradients
        assert got["moved"] == got["back"] == 3 * got["param_bytes"], got
        assert "offloaded" in got["refused"] and "onload()" in got["refused"]
        assert got["same_params"] and got["same_state"], got
        # the gradient buffers come back zeroed (the next step zeroes them before use anyway)
        assert got["grads_were_set"] and got["zero_grads"], got
        # training continues exactly as if nothing had happened
        assert got["loss"] == got["twin_loss"], got
        assert got["logp_gap"] == 0.0, got


def test_onload_without_offload_and_double_offload_are_refused():
    from bpo_megatron.trainer.offload import MemoryOffload

    tensors = [torch.arange(10.0), torch.ones(3, dtype=torch.bfloat16)]
    keep = [t.clone() for t in tensors]
    offload = MemoryOffload(lambda: tensors)
    with pytest.raises(RuntimeError, match="not offloaded"):
        offload.onload()
    assert offload.offload() == 10 * 4 + 3 * 2
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload.offload()
    offload.onload()
    assert all(torch.equal(a, b) for a, b in zip(tensors, keep))
    # later cycles reuse the host buffers of the first (pinned memory is slow to allocate)
    allocations, first_buffers = offload.buffers.allocations, offload.buffers.free_bytes
    tensors[0].add_(1.0)
    offload.offload()
    assert offload.buffers.allocations == allocations == 2 and first_buffers == 10 * 4 + 3 * 2
    offload.onload()
    assert torch.equal(tensors[0], keep[0] + 1.0) and torch.equal(tensors[1], keep[1])


def test_discarded_storages_are_freed_without_a_copy_and_come_back_zeroed():
    from bpo_megatron.trainer.offload import MemoryOffload

    weights, moments = torch.arange(6.0), torch.full((4,), 2.0, dtype=torch.float64)
    grad_buffer = torch.arange(8.0) + 1
    main_grad = grad_buffer[2:6]  # a view: the storage is offloaded, not the view
    shared = torch.ones(3)  # named as kept and as discarded: its values are kept
    offload = MemoryOffload(lambda: [weights, moments, shared], discard=lambda: [grad_buffer, main_grad, shared])
    assert offload.offload() == 6 * 4 + 4 * 8 + 3 * 4  # copied: what is kept, not the 32 gradient bytes
    assert (offload.host_bytes, offload.discarded_bytes) == (6 * 4 + 4 * 8 + 3 * 4, 8 * 4)
    assert all(t.untyped_storage().nbytes() == 0 for t in (weights, moments, grad_buffer, main_grad, shared))
    assert offload.onload() == 6 * 4 + 4 * 8 + 3 * 4
    assert torch.equal(weights, torch.arange(6.0)) and torch.equal(moments, torch.full((4,), 2.0, dtype=torch.float64))
    assert torch.equal(shared, torch.ones(3))
    assert torch.equal(grad_buffer, torch.zeros(8)) and torch.equal(main_grad, torch.zeros(4))
    assert main_grad.untyped_storage().data_ptr() == grad_buffer.untyped_storage().data_ptr()
    # only the kept storages' host buffers are spares for the next offload
    assert offload.spare_bytes == 6 * 4 + 4 * 8 + 3 * 4


def test_a_save_drops_the_spare_host_buffers_first():
    from bpo_megatron.trainer.offload import MemoryOffload

    tensors = [torch.arange(10.0)]
    offload = MemoryOffload(lambda: tensors)
    assert offload.drop_spares() == 0
    offload.offload()
    with pytest.raises(RuntimeError, match="onload"):
        offload.drop_spares()  # while offloaded they hold the trainer's state
    offload.onload()
    assert offload.spare_bytes == 40
    assert offload.drop_spares() == 40 and offload.spare_bytes == 0
    tensors[0].mul_(2)
    assert offload.offload() == 40  # fresh host buffers
    offload.onload()
    assert torch.equal(tensors[0], 2 * torch.arange(10.0))


def test_dropping_spares_on_a_gpu_empties_the_pinned_host_cache(monkeypatch):
    """The CUDA branch that failed every checkpoint save under torch 2.11 (it called
    torch.accelerator.empty_host_cache, which 2.11 lacks), run on CPU: with CUDA it calls
    torch._C._host_emptyCache once per drop, without CUDA never. That name exists in CUDA builds
    only; tools/check_torch_names.py resolves it under torch 2.11 and 2.14.1 in CI."""
    from bpo_megatron import platform
    from bpo_megatron.trainer.offload import MemoryOffload

    if torch.version.cuda is not None:
        assert callable(torch._C._host_emptyCache)
    calls = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("emptied"), raising=False)
    offload = MemoryOffload(lambda: [torch.arange(4.0)])
    monkeypatch.setattr(platform, "has_cuda", lambda: False)
    offload.drop_spares()
    assert calls == []
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    offload.drop_spares()
    assert calls == ["emptied"]


def _save_after_offload(root: str) -> dict:
    import torch.distributed as dist

    actor = th.build_actor()
    actor.train_step(th.make_samples(4, seed=1))
    actor.offload()
    try:
        actor.save(root)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    actor.onload()
    spare_before = actor._offload.spare_bytes
    path = actor.save(root)
    out = {"refused": refused, "spare_before": spare_before, "spare_after": actor._offload.spare_bytes,
           "saved": path, "rank": dist.get_rank()}
    actor.close()
    return out


def test_the_actor_saves_only_onloaded_and_without_its_spare_host_buffers(tmp_path):
    [got] = run_gloo_world(_save_after_offload, 1, str(tmp_path), timeout=TIMEOUT)
    assert "offloaded" in got["refused"] and "onload()" in got["refused"], got
    assert got["spare_before"] > 0 and got["spare_after"] == 0, got
    assert got["saved"].endswith("step-00000001"), got


# ------------------------------------------------------------------ host buffers allocated ahead
def test_host_buffers_are_packed_into_power_of_two_chunks_without_overlap():
    """Torch's pinned allocator rounds every request up to a power of two: the reservation asks
    only for power-of-two chunks, each buffer page-aligned inside one, none overlapping."""
    from bpo_megatron.trainer.host_buffers import HOST_ALIGN, pack_chunks

    sizes = [3 * 2**20, 2**20 + 5, 40, 7 * 2**20, 4096, 2**20, 123_456, 2**20]
    chunks = pack_chunks(sizes)
    placed = sorted(index for _, items in chunks for index, _ in items)
    assert placed == list(range(len(sizes)))  # every buffer once
    for chunk_bytes, items in chunks:
        assert chunk_bytes & (chunk_bytes - 1) == 0  # a power of two
        spans = sorted((offset, offset + sizes[index]) for index, offset in items)
        assert all(offset % HOST_ALIGN == 0 for offset, _ in spans)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= chunk_bytes
    aligned = sum(-(-n // HOST_ALIGN) * HOST_ALIGN for n in sizes)
    # 13.3 MiB of buffers in 8 + 4 + 1 + ... MiB chunks, not one 16 MiB chunk (or 8 rounded ones)
    assert aligned <= sum(c for c, _ in chunks) <= aligned + 2 * 2**20, (aligned, [c for c, _ in chunks])
    # a buffer larger than half of everything gets its own (rounded) chunk
    assert [c for c, _ in pack_chunks([5 * 2**20, 2**20])] == [8 * 2**20]


def test_a_reservation_holds_a_buffer_of_each_size_once():
    from bpo_megatron.trainer.host_buffers import HostBuffers

    buffers = HostBuffers()
    assert buffers.reserve([40, 40, 12], pin=False) > 0
    allocations = buffers.allocations
    assert buffers.reserve([12, 40, 40], pin=False) == 0 and buffers.allocations == allocations  # held already
    taken = [buffers.take(40, pin=False), buffers.take(40, pin=False), buffers.take(12, pin=False)]
    assert buffers.fresh == 0 and buffers.free_bytes == 0 and len({t.data_ptr() for t in taken}) == 3
    buffers.take(40, pin=False)  # none left of that size: a fresh one, counted
    assert buffers.fresh == 1 and buffers.allocations == allocations + 1


def _prepinned_cycles(root: str, parts: str, keep_across_saves: bool) -> dict:
    """plan_offload before step 1, then the loop's cycles (offload, onload, train) with a save
    between them; against a twin that never offloads."""
    from bpo_megatron.trainer.offload import first_step_state_bytes

    actor = th.build_actor(replay=True)
    moments = sum(first_step_state_bytes(actor.optimizer))
    reserved = actor.plan_offload(parts, keep_across_saves=keep_across_saves)
    buffers = actor.host_buffers
    allocations, held = buffers.allocations, buffers.free_bytes
    param_storage = {n: p.untyped_storage() for n, p in actor.model.named_parameters()}
    moved, params_left = [], []
    for step, seed in enumerate((3, 4, 5)):
        moved.append(actor.offload())  # the rollout phase
        params_left.append(sum(s.nbytes() for s in param_storage.values()))
        actor.onload()  # the train phase
        actor.train_step(th.make_samples(8, seed=seed, routing=True))
        if step == 1:
            actor.save(root)
    moved.append(actor.offload())
    actor.onload()
    out = {"reserved": reserved, "held": held, "moments": moments, "moved": moved, "params_left": params_left,
           "new_allocations": buffers.allocations - allocations, "fresh": buffers.fresh,
           "param_bytes": sum(p.numel() * p.element_size() for p in actor.model.parameters()),
           "params": th.flat_params(actor), "state": _optimizer_state(actor)}
    actor.close()
    twin = th.build_actor(replay=True)
    for seed in (3, 4, 5):
        twin.train_step(th.make_samples(8, seed=seed, routing=True))
    params, state = out.pop("params"), out.pop("state")
    out.update(same_params=all(torch.equal(params[n], p) for n, p in th.flat_params(twin).items()),
               same_state=all(torch.equal(state[k], v) for k, v in _optimizer_state(twin).items()))
    twin.close()
    return out


@pytest.mark.parametrize("parts, keep_across_saves", [("everything", True), ("optimizer", False)])
def test_the_first_offload_after_pre_pinning_allocates_no_host_memory(tmp_path, parts, keep_across_saves):
    """plan_offload allocates (pins, on a GPU) host buffers for the whole state an offload moves
    before step 1, the Adam moments the first step creates included; no offload after it
    allocates host memory, also across a checkpoint save when the host budget keeps the buffers
    (a save that may not keep them drops them, and the next offload allocates as it always did);
    the state is restored bit for bit (the same three steps as a trainer that never offloaded)."""
    [got] = run_gloo_world(_prepinned_cycles, 1, str(tmp_path), parts, keep_across_saves, timeout=TIMEOUT)
    assert got["same_params"] and got["same_state"], got
    params, moments = got["param_bytes"], got["moments"]
    assert moments == 2 * params  # fp32 on a CPU: two Adam moments shaped like the parameters
    if parts == "everything":
        # the parameters move at every offload, the moments from the first step on
        assert got["moved"] == [params, params + moments, params + moments, params + moments], got
        assert got["params_left"] == [0, 0, 0], got
    else:  # the optimizer state alone: the fp32 optimizer updates the model's own parameters, which stay
        assert got["moved"] == [0, moments, moments, moments], got
        assert got["params_left"] == [params] * 3, got
    assert got["reserved"] >= got["moved"][-1]  # one buffer per storage moved, from before step 1
    if keep_across_saves:
        assert got["new_allocations"] == 0 and got["fresh"] == 0, got
        assert got["held"] == got["moved"][-1], got
    else:  # the offload after the save allocated its buffers afresh
        assert got["fresh"] > 0 and got["new_allocations"] == got["fresh"], got


def test_nothing_offloaded_moves_and_frees_nothing():
    from bpo_megatron.trainer.offload import OFFLOAD_PARTS

    assert set(OFFLOAD_PARTS) == {"everything", "optimizer", "nothing"}
    assert list(OFFLOAD_PARTS["nothing"].kept(None, None)) == list(OFFLOAD_PARTS["nothing"].discarded(None, None)) == []
