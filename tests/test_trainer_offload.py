"""The trainer hands its memory back and takes it again (colocation): parameters, gradient
buffers and optimizer state leave for host memory, their storages really shrink to zero bytes,
and after onload everything is bit for bit what it was, so training continues exactly as an
uninterrupted run. Checked on CPU storages; the GPU smoke run repeats it with
``torch.cuda.memory_allocated``."""

from __future__ import annotations

import pytest
import torch

import train_helpers as th
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
    same_grads = all(torch.equal(grads[n], p.main_grad) for n, p in actor.model.named_parameters())
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
            "same_state": same_state, "same_grads": same_grads, "loss": after["loss"],
            "twin_loss": twin_after["loss"],
            "logp_gap": max(float((a - b).abs().max()) for a, b in zip(logps, twin_logps)),
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values())}


@pytest.mark.parametrize("ep", [1, 2])
def test_offload_frees_every_storage_and_onload_restores_it_bit_for_bit(ep):
    for got in run_gloo_world(_offload_round_trip, ep, ep, timeout=TIMEOUT):
        # parameters, main grads and Adam moments: every storage is empty while offloaded
        assert got["param_bytes_left"] == 0 and got["grad_bytes_left"] == 0, got
        assert got["state_tensors"] > 0 and got["state_bytes_left"] == 0, got
        # what moved: at least the parameters, their gradients and two Adam moments
        assert got["moved"] == got["back"] >= 4 * got["param_bytes"], got
        assert "offloaded" in got["refused"] and "onload()" in got["refused"]
        assert got["same_params"] and got["same_state"] and got["same_grads"], got
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
    first_buffers = [t.data_ptr() for t in offload._spare]
    tensors[0].add_(1.0)
    offload.offload()
    assert [held.host.data_ptr() for held in offload._held] == first_buffers
    offload.onload()
    assert torch.equal(tensors[0], keep[0] + 1.0) and torch.equal(tensors[1], keep[1])
