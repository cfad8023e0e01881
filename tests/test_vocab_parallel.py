"""vocab_parallel_logprobs against a full-vocabulary log_softmax, at TP=1 and TP=2 (gloo)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from bpo_megatron.ops import vocab_parallel_logprobs
from bpo_megatron.parallel.local_world import run_gloo_world

VOCAB = 96
SHAPE = (3, 7)  # leading dims: any shape works, e.g. Megatron's [s, b]
CASES = list(itertools.product([None, 4, 1000], [1.0, 0.7], [False, True]))  # chunk, T, inplace


def full_logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(*SHAPE, VOCAB, generator=gen) * 5.0  # peaky, like a trained LM
    targets = torch.randint(0, VOCAB, SHAPE, generator=gen)
    upstream = torch.randn(SHAPE, generator=gen)
    return logits, targets, upstream


def reference(temperature: float):
    logits, targets, upstream = full_logits()
    x = logits.double().requires_grad_()
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (grad,) = torch.autograd.grad(logp, x, upstream.double())
    return logp.detach(), entropy.detach(), grad


def _ours(logits, targets, upstream, group, chunk, temperature, inplace):
    leaf = logits.clone().requires_grad_()
    x = leaf * 1.0 if inplace else leaf  # in-place needs a buffer the caller gives up
    logp, entropy = vocab_parallel_logprobs(
        x, targets, group, temperature=temperature, chunk_size=chunk, with_entropy=True, inplace=inplace
    )
    (logp * upstream).sum().backward()
    if not inplace:  # the copy-safe mode must leave the caller's logits as they were
        assert torch.equal(leaf.detach(), logits), "copy-safe log-probs modified their input"
    return logp.detach(), entropy, leaf.grad


def _tp_rank(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets, upstream = full_logits()
    shard = VOCAB // world
    local = logits[..., rank * shard : (rank + 1) * shard].contiguous()
    return [_ours(local, targets, upstream, dist.group.WORLD, *case) for case in cases]


def _assert_matches(case, logp, entropy, grad, ref, tol=1e-6):
    """Within 1e-6 of the float64 reference (relative for log-probs around -20, where one fp32
    ulp is already 2e-6)."""
    ref_logp, ref_entropy, ref_grad = ref
    torch.testing.assert_close(logp.double(), ref_logp, rtol=tol, atol=tol, msg=f"log-probs {case}")
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=tol, atol=tol, msg=f"entropy {case}")
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol, msg=f"gradient {case}")


def _padded_rank(real_vocab, shift):
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets, upstream = full_logits()
    logits, targets = logits + shift, targets % real_vocab
    shard = VOCAB // world
    local = logits[..., rank * shard : (rank + 1) * shard].contiguous()
    results = []
    for inplace in (False, True):
        leaf = local.clone().requires_grad_()
        x = leaf * 1.0 if inplace else leaf
        logp, entropy = vocab_parallel_logprobs(
            x, targets, dist.group.WORLD, chunk_size=5, with_entropy=True, inplace=inplace, vocab_size=real_vocab
        )
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, leaf.grad))
    return results


# Real vocabularies within the 96 columns (the rest is padding, as Megatron pads the vocabulary
# to a multiple of 128·TP): 83 leaves rank 1 of 2 a few real tokens, 40 leaves it none at all
# (a 128-token vocabulary at TP=2), also with logits far below 0 (a rank of padding must not
# offer a maximum the real logits are measured against: exp(−300) is 0 in fp32). Around −300 one
# fp32 ulp is 3e-5, so that case is compared to 1e-4.
@pytest.mark.parametrize("world, real_vocab, shift", [(1, 83, 0.0), (2, 83, 0.0), (2, 40, 0.0), (2, 40, -300.0)])
def test_padding_columns_are_not_tokens(world, real_vocab, shift):
    logits, targets, upstream = full_logits()
    logits, targets = logits + shift, targets % real_vocab
    x = logits.double()[..., :real_vocab].requires_grad_()
    logp_all = torch.log_softmax(x, dim=-1)
    ref = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)
    (ref_grad,) = torch.autograd.grad(ref, x, upstream.double())
    ref_grad = torch.cat([ref_grad, torch.zeros(*SHAPE, VOCAB - real_vocab, dtype=torch.float64)], -1)
    per_rank = run_gloo_world(_padded_rank, world, real_vocab, shift, timeout=60)
    for mode, inplace in enumerate((False, True)):
        logp, entropy, _ = per_rank[0][mode]
        grad = torch.cat([r[mode][2] for r in per_rank], dim=-1)
        _assert_matches(("padded", world, real_vocab, shift, inplace), logp, entropy, grad,
                        (ref.detach(), ref_entropy.detach(), ref_grad), tol=1e-4 if shift else 1e-6)


def test_tp2_equals_full_vocabulary_log_softmax():
    per_rank = run_gloo_world(_tp_rank, 2, CASES, timeout=120)
    for i, case in enumerate(CASES):
        ref = reference(case[1])
        (logp0, ent0, grad0), (logp1, ent1, grad1) = per_rank[0][i], per_rank[1][i]
        assert torch.equal(logp0, logp1) and torch.equal(ent0, ent1), "ranks must agree exactly"
        _assert_matches(case, logp0, ent0, torch.cat([grad0, grad1], dim=-1), ref)


@pytest.mark.parametrize("chunk, temperature, inplace", CASES)
def test_single_rank_equals_full_vocabulary_log_softmax(chunk, temperature, inplace):
    logits, targets, upstream = full_logits()
    logp, entropy, grad = _ours(logits, targets, upstream, None, chunk, temperature, inplace)
    _assert_matches((chunk, temperature, inplace), logp, entropy, grad, reference(temperature))


@pytest.mark.parametrize("inplace", [False, True])
def test_bf16_logits_give_fp32_logprobs_and_bf16_gradients(inplace):
    logits, targets, upstream = full_logits()
    leaf = logits.bfloat16().requires_grad_()
    x = leaf * 1.0 if inplace else leaf
    logp = vocab_parallel_logprobs(x, targets, temperature=0.7, inplace=inplace)
    (logp * upstream).sum().backward()
    assert logp.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    # exact for the bf16-rounded logits; the gradient carries bf16 rounding only
    x_ref = leaf.detach().double().requires_grad_()
    ref = torch.log_softmax(x_ref / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * upstream.double()).sum().backward()
    torch.testing.assert_close(logp.double(), ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), x_ref.grad, rtol=1e-2, atol=1e-2)


def test_copy_safe_mode_leaves_logits_untouched_and_inplace_reuses_them():
    logits, targets, _ = full_logits()
    original = logits.clone()
    x = logits.clone().requires_grad_()
    vocab_parallel_logprobs(x, targets).sum().backward()
    assert torch.equal(x.detach(), original)

    leaf = logits.clone().requires_grad_()
    buffer = leaf * 1.0
    logp = vocab_parallel_logprobs(buffer, targets, inplace=True)
    (grad,) = torch.autograd.grad(logp.sum(), buffer)
    assert grad.data_ptr() == buffer.data_ptr(), "in-place backward writes into the logits buffer"


def test_forward_only_does_not_modify_logits_even_inplace():
    logits, targets, _ = full_logits()
    x = logits.clone()
    with torch.no_grad():
        logp = vocab_parallel_logprobs(x, targets, inplace=True)
    assert torch.equal(x, logits)
    ref = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(targets=torch.zeros(3, dtype=torch.long)), "targets shape"),
        (dict(targets=torch.full(SHAPE, VOCAB)), r"targets must lie in \[0, 96\)"),
        (dict(targets=torch.full(SHAPE, -1)), r"targets must lie in \[0, 96\)"),
        (dict(targets=torch.zeros(SHAPE)), "targets must be integer"),
        (dict(temperature=0.0), "temperature must be a positive"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
        (dict(vocab_size=VOCAB + 1), "vocab_size=97 must be in"),
        (dict(targets=torch.full(SHAPE, 90), vocab_size=90), r"targets must lie in \[0, 90\)"),
        (dict(logits=torch.zeros(*SHAPE, 2 * VOCAB)[..., ::2], inplace=True), "contiguous"),
    ],
)
def test_bad_input(kwargs, match):
    logits, targets, _ = full_logits()
    args = dict(logits=logits, targets=targets) | kwargs
    logits, targets = args.pop("logits"), args.pop("targets")
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs(logits, targets, **args)


# -- log-probs at k ids per row (score centering's head: ops/head_logprobs.py) --

K_IDS = 5


def _ids_and_upstream():
    gen = torch.Generator().manual_seed(12)
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:K_IDS] for _ in range(SHAPE[0] * SHAPE[1])])
    return ids.view(*SHAPE, K_IDS), torch.randn(*SHAPE, K_IDS, generator=gen)


def _at_reference(temperature: float, real_vocab: int = VOCAB):
    logits, _, _ = full_logits()
    ids, upstream = _ids_and_upstream()
    ids = ids % real_vocab
    x = logits.double().requires_grad_()
    logp = torch.log_softmax(x[..., :real_vocab] / temperature, dim=-1).gather(-1, ids)
    (grad,) = torch.autograd.grad(logp, x, upstream.double())
    return logp.detach(), grad


def _at_rank(temperature, chunk, real_vocab):
    from bpo_megatron.ops import vocab_parallel_logprobs_at

    rank, world = dist.get_rank(), dist.get_world_size()
    logits, _, _ = full_logits()
    ids, upstream = _ids_and_upstream()
    shard = VOCAB // world
    leaf = logits[..., rank * shard:(rank + 1) * shard].contiguous().requires_grad_()
    group = dist.group.WORLD if world > 1 else None
    logp = vocab_parallel_logprobs_at(leaf, ids % real_vocab, group, temperature=temperature, chunk_size=chunk,
                                      vocab_size=real_vocab)
    (logp * upstream).sum().backward()
    return logp.detach(), leaf.grad


@pytest.mark.parametrize("world, temperature, chunk, real_vocab",
                         [(1, 1.0, None, VOCAB), (1, 0.7, 4, 83), (2, 0.7, 4, VOCAB), (2, 1.0, None, 40)])
def test_logprobs_at_k_ids_equal_the_full_vocabulary_log_softmax(world, temperature, chunk, real_vocab):
    """TP = 1 and TP = 2 over gloo (40 real tokens: rank 1 of 2 holds only padding): every rank's
    log-probs at the ids and the gradient shards, against a float64 full-vocabulary log-softmax."""
    ref_logp, ref_grad = _at_reference(temperature, real_vocab)
    per_rank = run_gloo_world(_at_rank, world, temperature, chunk, real_vocab, timeout=60)
    assert all(torch.equal(r[0], per_rank[0][0]) for r in per_rank), "ranks must agree exactly"
    torch.testing.assert_close(per_rank[0][0].double(), ref_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in per_rank], dim=-1).double(), ref_grad, rtol=1e-6, atol=1e-6)
