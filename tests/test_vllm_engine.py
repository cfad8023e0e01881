"""The vLLM engine up to vLLM's boundary: request and sampling translation, output decoding, and the
engine's calls into a stand-in ``vllm`` module (vLLM itself is not installed on CPU machines). A
real generation test runs only where vLLM is importable."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.models import HFModelConfig
from bpo_megatron.rollout import EngineContext, GenerationRequest, SamplingParams, engine_spec
from bpo_megatron.rollout.vllm.options import VLLMOptions
from bpo_megatron.rollout.vllm.engine import (
    LOAD_WEIGHTS_RPC,
    ProtocolError,
    VLLMConfig,
    VLLMEngine,
    decode_output,
    sampling_kwargs,
)
from bpo_megatron.rollout.types import ResponseSlot
from bpo_megatron.rollout.types import response_slots as expand
from bpo_megatron.testing import MODEL_CONFIGS

MOE_DIR = MODEL_CONFIGS / "tiny_qwen3_moe"  # 2 MoE layers, top-2 of 4
DENSE_DIR = MOE_DIR.parent / "tiny_qwen3"


# ------------------------------------------------------------------------ stand-in vLLM objects
@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput (the fields the engine reads)
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


def completion(prompt_len: int, tokens: list[int], *, finish: str = "length", layers: int = 2, topk: int = 2,
               extra_row: bool = False) -> CompletionOutput:
    rows = prompt_len + len(tokens) - 1 + int(extra_row)
    routed = (np.arange(rows * layers * topk).reshape(rows, layers, topk) % 4).astype(np.uint8)
    return CompletionOutput(0, tokens, [{t: Logprob(-0.25 * (k + 1), rank=3)} for k, t in enumerate(tokens)],
                            routed, finish)


class FakeLLM:
    """Records what the engine asks of ``vllm.LLM`` and answers deterministically from the seed."""

    instances: list["FakeLLM"] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", prompts, params))
        outputs = []
        for prompt, p in zip(prompts, params):
            gen = torch.Generator().manual_seed(p.kwargs["seed"])
            tokens = torch.randint(0, 200, (p.kwargs["max_tokens"],), generator=gen).tolist()
            outputs.append(RequestOutput(prompt["prompt_token_ids"],
                                         [completion(len(prompt["prompt_token_ids"]), tokens)]))
        return outputs

    def collective_rpc(self, method, args=()):
        self.calls.append(("collective_rpc", method, args))
        return [len(args[0])]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.__version__ = FakeLLM, FakeSamplingParams, "0.33.0"
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances.clear()
    return module


def request(rid="q", prompt=(5, 6, 7), **sampling) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**{"max_new_tokens": 4, **sampling}))


# --------------------------------------------------------------------------------- translation
def test_sampling_params_ask_for_the_sampled_tokens_logprob_and_our_stops_only():
    params = SamplingParams(temperature=0.7, max_new_tokens=9, stop_token_ids=(3, 151645), n=4, seed=11)
    kwargs = sampling_kwargs(params, seed=13, mode="processed_logprobs")
    assert kwargs == {"n": 1, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 9, "logprobs": 0,
                      "stop_token_ids": [3, 151645], "ignore_eos": True, "detokenize": False,
                      "skip_special_tokens": False, "seed": 13}
    assert "seed" not in sampling_kwargs(SamplingParams(), seed=None, mode="processed_logprobs")
    assert sampling_kwargs(SamplingParams(top_k=20, top_p=0.9), seed=None, mode="raw_logprobs")["top_k"] == 20


def test_settings_whose_reported_logprobs_differ_from_the_trainers_are_refused():
    # processed log-probs are taken after top-k/top-p masking: exact only without filters
    for filtered in (SamplingParams(top_p=0.95), SamplingParams(top_k=50)):
        with pytest.raises(ValueError, match="rollout.top_k=0 and rollout.top_p=1.0"):
            sampling_kwargs(filtered, seed=0, mode="processed_logprobs")
    # raw log-probs are taken before temperature: exact only at T = 1
    with pytest.raises(ValueError, match="rollout.temperature=0.7"):
        sampling_kwargs(SamplingParams(temperature=0.7), seed=0, mode="raw_logprobs")


def test_each_response_is_its_own_request_with_seed_plus_index():
    rows = expand([request("a", n=3, seed=100), request("b", n=1, seed=None)])
    assert [(r.request.request_id, r.index, r.seed) for r in rows] == [("a", 0, 100), ("a", 1, 101), ("a", 2, 102),
                                                                       ("b", 0, None)]


def test_engine_arguments():
    cfg = VLLMConfig(model_path="/m", max_model_len=4096, engine_args={"enforce_eager": True, "kv_cache_dtype": "fp8"})
    kwargs = cfg.llm_kwargs()
    assert kwargs["enable_return_routed_experts"] is True and kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["skip_tokenizer_init"] is True and kwargs["max_model_len"] == 4096
    assert kwargs["worker_extension_cls"] == "bpo_megatron.rollout.vllm.engine.WeightLoadingExtension"
    assert kwargs["enforce_eager"] is True and kwargs["kv_cache_dtype"] == "fp8"  # engine_args win
    assert "enable_return_routed_experts" not in VLLMConfig(model_path="/m", capture_routed_experts=False).llm_kwargs()
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMConfig(model_path="/m", logprobs_mode="processed_logits")


# ------------------------------------------------------------------------------------ decoding
def _decode(row, output, capture=True):
    return decode_output(row, output, routing=RoutingLayout(2, (0, 1), 2, 4) if capture else None)


def test_decoding_a_completion():
    row = ResponseSlot(request(stop_token_ids=(9,)), 1)
    sample = _decode(row, RequestOutput([5, 6, 7], [completion(3, [4, 8, 1, 2])]))
    assert (sample.request_id, sample.index, sample.finish_reason) == ("q", 1, "length")
    assert sample.tokens.tolist() == [5, 6, 7, 4, 8, 1, 2]
    assert torch.equal(sample.rollout_logprobs, torch.tensor([-0.25, -0.5, -0.75, -1.0]))
    assert sample.routed_experts.dtype == torch.uint8 and sample.routed_experts.shape == (6, 2, 2)
    sample.check(num_moe_layers=2, topk=2)


def test_the_samplers_top_k_is_asked_for_and_decoded_by_rank():
    """logprobs=k returns, per position, the k most likely tokens (ranks 1 … k) and the sampled
    token's entry when it is not among them: the head is the ranked ones, in rank order."""
    assert sampling_kwargs(SamplingParams(top_logprobs=3), seed=None, mode="processed_logprobs")["logprobs"] == 3
    row = ResponseSlot(request(top_logprobs=3), 0)
    positions = [{4: Logprob(-2.0, rank=5), 11: Logprob(-0.5, rank=1), 12: Logprob(-1.0, rank=2), 13: Logprob(-1.5, rank=3)},
                 {13: Logprob(-0.2, rank=2), 8: Logprob(-0.1, rank=1), 14: Logprob(-3.0, rank=3)}]
    out = CompletionOutput(0, [4, 8], positions, None, "length")
    sample = _decode(row, RequestOutput([5, 6, 7], [out]), capture=False)
    assert sample.sampler_head_ids.dtype == torch.int32
    assert sample.sampler_head_ids.tolist() == [[11, 12, 13], [8, 13, 14]]
    assert torch.equal(sample.sampler_head_logprobs, torch.tensor([[-0.5, -1.0, -1.5], [-0.1, -0.2, -3.0]]))
    sample.check()
    positions[1].pop(14)  # fewer than asked
    with pytest.raises(ProtocolError, match="the 3 most likely tokens asked"):
        _decode(row, RequestOutput([5, 6, 7], [CompletionOutput(0, [4, 8], positions, None, "length")]), capture=False)


def test_a_stop_token_is_kept_and_is_a_stop_even_on_the_last_allowed_step():
    row = ResponseSlot(request(stop_token_ids=(9,)), 0)
    stopped = _decode(row, RequestOutput([5, 6, 7], [completion(3, [4, 9], finish="stop")]))
    assert stopped.response_tokens.tolist() == [4, 9] and stopped.finish_reason == "stop"
    # vLLM tests the length cap first and says "length"; the other engines say "stop"
    capped = _decode(row, RequestOutput([5, 6, 7], [completion(3, [4, 1, 2, 9], finish="length")]))
    assert capped.finish_reason == "stop"


def test_a_routing_row_for_the_last_token_is_dropped():
    sample = _decode(ResponseSlot(request(), 0), RequestOutput([5, 6, 7], [completion(3, [4, 8], extra_row=True)]))
    assert sample.routed_experts.shape == (4, 2, 2)


@pytest.mark.parametrize("case, message", [
    ("no routing", "enable_return_routed_experts"),
    ("short routing", r"routed_experts has shape \(3, 2, 2\)"),
    ("other top-k", r"routed_experts: shape \(4, 2, 3\)"),
    ("missing logprob", "no log-prob for the sampled token 8"),
    ("no logprobs", "0 log-prob positions for 2 tokens"),
    ("two completions", "2 completions"),
    ("other prompt", "another prompt"),
])
def test_malformed_outputs_are_refused(case, message):
    out = completion(3, [4, 8])
    prompt = [5, 6, 7]
    outputs = [out]
    if case == "no routing":
        out.routed_experts = None
    elif case == "short routing":
        out.routed_experts = out.routed_experts[:3]
    elif case == "other top-k":
        out.routed_experts = np.zeros((4, 2, 3), dtype=np.uint8)
    elif case == "missing logprob":
        out.logprobs[1] = {7: Logprob(-1.0)}
    elif case == "no logprobs":
        out.logprobs = None
    elif case == "two completions":
        outputs = [out, out]
    elif case == "other prompt":
        prompt = [5, 6]
    with pytest.raises(ProtocolError, match=message):
        _decode(ResponseSlot(request(), 0), RequestOutput(prompt, outputs))


def test_without_capture_routing_is_not_read():
    out = completion(3, [4, 8])
    out.routed_experts = None
    assert _decode(ResponseSlot(request(), 0), RequestOutput([5, 6, 7], [out]), capture=False).routed_experts is None


# ------------------------------------------------------------------- the engine over a stand-in
def test_engine_generates_through_vllm_llm(fake_vllm):
    # built as the engine workers build it: from its spec, with the model's routing layout
    context = EngineContext(str(MOE_DIR), 0, RoutingLayout.of(HFModelConfig.load(MOE_DIR)))
    engine = engine_spec("vllm").build(VLLMOptions(), context)
    assert isinstance(engine, VLLMEngine) and engine.capabilities.captures_routing
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["model"] == str(MOE_DIR) and llm.kwargs["enable_return_routed_experts"] is True
    requests = [request("a", prompt=(1, 2), n=2, seed=7), request("b", prompt=(3, 4, 5, 6), n=1, seed=9)]
    samples = engine.generate(requests)
    assert [(s.request_id, s.index) for s in samples] == [("a", 0), ("a", 1), ("b", 0)]
    _, prompts, params = llm.calls[-1]
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2], [1, 2], [3, 4, 5, 6]]
    assert [p.kwargs["seed"] for p in params] == [7, 8, 9]
    assert not torch.equal(samples[0].response_tokens, samples[1].response_tokens)
    for sample in samples:
        sample.check(num_moe_layers=2, topk=2)

    engine.begin_weight_update(2)
    with pytest.raises(RuntimeError, match="weight update"):
        engine.generate(requests)
    weights = [(f"w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    engine.cfg = VLLMConfig(model_path=str(MOE_DIR), weight_bucket_bytes=2048)
    assert engine.update_weights(iter(weights)) == 5 * 1024
    rpcs = [c for c in llm.calls if c[0] == "collective_rpc"]
    assert [c[1] for c in rpcs] == [LOAD_WEIGHTS_RPC] * 3
    assert [[n for n, _ in c[2][0]] for c in rpcs] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    engine.end_weight_update()
    assert llm.calls[-1] == ("reset_prefix_cache",), "no KV of the old weights may be reused"
    assert engine.health().detail == "ready" and engine.weight_version == 2
    with pytest.raises(NotImplementedError, match="weight_sync.verify"):
        engine.named_hf_weights()
    engine.shutdown()
    assert not engine.health().healthy
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(requests)


def test_filtered_sampling_is_refused_before_anything_is_generated(fake_vllm):
    engine = VLLMEngine(str(MOE_DIR), capture_routing=True)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([request("ok"), request("filtered", top_p=0.9)])
    assert not [c for c in FakeLLM.instances[-1].calls if c[0] == "generate"]


def test_a_dense_model_captures_nothing(fake_vllm):
    engine = VLLMEngine(str(DENSE_DIR), capture_routing=True)
    assert not engine.capabilities.captures_routing
    assert "enable_return_routed_experts" not in FakeLLM.instances[-1].kwargs


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"bpo-megatron\[vllm\]"):
        VLLMEngine(str(MOE_DIR), capture_routing=False)


@pytest.mark.parametrize("version", ["0.21.0", "0.20.2", "0.34.0", "0.10.1"])
def test_a_vllm_outside_the_supported_releases_is_refused_naming_them(fake_vllm, version):
    fake_vllm.__version__ = version
    with pytest.raises(ImportError, match=rf"vLLM {version} is installed; .*0\.22 ≤ vLLM < 0\.34"):
        VLLMEngine(str(MOE_DIR), capture_routing=False)
    assert not FakeLLM.instances  # refused before vLLM builds anything


# --------------------------------------------------------------------------- real vLLM (optional)
def test_real_vllm_logprobs_equal_a_teacher_forced_recompute(tiny_checkpoint):
    """Where vLLM is installed: log μ against transformers; routing too on GPUs (R3 needs them)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM


    model_dir = tiny_checkpoint(MOE_DIR)
    capture = torch.cuda.is_available()
    engine = VLLMEngine(str(model_dir), capture_routing=capture, dtype="float32", enforce_eager=True,
                        max_model_len=256, gpu_memory_utilization=0.3)
    samples = engine.generate([request("r", prompt=(5, 9, 2, 77), n=3, max_new_tokens=12, temperature=0.7, seed=1)])
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for sample in samples:
        with torch.inference_mode():
            logits = model(input_ids=sample.tokens[None, :-1]).logits[0].float()
        recomputed = torch.log_softmax(logits / 0.7, -1)[3:].gather(1, sample.response_tokens[:, None])[:, 0]
        assert (recomputed - sample.rollout_logprobs).abs().max() < 1e-3
        if capture:
            sample.check(num_moe_layers=2, topk=2)
    engine.shutdown()
