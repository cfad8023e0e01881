"""R3 across a weight update that reaches SGLang mid-generation (train.async, partial rollouts).

The client pauses with ``retract``: SGLang frees the paused requests' KV cache and, on continue,
prefills prompt + output again with the new weights, so the routed experts it reports for every
position are the new weights' — not those that sampled the tokens before the pause. The stand-in
routes a position by (request id, position, weights version) the way SGLang then reports it, so the
routing each token was sampled with is known: that of an unpaused generation of the same request
(same seed, same tokens) under the token's version. Every response token must either be replayed
with exactly that routing or be masked out of the loss and counted. The client never pauses
``in_place`` (SGLang's cache flush after a weight update fails while requests sit in place), but
the decoder knows what that mode reports: each position keeps the routing that processed it, so
nothing needs masking; checked here by a client patched to pause that way.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_sglang_contract import SGLANG_PYTHON, checkpoints, layout, pushed, requests, start, state  # noqa: F401

from bpo_megatron.loop.samples import training_samples
from bpo_megatron.rollout.sglang import engine as engine_module
from bpo_megatron.rollout.sglang.protocol import decode_sample

pytestmark = [
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is missing: bash tools/setup.sh --sglang"),
    pytest.mark.timeout(300),
]


def _by_response(samples) -> dict:
    return {(s.request_id, s.index): s for s in samples}


def _sampled_with(reference: dict, key, versions: list[int], prompt: int, t: int, mode: str) -> torch.Tensor:
    """The routing of positions 0 … P + t − 1 when token t was sampled: under ``retract`` all of them
    were routed by the weights that sampled it (the pause that brought those weights re-prefilled
    the earlier positions); ``in_place`` position q kept the routing of the weights that processed
    it (the prompt: token 0's; q ≥ P − 1: token q − P + 1's)."""
    if mode == "retract":
        return reference[versions[t]][key].routed_experts[:prompt + t]
    rows = [reference[versions[max(0, q - prompt + 1)]][key].routed_experts[q] for q in range(prompt + t)]
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["retract", pytest.param("in_place", marks=pytest.mark.slow)])  # in_place (≈ 60 s, CI time: -m slow): a mode the client does not use
def test_each_token_is_replayed_with_the_routing_that_sampled_it_or_masked_and_counted(checkpoints, layout, pushed,
                                                                                      tmp_path, monkeypatch, mode):
    if mode != engine_module.PAUSE_MODE:  # a client that pauses another way, and decodes accordingly
        monkeypatch.setattr(engine_module, "PAUSE_MODE", mode)
        # the decoder's default mode, wherever the client calls it from
        monkeypatch.setitem(decode_sample.__kwdefaults__, "pause_mode", mode)
    engine = start(checkpoints[0], layout, tmp_path, "--standin-token-delay", "0.3")
    try:
        unpaused_0 = _by_response(engine.generate(requests(count=2, n=2)))  # the weights of version 0 alone
        decoded = state(engine)["tokens"]
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(engine.generate, requests(count=2, n=2))
            deadline = time.monotonic() + 60
            while state(engine)["tokens"] < decoded + 4:  # every request has decoded a token
                assert time.monotonic() < deadline, "the stand-in decoded no token in 60 s"
                time.sleep(0.05)
            engine.begin_weight_update(1)  # pause_generation in ``mode``
            paused_at = state(engine)["tokens"]
            time.sleep(1.0)  # three decoding steps' time: nothing decodes while paused
            assert state(engine)["tokens"] == paused_at
            engine.update_weights(iter(pushed))
            engine.end_weight_update()
            paused = future.result(timeout=120)
        unpaused_1 = _by_response(engine.generate(requests(count=2, n=2)))  # version 1 alone
    finally:
        engine.shutdown()
    reference = {0: unpaused_0, 1: unpaused_1}
    for version, samples in reference.items():
        assert all(s.token_versions.tolist() == [version] * s.response_tokens.numel() and s.routing_valid is None
                   for s in samples.values())

    # each token dated by SGLang's weight_versions spans, its μ computed with that version's weights
    assert len(paused) == 4 and sum(s.response_tokens.numel() for s in paused) > paused_at - decoded
    for sample in paused:
        versions = sample.token_versions
        assert versions.shape == sample.response_tokens.shape and set(versions.tolist()) <= {0, 1}
        assert (versions.diff() >= 0).all() and sample.weight_version == int(versions.min())
        want = torch.tensor([-0.1 * (i + 1) - 0.01 * v for i, v in enumerate(versions.tolist())])
        assert torch.allclose(sample.rollout_logprobs, want)
    assert sum(int((s.token_versions == 0).sum()) for s in paused) == paused_at - decoded
    masked = total = spanning = 0
    for sample in paused:
        key, prompt = (sample.request_id, sample.index), sample.prompt_tokens.numel()
        versions = sample.token_versions.tolist()
        for version in (0, 1):  # the seed fixes the tokens, whatever the weights (the stand-in's sampler)
            assert torch.equal(sample.response_tokens, reference[version][key].response_tokens)
        if mode == "retract":  # every position reports the routing of the request's last weights
            assert torch.equal(sample.routed_experts, reference[versions[-1]][key].routed_experts)
        spanning += versions[0] != versions[-1]
        for t, version in enumerate(versions):
            # token t was sampled from positions 0 … P + t − 1, routed by the weights that sampled it
            sampled_with = _sampled_with(reference, key, versions, prompt, t, mode)
            replayed = sample.routed_experts[:prompt + t]
            valid = sample.routing_valid is None or bool(sample.routing_valid[t])
            total += 1
            if valid:
                assert torch.equal(replayed, sampled_with), (key, t, versions)
            else:
                assert not torch.equal(replayed, sampled_with), f"{key} token {t} masked although its routing held"
                masked += 1
    assert spanning >= 1, [s.token_versions.tolist() for s in paused]
    assert (masked >= 1) if mode == "retract" else masked == 0

    train, metrics = training_samples(paused, torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, keep_routing=True,
                                      asynchronous=True)
    assert metrics["async/r3_masked_frac"] == masked / total
    for sample, trained in zip(paused, train):
        want = [mode == "in_place" or v == sample.token_versions[-1] for v in sample.token_versions.tolist()]
        got = [True] * len(want) if trained.train_mask is None else trained.train_mask.tolist()
        assert got == want


def test_a_request_retracted_for_kv_space_has_all_its_tokens_masked_and_counted(checkpoints, layout, tmp_path):
    """SGLang retracts a running request when the KV pool overflows (its admission only estimated
    the response's length) and prefills it again later in another batch: the routing it reports is
    that prefill's, not what sampled the tokens before. The stated rule (README, R3): such a
    response (``meta_info.num_retractions`` beyond its weight updates) keeps its tokens and μ but
    none of them is trained on with replayed routing, and its share is ``rollout/retracted_frac``.
    A response never retracted is replayed exactly."""
    asked = requests(count=4, n=2)
    # admission reserves 10% of max_new_tokens: 4 requests in flight outgrow a pool of 24 tokens,
    # one at a time never does (the largest needs 14)
    engine = start(checkpoints[0], layout, tmp_path, "--standin-kv-tokens", "24", "--standin-new-token-ratio", "0.1")
    try:
        tight = engine.cfg
        engine.cfg = dataclasses.replace(tight, max_inflight=1)
        reference = _by_response(engine.generate(asked))
        engine.cfg = tight
        samples = engine.generate(asked)
    finally:
        engine.shutdown()
    assert not any(s.retracted_for_space for s in reference.values())
    retracted = [s for s in samples if s.retracted_for_space]
    kept = [s for s in samples if not s.retracted_for_space]
    assert retracted and kept, "the tight pool retracts some requests and not others"
    for sample in samples:
        expected = reference[(sample.request_id, sample.index)]
        assert torch.equal(sample.response_tokens, expected.response_tokens)  # the same seeded tokens
    for sample in kept:
        assert sample.routing_valid is None
        assert torch.equal(sample.routed_experts, reference[(sample.request_id, sample.index)].routed_experts)
    for sample in retracted:  # the re-prefill's routing is not what sampled the earlier tokens
        assert not torch.equal(sample.routed_experts, reference[(sample.request_id, sample.index)].routed_experts)
        assert sample.routing_valid.tolist() == [False] * sample.response_tokens.numel()

    rewards = torch.tensor([1.0, 0.0] * 4)
    train, metrics = training_samples(samples, rewards, 2, keep_routing=True, asynchronous=False)
    assert metrics["rollout/retracted_frac"] == len(retracted) / len(samples)
    for sample, trained in zip(samples, train):
        if sample.retracted_for_space:
            assert trained.train_mask is not None and not bool(trained.train_mask.any())
        else:
            assert trained.train_mask is None or bool(trained.train_mask.all())
