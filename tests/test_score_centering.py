"""Score centering (losses/score_centering.py) against its closed form over the whole vocabulary.

The term's gradient, built from the sampler's top-k only, must equal the full-vocabulary centering
``Â_t · Σ_v q(v)·f(π(v)/q(v)) · ∇log π(v)`` (fp64) when the sampler's tail is the trainer's tail
rescaled — the case the top-k estimator is exact for — in every correction mode; it must vanish
when sampler and trainer agree; and a filtered sampler (q = 0 off its kept tokens) is exact with no
tail at all."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.losses import PolicyLossConfig
from bpo_megatron.losses.config import CorrectionConfig
from bpo_megatron.losses.core import compute_policy_loss

B, T, V, K = 2, 5, 40, 8
TEMPERATURE = 0.9


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2.0
    advantages = torch.tensor([1.5, -0.7], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -1] = False  # a padding position
    return logits, advantages, mask, gen


def _sampler_with_rescaled_tail(trainer: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampler distribution whose top-K set H is free and whose tail is exactly ρ·π (ρ from the
    masses), with the ids of H: the case the top-k estimate is exact for."""
    noisy = torch.softmax(trainer.log() + 0.6 * torch.randn(trainer.shape, generator=gen, dtype=torch.float64), -1)
    ids = noisy.topk(K, dim=-1).indices
    in_head = torch.zeros_like(trainer, dtype=torch.bool).scatter_(-1, ids, True)
    head_q = torch.where(in_head, noisy, 0.0)
    q_head_mass = head_q.sum(-1, keepdim=True)
    p_tail_mass = torch.where(in_head, 0.0, trainer).sum(-1, keepdim=True)
    rho = (1 - q_head_mass) / p_tail_mass
    return torch.where(in_head, noisy, rho * trainer), ids


def _loss_and_grad(logits, advantages, mask, q, ids, sampled, cfg):
    z = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(z / TEMPERATURE, dim=-1)
    logp = logp_all.gather(-1, sampled[..., None])[..., 0]
    rollout = q.log().gather(-1, sampled[..., None])[..., 0]
    head = logp_all.gather(-1, ids)
    sampler_head = q.log().gather(-1, ids)
    old = logp.detach() if cfg.correction.active else None
    loss, _ = compute_policy_loss(logp, rollout, advantages, mask, cfg, old_logprobs=old, head_logprobs=head,
                                  sampler_head_logprobs=sampler_head)
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad


def _full_vocabulary_centering(logits, advantages, mask, q, weight_mass):
    """−∇ of the centering in closed form: Â_t · (m − π Σ_v m_v) / T per position, with
    m_v = q(v)·f(π(v)/q(v)) over the whole vocabulary (token-sum aggregation)."""
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    m = weight_mass(pi, q)
    per_position = (m - pi * m.sum(-1, keepdim=True)) / TEMPERATURE
    return torch.where(mask[..., None], advantages[:, None, None] * per_position, 0.0)


MODES = {
    "none": (CorrectionConfig(), lambda pi, q: q),
    "tis": (CorrectionConfig(name="tis", tis_cap=1.3), lambda pi, q: torch.minimum(pi, 1.3 * q)),
    "icepop": (CorrectionConfig(name="icepop", icepop_low=0.7, icepop_high=1.4),
               lambda pi, q: torch.where((pi / q >= 0.7) & (pi / q <= 1.4), pi, 0.0)),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("loss", ["bpo", "grpo", "cispo"])
def test_the_terms_gradient_is_the_full_vocabulary_centering(mode, loss):
    logits, advantages, mask, gen = _setup()
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    q, ids = _sampler_with_rescaled_tail(pi, gen)
    sampled = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
    correction, weight_mass = MODES[mode]
    base_cfg = PolicyLossConfig(name=loss, agg="token-sum", correction=correction)
    centred_cfg = PolicyLossConfig(name=loss, agg="token-sum", correction=correction, score_centering=True)
    plain_loss, plain = _loss_and_grad(logits, advantages, mask, q, ids, sampled, base_cfg)
    centred_loss, centred = _loss_and_grad(logits, advantages, mask, q, ids, sampled, centred_cfg)
    assert torch.equal(plain_loss, centred_loss)  # the term's value is zero: the loss reads as without it
    # the loss is minimised: its gradient gains +Â·μ̂ (the update −∇ loses the mean score)
    want = _full_vocabulary_centering(logits, advantages, mask, q, weight_mass)
    assert float(want.abs().max()) > 1e-3  # a real correction, not a vanishing one
    # tokens the loss's own mask drops lose the term too (BPO/GRPO drop some here; CISPO none)
    from bpo_megatron.losses.registry import POLICY_LOSSES
    from bpo_megatron.losses.terms import TokenTerms
    logp_sampled = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, sampled[..., None])[..., 0]
    # the loss's mask is taken against π_old (= π here) when a correction is on, else against μ
    anchor = logp_sampled if correction.active else q.log().gather(-1, sampled[..., None])[..., 0]
    terms = TokenTerms(logp_sampled, anchor, advantages[:, None].expand(B, T), mask, 20.0)
    _, keep = POLICY_LOSSES[loss].weight_and_mask(terms, base_cfg)
    want = torch.where(keep[..., None], want, 0.0)
    torch.testing.assert_close(centred - plain, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_term_vanishes_when_sampler_and_trainer_agree(mode):
    logits, advantages, mask, gen = _setup(1)
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    ids = pi.topk(K, dim=-1).indices
    sampled = torch.multinomial(pi.view(-1, V), 1, generator=gen).view(B, T)
    correction, _ = MODES[mode]
    _, plain = _loss_and_grad(logits, advantages, mask, pi, ids, sampled,
                              PolicyLossConfig(agg="token-sum", correction=correction))
    _, centred = _loss_and_grad(logits, advantages, mask, pi, ids, sampled,
                                PolicyLossConfig(agg="token-sum", correction=correction, score_centering=True))
    torch.testing.assert_close(centred, plain, rtol=0, atol=1e-12)


def test_a_filtered_sampler_is_centred_exactly_over_its_kept_tokens():
    """Top-5 filtering, renormalised: q = 0 off the kept tokens, whose log q is −inf in the head
    (K = 8 > 5). The head covers the kept support, so there is no tail (ρ → 0) and the term is the
    exact Σ_{v kept} q(v)∇log π(v); nothing non-finite leaks into the gradient."""
    logits, advantages, mask, gen = _setup(2)
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    kept = pi.topk(5, dim=-1).indices
    q = torch.zeros_like(pi).scatter_(-1, kept, pi.gather(-1, kept))
    q = q / q.sum(-1, keepdim=True)
    ids = torch.cat([kept, pi.topk(K, dim=-1).indices[..., 5:]], dim=-1)  # 3 ids the sampler gave q = 0
    sampled = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
    with torch.no_grad():
        safe_q = q.clamp(min=1e-300)  # the sampled tokens are kept, so their log q is finite anyway
    _, plain = _loss_and_grad(logits, advantages, mask, safe_q, ids, sampled, PolicyLossConfig(agg="token-sum"))
    _, centred = _loss_and_grad(logits, advantages, mask, q, ids, sampled,
                                PolicyLossConfig(agg="token-sum", score_centering=True))
    assert bool(torch.isfinite(centred).all())
    want = _full_vocabulary_centering(logits, advantages, mask, q, lambda p_, q_: q_)
    from bpo_megatron.losses.registry import POLICY_LOSSES
    from bpo_megatron.losses.terms import TokenTerms
    terms = TokenTerms(torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, sampled[..., None])[..., 0],
                       q.log().gather(-1, sampled[..., None])[..., 0], advantages[:, None].expand(B, T), mask, 20.0)
    _, keep = POLICY_LOSSES["bpo"].weight_and_mask(terms, PolicyLossConfig())
    # exact but for ρ's floor: the sampler's tail mass (0 here) counts as 1e-6 (score_centering.EPS)
    torch.testing.assert_close(centred - plain, torch.where(keep[..., None], want, 0.0), rtol=1e-4, atol=1e-5)


def test_mis_drops_the_term_with_the_responses_it_drops():
    logits, advantages, mask, gen = _setup(3)
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    q, ids = _sampler_with_rescaled_tail(pi, gen)
    sampled = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
    z = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(z / TEMPERATURE, dim=-1)
    logp = logp_all.gather(-1, sampled[..., None])[..., 0]
    rollout = q.log().gather(-1, sampled[..., None])[..., 0]
    # π_old far above μ on response 0 only: MIS (cap 2) drops response 0 and keeps response 1
    old = rollout.clone()
    old[0] = rollout[0] / 2  # π_old/μ = μ^(-1/2) per token: far above the cap over the response
    grads = []
    for centring in (False, True):
        cfg = PolicyLossConfig(agg="token-sum", correction=CorrectionConfig(name="mis"), score_centering=centring)
        loss, _ = compute_policy_loss(logp, rollout, advantages, mask, cfg, old_logprobs=old,
                                      head_logprobs=logp_all.gather(-1, ids), sampler_head_logprobs=q.log().gather(-1, ids))
        grads.append(torch.autograd.grad(loss, z, retain_graph=True)[0])
    difference = grads[1] - grads[0]
    assert float(difference[0].abs().max()) == 0.0 and float(difference[1].abs().max()) > 1e-4


def test_score_centering_without_the_samplers_top_k_is_refused():
    logits, advantages, mask, _ = _setup()
    logp = torch.log_softmax(logits, -1)[..., 0]
    with pytest.raises(ValueError, match="sampler's top-k log-probs"):
        compute_policy_loss(logp, logp, advantages, mask, PolicyLossConfig(score_centering=True))
    with pytest.raises(ValueError, match="score_centering_top_k must be >= 1"):
        PolicyLossConfig(score_centering=True, score_centering_top_k=0)


def test_the_metrics_report_the_tail_ratio_and_the_samplers_head_mass():
    logits, advantages, mask, gen = _setup(4)
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    q, ids = _sampler_with_rescaled_tail(pi, gen)
    sampled = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
    logp_all = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    _, metrics = compute_policy_loss(logp_all.gather(-1, sampled[..., None])[..., 0],
                                     q.log().gather(-1, sampled[..., None])[..., 0], advantages, mask,
                                     PolicyLossConfig(score_centering=True), head_logprobs=logp_all.gather(-1, ids),
                                     sampler_head_logprobs=q.log().gather(-1, ids))
    head_q, head_p = q.gather(-1, ids).sum(-1), pi.gather(-1, ids).sum(-1)
    assert metrics["score_centering_head_mass"] == pytest.approx(float(head_q[mask].mean()), rel=1e-6)
    assert metrics["score_centering_rho"] == pytest.approx(float(((1 - head_q) / (1 - head_p))[mask].mean()), rel=1e-5)
    _, plain = compute_policy_loss(logp_all[..., 0], logp_all[..., 0], advantages, mask, PolicyLossConfig())
    assert "score_centering_rho" not in plain


def _centering_on_rank(mode: str):
    """One rank's gradient shard of the centering term, the head's log-probs from the vocab-parallel op."""
    import torch.distributed as dist

    from bpo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_logprobs_at

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, advantages, mask, gen = _setup(5)
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    q, ids = _sampler_with_rescaled_tail(pi, gen)
    sampled = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
    shard = V // world
    correction, _ = MODES[mode]
    group = dist.group.WORLD if world > 1 else None
    grads = []
    for centring in (False, True):
        leaf = logits[..., rank * shard:(rank + 1) * shard].float().contiguous().requires_grad_()
        logp = vocab_parallel_logprobs(leaf, sampled, group, temperature=TEMPERATURE)
        head = vocab_parallel_logprobs_at(leaf, ids, group, temperature=TEMPERATURE)
        cfg = PolicyLossConfig(agg="token-sum", correction=correction, score_centering=centring)
        loss, _ = compute_policy_loss(logp, q.log().gather(-1, sampled[..., None])[..., 0].float(), advantages.float(),
                                      mask, cfg, old_logprobs=logp.detach() if correction.active else None,
                                      head_logprobs=head, sampler_head_logprobs=q.log().gather(-1, ids).float())
        loss.backward()
        grads.append(leaf.grad)
    return grads[1] - grads[0]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["none", "tis"])
def test_the_term_through_the_vocab_parallel_op_is_the_full_vocabulary_centering(world, mode):
    """TP = 1 and TP = 2 over gloo, fp32: the trainer's path (the head's log-probs from each rank's
    vocabulary shard, no gather) against the fp64 closed form."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    logits, advantages, mask, gen = _setup(5)
    pi = torch.softmax(logits / TEMPERATURE, dim=-1)
    q, _ = _sampler_with_rescaled_tail(pi, gen)
    want = _full_vocabulary_centering(logits, advantages, mask, q, MODES[mode][1])
    # BPO's own mask against π_old = π (with a correction) or μ: the dropped tokens get no term
    from bpo_megatron.losses.registry import POLICY_LOSSES
    from bpo_megatron.losses.terms import TokenTerms
    sampled = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
    logp_sampled = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, sampled[..., None])[..., 0]
    anchor = logp_sampled if MODES[mode][0].active else q.log().gather(-1, sampled[..., None])[..., 0]
    _, keep = POLICY_LOSSES["bpo"].weight_and_mask(
        TokenTerms(logp_sampled, anchor, advantages[:, None].expand(B, T), mask, 20.0), PolicyLossConfig())
    shards = run_gloo_world(_centering_on_rank, world, mode, timeout=60)
    torch.testing.assert_close(torch.cat(shards, dim=-1).double(), torch.where(keep[..., None], want, 0.0),
                               rtol=1e-4, atol=1e-6)


# -- the embedded engine returns the top-k of the distribution it draws from --

@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from bpo_megatron.testing import MODEL_CONFIGS, random_checkpoint

    return random_checkpoint(MODEL_CONFIGS / "tiny_qwen3_moe", tmp_path_factory.mktemp("sc-engine"), seed=2)


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.6}])
def test_the_embedded_engine_reports_the_top_k_it_drew_from(moe_dir, filters):
    """Against a teacher-forced recompute: without filters, the top-k of log-softmax(logits / T);
    with top-k or top-p, the kept tokens renormalised (the rest −inf), every sampled token among
    them. A request that does not ask gets none."""
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine
    from bpo_megatron.testing.recompute import teacher_forced

    engine = HFEngine(moe_dir, capture_routing=False)
    asked = [GenerationRequest(f"q{i}", tuple(range(3 + i, 9 + i)),
                               SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=i, top_logprobs=5, **filters))
             for i in range(3)]
    plain = GenerationRequest("plain", (1, 2, 3), SamplingParams(max_new_tokens=4, **filters))
    samples = engine.generate([*asked, plain])
    assert samples[-1].sampler_head_ids is None and samples[-1].sampler_head_logprobs is None
    vocab = engine.model.config.vocab_size
    with pytest.raises(ValueError, match=f"top_logprobs={vocab + 1} exceeds the model's vocabulary of {vocab}"):
        engine.generate([GenerationRequest("big", (1, 2), SamplingParams(max_new_tokens=2, top_logprobs=vocab + 1))])
    for sample in samples[:-1]:
        sample.check()
        ids, logq = sample.sampler_head_ids, sample.sampler_head_logprobs
        assert ids.dtype == torch.int32 and logq.dtype == torch.float32 and ids.shape == (sample.response_tokens.numel(), 5)
        prompt = sample.prompt_tokens.numel()
        logp, _ = teacher_forced(engine.model, sample.tokens, temperature=0.8)
        logp = logp[prompt - 1:]
        if not filters:
            want_values, want_ids = logp.topk(5, dim=-1)
            assert torch.equal(ids.long(), want_ids)
            torch.testing.assert_close(logq, want_values, rtol=0, atol=1e-5)
            continue
        order = logp.argsort(dim=-1, descending=True)
        assert torch.equal(ids.long(), order[:, :5])
        probs = logp.exp().gather(-1, order)
        kept = torch.zeros_like(probs, dtype=torch.bool)
        if "top_k" in filters:
            kept[:, :3] = True
        else:
            kept = (probs.cumsum(-1) - probs) < 0.6
        want = torch.where(kept, probs, 0.0)
        want = (want / want.sum(-1, keepdim=True))[:, :5].log()
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(logq), finite) and bool((~finite).any() or "top_p" in filters)
        torch.testing.assert_close(logq[finite], want[finite], rtol=0, atol=1e-5)
        # every sampled token is one the filters kept
        rank = (order == sample.response_tokens[:, None]).int().argmax(-1)
        assert bool(kept.gather(-1, rank[:, None]).all())
    engine.shutdown()


def test_score_centering_is_refused_up_front_where_the_engine_cannot_return_the_top_k():
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment

    free = ["model.routing_replay=false", "rollout.capture_routed_experts=false"]  # R3 aside: CPU-only checks
    # SGLang and vLLM report the top-k before their filters: only without them is that the
    # distribution they draw from
    for engine in ("sglang", "vllm"):
        with pytest.raises(ConfigError, match="rollout.top_p=0.9, rollout.top_k=0; set rollout.top_p=1.0"):
            load_experiment("configs/tiny_moe_cpu.yaml", ["loss.score_centering=true", f"rollout.engine={engine}",
                                                          "rollout.top_p=0.9", *free])
    from bpo_megatron.rollout import ENGINES, engine_spec
    assert {name: engine_spec(name).top_logprobs for name in ENGINES} == {"hf": "drawn", "sglang": "unfiltered",
                                                                          "vllm": "unfiltered"}
    with pytest.raises(ConfigError, match="rollout.agent.name=calculator"):
        load_experiment("configs/tiny_moe_cpu.yaml", ["loss.score_centering=true", "rollout.agent.name=calculator"])
    cfg = load_experiment("configs/tiny_moe_cpu.yaml", ["loss.score_centering=true", "loss.score_centering_top_k=16"])
    assert cfg.loss.score_centering and cfg.loss.score_centering_top_k == 16
