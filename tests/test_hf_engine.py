"""The embedded rollout engine against independent references: a teacher-forced transformers forward
(log μ and routed experts), the checkpoint files ``save_pretrained`` writes (weight names and fused
expert layout), and closed-form sampling distributions."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from bpo_megatron.models import HFModelConfig
from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.rollout import EngineContext, GenerationRequest, SamplingParams, engine_spec
from bpo_megatron.rollout.hf.options import HFEngineOptions
from bpo_megatron.rollout.hf.engine import HFEngine
from bpo_megatron.testing.recompute import teacher_forced

TOLERANCE = 1e-5  # fp32 log μ: KV-cache decoding sums in another order than one full forward

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("tiny_qwen3_moe")


@pytest.fixture(scope="module")
def dense_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("tiny_qwen3")


@pytest.fixture(scope="module")
def glm_dir(tiny_checkpoint) -> Path:
    """GLM-4.5 MoE: a dense first layer, sigmoid routing with a non-zero expert bias, a shared expert,
    Q/K/V biases, QK-norm and RoPE over half of each head."""
    return tiny_checkpoint("tiny_glm4_moe")


@pytest.fixture(scope="module")
def deepseek_dir(tiny_checkpoint) -> Path:
    """DeepSeek-V3: multi-head latent attention (a compressed query, interleaved RoPE, value heads
    narrower than query/key heads), group-limited sigmoid routing with an expert bias, a shared expert."""
    return tiny_checkpoint("tiny_deepseek_v3")


def _model_dir(kind: str, request) -> Path:
    return request.getfixturevalue(f"{kind}_dir")


def _requests(vocab: int, lengths=(3, 17, 1, 30, 9), **sampling) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(1)
    defaults = dict(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=24, n=3)
    return [GenerationRequest(f"q{i}", tuple(torch.randint(0, vocab, (length,), generator=generator).tolist()),
                              SamplingParams(**{**defaults, "seed": 100 + i, **sampling}))
            for i, length in enumerate(lengths)]


@pytest.mark.parametrize("kind", ["moe", "dense", "glm", "deepseek"])
def test_rollout_logprobs_and_routing_equal_a_teacher_forced_recompute(kind, request):
    path = _model_dir(kind, request)
    engine = HFEngine(path, capture_routing=True)
    hf = HFModelConfig.load(path)
    assert engine.capabilities.captures_routing == hf.is_moe
    assert engine.num_moe_layers == len(hf.moe_layers)
    requests = _requests(hf.vocab_size, stop_token_ids=(7, 11))
    samples = engine.generate(requests)

    # n samples per request, in request order then index order
    assert [(s.request_id, s.index) for s in samples] == [(r.request_id, i) for r in requests for i in range(3)]
    worst, routed_tokens = 0.0, 0
    for sample in samples:
        sample.check(num_moe_layers=len(hf.moe_layers) or None, topk=hf.num_experts_per_tok or None)
        prompt = sample.prompt_tokens.numel()
        logprobs, routing = teacher_forced(engine.model, sample.tokens, temperature=0.7)
        response_logprobs = logprobs[prompt - 1:].gather(1, sample.response_tokens[:, None])[:, 0]
        worst = max(worst, (response_logprobs - sample.rollout_logprobs).abs().max().item())
        # every sampled token lies inside top-k, then top-p, of the recomputed distribution
        ranks = (logprobs[prompt - 1:] > response_logprobs[:, None]).sum(1)
        assert int(ranks.max()) < 40
        assert sample.finish_reason == ("stop" if sample.response_tokens[-1].item() in (7, 11) else "length")
        if hf.is_moe:
            assert sample.routed_experts.dtype == torch.uint8  # 4 or 8 experts: ids travel as bytes
            assert torch.equal(sample.routed_experts, routing.to(torch.uint8)), sample.request_id
            routed_tokens += routing.shape[0]
        else:
            assert sample.routed_experts is None
    assert worst <= TOLERANCE, worst
    assert routed_tokens == sum(s.tokens.numel() - 1 for s in samples) if hf.is_moe else True


def test_sampling_follows_the_filtered_distribution_while_logprobs_stay_unfiltered(moe_dir):
    """One prompt, many first tokens: frequencies match top-k-then-top-p of softmax(logits / T)."""
    engine = HFEngine(moe_dir, capture_routing=False)
    prompt = (5, 9, 2, 77)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.7, max_new_tokens=1, n=3000, seed=3)
    samples = engine.generate([GenerationRequest("p", prompt, params)])
    logprobs, _ = teacher_forced(engine.model, torch.tensor(prompt + (0,)), temperature=0.8)
    full = logprobs[-1].exp()
    ordered, order = full.sort(descending=True)
    kept = ordered[:6] / ordered[:6].sum()
    kept = kept[:int(((kept.cumsum(0) - kept) < 0.7).sum())]
    expected = torch.zeros_like(full)
    expected[order[:kept.numel()]] = kept / kept.sum()
    first = torch.tensor([s.response_tokens[0].item() for s in samples])
    frequencies = torch.bincount(first, minlength=full.numel()).double() / first.numel()
    sigma = (expected * (1 - expected) / first.numel()).sqrt()
    assert (frequencies[expected == 0] == 0).all()
    assert ((frequencies - expected).abs() <= 4 * sigma + 1e-9).all()
    reported = torch.tensor([s.rollout_logprobs[0].item() for s in samples])
    assert torch.allclose(reported, logprobs[-1][first], atol=TOLERANCE, rtol=0)


def test_a_seed_fixes_the_samples_whatever_else_is_batched(moe_dir):
    engine = HFEngine(moe_dir, capture_routing=True)
    requests = _requests(200)
    first, again = engine.generate(requests), engine.generate(requests)
    alone = engine.generate([requests[3]])
    for a, b in zip(first, again):
        assert torch.equal(a.response_tokens, b.response_tokens)
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert torch.equal(a.routed_experts, b.routed_experts)
    for a, b in zip(first[9:12], alone):
        assert torch.equal(a.response_tokens, b.response_tokens)
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert torch.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=TOLERANCE, rtol=0)
    # the n samples of a request differ, and so do other seeds
    assert not torch.equal(first[0].response_tokens, first[1].response_tokens)
    reseeded = engine.generate(_requests(200, seed=7))
    assert any(not torch.equal(a.response_tokens, b.response_tokens) for a, b in zip(first, reseeded))


def test_stop_tokens_end_a_response_and_max_new_tokens_bounds_it(moe_dir):
    engine = HFEngine(moe_dir, capture_routing=True)
    prompt = (4, 8, 15, 16, 23, 42)
    free = engine.generate([GenerationRequest("free", prompt, SamplingParams(max_new_tokens=20, seed=5))])[0]
    assert free.finish_reason == "length" and free.response_tokens.numel() == 20
    stop_id = int(free.response_tokens[6])
    cut = 1 + int((free.response_tokens == stop_id).nonzero()[0])  # first occurrence, included
    requests = [
        GenerationRequest("stop", prompt, SamplingParams(max_new_tokens=20, seed=5, stop_token_ids=(stop_id, 199))),
        GenerationRequest("short", prompt, SamplingParams(max_new_tokens=3, seed=5)),
        GenerationRequest("any", (1, 2), SamplingParams(max_new_tokens=9, stop_token_ids=tuple(range(200)))),
    ]
    stopped, short, instantly = engine.generate(requests)
    assert stopped.finish_reason == "stop"
    assert torch.equal(stopped.response_tokens, free.response_tokens[:cut])
    assert torch.equal(stopped.routed_experts, free.routed_experts[:len(prompt) + cut - 1])
    assert short.finish_reason == "length" and torch.equal(short.response_tokens, free.response_tokens[:3])
    assert instantly.finish_reason == "stop" and instantly.response_tokens.numel() == 1
    assert instantly.routed_experts.shape == (2, 2, 2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([GenerationRequest("long", prompt, SamplingParams(max_new_tokens=251))])


@pytest.mark.parametrize("kind", ["moe", "dense", "glm", "deepseek"])
def test_named_hf_weights_are_the_checkpoint_tensors(kind, request):
    path = _model_dir(kind, request)
    on_disk = load_file(path / "model.safetensors")
    weights = dict(HFEngine(path, capture_routing=False).named_hf_weights())
    assert sorted(weights) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(weights[name], tensor), name


def test_update_weights_by_on_disk_names_lands_in_the_fused_experts(moe_dir, tmp_path, tiny_checkpoint):
    engine = HFEngine(moe_dir, capture_routing=True)
    requests = _requests(200)
    before = engine.generate(requests)
    other_dir = tiny_checkpoint("tiny_qwen3_moe", seed=1)
    new = load_file(other_dir / "model.safetensors")

    received = engine.update_weights(iter(new.items()))
    assert received == sum(t.numel() * t.element_size() for t in new.values())
    experts = engine.model.model.layers[0].mlp.experts  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
    inter = experts.gate_up_proj.shape[1] // 2
    assert torch.equal(experts.gate_up_proj[3, :inter], new["model.layers.0.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(experts.gate_up_proj[3, inter:], new["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert torch.equal(experts.down_proj[3], new["model.layers.0.mlp.experts.3.down_proj.weight"])
    assert all(torch.equal(tensor, new[name]) for name, tensor in engine.named_hf_weights())

    after = engine.generate(requests)
    assert any(not torch.equal(a.response_tokens, b.response_tokens) for a, b in zip(before, after))
    engine.model.save_pretrained(tmp_path / "saved")
    for fresh in (HFEngine(other_dir, capture_routing=True), HFEngine(tmp_path / "saved", capture_routing=True)):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fresh.named_hf_weights(), engine.named_hf_weights()))
        for a, b in zip(after, fresh.generate(requests)):
            assert torch.equal(a.response_tokens, b.response_tokens)
            assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
            assert torch.equal(a.routed_experts, b.routed_experts)


def test_update_weights_refuses_unknown_names_and_wrong_shapes(moe_dir):
    engine = HFEngine(moe_dir, capture_routing=False)
    snapshot = {name: t.clone() for name, t in engine.named_hf_weights()}
    gate = "model.layers.1.mlp.experts.2.gate_proj.weight"
    bad = {
        "model.layers.0.mlp.experts.4.gate_proj.weight": torch.zeros(32, 64),  # expert 4 of 4
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 64),  # in-memory, not on-disk
        gate: torch.zeros(64, 32),  # transposed
    }
    for name, tensor in bad.items():
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            engine.update_weights([(name, tensor)])
    with pytest.raises(ValueError, match="floating-point"):
        engine.update_weights([(gate, torch.zeros(32, 64, dtype=torch.long))])
    assert all(torch.equal(t, snapshot[name]) for name, t in engine.named_hf_weights())


def test_weight_update_session_version_and_shutdown(moe_dir):
    hf = HFModelConfig.load(moe_dir)  # built as the engine workers build it: from its spec
    engine = engine_spec("hf").build(HFEngineOptions(), EngineContext(moe_dir, 0, RoutingLayout.of(hf)))
    assert isinstance(engine, HFEngine) and engine.capabilities.captures_routing
    request = [GenerationRequest("x", (1, 2, 3), SamplingParams(max_new_tokens=2, seed=0))]
    assert engine.generate(request)[0].weight_version == 0  # the checkpoint it started from
    engine.begin_weight_update(7)
    assert engine.health().detail == "paused"
    with pytest.raises(RuntimeError, match="weight update"):
        engine.generate(request)
    name, tensor = next(engine.named_hf_weights())
    assert engine.update_weights([(name, tensor.clone())]) == tensor.numel() * 4  # allowed in the update
    engine.end_weight_update()
    assert engine.health().healthy and engine.health().detail == "ready"
    [sample] = engine.generate(request)
    assert engine.weight_version == 7 and sample.weight_version == 7

    model = weakref.ref(engine.model)
    engine.shutdown()
    gc.collect()
    assert model() is None, "shutdown must free the model"
    assert not engine.health().healthy
    for call in (lambda: engine.generate(request), lambda: engine.begin_weight_update(1), engine.end_weight_update,
                 lambda: engine.update_weights([]), lambda: next(engine.named_hf_weights())):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


def test_capture_is_off_when_not_asked_for(moe_dir):
    engine = HFEngine(moe_dir, capture_routing=False)
    assert not engine.capabilities.captures_routing
    sample = engine.generate([GenerationRequest("x", (1, 2, 3), SamplingParams(max_new_tokens=4, seed=0))])[0]
    assert sample.routed_experts is None


def test_a_partial_rollout_records_both_versions_and_the_logprobs_it_sampled_with(moe_dir):
    """A weight update arrives while a response is being generated (another thread, as a weight
    sync reaches a busy engine): the generation pauses at its next step, continues with the new
    weights, and each token records the version that sampled it. Its μ equals, token by token, an
    independent recompute in plain transformers that feeds the same tokens through one KV cache and
    switches the weights at the recorded token (the prefix's cache stays the old weights', as in
    the engine), and differs from the old weights' own log-probs after the switch."""
    import threading

    engine = HFEngine(moe_dir, capture_routing=False)
    model = engine.model
    old = {name: tensor.clone() for name, tensor in engine.named_hf_weights()}
    new = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(3))
           for name, tensor in old.items()}
    prompt = (5, 9, 2, 7)
    request = [GenerationRequest("p", prompt, SamplingParams(temperature=1.0, max_new_tokens=10, seed=11,
                                                             stop_token_ids=()))]
    forwards, third_done, requested = [0], threading.Event(), threading.Event()
    forward_done = engine._forward_done

    def counting_done():  # the gate's own hook: every forward pass, prefill and decode steps alike
        forward_done()
        forwards[0] += 1
        if forwards[0] == 3:  # hold the generation after its third forward until the update is requested
            third_done.set()
            assert requested.wait(30)

    engine._forward_done = counting_done
    result: list = []
    worker = threading.Thread(target=lambda: result.extend(engine.generate(request)))
    worker.start()
    assert third_done.wait(30)
    engine.begin_weight_update(1)  # a generation under way stops at its next step
    requested.set()
    engine.update_weights(new.items())
    engine.end_weight_update()
    worker.join(30)
    engine._forward_done = forward_done
    [sample] = result
    assert sample.token_versions.tolist() == [0, 0, 0] + [1] * 7 and sample.weight_version == 0

    def recompute(switch_at: int | None) -> torch.Tensor:
        """log π of each response token; the weights switched to the new ones before token ``switch_at``."""
        engine.update_weights(old.items())
        tokens = sample.response_tokens.tolist()
        cache, logprobs = DynamicCache(config=model.config), []
        with torch.inference_mode():
            for t, token in enumerate(tokens):
                if t == switch_at:
                    engine.update_weights(new.items())
                ids = list(prompt) if t == 0 else [tokens[t - 1]]  # the prompt, then each sampled token
                positions = torch.arange(len(prompt) + t - len(ids), len(prompt) + t)[None]
                logits = model(input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache,
                               use_cache=True).logits[0, -1].float()
                logprobs.append(torch.log_softmax(logits, dim=-1)[token])
        return torch.stack(logprobs)

    assert torch.allclose(sample.rollout_logprobs, recompute(3), atol=1e-5)
    assert (sample.rollout_logprobs[3:] - recompute(None)[3:]).abs().max() > 1e-3
