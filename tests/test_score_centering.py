"""Score centering (losses/score_centering.py) against its closed forms.

At one position the sampler draws y from μ, and the loss's update is Â·g(y)·∇log π(y) with g the
loss's (and the correction's) weight and mask of y against its anchor. Score centering must cancel
the drift: with an advantage that does not depend on the token, the update's expectation over y ~ μ
— computed exactly here by enumerating a small vocabulary — is zero once the term is added, for
every loss and anchor the config admits, when the sampler's and the anchor's mass off the sampler's
top-k is the trainer's rescaled (the case the top-k estimate is exact for). The term does not
depend on which token was drawn (it is there also where the loss drops the sampled token), its
value is zero, and its coefficients are the closed forms the module's docstring states. Losses
that weigh by probabilities (BPO, DPPO) are exact when the top-k covers the sampler's support and
otherwise leave exactly the stated residual. Sequence-level weights (GSPO, MIS) and the π_old
anchor in the trainer are refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.losses import POLICY_LOSSES, PolicyLossConfig
from bpo_megatron.losses.config import CorrectionConfig
from bpo_megatron.losses.core import compute_policy_loss
from bpo_megatron.losses.score_centering import SEQUENCE_LEVEL_LOSSES, coefficients

B, T, V, K = 2, 5, 40, 8  # the batched tests (vocab-parallel)
SMALL_V, SMALL_K = 12, 5  # the enumerated position
TEMPERATURE = 0.9
TOKEN_LOSSES = sorted(set(POLICY_LOSSES) - SEQUENCE_LEVEL_LOSSES)
# weight and mask see only ratios: constant off the top-k under the tail model, so exact with a tail
RATIO_LOSSES = ["cispo", "grpo", "grpo_dualclip", "sapo"]
# at this position the weight is π/μ and the mask (BPO's, on ω, for Â > 0) drops no token: a full
# importance weight, whose update has no drift (Σ_v π(v)∇log π(v) = 0)
FULL_IMPORTANCE_WEIGHT_HERE = {("bpo_mask_r_weight", "mu", 1.3)}
ANCHORS = {  # name -> (the correction, whether the loss is anchored to a recomputed π_old)
    "mu": (CorrectionConfig(), False),
    "pi_old": (CorrectionConfig(), True),
    "pi_old+tis": (CorrectionConfig(name="tis", tis_cap=1.3), True),
    "pi_old+icepop": (CorrectionConfig(name="icepop", icepop_low=0.7, icepop_high=1.4), True),
}


def _with_rescaled_tail(noisy: torch.Tensor, pi: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``noisy`` on the ids, the trainer's π rescaled to the remaining mass off them."""
    in_head = torch.zeros_like(pi, dtype=torch.bool).scatter_(-1, ids, True)
    if bool(in_head.all()):
        return noisy
    rest = 1 - torch.where(in_head, noisy, 0.0).sum(-1, keepdim=True)
    return torch.where(in_head, noisy, rest * pi / torch.where(in_head, 0.0, pi).sum(-1, keepdim=True))


def _position(seed: int, k: int = SMALL_K):
    """One position: the trainer's logits, the sampler's μ and π_old (each with its own top-k
    values and the trainer's tail rescaled), the sampler's top-k ids."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(SMALL_V, generator=gen, dtype=torch.float64) * 2.0
    pi = torch.softmax(logits / TEMPERATURE, -1)
    noisy_mu = torch.softmax(pi.log() + 1.0 * torch.randn(SMALL_V, generator=gen, dtype=torch.float64), -1)
    noisy_old = torch.softmax(pi.log() + 0.3 * torch.randn(SMALL_V, generator=gen, dtype=torch.float64), -1)
    ids = noisy_mu.topk(k).indices
    return logits, _with_rescaled_tail(noisy_mu, pi, ids), _with_rescaled_tail(noisy_old, pi, ids), ids


def _per_token_gradients(logits, mu, old, ids, advantage, cfg):
    """The loss's gradient (token-sum) for each token the sampler could draw, ``[V, V]``: row y is
    the gradient with respect to the logits when y was sampled (rows μ(y) = 0 are 0)."""
    n = logits.numel()
    z = logits.expand(n, 1, n).clone().requires_grad_()
    logp_all = torch.log_softmax(z / TEMPERATURE, -1)
    sampled = torch.arange(n)[:, None]
    drawable = mu > 0
    log_mu = torch.where(drawable, mu.log(), 0.0)  # rows the sampler cannot draw are masked out
    kwargs = {}
    if old is not None:
        kwargs = {"old_logprobs": old.log()[sampled], "old_head_logprobs": old.log()[ids].expand(n, 1, -1)}
    loss, _ = compute_policy_loss(logp_all.gather(-1, sampled[..., None])[..., 0], log_mu[sampled],
                                  torch.full((n,), advantage, dtype=torch.float64), drawable[:, None], cfg,
                                  head_logprobs=logp_all.gather(-1, ids.expand(n, 1, -1)),
                                  sampler_head_logprobs=mu.log()[ids].expand(n, 1, -1), **kwargs)
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad[:, 0, :]


def _centred_and_plain(logits, mu, old, ids, advantage, loss, correction, **settings):
    plain_cfg = PolicyLossConfig(name=loss, agg="token-sum", correction=correction, **settings)
    centred_cfg = PolicyLossConfig(name=loss, agg="token-sum", correction=correction, score_centering=True, **settings)
    plain_value, plain = _per_token_gradients(logits, mu, old, ids, advantage, plain_cfg)
    centred_value, centred = _per_token_gradients(logits, mu, old, ids, advantage, centred_cfg)
    assert torch.equal(plain_value, centred_value)  # the term's value is zero: the loss reads as without it
    return centred, plain


def _scores(logits: torch.Tensor) -> torch.Tensor:
    """∇_z log π(v) for every v, ``[V, V]`` (row v)."""
    pi = torch.softmax(logits / TEMPERATURE, -1)
    return (torch.eye(logits.numel(), dtype=torch.float64) - pi) / TEMPERATURE


@pytest.mark.parametrize("advantage", [1.3, -0.8])
@pytest.mark.parametrize("anchor", sorted(ANCHORS))
@pytest.mark.parametrize("loss", TOKEN_LOSSES)
def test_the_centred_update_has_zero_expectation_under_the_sampler(loss, anchor, advantage):
    """E_{y~μ}[∇ loss] = 0 with the term, against a real drift without it. Ratio-only losses with a
    tail off the top-k; the rest with a top-k that covers the vocabulary (next test: with a tail)."""
    correction, recomputed = ANCHORS[anchor]
    logits, mu, old, ids = _position(seed=7, k=SMALL_K if loss in RATIO_LOSSES else SMALL_V)
    centred, plain = _centred_and_plain(logits, mu, old if recomputed else None, ids, advantage, loss, correction)
    drift = mu @ plain  # −Â·d: the uncentred update's expectation
    if (loss, anchor, advantage) in FULL_IMPORTANCE_WEIGHT_HERE:
        assert float(drift.abs().max()) < 1e-12  # no drift to cancel: the term must add none
    else:
        assert float(drift.abs().max()) > 1e-3
    torch.testing.assert_close(mu @ centred, torch.zeros_like(drift), rtol=0, atol=1e-12)
    # the term is the same whichever token was drawn, kept or dropped by the loss: −E[plain]
    torch.testing.assert_close(centred - plain, -drift.expand_as(plain), rtol=0, atol=1e-12)


@pytest.mark.parametrize("advantage", [1.3, -0.8])
def test_bpo_with_a_tail_leaves_exactly_the_stated_residual(advantage):
    """BPO's ω depends on π and μ themselves: off the top-k its weight is taken at ω → 1, and the
    centred update's expectation is Â·Σ_{v∉H} μ(v)·(g(v) − 1)·∇log π(v), g = min(ω, C)·M (the
    update, −∇ loss, loses it), small next to the drift."""
    logits, mu, _, ids = _position(seed=7)
    centred, plain = _centred_and_plain(logits, mu, None, ids, advantage, "bpo", CorrectionConfig())
    pi = torch.softmax(logits / TEMPERATURE, -1)
    cfg = PolicyLossConfig()
    omega = (1 + cfg.bpo_eps - mu) / (1 + cfg.bpo_eps - pi)
    kept = (omega <= 1 + cfg.eps_high) if advantage > 0 else (omega >= 1 - cfg.eps_low)
    g = omega.clamp(max=cfg.bpo_cap) * kept
    tail = torch.ones(SMALL_V, dtype=torch.bool).scatter_(0, ids, False)
    residual = -advantage * (torch.where(tail, mu * (g - 1.0), 0.0) @ _scores(logits))
    torch.testing.assert_close(mu @ centred, residual, rtol=1e-9, atol=1e-13)
    assert 0 < float(residual.norm()) < 0.05 * float((mu @ plain).norm())


def test_the_coefficients_are_the_closed_forms_of_the_mu_anchor():
    """The docstring's per-loss forms, at the sampler's top-k with a tail: plain policy gradient
    c = μ − ρπ; GRPO-ClipHigher c = π·(M − M_T), zero when its clip drops no candidate (the weight
    π/μ already removes the drift); CISPO min(π, Cμ) − min(1, Cρ)π; BPO μ·min(ω, C)·M − ρπ."""
    logits, mu, _, ids = _position(seed=3)
    pi = torch.softmax(logits / TEMPERATURE, -1)
    p, q = pi[ids][None], mu[ids][None]
    rho = (1 - q.sum()) / (1 - p.sum())
    advantage = torch.tensor([1.0], dtype=torch.float64)

    def c(**settings):
        return coefficients(p.log(), q.log(), advantage, PolicyLossConfig(**settings))[0]

    unclipped = {"eps_low": 0.999, "eps_high": 1e3}
    torch.testing.assert_close(c(name="grpo", **unclipped), torch.zeros_like(p), rtol=0, atol=1e-15)
    ratio = p / q
    clip_kept = (ratio <= 1.28).double()
    tail_kept = float(1 / rho <= 1.28)
    torch.testing.assert_close(c(name="grpo"), p * (clip_kept - tail_kept), rtol=1e-12, atol=1e-15)
    assert float(clip_kept.min()) == 0.0  # the clip drops a candidate here: a non-zero term
    torch.testing.assert_close(c(name="cispo", cispo_cap=1.2),
                               torch.minimum(p, 1.2 * q) - min(1.0, 1.2 * float(rho)) * p, rtol=1e-12, atol=1e-15)
    # BPO with ε = 1e3: ω within 1e-3 of 1 and every token kept, the plain policy gradient's μ − ρπ
    torch.testing.assert_close(c(name="bpo", bpo_eps=1e3), q - rho * p, rtol=0, atol=2e-3 * float(q.max()))
    omega = (1.1 - q) / (1.1 - p)
    torch.testing.assert_close(c(name="bpo"), q * omega.clamp(max=3.0) * (omega <= 1.28) - rho * p,
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss", TOKEN_LOSSES)
def test_the_term_vanishes_when_sampler_anchor_and_trainer_agree(loss):
    logits, _, _, _ = _position(seed=1)
    pi = torch.softmax(logits / TEMPERATURE, -1)
    ids = pi.topk(SMALL_K).indices
    for anchor in ("mu", "pi_old+tis"):
        correction, recomputed = ANCHORS[anchor]
        centred, plain = _centred_and_plain(logits, pi, pi if recomputed else None, ids, 1.3, loss, correction)
        torch.testing.assert_close(centred, plain, rtol=0, atol=1e-12)


def test_a_filtered_sampler_is_centred_exactly_over_its_kept_tokens():
    """Top-4 filtering, renormalised: μ = 0 off the kept tokens, whose log μ is −inf in the head
    (k = 5 > 4). The head covers the kept support, so BPO is exact too (no tail, ρ → 0) and nothing
    non-finite leaks into the gradient."""
    logits, _, _, _ = _position(seed=2)
    pi = torch.softmax(logits / TEMPERATURE, -1)
    kept = pi.topk(4).indices
    mu = torch.zeros_like(pi).scatter_(0, kept, pi[kept] * torch.tensor([1.3, 0.8, 1.1, 0.6], dtype=torch.float64))
    mu = mu / mu.sum()
    ids = torch.cat([kept, pi.topk(SMALL_K).indices[4:]])  # one id the sampler gave μ = 0
    for advantage in (1.3, -0.8):
        centred, plain = _centred_and_plain(logits, mu, None, ids, advantage, "bpo", CorrectionConfig())
        assert bool(torch.isfinite(centred).all()) and float((mu @ plain).abs().max()) > 1e-3
        # exact but for ρ's floor: the sampler's tail mass (0 here) counts as 1e-6 (score_centering.EPS)
        torch.testing.assert_close(mu @ centred, torch.zeros(SMALL_V, dtype=torch.float64), rtol=0, atol=1e-5)


# -- refused: what the derivation does not define --

def test_sequence_level_weights_are_refused_naming_the_field(capsys):
    from bpo_megatron.cli import main
    from test_cli import DEMO

    with pytest.raises(ValueError, match="loss.score_centering with loss.name=gspo: its weight is a ratio of the whole"):
        PolicyLossConfig(name="gspo", score_centering=True)
    with pytest.raises(ValueError, match="loss.score_centering with loss.correction=mis"):
        PolicyLossConfig(correction=CorrectionConfig(name="mis"), score_centering=True)
    assert main(["train", DEMO, "loss.score_centering=true", "loss.name=gspo", "--check"]) == 2
    assert "loss.score_centering with loss.name=gspo" in capsys.readouterr().err
    assert main(["train", DEMO, "loss.score_centering=true", "loss.correction=mis", "train.recompute_old_logprobs=true",
                 "--check"]) == 2
    assert "loss.score_centering with loss.correction=mis" in capsys.readouterr().err


def test_a_ratio_against_the_engines_unfiltered_mu_is_refused_under_sampling_filters(capsys):
    """The engine's log μ of the sampled token is taken before top-k/top-p, its top-k log q after:
    the candidates' ratio against μ would not be the sampled token's. Admitted: no filters, or
    the π_old anchor without a correction (whose weight does not see μ)."""
    from bpo_megatron.cli import main
    from bpo_megatron.experiment import load_experiment
    from test_cli import DEMO

    for extra in ([], ["train.recompute_old_logprobs=true", "loss.correction=tis"]):
        assert main(["train", DEMO, "loss.score_centering=true", "rollout.top_p=0.9", *extra, "--check"]) == 2
        assert "loss.score_centering with rollout.top_p=0.9, rollout.top_k=0: the engine's log μ" in capsys.readouterr().err
    cfg = load_experiment(DEMO, ["loss.score_centering=true", "rollout.top_k=5", "train.recompute_old_logprobs=true"],
                          check_model=False)
    assert cfg.loss.score_centering and cfg.rollout.top_k == 5


def test_the_loss_anchored_to_pi_old_needs_its_heads():
    """With old_logprobs the coefficients weigh each candidate against π_old: the loss refuses to
    centre without π_old's log-probs of the sampler's top-k ids (the recompute pass returns them)."""
    logits, mu, old, ids = _position(seed=4)
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    with pytest.raises(ValueError, match="needs π_old's log-probs of the sampler's top-k ids too"):
        compute_policy_loss(logp[None, :1], mu.log()[None, :1], torch.ones(1, dtype=torch.float64),
                            torch.ones(1, 1, dtype=torch.bool), PolicyLossConfig(score_centering=True),
                            old_logprobs=old.log()[None, :1], head_logprobs=logp[ids][None, None],
                            sampler_head_logprobs=mu.log()[ids][None, None])


def test_score_centering_without_the_samplers_top_k_is_refused():
    logp = torch.log_softmax(torch.randn(B, T, V, dtype=torch.float64), -1)[..., 0]
    advantages = torch.tensor([1.5, -0.7], dtype=torch.float64)
    with pytest.raises(ValueError, match="sampler's top-k log-probs"):
        compute_policy_loss(logp, logp, advantages, torch.ones(B, T, dtype=torch.bool),
                            PolicyLossConfig(score_centering=True))
    with pytest.raises(ValueError, match="score_centering_top_k must be >= 1"):
        PolicyLossConfig(score_centering=True, score_centering_top_k=0)


# -- batched: the metrics, and the trainer's vocab-parallel path --

def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2.0
    advantages = torch.tensor([1.5, -0.7], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -1] = False  # a padding position
    return logits, advantages, mask, gen


def _sampler_with_rescaled_tail(trainer: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampler whose top-K set H is free and whose tail is exactly ρ·π, with the ids of H."""
    noisy = torch.softmax(trainer.log() + 0.6 * torch.randn(trainer.shape, generator=gen, dtype=torch.float64), -1)
    ids = noisy.topk(K, dim=-1).indices
    return _with_rescaled_tail(noisy, trainer, ids), ids


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


def _centering_gradient(logits, advantages, mask, q, ids, sampled, loss, group=None, shard=None):
    """The centering's gradient with respect to the logits (or to this rank's vocabulary shard of
    them, through the vocab-parallel ops)."""
    from bpo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_logprobs_at

    grads = []
    for centring in (False, True):
        cfg = PolicyLossConfig(name=loss, agg="token-sum", score_centering=centring)
        rollout = q.log().gather(-1, sampled[..., None])[..., 0]
        if shard is None:
            leaf = logits.clone().requires_grad_()
            logp_all = torch.log_softmax(leaf / TEMPERATURE, -1)
            logp, head = logp_all.gather(-1, sampled[..., None])[..., 0], logp_all.gather(-1, ids)
        else:
            leaf = logits[..., shard].float().contiguous().requires_grad_()
            logp = vocab_parallel_logprobs(leaf, sampled, group, temperature=TEMPERATURE)
            head = vocab_parallel_logprobs_at(leaf, ids, group, temperature=TEMPERATURE)
            rollout, advantages = rollout.float(), advantages.float()
        loss_value, _ = compute_policy_loss(logp, rollout, advantages, mask, cfg, head_logprobs=head,
                                            sampler_head_logprobs=q.log().gather(-1, ids).to(rollout.dtype))
        grads.append(torch.autograd.grad(loss_value, leaf)[0])
    return grads[1] - grads[0]


def _batch(seed: int = 5):
    logits, advantages, mask, gen = _setup(seed)
    q, ids = _sampler_with_rescaled_tail(torch.softmax(logits / TEMPERATURE, dim=-1), gen)
    sampled = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, T)
    return logits, advantages, mask, q, ids, sampled


def _centering_on_rank(loss: str):
    """One rank's gradient shard of the centering term, the head's log-probs from the vocab-parallel op."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    width = V // world
    return _centering_gradient(*_batch(), loss, group=dist.group.WORLD if world > 1 else None,
                               shard=slice(rank * width, (rank + 1) * width))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("loss", ["bpo", "grpo"])
def test_the_term_through_the_vocab_parallel_op_is_the_full_vocabulary_one(world, loss):
    """TP = 1 and TP = 2 over gloo, fp32: the trainer's path (the head's log-probs from each rank's
    vocabulary shard, no gather) against the full log-softmax in fp64, whose expectation the tests
    above check against the closed forms."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    want = _centering_gradient(*_batch(), loss)
    assert float(want.abs().max()) > 1e-3
    shards = run_gloo_world(_centering_on_rank, world, loss, timeout=60)
    torch.testing.assert_close(torch.cat(shards, dim=-1).double(), want, rtol=1e-4, atol=1e-6)


# -- the embedded engine returns the top-k of the distribution it draws from --

@pytest.fixture(scope="module")
def moe_dir(tiny_checkpoint):
    return tiny_checkpoint("tiny_qwen3_moe", seed=2)


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
