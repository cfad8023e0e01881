"""The Megatron-Core train actor: layouts agree, R3 replay, the BPO step, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world

TIMEOUT = 180
LAYOUTS = {  # name -> (world size, actor layout and options)
    "recompute": (1, dict(recompute="full")),
    "tp2_sp": (2, dict(tp=2)),
    "tp2_sp_recompute": (2, dict(tp=2, recompute="full")),
    "ep2": (2, dict(ep=2)),
    "pp2": (2, dict(pp=2)),
    "dp2": (2, dict()),
    "tp2_ep2": (2, dict(tp=2, ep=2)),
}


# ----------------------------------------------------------------------------------- ranks
def _score_and_step(checkpoint: str, save: bool, layout: dict) -> dict | None:
    """Log-probs (R3 replay on) and one BPO train step from the weights in ``checkpoint``."""
    actor = th.build_actor(replay=True, **layout)
    if save:
        actor.save(checkpoint)
    else:
        actor.load(checkpoint)
    samples = th.make_samples(8, seed=1, routing=True)
    scored = actor.compute_logprobs(samples)
    metrics = actor.train_step(samples)
    after = actor.compute_logprobs(samples)
    actor.close()
    if scored is None:
        return None
    return {"logprobs": scored.logprobs, "entropies": scored.entropies, "metrics": metrics,
            "after": after.logprobs}


def _replay_roundtrip(checkpoint: str, layout: dict) -> dict | None:
    actor = th.build_actor(replay=True, recompute="full", **layout)
    actor.load(checkpoint)
    samples = th.make_samples(6, seed=2)
    free = actor.compute_logprobs(samples, record_routing=True)
    routing = _broadcast_from_last_stage(actor, free.routed_experts if free else None)
    replayed = [s.__class__(**{**vars(s), "routed_experts": r}) for s, r in zip(samples, routing)]
    same = actor.compute_logprobs(replayed)
    shifted = [s.__class__(**{**vars(s), "routed_experts": (r + 1) % actor.hf.num_experts})
               for s, r in zip(samples, routing)]
    other = actor.compute_logprobs(shifted)
    metrics = actor.train_step(replayed)  # backward with REPLAY_BACKWARD under recomputation
    actor.close()
    if free is None:
        return None
    return {"free": free.logprobs, "same": same.logprobs, "other": other.logprobs,
            "routing": routing, "metrics": metrics, "positions": [s.tokens.numel() - 1 for s in samples]}


def _broadcast_from_last_stage(actor, value):
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    return box[0]


def _bad_routing_errors() -> dict[str, str]:
    actor = th.build_actor(replay=True)
    good = th.make_samples(2, seed=3, routing=True)
    cases = {
        "missing": [s.__class__(**{**vars(s), "routed_experts": None}) for s in good],
        "shape": [s.__class__(**{**vars(s), "routed_experts": s.routed_experts[:-1]}) for s in good],
        "range": [s.__class__(**{**vars(s), "routed_experts": s.routed_experts + 10}) for s in good],
    }
    errors = {}
    before = th.flat_params(actor)
    for name, samples in cases.items():
        for method in (actor.compute_logprobs, actor.train_step):
            try:
                method(samples)
            except ValueError as exc:
                errors[f"{name}/{method.__name__}"] = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in th.flat_params(actor).items())
    actor.close()
    return {"errors": errors, "unchanged": unchanged, "step": actor.step}


# ----------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, dict]:
    """World size 1: the initial weights as a checkpoint, and the results every layout must match."""
    checkpoint = str(tmp_path_factory.mktemp("actor") / "initial")
    (result,) = run_gloo_world(_score_and_step, 1, checkpoint, True, {}, timeout=TIMEOUT)
    return checkpoint, result


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts_agree_with_world_size_one(reference, name):
    """Same weights and batch: log-probs, loss, grad norm and the updated model's log-probs agree
    (R3 replay on, so the routing slices per SP shard and pipeline stage are exercised too)."""
    checkpoint, ref = reference
    world, layout = LAYOUTS[name]
    results = [r for r in run_gloo_world(_score_and_step, world, checkpoint, False, layout, timeout=TIMEOUT) if r]
    assert results, "no rank returned results"
    for got in results:
        for key in ("logprobs", "entropies", "after"):
            for mine, theirs in zip(got[key], ref[key], strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
        for key in ("loss", "grad_norm", "clip_frac", "weight_mean", "kl_k3", "num_tokens"):
            assert _rel(got["metrics"][key], ref["metrics"][key]) <= 1e-5, (name, key, got["metrics"][key], ref["metrics"][key])


def test_reference_step_is_sane(reference):
    _, ref = reference
    m = ref["metrics"]
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["num_tokens"] > 0
    assert m["num_micro_batches"] == 4.0  # 8 samples, 2 per micro-batch


@pytest.mark.parametrize("layout", [dict(), dict(tp=2), dict(pp=2)], ids=["ws1", "tp2_sp", "pp2"])
def test_recorded_routing_replays_exactly(reference, layout):
    world = 1 if not layout else 2
    results = [r for r in run_gloo_world(_replay_roundtrip, world, reference[0], layout, timeout=TIMEOUT) if r]
    hf = th.tiny_moe()
    for got in results:
        for routing, positions in zip(got["routing"], got["positions"], strict=True):
            assert routing.shape == (positions, len(hf.moe_layers), hf.num_experts_per_tok)
        diffs = [float((a - b).abs().max()) for a, b in zip(got["same"], got["free"])]
        assert max(diffs) == 0.0, "replaying the recorded routing must reproduce log-probs exactly"
        changed = max(float((a - b).abs().max()) for a, b in zip(got["other"], got["free"]))
        assert changed > 1e-4, "replaying other experts must change the log-probs"
        assert math.isfinite(got["metrics"]["loss"]) and got["metrics"]["grad_norm"] > 0


def test_recorded_routing_is_the_same_in_every_layout(reference):
    """The trainer's own routing, assembled from sequence shards and pipeline stages."""
    ws1 = run_gloo_world(_replay_roundtrip, 1, reference[0], {}, timeout=TIMEOUT)[0]
    for layout in (dict(tp=2), dict(pp=2)):
        got = [r for r in run_gloo_world(_replay_roundtrip, 2, reference[0], layout, timeout=TIMEOUT) if r][0]
        for a, b in zip(got["routing"], ws1["routing"]):
            assert torch.equal(a, b), layout


def test_unreplayable_routing_fails_before_any_compute():
    (got,) = run_gloo_world(_bad_routing_errors, 1, timeout=TIMEOUT)
    errors = got["errors"]
    assert set(errors) == {f"{c}/{m}" for c in ("missing", "shape", "range")
                           for m in ("compute_logprobs", "train_step")}
    for key in ("missing/compute_logprobs", "missing/train_step", "shape/train_step"):
        assert "rollout.capture_routed_experts" in errors[key] and "model.routing_replay" in errors[key]
    assert "[0, 4)" in errors["range/train_step"]
    assert got["unchanged"] and got["step"] == 0, "nothing may be trained on bad rollout data"


def _logprob_kernels() -> dict:
    """The trainer's log-prob op as trainer.logprob_kernel picks it, on a CPU rank."""
    samples = th.make_samples(4, seed=8)
    got = {}
    for kernel in ("auto", "chunked"):
        actor = th.build_actor(logprob_kernel=kernel)
        got[kernel] = actor.compute_logprobs(samples).logprobs
        actor.close()
    try:
        th.build_actor(logprob_kernel="fused")
    except ValueError as exc:
        got["fused"] = str(exc)
    return got


def test_the_logprob_kernel_setting_reaches_the_op_and_a_cpu_rank_refuses_the_fused_one():
    """On a CPU ``auto`` is the chunked op (the fused kernels need CUDA and triton), and a rank that
    cannot run the fused kernels refuses ``trainer.logprob_kernel=fused`` when it is built."""
    (got,) = run_gloo_world(_logprob_kernels, 1, timeout=TIMEOUT)
    assert all(torch.equal(a, b) for a, b in zip(got["auto"], got["chunked"], strict=True))
    assert "trainer.logprob_kernel=fused needs a GPU with triton" in got["fused"]


def _bpo_step_vs_plain_pytorch() -> dict:
    """One actor step and the same step written with plain PyTorch on a copy of the model."""
    from dataclasses import replace

    from bpo_megatron.losses import PolicyLossConfig, compute_policy_loss
    from bpo_megatron.models import ModelOptions, build_gpt_model

    actor = th.build_actor(lr=1e-4, micro_batch_size=3)  # 8 samples: micro-batches of 3, 3, 2
    samples = th.make_samples(8, seed=4)
    before = actor.compute_logprobs(samples).logprobs
    gen = torch.Generator().manual_seed(5)
    # Mostly on-policy; on ~30% of tokens the engine was confident (μ = 0.9), which gives BPO
    # weights ω ≈ 0.18 and drops those tokens of negative-advantage responses.
    def rollout(lp: torch.Tensor) -> torch.Tensor:
        confident = torch.rand(lp.shape, generator=gen) < 0.3
        return torch.where(confident, torch.tensor(0.9).log(), lp + 0.3 * torch.randn(lp.shape, generator=gen)).clamp(max=0.0)

    samples = [replace(s, rollout_logprobs=rollout(lp)) for s, lp in zip(samples, before)]

    reference = build_gpt_model(actor.hf, actor.parallel, ModelOptions())
    reference.load_state_dict(actor.model.state_dict())
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    metrics = actor.train_step(samples)
    after = actor.compute_logprobs(samples).logprobs

    width = max(s.num_response_tokens for s in samples)
    logp = torch.zeros(len(samples), width)
    rollout = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    rows = []
    for i, s in enumerate(samples):
        tokens = s.tokens.unsqueeze(0)
        positions = torch.arange(tokens.shape[1] - 1).unsqueeze(0)
        logits = reference(tokens[:, :-1], positions, attention_mask=None)[0, :, : actor.hf.vocab_size]
        token_logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
        rows.append(token_logp[s.response_start - 1 :])
        n = s.num_response_tokens
        rollout[i, :n], mask[i, :n] = s.rollout_logprobs, True
    logp = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    advantages = torch.tensor([s.advantage for s in samples])
    loss, _ = compute_policy_loss(logp, rollout, advantages, mask, PolicyLossConfig(name="bpo"))
    loss.backward()
    params = list(reference.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    no_decay = [p for p in params if p.dim() == 1]
    decay = [p for p in params if p.dim() > 1]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-4, betas=(0.9, 0.98), eps=1e-8)
    adamw.step()
    result = {
        "metrics": metrics, "reference_loss": loss.item(), "reference_grad_norm": grad_norm.item(),
        "actor": {n: p.detach().clone() for n, p in actor.model.named_parameters()},
        "reference": {n: p.detach().clone() for n, p in reference.named_parameters()},
        "start": start, "before": before, "after": after,
        "advantages": advantages, "masks": [torch.ones(s.num_response_tokens, dtype=torch.bool) for s in samples],
    }
    actor.close()
    return result


def test_bpo_step_matches_plain_pytorch_and_moves_logprobs_the_right_way():
    (got,) = run_gloo_world(_bpo_step_vs_plain_pytorch, 1, timeout=TIMEOUT)
    assert _rel(got["metrics"]["loss"], got["reference_loss"]) <= 1e-5
    assert _rel(got["metrics"]["grad_norm"], got["reference_grad_norm"]) <= 1e-5
    assert got["reference_grad_norm"] > 1.0, "the clip must be active for the comparison to cover it"
    assert 0 < got["metrics"]["clip_frac"] < 1
    for name, ours in got["actor"].items():
        theirs = got["reference"][name]
        assert not torch.equal(theirs, got["start"][name]), f"{name} was not updated"
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)
    # The closed check: tokens of positive-advantage responses became likelier, negative ones less.
    deltas = [a - b for a, b in zip(got["after"], got["before"])]
    up = torch.cat([d for d, adv in zip(deltas, got["advantages"]) if adv > 0])
    down = torch.cat([d for d, adv in zip(deltas, got["advantages"]) if adv < 0])
    assert up.mean() > 0 > down.mean(), (up.mean(), down.mean())


def _resume(root: str, plan: str) -> dict:
    actor = th.build_actor(ep=2, lr=1e-3)
    batches = [th.make_samples(4, seed=10 + i) for i in range(3)]
    meta = actor.load(root) if plan == "resume" else {}
    steps = {"uninterrupted": range(3), "first": range(1), "resume": range(1, 3)}[plan]
    losses = [actor.train_step(batches[i])["loss"] for i in steps]
    if plan == "first":
        actor.save(root, trainer_state={"data_cursor": 1})
    result = {"params": th.flat_params(actor), "step": actor.step, "meta": meta, "losses": losses}
    actor.close()
    return result


def test_save_load_continue_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    root = str(tmp_path / "ckpt")
    straight = run_gloo_world(_resume, 2, root, "uninterrupted", timeout=TIMEOUT)
    run_gloo_world(_resume, 2, root, "first", timeout=TIMEOUT)
    resumed = run_gloo_world(_resume, 2, root, "resume", timeout=TIMEOUT)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert b["meta"]["data_cursor"] == 1 and b["meta"]["step"] == 1
        assert b["step"] == a["step"] == 3
        assert b["losses"] == a["losses"][1:]
        for name, tensor in a["params"].items():
            assert torch.equal(tensor, b["params"][name]), f"rank {rank}: {name}"


def _killed_mid_save(root: str) -> dict:
    from megatron.core import dist_checkpointing

    from bpo_megatron.trainer import checkpoint

    actor = th.build_actor(lr=1e-3)
    actor.train_step(th.make_samples(2, seed=20))
    actor.save(root)
    saved = th.flat_params(actor)
    actor.train_step(th.make_samples(2, seed=21))

    real_save = dist_checkpointing.save

    def dies_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("process killed while saving")

    dist_checkpointing.save = dies_after_writing
    try:
        actor.save(root)
    except KeyboardInterrupt:
        pass
    finally:
        dist_checkpointing.save = real_save
    listing = sorted(p.name for p in Path(root).iterdir())
    marker = (Path(root) / checkpoint.LATEST).read_text()
    meta = actor.load(root)
    restored = all(torch.equal(saved[n], p) for n, p in th.flat_params(actor).items())
    actor.save(root)  # the next save (step 1 again, after loading) clears the partial directory
    final_listing = sorted(p.name for p in Path(root).iterdir())
    actor.close()
    return {"listing": listing, "marker": marker, "step": meta["step"], "restored": restored,
            "final_listing": final_listing}


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    (got,) = run_gloo_world(_killed_mid_save, 1, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    assert got["listing"] == [".partial-step-00000002", "latest", "step-00000001"]
    assert got["marker"] == "step-00000001" and got["step"] == 1 and got["restored"]
    assert got["final_listing"] == ["latest", "step-00000001"]


def test_loading_nothing_is_a_clear_error(tmp_path):
    from bpo_megatron.trainer import checkpoint

    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*: expected step directories holding "
                                                r"trainer_state.json"):
        checkpoint.resolve(tmp_path)
    (tmp_path / "latest").write_text("step-00000009")  # a marker names a checkpoint; it is not one
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.resolve(tmp_path)
