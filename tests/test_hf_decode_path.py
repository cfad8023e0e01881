"""The embedded engine's static decode path (``rollout.hf.decode=static``: fixed per-row KV slots,
a functional step, slots refilled from the queue) against independent references: a teacher-forced
transformers forward (log μ and routed experts, fp32), the transformers decode path (the same
tokens for greedy and seeded sampling), and transformers' own expert loop. The CUDA-graph path runs
this same step; only its kernels (FlashAttention, bf16 grouped GEMM, graph replay) are GPU-only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bpo_megatron.models import HFModelConfig
from bpo_megatron.rollout import GenerationRequest, SamplingParams
from bpo_megatron.rollout.hf.decode import grouped_experts, resolve_path
from bpo_megatron.rollout.hf.engine import HFEngine
from bpo_megatron.rollout.hf.options import HFEngineOptions
from bpo_megatron.testing import MODEL_CONFIGS
from bpo_megatron.testing.models import random_checkpoint
from bpo_megatron.testing.recompute import teacher_forced

TOLERANCE = 1e-5  # fp32 log μ: slot attention and grouped experts sum in another order

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return random_checkpoint(MODEL_CONFIGS / "tiny_qwen3_moe", tmp_path_factory.mktemp("moe"), seed=0)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return random_checkpoint(MODEL_CONFIGS / "tiny_qwen3", tmp_path_factory.mktemp("dense"), seed=0)


def _requests(vocab: int, **sampling) -> list[GenerationRequest]:
    """Prompts of mixed lengths (1 … 30) and mixed response budgets, so rows finish at different
    steps and slots are refilled while others decode."""
    generator = torch.Generator().manual_seed(1)
    requests = []
    for i, (length, budget) in enumerate(((3, 24), (17, 9), (1, 20), (30, 24), (9, 5))):
        prompt = tuple(torch.randint(0, vocab, (length,), generator=generator).tolist())
        params = {**dict(temperature=0.7, top_p=0.9, top_k=40, n=3, max_new_tokens=budget, seed=100 + i), **sampling}
        requests.append(GenerationRequest(f"q{i}", prompt, SamplingParams(**params)))
    return requests


def _same_samples(a, b) -> None:
    """Same rows, tokens, finish reasons and routing; log μ within the sum of two paths' errors
    against the exact value (each within TOLERANCE of a teacher-forced recompute)."""
    for x, y in zip(a, b, strict=True):
        assert (x.request_id, x.index, x.finish_reason) == (y.request_id, y.index, y.finish_reason)
        assert torch.equal(x.response_tokens, y.response_tokens), x.request_id
        assert torch.allclose(x.rollout_logprobs, y.rollout_logprobs, atol=2 * TOLERANCE, rtol=0)
        assert (x.routed_experts is None) == (y.routed_experts is None)
        if x.routed_experts is not None:
            assert torch.equal(x.routed_experts, y.routed_experts), x.request_id


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_static_path_equals_a_teacher_forced_recompute_and_the_transformers_path(kind, moe_dir, dense_dir):
    path = moe_dir if kind == "moe" else dense_dir
    hf = HFModelConfig.load(path)
    # 4 slots for 15 rows, the host looking every 3 steps: rows enter and leave mid-decode
    engine = HFEngine(path, capture_routing=True, decode="static", max_batch_rows=4, refill_every=3)
    stops = tuple(range(0, hf.vocab_size, 10))  # ~10% of the tokens: some rows stop, some run out
    requests = _requests(hf.vocab_size, stop_token_ids=stops)
    samples = engine.generate(requests)

    assert [(s.request_id, s.index) for s in samples] == [(r.request_id, i) for r in requests for i in range(3)]
    worst = 0.0
    for sample, request in zip(samples, [r for r in requests for _ in range(3)]):
        sample.check(num_moe_layers=len(hf.moe_layers) or None, topk=hf.num_experts_per_tok or None)
        assert sample.response_tokens.numel() <= request.sampling.max_new_tokens
        prompt = sample.prompt_tokens.numel()
        logprobs, routing = teacher_forced(engine.model, sample.tokens, temperature=0.7)
        response_logprobs = logprobs[prompt - 1:].gather(1, sample.response_tokens[:, None])[:, 0]
        worst = max(worst, (response_logprobs - sample.rollout_logprobs).abs().max().item())
        assert sample.finish_reason == ("stop" if sample.response_tokens[-1].item() in stops else "length")
        if kind == "moe":  # R3: every processed token's experts, prompt and response, as recomputed
            assert torch.equal(sample.routed_experts, routing.to(torch.uint8)), sample.request_id
        else:
            assert sample.routed_experts is None
    assert worst <= TOLERANCE, worst
    assert {s.finish_reason for s in samples} == {"stop", "length"}

    # the same rows through today's loop: the same seeded draws give the same tokens
    _same_samples(HFEngine(path, capture_routing=True, decode="transformers").generate(requests), samples)


@pytest.mark.parametrize("sampling", [dict(top_k=1), dict(temperature=1.0, top_p=1.0, top_k=0)],
                         ids=["greedy", "unfiltered"])
def test_same_tokens_as_the_transformers_path_for_greedy_and_unfiltered_sampling(sampling, moe_dir):
    requests = _requests(200, **sampling)
    reference = HFEngine(moe_dir, capture_routing=True, decode="transformers").generate(requests)
    for slots, refill_every in ((15, 8), (2, 1)):
        engine = HFEngine(moe_dir, capture_routing=True, decode="static", max_batch_rows=slots,
                          refill_every=refill_every)
        _same_samples(engine.generate(requests), reference)
    if sampling == dict(top_k=1):  # greedy: each token is the recompute's argmax
        for sample in reference:
            logprobs, _ = teacher_forced(engine.model, sample.tokens, temperature=0.7)
            argmax = logprobs[sample.prompt_tokens.numel() - 1:].argmax(-1)
            assert torch.equal(argmax, sample.response_tokens)


def test_only_the_requests_that_ask_record_routing_and_weight_updates_are_seen(moe_dir, tmp_path):
    engine = HFEngine(moe_dir, capture_routing=True, decode="static", max_batch_rows=3, refill_every=2)
    requests = [GenerationRequest(r.request_id, r.prompt_tokens, r.sampling, capture_routing=i % 2 == 0)
                for i, r in enumerate(_requests(200))]
    reference = HFEngine(moe_dir, capture_routing=True, decode="transformers").generate(requests)
    samples = engine.generate(requests)
    assert [s.routed_experts is not None for s in samples] == [i % 2 == 0 for i in range(5) for _ in range(3)]
    _same_samples(samples, reference)

    # an in-place weight update reaches the functional step (it reads the model's own modules)
    other = random_checkpoint(MODEL_CONFIGS / "tiny_qwen3_moe", tmp_path / "other", seed=1)
    engine.update_weights(load_file(other / "model.safetensors").items())
    _same_samples(engine.generate(requests),
                  HFEngine(other, capture_routing=True, decode="transformers").generate(requests))


def test_grouped_experts_equal_transformers_expert_loop(moe_dir):
    """The step's expert GEMMs against the model's own experts module, on tokens routed so that
    one expert gets no token (an empty group) and others several."""
    engine = HFEngine(moe_dir, capture_routing=False, decode="static")
    experts = engine.model.model.layers[0].mlp.experts
    x = torch.randn(6, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(0))
    chosen = torch.tensor([[0, 2], [2, 0], [1, 2], [0, 1], [2, 1], [0, 2]])  # expert 3 unused
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = experts(x, chosen, weights)
        mine = grouped_experts(x, chosen, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn)
    assert torch.allclose(mine, reference, atol=1e-5, rtol=0)


def test_decode_option_is_checked_and_resolved_per_device(moe_dir):
    with pytest.raises(ValueError, match="rollout.hf.decode='fast'"):
        HFEngineOptions(decode="fast")
    with pytest.raises(ValueError, match="refill_every"):
        HFEngineOptions(refill_every=0)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_path("auto", cpu, torch.float32) == "transformers"
    assert resolve_path("auto", cuda, torch.float32) == "transformers"
    assert resolve_path("auto", cuda, torch.bfloat16) == "cuda_graph"
    assert resolve_path("static", cpu, torch.bfloat16) == "static"
    with pytest.raises(ValueError, match="static on CUDA needs rollout.hf.dtype=bf16"):
        resolve_path("static", cuda, torch.float32)
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        HFEngine(moe_dir, capture_routing=False, decode="cuda_graph")


def test_a_weight_update_mid_generation_is_seen_from_the_next_step_as_in_the_transformers_path(moe_dir):
    """A weight update requested after the third forward pass (another thread, as a sync reaching a
    busy engine): both loops pause there, continue with the new weights and record the version
    of every token; the static loop's samples equal today's loop's."""
    import threading

    old = dict(HFEngine(moe_dir, capture_routing=False).named_hf_weights())
    new = {name: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) for name, t in old.items()}
    request = [GenerationRequest("p", (5, 9, 2, 7), SamplingParams(temperature=1.0, max_new_tokens=10, seed=11))]

    def interrupted(decode: str):
        engine = HFEngine(moe_dir, capture_routing=True, decode=decode)
        third_done, requested, forward_done, calls = threading.Event(), threading.Event(), engine._forward_done, [0]

        def counting_done():
            forward_done()
            calls[0] += 1
            if calls[0] == 3:  # hold the generation here until the update is requested
                third_done.set()
                assert requested.wait(30)

        engine._forward_done = counting_done
        result: list = []
        worker = threading.Thread(target=lambda: result.extend(engine.generate(request)))
        worker.start()
        assert third_done.wait(30)
        engine.begin_weight_update(1)
        requested.set()
        engine.update_weights(new.items())
        engine.end_weight_update()
        worker.join(30)
        return result

    [static], [reference] = interrupted("static"), interrupted("transformers")
    assert static.token_versions.tolist() == [0, 0, 0] + [1] * 7 == reference.token_versions.tolist()
    _same_samples([static], [reference])


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and FlashAttention need a GPU")


@cuda_only
def test_graph_replay_changes_no_number_on_cuda(moe_dir):
    """The same step (SDPA, bf16 grouped GEMM) eager and replayed as a CUDA graph: capture must
    change nothing, so tokens, log μ and routing are bit for bit the same."""
    from bpo_megatron.rollout.hf.slots import SlotRow, SlotSession, SlotSettings

    engine = HFEngine(moe_dir, capture_routing=True, dtype=torch.bfloat16, device="cuda", decode="static")
    rows = [SlotRow(r.prompt_tokens, r.sampling, seed, True) for r in _requests(200) for seed in (1, 2, 3)]

    def run(cuda_graph: bool):
        settings = SlotSettings(slots=4, refill_every=3, attention="sdpa", cuda_graph=cuda_graph)
        with torch.inference_mode():
            return SlotSession(engine.model, rows, settings, engine._capture, lambda step: (step(), 0)).run()

    for eager, graphed in zip(run(False), run(True), strict=True):
        assert torch.equal(eager.tokens, graphed.tokens)
        assert torch.equal(eager.logprobs, graphed.logprobs)
        assert torch.equal(eager.routing, graphed.routing)


@cuda_only
def test_cuda_graph_path_against_a_teacher_forced_recompute_on_cuda(moe_dir):
    """auto = cuda_graph on a GPU in bf16 (FlashAttention varlen, one graph per session): log μ and
    routing against transformers' own bf16 forward over each whole sequence. bf16 kernels sum
    differently, so log μ agrees to bf16 precision and a near-tied router may flip."""
    engine = HFEngine(moe_dir, capture_routing=True, dtype=torch.bfloat16, device="cuda", max_batch_rows=4,
                      refill_every=3)
    assert engine.decode_path == "cuda_graph"
    samples = engine.generate(_requests(200))
    gaps, same = [], []
    for sample in samples:
        logprobs, routing = teacher_forced(engine.model, sample.tokens.cuda(), temperature=0.7)
        response = logprobs[sample.prompt_tokens.numel() - 1:].gather(1, sample.response_tokens.cuda()[:, None])[:, 0]
        gaps.append((response.cpu() - sample.rollout_logprobs).abs())
        same.append((routing.sort(-1).values.cpu().to(torch.uint8) == sample.routed_experts.sort(-1).values).all(-1))
    gaps, same = torch.cat(gaps), torch.cat([s.flatten() for s in same])
    assert float(gaps.mean()) <= 0.05, float(gaps.mean())
    assert float(same.float().mean()) >= 0.99, float(same.float().mean())
