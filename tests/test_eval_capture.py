"""Evaluation does not capture routed experts: a request's ``capture_routing`` decides whether an
engine that captures (R3) returns its routing. Every engine honours it (SGLang's request body and
decoding, the embedded engine's router hooks, vLLM's decoding), and the evaluation builds its
requests without it while training rollouts keep it."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from bpo_megatron.data.rewards import reward_fn
from bpo_megatron.data.tokenizer import CharTokenizer
from bpo_megatron.eval.avg_at_k import eval_requests, evaluate, load_eval_sets
from bpo_megatron.experiment import load_experiment
from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.rollout import GenerationRequest, Sample, SamplingParams
from bpo_megatron.rollout.hf.engine import HFEngine
from bpo_megatron.rollout.sglang.client import _Attempt
from bpo_megatron.rollout.sglang.protocol import ProtocolError, decode_sample, generate_body
from bpo_megatron.rollout.types import response_slots
from bpo_megatron.tasks.prompts import PromptFormat, requests

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "tiny_moe_cpu.yaml"
LAYOUT = RoutingLayout(num_hidden_layers=2, moe_layers=(0, 1), topk=2, num_experts=4)

torch.set_num_threads(1)


def _request(rid: str, capture: bool, prompt=(1, 2, 3), **sampling) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**{"max_new_tokens": 2, **sampling}),
                             capture_routing=capture)


def test_requests_capture_their_routing_unless_they_say_otherwise():
    assert GenerationRequest("q", (1,)).capture_routing is True
    assert GenerationRequest("q", (1,), capture_routing=False).capture_routing is False


# ------------------------------------------------------------------------------------- SGLang
@pytest.mark.parametrize("engine_captures", [True, False])
def test_sglang_asks_for_routing_only_for_requests_that_want_it(engine_captures):
    """The client posts one response per body: each body asks for routed experts exactly when the
    engine captures and its request wants them, retries included (a retry keeps its request)."""
    training, evaluation = response_slots([_request("t", True, n=2), _request("e", False, n=2)])[::2]
    for slot, wants in ((training, True), (evaluation, False)):
        for sent in (slot, _Attempt(slot, 0), _Attempt(slot, 3)):
            body = generate_body([sent], capture_routing=engine_captures)
            assert body["return_routed_experts"] is (engine_captures and wants), (sent.rid, engine_captures)
            assert body["rid"] == [sent.rid]
    # a batched body (one flag for all its items) asks when any item wants the routing
    assert generate_body([training, evaluation], capture_routing=True)["return_routed_experts"] is True
    assert generate_body([evaluation, evaluation], capture_routing=True)["return_routed_experts"] is False


def _answer(rid: str, routed: bool) -> dict:
    experts = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 4  # 3 prompt + 2 output − 1 rows
    meta = {"id": rid, "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 9, None], [-1.0, 4, None]],
            "weight_versions": [{"version": "default", "start": 0, "end": 2}]}
    if routed:
        meta["routed_experts"] = base64.b64encode(experts.tobytes()).decode()
    return {"output_ids": [9, 4], "meta_info": meta}


def test_sglang_decoding_demands_routing_only_of_requests_that_asked():
    training, evaluation = response_slots([_request("t", True), _request("e", False)])
    # a request that did not ask gets none, and may get none without error
    assert decode_sample(evaluation, _answer("e#0", routed=False), routing=LAYOUT).routed_experts is None
    # routing a batched body brought along for it is not kept either
    assert decode_sample(evaluation, _answer("e#0", routed=True), routing=LAYOUT).routed_experts is None
    # a request that asked still needs its routing
    sample = decode_sample(training, _answer("t#0", routed=True), routing=LAYOUT)
    assert sample.routed_experts.shape == (4, 2, 2)
    with pytest.raises(ProtocolError, match="no routed experts"):
        decode_sample(training, _answer("t#0", routed=False), routing=LAYOUT)


# -------------------------------------------------------------------------------------- vLLM
def test_vllm_returns_no_routing_for_requests_that_did_not_ask():
    """vLLM records routing engine-wide: a request that did not ask gets none, and none is
    required of it."""
    from test_vllm_engine import RequestOutput, completion

    from bpo_megatron.rollout.vllm.engine import ProtocolError as VLLMProtocolError
    from bpo_megatron.rollout.vllm.engine import decode_output

    training, evaluation = response_slots([_request("t", True, prompt=(5, 6, 7)),
                                           _request("e", False, prompt=(5, 6, 7))])
    routed = completion(3, [4, 8])
    assert decode_output(training, RequestOutput([5, 6, 7], [routed]), routing=LAYOUT).routed_experts.shape == (4, 2, 2)
    assert decode_output(evaluation, RequestOutput([5, 6, 7], [routed]), routing=LAYOUT).routed_experts is None
    bare = completion(3, [4, 8])
    bare.routed_experts = None
    assert decode_output(evaluation, RequestOutput([5, 6, 7], [bare]), routing=LAYOUT).routed_experts is None
    with pytest.raises(VLLMProtocolError, match="no routed experts"):
        decode_output(training, RequestOutput([5, 6, 7], [bare]), routing=LAYOUT)


# --------------------------------------------------------------------------- embedded engine
@pytest.fixture(scope="module")
def moe_engine(tiny_checkpoint) -> HFEngine:
    path = tiny_checkpoint("tiny_qwen3_moe")
    return HFEngine(path, capture_routing=True)


def _mixed(vocab: int, captures: list[bool]) -> list[GenerationRequest]:
    """Requests of different prompt and response lengths, with stop tokens: rows leave the batch
    at different steps, so the capture follows a changing set of live rows."""
    generator = torch.Generator().manual_seed(1)
    lengths = (3, 17, 1, 30, 9, 5)
    return [GenerationRequest(f"q{i}", tuple(torch.randint(0, vocab, (lengths[i],), generator=generator).tolist()),
                              SamplingParams(temperature=0.9, max_new_tokens=8 + 3 * i, stop_token_ids=(7, 11, 13),
                                             seed=100 + i, n=2),
                              capture_routing=capture)
            for i, capture in enumerate(captures)]


def test_embedded_engine_routes_in_one_mixed_batch_only_the_requests_that_asked(moe_engine):
    vocab = moe_engine.model.config.vocab_size
    wants = [True, False, False, True, False, True]
    everything = moe_engine.generate(_mixed(vocab, [True] * len(wants)))  # what every request got before
    mixed = moe_engine.generate(_mixed(vocab, wants))
    assert [(s.request_id, s.index) for s in mixed] == [(s.request_id, s.index) for s in everything]
    lengths = {s.response_tokens.numel() for s in mixed}
    assert len(lengths) > 2, "rows must leave the batch at different steps for this test to mean anything"
    for sample, reference in zip(mixed, everything):
        assert torch.equal(sample.response_tokens, reference.response_tokens)
        assert torch.equal(sample.rollout_logprobs, reference.rollout_logprobs)
        if wants[int(sample.request_id[1:])]:
            assert sample.routed_experts is not None, sample.request_id
            assert torch.equal(sample.routed_experts, reference.routed_experts), sample.request_id
            sample.check(num_moe_layers=moe_engine.num_moe_layers, topk=moe_engine.model.config.num_experts_per_tok)
        else:
            assert sample.routed_experts is None, sample.request_id


def test_embedded_engine_captures_nothing_for_a_batch_that_wants_no_routing(moe_engine, monkeypatch):
    opened = []
    monkeypatch.setattr(moe_engine._capture, "open", lambda *args: opened.append(args))
    samples = moe_engine.generate(_mixed(moe_engine.model.config.vocab_size, [False] * 3))
    assert len(samples) == 6 and all(s.routed_experts is None for s in samples)
    assert opened == [], "no capture buffer (and no recording) for a batch none of whose requests wants it"


def test_embedded_engine_splits_into_batches_each_capturing_only_what_it_needs(tiny_checkpoint, monkeypatch):
    """With more rows than one batch holds, a batch of requests that want no routing runs without
    capture while another records its rows."""
    path = tiny_checkpoint("tiny_qwen3_moe")
    engine = HFEngine(path, capture_routing=True, max_batch_rows=2)
    opened = []
    original = engine._capture.open

    def recording_open(rows, columns, device):
        opened.append(rows)
        original(rows, columns, device)

    monkeypatch.setattr(engine._capture, "open", recording_open)
    # prompts of lengths 1 and 30 (no routing) and 3 (routing), 2 rows each: batches by prompt length
    reqs = [GenerationRequest("a", (4,), SamplingParams(max_new_tokens=3, n=2, seed=1), capture_routing=False),
            GenerationRequest("b", (4, 5, 6), SamplingParams(max_new_tokens=3, n=2, seed=2)),
            GenerationRequest("c", tuple(range(1, 31)), SamplingParams(max_new_tokens=3, n=2, seed=3),
                              capture_routing=False)]
    samples = engine.generate(reqs)
    assert opened == [2], "only the batch of the request that wants routing opens a capture"
    assert [s.routed_experts is not None for s in samples] == [False, False, True, True, False, False]


# -------------------------------------------------------------------------------- evaluation
def test_evaluation_requests_do_not_ask_for_routing_and_training_requests_do():
    cfg = load_experiment(DEMO, ["eval.k=2", "eval.limit=3", "eval.datasets=[procedural:add,procedural:max]"])
    fmt = PromptFormat(CharTokenizer(), "plain", max_prompt_tokens=16)
    sets = load_eval_sets(cfg.eval, ".", fmt, skip_bad=False)
    built = eval_requests(sets, CharTokenizer(), cfg, step=4)
    assert len(built) == 6 and all(r.sampling.n == 2 for r in built)
    assert [r.capture_routing for r in built] == [False] * 6
    assert built[0].request_id == "eval4-procedural:add-0" and built[3].request_id == "eval4-procedural:max-0"

    # what evaluate() hands the engines is exactly these requests
    seen: list[GenerationRequest] = []

    def generate(batch):
        seen.extend(batch)
        return [Sample(r.request_id, i, torch.tensor(r.prompt_tokens), torch.tensor([1]), torch.tensor([-1.0]),
                       "stop") for r in batch for i in range(r.sampling.n)]

    evaluate(generate, sets, CharTokenizer(), reward_fn("exact"), cfg, step=4)
    assert seen == built

    # training rollouts (the loop's request builder, its default) keep capturing
    training = requests(sets[0].prompts, tag="s1", n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4,
                        stop_token_ids=(), seed=0)
    assert training and all(r.capture_routing for r in training)
