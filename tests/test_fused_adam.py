"""Torch's fused AdamW where Megatron falls back to torch's optimizer (``trainer.optimizer.fuse_torch_adam``).

The train actor's updates over several steps equal AdamW written out in float64 from the
gradients the optimizer consumed (Megatron's weight-decay grouping included), with one float32
step counter per parameter on its device; a checkpoint holds the optimizer state bit for bit and a
resumed run equals an uninterrupted one; a checkpoint written by torch's single-tensor AdamW (the
optimizer before the switch) loads into the fused one unchanged.
"""

from __future__ import annotations

import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world

TIMEOUT = 180
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.98), 1e-8, 0.1  # testing.build_actor's optimizer
STEPS = 4
SAVED_AT = 2
PARAM_REL_TOL = 1e-6


def _torch_optimizers(actor):
    from bpo_megatron.trainer.offload import torch_optimizers

    return list(torch_optimizers(actor.optimizer))


def _optimizer_state(actor) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's Adam state by the parameter's name."""
    names = {param: name for name, param in actor.model.named_parameters()}
    return {names[param]: {key: value.detach().clone() for key, value in state.items()}
            for inner in _torch_optimizers(actor) for param, state in inner.state.items()}


def _counters(actor) -> dict:
    """How the step counters are kept: every group fused, one float32 counter per parameter on
    its device (no two parameters share one)."""
    states = [(param, state) for inner in _torch_optimizers(actor) for param, state in inner.state.items()]
    return {"fused": all(group["fused"] for inner in _torch_optimizers(actor) for group in inner.param_groups),
            "float32_on_param_device": all(s["step"].dtype == torch.float32 and s["step"].device == p.device
                                           for p, s in states),
            "distinct": len({id(s["step"]) for _, s in states}) == len(states),
            "values": sorted({float(s["step"]) for _, s in states})}


def _no_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default grouping: biases and 1-D parameters (norm weights) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def _steps_against_written_out_adamw(root: str) -> dict:
    """STEPS training steps; after each, the parameters AdamW written out in float64 gives from the
    step's start and the gradients the optimizer consumed (clipped, in ``.grad``); a checkpoint at
    SAVED_AT with the optimizer state at that point."""
    actor = th.build_actor(lr=LR)
    assert actor.optimizer.config.adam_beta1 == BETAS[0] and actor.optimizer.config.adam_beta2 == BETAS[1]
    assert actor.optimizer.config.adam_eps == EPS and actor.optimizer.config.weight_decay == WEIGHT_DECAY
    params = dict(actor.model.named_parameters())
    moments = {name: (torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64))
               for name, p in params.items()}
    worst, moved, counters = 0.0, float("inf"), []
    for step in range(1, STEPS + 1):
        before = {name: p.detach().double() for name, p in params.items()}
        actor.train_step(th.make_samples(4, seed=10 + step))
        counters.append(_counters(actor)["values"])
        bias1, bias2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        for name, p in params.items():
            grad = p.grad.double()
            m, v = moments[name]
            m.mul_(BETAS[0]).add_(grad, alpha=1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
            decay = 0.0 if _no_decay(name, p) else WEIGHT_DECAY
            expected = before[name] * (1 - LR * decay) - LR * (m / bias1) / ((v / bias2).sqrt() + EPS)
            scale = expected.norm().clamp_min(1e-12)
            worst = max(worst, float((p.detach().double() - expected).norm() / scale))
            moved = min(moved, float((expected - before[name]).norm() / scale))
        if step == SAVED_AT:
            actor.save(root)
            saved = _optimizer_state(actor)
    result = {"worst": worst, "moved": moved, "counters": counters, "layout": _counters(actor),
              "no_decay": sorted(n for n, p in params.items() if _no_decay(n, p)),
              "megatron_no_decay": sorted(n for n, p in params.items() for inner in _torch_optimizers(actor)
                                          for group in inner.param_groups
                                          if group["weight_decay"] == 0.0 and any(q is p for q in group["params"])),
              "saved": saved, "params": th.flat_params(actor)}
    actor.close()
    return result


def _resume(root: str) -> dict:
    """Load the checkpoint written at SAVED_AT and take the remaining steps."""
    actor = th.build_actor(lr=LR)
    actor.load(root)
    loaded, counters = _optimizer_state(actor), _counters(actor)
    for step in range(SAVED_AT + 1, STEPS + 1):
        actor.train_step(th.make_samples(4, seed=10 + step))
    result = {"loaded": loaded, "counters": counters, "params": th.flat_params(actor)}
    actor.close()
    return result


def test_fused_adamw_steps_like_adamw_written_out_and_resumes_bit_for_bit(tmp_path):
    root = str(tmp_path / "ckpt")
    (straight,) = run_gloo_world(_steps_against_written_out_adamw, 1, root, timeout=TIMEOUT)
    assert straight["megatron_no_decay"] == straight["no_decay"] and straight["no_decay"]
    assert straight["worst"] <= PARAM_REL_TOL < straight["moved"] / 50
    assert straight["counters"] == [[float(step)] for step in range(1, STEPS + 1)]
    assert straight["layout"] == {"fused": True, "float32_on_param_device": True, "distinct": True,
                                  "values": [float(STEPS)]}
    (resumed,) = run_gloo_world(_resume, 1, root, timeout=TIMEOUT)
    assert resumed["counters"] == {"fused": True, "float32_on_param_device": True, "distinct": True,
                                   "values": [float(SAVED_AT)]}
    assert resumed["loaded"].keys() == straight["saved"].keys()
    for name, state in straight["saved"].items():
        for key, value in state.items():
            assert torch.equal(resumed["loaded"][name][key], value), (name, key)
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def _single_tensor_checkpoint(root: str) -> dict:
    """A checkpoint written by torch's single-tensor AdamW (its counters on the host), as every
    checkpoint before the switch to the fused kernel was; then one more step of it."""
    actor = th.build_actor(lr=LR)
    for inner in _torch_optimizers(actor):
        for group in inner.param_groups:
            group["fused"] = None
    for step in range(1, SAVED_AT + 1):
        actor.train_step(th.make_samples(4, seed=10 + step))
    actor.save(root)
    result = {"saved": _optimizer_state(actor)}
    actor.train_step(th.make_samples(4, seed=10 + SAVED_AT + 1))
    result["params"] = th.flat_params(actor)
    actor.close()
    return result


def test_a_checkpoint_of_the_single_tensor_adamw_loads_into_the_fused_one(tmp_path):
    root = str(tmp_path / "ckpt")
    (old,) = run_gloo_world(_single_tensor_checkpoint, 1, root, timeout=TIMEOUT)
    assert all(state["step"].dtype == torch.float32 for state in old["saved"].values())
    (new,) = run_gloo_world(_resume, 1, root, timeout=TIMEOUT)
    assert new["counters"] == {"fused": True, "float32_on_param_device": True, "distinct": True,
                               "values": [float(SAVED_AT)]}
    for name, state in old["saved"].items():
        for key, value in state.items():
            assert torch.equal(new["loaded"][name][key], value), (name, key)


def test_fusing_gives_every_parameter_its_own_counter_on_its_device():
    """Megatron's distributed-optimizer loader (torch's optimizer) hands every parameter one shared
    host step tensor, which any in-place ``step += 1`` advances once per parameter: after
    :func:`fuse_torch_adam` each parameter counts its own steps, on its device, in float32."""
    from types import SimpleNamespace

    from bpo_megatron.trainer.optimizer import fuse_torch_adam

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    inner = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=LR)
    shared = torch.tensor(5.0)
    for p in params:
        inner.state[p].update(step=shared, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    reference = torch.optim.AdamW([{"params": [p.detach().clone().requires_grad_() for p in params[:1]]},
                                   {"params": [p.detach().clone().requires_grad_() for p in params[1:]],
                                    "weight_decay": 0.0}], lr=LR)
    for group in reference.param_groups:
        for p in group["params"]:
            reference.state[p].update(step=torch.tensor(5.0), exp_avg=torch.zeros_like(p),
                                      exp_avg_sq=torch.zeros_like(p))

    assert fuse_torch_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner),
                                                               SimpleNamespace(optimizer=None)])) == 1
    steps = [inner.state[p]["step"] for p in params]
    assert steps[0] is not steps[1] and all(s.dtype == torch.float32 and float(s) == 5.0 for s in steps)
    assert all(group["fused"] for group in inner.param_groups) and shared.item() == 5.0
    grads = [torch.randn_like(p) for p in params]
    for p, q, g in zip(params, [p for group in reference.param_groups for p in group["params"]], grads):
        p.grad, q.grad = g.clone(), g.clone()
    inner.step()
    reference.step()
    assert [float(inner.state[p]["step"]) for p in params] == [6.0, 6.0]
    for p, q in zip(params, [p for group in reference.param_groups for p in group["params"]]):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_other_optimizers_are_left_alone():
    from types import SimpleNamespace

    from bpo_megatron.trainer.optimizer import fuse_torch_adam

    inner = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    assert fuse_torch_adam(SimpleNamespace(optimizer=inner)) == 0
    assert "fused" not in inner.param_groups[0] or not inner.param_groups[0]["fused"]
