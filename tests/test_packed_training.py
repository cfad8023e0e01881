"""Packed micro-batches train exactly as padded ones: the same samples (varied lengths, R3 replay,
π_old with a mismatch correction, tokens left out by ``train_mask``) scored and trained with
``trainer.max_tokens_per_micro_batch`` and with padded micro-batches, from the same initial
weights, give the same log-probs, entropies, recorded routing, loss, loss statistics and
gradients for every registered policy loss × every aggregation (each mismatch correction several
times, and once without π_old), under tensor + sequence, expert, pipeline and data parallelism.

Each world builds one padded and one packed actor and runs every loss on it in turn
(``set_loss``), putting the initial weights back before each step: gradients, not updated
weights, are compared (Adam's first update lr · g / (|g| + ε) turns the rounding of a near-zero
gradient into an update of up to lr), so the optimizer's state never matters. Nothing here
depends on which data-parallel rank holds which sample or pack: results are compared in sample
order, and the loss, its statistics and the gradients are the whole minibatch's on every rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.losses import AGGREGATIONS, POLICY_LOSSES, BatchTotals, CorrectionConfig, PolicyLossConfig, policy_loss
from bpo_megatron.losses.corrections import CORRECTIONS
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.samples import TrainSample

TIMEOUT = 300
BUDGET = 16
# input positions (len(tokens) − 1) and prompt lengths: 45 positions from 3 to 11 a sample, several
# packs of up to 16 on each data-parallel rank; odd totals are padded for TP
POSITIONS = (3, 4, 5, 3, 11, 4, 9, 6)
PROMPTS = (2, 3, 2, 2, 5, 2, 4, 3)
# seq-mean-token-sum-norm's constant divisor: the longest response (a padded length would differ
# between a pack's samples and a padded micro-batch's)
NORM_LENGTH = max(p + 1 - q for p, q in zip(POSITIONS, PROMPTS))
LAYOUTS = {  # name -> (world size, layout); data parallelism 2 in each
    "tp2_sp_dp2": (4, dict(tp=2)),
    "ep2_pp2_dp2": (4, dict(ep=2, pp=2)),
    # experts split over TP and DP ranks, and R3 replayed again by activation recomputation
    "tp2_sp_ep2_dp2_recompute": (4, dict(tp=2, ep=2, recompute="full")),
}
# (name, token budget, trainer.micro_batch_size[, layout fields that differ from the world's])
MODES = (("padded", 0, 2), ("packed", BUDGET, 2))
# Tolerances, packed against padded (fp32). A packed sample's attention reduces over its own n
# keys where a padded row reduces over the micro-batch's longest (the rest masked to 0), so the
# two orders of summation round apart: log-probs and entropies differ by one float32 ulp at most
# (measured 4.8e-7 at |log π| ≈ 5; padded micro-batches of 2 and of 4 samples agree bit for bit).
LOGPROB_ATOL = 1e-6
# the loss statistics and the gradient norm: relative (measured ≤ 5e-7)
METRIC_RTOL = 1e-6
# The loss: relative to its magnitude Σ_i |L_i|, the samples' contributions before those of
# opposite advantages cancel (measured ≤ 2.4e-7). Relative to the loss itself the same rounding
# reaches 6e-6 where it cancels to 1/90 of its magnitude (cispo/seq-mean-token-mean).
LOSS_RTOL = 1e-6
# Gradients: the largest difference relative to the tensor's largest entry. One-ulp differences
# in the forward pass reach 1.3e-6 to 1.8e-6 of the max in small gradients summed over tokens
# of either sign (router and norm weights); padded micro-batches of 2 against 4 samples, whose
# forward passes agree bit for bit, differ by up to 3e-7. Packing errors move them by far more
# (measured at TP=2): one segment for the whole pack, samples attending to each other, 2.4 (and
# log-probs by 0.13); routing replayed one position late, 5.8 (log-probs 8.6e-3).
GRAD_RTOL = 4e-6
# The whole gradient of a rank, ‖g_packed − g_padded‖ / ‖g_padded‖: the acceptance's 1e-6.
GRAD_NORM_RTOL = 1e-6


def _cases() -> dict[str, tuple[PolicyLossConfig, bool]]:
    """name -> (loss, with π_old): every loss × every aggregation, the corrections in turn (each
    loss meets every correction, and so does each aggregation), and one loss without π_old."""
    corrections = list(CORRECTIONS)
    cases = {}
    for i, (name, agg) in enumerate(itertools.product(POLICY_LOSSES, AGGREGATIONS)):
        correction = corrections[i % len(corrections)]
        norm = NORM_LENGTH if agg == "seq-mean-token-sum-norm" else None
        cases[f"{name}/{agg}/{correction}"] = (
            PolicyLossConfig(name=name, agg=agg, correction=CorrectionConfig(name=correction), norm_length=norm), True)
    cases["bpo/seq-mean-token-mean/no-old-logprobs"] = (PolicyLossConfig(name="bpo"), False)
    return cases


CASES = _cases()


def _samples() -> list[TrainSample]:
    # π_old up to 1 nat from μ: ratios beyond the caps too; a few response tokens left out (R3
    # marked their routing stale)
    return th.samples_of_lengths(POSITIONS, PROMPTS, seed=7, old_spread=1.0, masked=(1, 4))


def _loss_by_sample(loss: PolicyLossConfig, logprobs: list[torch.Tensor], with_old: bool) -> tuple[float, float]:
    """The minibatch's loss recomputed in float64 from the trainer's log-probs of each response,
    one sample at a time with the whole minibatch's denominators: (Σ_i L_i, Σ_i |L_i|). The
    second is the loss's magnitude before the contributions of opposite advantages cancel, the
    scale float32 rounding acts on."""
    samples = _samples()
    masks = [torch.ones(lp.numel(), dtype=torch.bool) if s.train_mask is None else s.train_mask
             for s, lp in zip(samples, logprobs, strict=True)]
    totals = BatchTotals(tokens=float(sum(int(m.sum()) for m in masks)),
                         sequences=float(sum(bool(m.any()) for m in masks)))
    parts = []
    for sample, lp, mask in zip(samples, logprobs, masks, strict=True):
        part, _ = policy_loss(lp.double()[None], sample.rollout_logprobs.double()[None],
                              torch.tensor([sample.advantage], dtype=torch.float64), mask[None], loss, totals=totals,
                              old_logprobs=sample.old_logprobs.double()[None] if with_old else None)
        parts.append(float(part))
    return sum(parts), sum(abs(p) for p in parts)


def _set_params(actor, params: dict[str, torch.Tensor]) -> None:
    th.set_flat_params(actor, params)
    actor.reload_optimizer_params()


def _rel(a: float, b: float) -> float:
    """|a − b| relative to the larger magnitude (0 when both are within 1e-9 of each other)."""
    diff = abs(a - b)
    return 0.0 if diff <= 1e-9 else diff / max(abs(a), abs(b))


def _train_every_loss(layout: dict, modes=MODES) -> dict:
    """Per batching: scores (R3 replay), the trainer's own routing, and for every case the step's
    metrics and gradients (clipping off, so they are the raw ones), each step from the same
    initial weights. Returns the second mode's deviations from the first (reported as "packed"
    and "padded"), computed here so the gradients do not cross process boundaries."""
    samples = _samples()
    without_old = [dataclasses.replace(s, old_logprobs=None) for s in samples]
    initial = None
    runs: dict = {}
    for mode, budget, micro_batch_size, *overrides in modes:
        actor = th.build_actor(replay=True, micro_batch_size=micro_batch_size, grad_clip=math.inf,
                               max_tokens_per_micro_batch=budget, **{**layout, **(overrides[0] if overrides else {})})
        if initial is None:
            initial = th.flat_params(actor)
        _set_params(actor, initial)  # the same weights however each actor was initialised
        scored = actor.compute_logprobs(samples)
        free = actor.compute_logprobs(samples, record_routing=True)
        steps = {}
        for case, (loss, with_old) in CASES.items():
            _set_params(actor, initial)
            actor.set_loss(loss)
            metrics = actor.train_step(samples if with_old else without_old)
            grads = {name: p.main_grad.detach().clone() for name, p in actor.model.named_parameters()}
            steps[case] = (metrics, grads)
        runs[mode] = {"scored": scored, "routing": None if free is None else free.routed_experts, "steps": steps}
        actor.close()

    padded, packed = runs[modes[0][0]], runs[modes[1][0]]
    report: dict = {"cases": {}, "scored": None}
    for case in CASES:
        (pad_metrics, pad_grads), (pack_metrics, pack_grads) = padded["steps"][case], packed["steps"][case]
        keys = {k for k in pad_metrics if not k.endswith("_s") and k not in ("num_micro_batches", "step")}
        metric_devs = {k: _rel(pack_metrics[k], pad_metrics[k]) for k in keys if k in pack_metrics}
        scales = {param: float(grad.abs().max()) for param, grad in pad_grads.items()}
        grad_devs = {param: float((pack_grads[param] - grad).abs().max()) / max(scales[param], 1e-12)
                     for param, grad in pad_grads.items()}
        # the whole gradient: ‖Δg‖ / ‖g‖ over every parameter of this rank
        delta = sum(float((pack_grads[param] - grad).double().pow(2).sum()) for param, grad in pad_grads.items())
        norm = sum(float(grad.double().pow(2).sum()) for grad in pad_grads.values())
        grad_devs["‖Δg‖/‖g‖"] = (delta / max(norm, 1e-300)) ** 0.5
        scales["‖Δg‖/‖g‖"] = norm ** 0.5
        report["cases"][case] = {
            "padded": pad_metrics, "packed": pack_metrics, "missing": sorted(keys - set(pack_metrics)),
            "extra": sorted(set(pack_metrics) - set(pad_metrics)), "metric_devs": metric_devs,
            "grad_devs": grad_devs, "grad_scales": scales,
        }
    if padded["scored"] is not None:  # the last pipeline stage
        scored = {"padded_logprobs": padded["scored"].logprobs}
        for key in ("logprobs", "entropies"):
            mine, theirs = getattr(packed["scored"], key), getattr(padded["scored"], key)
            responses = [(p + 1 - q,) for p, q in zip(POSITIONS, PROMPTS)]
            scored[f"{key}_shapes"] = [tuple(t.shape) for t in mine] == responses
            scored[f"{key}_same_shapes"] = [t.shape for t in mine] == [t.shape for t in theirs]
            scored[key] = max(float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True))
        scored["routing_equal"] = [torch.equal(a, b) for a, b in zip(packed["routing"], padded["routing"], strict=True)]
        scored["routing_shapes"] = [t.shape[0] for t in packed["routing"]] == list(POSITIONS)
        report["scored"] = scored
    return report


# tp2_sp_dp2 (a world of 4, CI time): its TP 2 with sequence parallelism and DP 2 train packed in the default
# run inside tp2_sp_ep2_dp2_recompute, the same layout with experts split over TP and DP ranks and recomputation
@pytest.mark.timeout(TIMEOUT * 2)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.ci) if name == "tp2_sp_dp2" else name
                                  for name in sorted(LAYOUTS)])
def test_packed_micro_batches_train_every_loss_exactly_as_padded_ones(name):
    world, layout = LAYOUTS[name]
    ranks = run_gloo_world(_train_every_loss, world, layout, timeout=TIMEOUT)
    check_every_loss_alike(ranks, f"{name}: packed against padded, {len(CASES)} losses on {world} ranks")


def check_every_loss_alike(ranks: list[dict], title: str) -> None:
    """Every rank's report of :func:`_train_every_loss`: the second mode ("packed") trained and
    scored as the first ("padded") within the tolerances above, and the comparison is a real one."""
    outputs = [r["scored"] for r in ranks if r["scored"] is not None]
    assert len(outputs) >= 2  # every data-parallel rank's last stage
    logprobs = outputs[0]["padded_logprobs"]  # the same on every output rank: gathered in sample order
    by_sample = {case: _loss_by_sample(loss, logprobs, with_old) for case, (loss, with_old) in CASES.items()}
    worst: dict[str, tuple[float, str]] = {}

    def check(kind: str, dev: float, tol: float, where: str, *detail) -> None:
        assert dev <= tol, (kind, where, dev, *detail)
        worst[kind] = max(worst.get(kind, (0.0, "")), (dev, where))

    for rank, report in enumerate(ranks):
        for case, got in report["cases"].items():
            where = f"rank {rank} {case}"
            padded, packed = got["padded"], got["packed"]
            assert not got["missing"] and not got["extra"], (where, got["missing"], got["extra"])
            # every rank ran as many micro-batches (the pipeline and DDP run them in lockstep)
            assert packed["num_micro_batches"] == ranks[0]["cases"][case]["packed"]["num_micro_batches"], where
            # the whole minibatch's loss on every rank, and the loss the trainer's log-probs give
            assert padded["loss"] == ranks[0]["cases"][case]["padded"]["loss"], where
            reference, magnitude = by_sample[case]
            check("loss (of its magnitude)", abs(packed["loss"] - padded["loss"]) / magnitude, LOSS_RTOL, where,
                  packed["loss"], padded["loss"], magnitude)
            worst["loss (of itself)"] = max(worst.get("loss (of itself)", (0.0, "")),
                                            (_rel(packed["loss"], padded["loss"]), where))
            for mode, value in (("padded", padded["loss"]), ("packed", packed["loss"])):
                check("loss against the float64 per-sample sum", abs(value - reference) / magnitude, LOSS_RTOL,
                      f"{where} {mode}", value, reference)
            for key, dev in got["metric_devs"].items():
                if key != "loss":
                    check("statistics", dev, METRIC_RTOL, f"{where} {key}", packed[key], padded[key])
            for param, dev in got["grad_devs"].items():
                if param == "‖Δg‖/‖g‖":
                    check("gradient (relative norm)", dev, GRAD_NORM_RTOL, where, got["grad_scales"][param])
                else:
                    check("gradients (of the tensor max)", dev, GRAD_RTOL, f"{where} {param}", got["grad_scales"][param])
        scored = report["scored"]
        if scored is None:  # not the last pipeline stage
            continue
        for key in ("logprobs", "entropies"):
            assert scored[f"{key}_shapes"] and scored[f"{key}_same_shapes"], (rank, key)
            check(key, scored[key], LOGPROB_ATOL, f"rank {rank}")
        assert all(scored["routing_equal"]) and scored["routing_shapes"], (rank, scored["routing_equal"])
    print(f"\n{title}; largest deviations:")
    for kind, (dev, where) in sorted(worst.items()):
        print(f"  {kind:42s} {dev:.2e}  {where}")

    # a real comparison: every case trained, no two losses alike, the masks and corrections acted
    cases = ranks[0]["cases"]
    trained = sum(p + 1 - q for p, q in zip(POSITIONS, PROMPTS)) - sum(
        int((~s.train_mask).sum()) for s in _samples() if s.train_mask is not None)
    for case, got in cases.items():
        assert got["padded"]["num_tokens"] == trained and got["padded"]["grad_norm"] > 0, case
    assert len({round(got["padded"]["loss"], 9) for got in cases.values()}) == len(cases), "every loss differs"
    assert {case.split("/")[0] for case in cases} == set(POLICY_LOSSES)
    assert {case.split("/")[1] for case in cases} == set(AGGREGATIONS)
    assert {case.split("/")[2] for case in cases} >= set(CORRECTIONS)
    assert any(got["padded"]["correction_drop_frac"] > 0 for case, got in cases.items() if case.endswith("/icepop"))
    assert any(got["padded"]["correction_drop_frac"] > 0 for case, got in cases.items() if case.endswith("/mis"))
    assert any(got["padded"]["correction_weight_mean"] != 1.0 for case, got in cases.items() if case.endswith("/tis"))
    assert all(got["padded"]["clip_frac"] > 0 for case, got in cases.items() if case.startswith(("bpo", "grpo")))
    assert "correction_weight_mean" not in cases["bpo/seq-mean-token-mean/no-old-logprobs"]["padded"]


# ------------------------------------------------------------------------------ refusals
def _refusals() -> dict:
    """Samples the budget cannot take, given as the whole batch (every rank sees them) and as
    one rank's share (the other rank's share fits): every rank refuses, none waits for another."""
    import torch.distributed as dist

    from bpo_megatron.trainer.shares import minibatch_totals

    actor = th.build_actor(replay=True, max_tokens_per_micro_batch=10)
    short = _samples()[:4]  # 3, 4, 5 and 3 positions
    long = _samples()[4:]  # 11, 4, 9 and 6 positions
    rank = dist.get_rank()
    before = th.flat_params(actor)
    errors = {}
    calls = {
        "whole batch": lambda: actor.train_step(short + long),
        "whole batch scored": lambda: actor.compute_logprobs(short + long),
        "share": lambda: actor.train_share(short if rank == 0 else long, minibatch_totals(short + long)),
        # rank 0's one sample cannot fill the 3 packs of rank 1's three 6-position samples
        "too few samples": lambda: actor.logprobs_of_share(short[1:2] if rank == 0 else [long[3], long[3], long[3]]),
    }
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            errors[name] = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in th.flat_params(actor).items())
    actor.close()
    return {"errors": errors, "unchanged": unchanged}


@pytest.mark.timeout(TIMEOUT)
def test_samples_the_budget_cannot_take_are_refused_by_every_rank_before_any_compute():
    ranks = run_gloo_world(_refusals, 2, timeout=TIMEOUT)
    for rank, got in enumerate(ranks):
        errors = got["errors"]
        assert set(errors) == {"whole batch", "whole batch scored", "share", "too few samples"}, (rank, errors)
        for key in ("whole batch", "whole batch scored"):
            assert "sample 4 has 11 input positions" in errors[key] and "max_tokens_per_micro_batch=10" in errors[key]
        assert got["unchanged"], rank
        assert "3 micro-batches but another holds only 1 samples" in errors["too few samples"], errors
    assert "sample 0 has 11 input positions" in ranks[1]["errors"]["share"]  # its share's first sample
    assert "a sample of 11 input positions on another data-parallel rank" in ranks[0]["errors"]["share"]
