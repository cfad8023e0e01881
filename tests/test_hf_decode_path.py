"""The embedded engine's decode loop (fixed per-row KV slots, a functional step with sampling and
bookkeeping on the device, slots refilled from the queue) against independent references: a
teacher-forced transformers forward (log μ and routed experts, fp32), the tokens a seed must give
(each row's uniforms redrawn from its seed and inverted against the recomputed distribution in
fp64), transformers' own expert loop; and what a captured CUDA graph needs of it: it owns what it
reads, it is captured once per shape and reused, its replay changes no number."""

from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bpo_megatron.models import HFModelConfig
from bpo_megatron.rollout import GenerationRequest, SamplingParams
from bpo_megatron.rollout.hf import graphs
from bpo_megatron.rollout.hf.decode import grouped_experts, resolve_path
from bpo_megatron.rollout.hf.engine import HFEngine
from bpo_megatron.rollout.hf.options import HFEngineOptions
from bpo_megatron.rollout.hf.sampling import UNIFORM_BLOCK, row_seeds
from bpo_megatron.rollout.hf.slots import DecodeState, SlotRow, SlotSession, SlotSettings, StateShape
from bpo_megatron.testing import MODEL_CONFIGS
from bpo_megatron.testing.recompute import teacher_forced

TOLERANCE = 1e-5  # fp32 log μ: slot attention and grouped experts sum in another order

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("tiny_qwen3_moe")


@pytest.fixture(scope="module")
def dense_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("tiny_qwen3")


@pytest.fixture(scope="module")
def deepseek_dir(tiny_checkpoint) -> Path:
    """Latent attention: the slot cache holds the latent and the shared rotated key, not K and V."""
    return tiny_checkpoint("tiny_deepseek_v3")


def _requests(vocab: int, **sampling) -> list[GenerationRequest]:
    """Prompts of mixed lengths (1 … 30) and mixed response budgets, so rows finish at different
    steps and slots are refilled while others decode; budgets past UNIFORM_BLOCK cross a block."""
    generator = torch.Generator().manual_seed(1)
    requests = []
    for i, (length, budget) in enumerate(((3, 24), (17, 9), (1, 70), (30, 24), (9, 5))):
        prompt = tuple(torch.randint(0, vocab, (length,), generator=generator).tolist())
        params = {**dict(temperature=0.7, top_p=0.9, top_k=40, n=3, max_new_tokens=budget, seed=100 + i), **sampling}
        requests.append(GenerationRequest(f"q{i}", prompt, SamplingParams(**params)))
    return requests


def _reference_tokens(logprobs: torch.Tensor, params: SamplingParams, seed: int, filtered: bool) -> torch.Tensor:
    """The tokens a row's seed must give against recomputed log μ ``[T, V]``: uniform t of the
    row's stream (blocks of UNIFORM_BLOCK drawn in order from its generator) inverted, in fp64,
    against softmax(logits / T) — after top-k then top-p, in descending order, when ``filtered``."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-logprobs.shape[0] // UNIFORM_BLOCK)
    uniforms = torch.cat([torch.rand(UNIFORM_BLOCK, generator=generator) for _ in range(blocks)]).double()
    tokens = []
    for t, row in enumerate(logprobs.double()):
        probs, order = row.exp(), torch.arange(row.numel())
        if filtered:
            probs, order = probs.sort(descending=True)
            if params.top_k > 0:
                probs = torch.where(torch.arange(probs.numel()) < params.top_k, probs, 0.0)
            before = probs.cumsum(0) - probs
            probs = torch.where(before < params.top_p * probs.sum(), probs, 0.0)
        cdf = probs.cumsum(0)
        tokens.append(int(order[int((cdf > uniforms[t] * cdf[-1]).nonzero()[0])]))
    return torch.tensor(tokens)


def _check_against_recompute(engine: HFEngine, requests, samples, temperature: float, *, moe: bool,
                             stops=()) -> float:
    """Every sample against a teacher-forced recompute: routing equal, the seed's tokens; returns
    the worst |log μ − recomputed|."""
    filtered = any(r.sampling.top_k > 0 or r.sampling.top_p < 1.0 for r in requests)
    by_id = {r.request_id: r for r in requests}
    worst = 0.0
    for sample in samples:
        request = by_id[sample.request_id]
        prompt = sample.prompt_tokens.numel()
        logprobs, routing = teacher_forced(engine.model, sample.tokens, temperature=temperature)
        response = logprobs[prompt - 1:]
        worst = max(worst, (response.gather(1, sample.response_tokens[:, None])[:, 0]
                            - sample.rollout_logprobs).abs().max().item())
        seed = row_seeds(request.sampling.seed, request.sampling.n)[sample.index]
        expected = _reference_tokens(response, request.sampling, seed, filtered)
        assert torch.equal(sample.response_tokens, expected), (sample.request_id, sample.index)
        assert sample.response_tokens.numel() <= request.sampling.max_new_tokens
        if stops:
            assert sample.finish_reason == ("stop" if sample.response_tokens[-1].item() in stops else "length")
        if moe and sample.routed_experts is not None:  # R3: every processed token's experts, as recomputed
            assert torch.equal(sample.routed_experts, routing.to(sample.routed_experts.dtype)), sample.request_id
    return worst


def _same_samples(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.request_id, x.index, x.finish_reason) == (y.request_id, y.index, y.finish_reason)
        assert torch.equal(x.response_tokens, y.response_tokens), x.request_id
        assert torch.equal(x.token_versions, y.token_versions)
        assert torch.allclose(x.rollout_logprobs, y.rollout_logprobs, atol=2 * TOLERANCE, rtol=0)
        assert (x.routed_experts is None) == (y.routed_experts is None)
        if x.routed_experts is not None:
            assert torch.equal(x.routed_experts, y.routed_experts), x.request_id


@pytest.mark.parametrize("kind", ["moe", "dense", "deepseek"])
def test_the_decode_loop_equals_a_teacher_forced_recompute_and_the_seeds_draws(kind, request):
    path = request.getfixturevalue(f"{kind}_dir")
    hf = HFModelConfig.load(path)
    # 4 slots for 15 rows, the host looking every 3 steps: rows enter and leave mid-decode
    engine = HFEngine(path, capture_routing=True, max_batch_rows=4, refill_every=3)
    assert engine.decode_path == "eager"
    stops = tuple(range(0, hf.vocab_size, 10))  # ~10% of the tokens: some rows stop, some run out
    requests = _requests(hf.vocab_size, stop_token_ids=stops)
    samples = engine.generate(requests)

    assert [(s.request_id, s.index) for s in samples] == [(r.request_id, i) for r in requests for i in range(3)]
    for sample in samples:
        sample.check(num_moe_layers=len(hf.moe_layers) or None, topk=hf.num_experts_per_tok or None)
        assert (sample.routed_experts is None) == (kind == "dense")
    worst = _check_against_recompute(engine, requests, samples, 0.7, moe=kind != "dense", stops=stops)
    assert worst <= TOLERANCE, worst
    assert {s.finish_reason for s in samples} == {"stop", "length"}


@pytest.mark.parametrize("sampling", [dict(top_k=1), dict(temperature=1.0, top_p=1.0, top_k=0)],
                         ids=["greedy", "unfiltered"])
def test_outputs_depend_on_neither_the_slots_nor_the_refill_interval(sampling, moe_dir):
    requests = _requests(200, **sampling)
    runs = [HFEngine(moe_dir, capture_routing=True, max_batch_rows=slots, refill_every=refill).generate(requests)
            for slots, refill in ((15, 8), (2, 1), (4, 64))]
    for other in runs[1:]:
        _same_samples(other, runs[0])
    engine = HFEngine(moe_dir, capture_routing=True)
    temperature = requests[0].sampling.temperature
    assert _check_against_recompute(engine, requests, runs[0], temperature, moe=True) <= TOLERANCE
    if sampling == dict(top_k=1):  # greedy: each token is the recompute's argmax
        for sample in runs[0]:
            logprobs, _ = teacher_forced(engine.model, sample.tokens, temperature=0.7)
            assert torch.equal(logprobs[sample.prompt_tokens.numel() - 1:].argmax(-1), sample.response_tokens)


def test_only_the_requests_that_ask_record_routing_and_weight_updates_are_seen(moe_dir, tiny_checkpoint):
    engine = HFEngine(moe_dir, capture_routing=True, max_batch_rows=3, refill_every=2)
    requests = [GenerationRequest(r.request_id, r.prompt_tokens, r.sampling, capture_routing=i % 2 == 0)
                for i, r in enumerate(_requests(200))]
    samples = engine.generate(requests)
    assert [s.routed_experts is not None for s in samples] == [i % 2 == 0 for i in range(5) for _ in range(3)]
    assert _check_against_recompute(engine, requests, samples, 0.7, moe=True) <= TOLERANCE

    # an in-place weight update reaches the functional step (it reads the model's own modules),
    # and the decode state kept from the first generation is reused with the new weights
    other = tiny_checkpoint("tiny_qwen3_moe", seed=1)
    engine.update_weights(load_file(other / "model.safetensors").items())
    _same_samples(engine.generate(requests),
                  HFEngine(other, capture_routing=True, max_batch_rows=3, refill_every=2).generate(requests))
    assert len(engine._states) == 1


@pytest.mark.parametrize("session", [True, False], ids=["weight_update_session", "update_weights_alone"])
def test_the_stacked_qkv_follows_every_weight_update_in_place(moe_dir, tiny_checkpoint, monkeypatch, session):
    """The decode step's one QKV GEMM (rollout/hf/fused_qkv.py) reads a copy of the projections'
    weights: after an update through the engine (in a weight-update session, or update_weights
    alone), a state captured before it — the graph path, capture faked on a CPU — decodes with the
    new weights (teacher-forced recompute of the updated model, the seeds' tokens), its copy
    refreshed in the same storage (what a real graph's kernels read) and no new state built."""
    with _cpu_graph_capture(monkeypatch):
        engine = HFEngine(moe_dir, capture_routing=True, max_batch_rows=4, refill_every=3)
        engine._decode_path = "cuda_graph"  # what a GPU resolves: the step captured (faked) and replayed
        holders = [layer.self_attn.fused_qkv for layer in engine.model.model.layers]
        assert holders and all(h.norm_weight is not None for h in holders)  # Qwen3-MoE: q/k norms stacked too
        engine.generate(_requests(200))
        [state] = engine.decode_states()
        assert isinstance(state._replay, graphs.GraphedStep)
        addresses = [(h.weight.data_ptr(), h.norm_weight.data_ptr()) for h in holders]
        other = tiny_checkpoint("tiny_qwen3_moe", seed=1)
        if session:
            engine.begin_weight_update(1)
        engine.update_weights(load_file(other / "model.safetensors").items())
        if session:
            engine.end_weight_update()
        attn = engine.model.model.layers[0].self_attn
        assert torch.equal(holders[0].weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        assert [(h.weight.data_ptr(), h.norm_weight.data_ptr()) for h in holders] == addresses
        requests = _requests(200)
        samples = engine.generate(requests)
        assert engine.decode_states() == [state]
        assert _check_against_recompute(engine, requests, samples, 0.7, moe=True) <= TOLERANCE


def test_decode_states_are_kept_per_shape_bucket_and_dropped_with_the_memory(moe_dir):
    """A state (KV slots, buffers, graph) is built once per shape bucket and reused: a second
    generation of similar shape, or a shorter one, takes the same object and gives what a fresh
    engine gives (nothing of the previous rows' cache or buffers leaks); at most two states are
    kept; release_memory drops them."""
    engine = HFEngine(moe_dir, capture_routing=True, max_batch_rows=8, refill_every=4)
    first, second = _requests(200), _requests(200, seed=9, max_new_tokens=60)
    engine.generate(first)
    [state] = engine._states._states.values()
    samples = engine.generate(second)  # 30 + 60 (+ 4) falls in the bucket of 1 + 70 (+ 4): 128
    assert list(engine._states._states.values()) == [state]
    _same_samples(samples, HFEngine(moe_dir, capture_routing=True, max_batch_rows=8, refill_every=4).generate(second))
    engine.generate([GenerationRequest("x", (1, 2), SamplingParams(max_new_tokens=200, seed=0))])  # 1 slot, 256
    [(_, long)] = [(k, s) for k, s in engine._states._states.items() if s is not state]
    short = [GenerationRequest("y", (1, 2), SamplingParams(max_new_tokens=3, seed=0))]
    samples = engine.generate(short)  # needs 64 positions: served by the kept 256 state
    assert len(engine._states) == 2 and long in engine._states._states.values()
    _same_samples(samples, HFEngine(moe_dir, capture_routing=True, max_batch_rows=8, refill_every=4).generate(short))
    engine.generate([GenerationRequest(f"z{i}", (1, 2), SamplingParams(max_new_tokens=3, seed=0)) for i in range(2)])
    assert len(engine._states) == 2 and state not in engine._states._states.values()  # the least recent went
    engine.release_memory()
    assert len(engine._states) == 0
    assert StateShape.of([SlotRow((1,) * 30, SamplingParams(max_new_tokens=100, stop_token_ids=(1, 2, 3, 4, 5)), 0,
                                  False)], SlotSettings(8, 4, "sdpa", False), capture=False) == \
        StateShape(slots=1, length=256, routing=False, filtered=False, stop_width=8)


@contextlib.contextmanager
def _cpu_graph_capture(monkeypatch):
    """torch.cuda's stream and graph API on a CPU: a replay runs the captured step again, which is
    what a graph does provided the step reads only tensors it owns. Like a real graph, the fake
    holds no Python reference to the step (a weak one: a replay after the step was freed fails,
    where a GPU would read freed memory). Lets the graph path's construction, ownership and
    warm-up run without a GPU; yields the weak references to the steps captured."""
    captured: list = []

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    class Graph:
        def replay(self) -> None:
            step = self.step()
            assert step is not None, "replayed a graph whose step (and what it reads) was freed"
            step()

    @contextlib.contextmanager
    def capture_into(graph):
        yield

    cuda = graphs.torch.cuda
    monkeypatch.setattr(cuda, "Stream", Stream)
    monkeypatch.setattr(cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "graph", capture_into)
    original = graphs.GraphedStep.__init__

    def recording_init(self, step):
        ref = weakref.WeakMethod(step) if hasattr(step, "__self__") else weakref.ref(step)
        captured.append(ref)
        original(self, step)
        self._graph.step = ref

    monkeypatch.setattr(graphs.GraphedStep, "__init__", recording_init)
    yield captured


def test_a_captured_step_keeps_alive_everything_it_reads(monkeypatch):
    """The graph replays raw addresses: whatever the step closure reaches must live as long as the
    graph, even when nothing else holds it (a decoder built inside a constructor, say)."""
    class Decoder:
        def __init__(self) -> None:
            self.table = torch.arange(4.0)

        def __call__(self) -> torch.Tensor:
            return self.table * 2

    def build() -> tuple[weakref.ref, graphs.GraphedStep]:  # as a constructor builds its step's decoder
        decoder = Decoder()
        return weakref.ref(decoder), graphs.GraphedStep(lambda: decoder())

    with _cpu_graph_capture(monkeypatch):
        alive, step = build()
        gc.collect()
        assert alive() is not None, "the graph's step must keep what its kernels read"
        assert torch.equal(step(), torch.arange(4.0) * 2)
        del step
        gc.collect()
        assert alive() is None


def test_the_graph_path_owns_its_state_and_replays_it_as_the_eager_step(moe_dir, monkeypatch):
    """The engine's graph path on a CPU (capture faked as above): the decode state — decoder,
    cache, sampler — outlives its constructor through the graph alone, the warm-up steps leave no
    trace, and replaying the captured step (no argument: every input read from the state's own
    tensors) gives what the eager step gives."""
    engine = HFEngine(moe_dir, capture_routing=True)
    rows = [SlotRow(r.prompt_tokens, r.sampling, seed, True) for r in _requests(200) for seed in (1, 2, 3)]
    settings = SlotSettings(slots=4, refill_every=3, attention="sdpa", cuda_graph=False)
    shape = StateShape.of(rows, settings, capture=True)

    def run(state: DecodeState):
        with torch.inference_mode():
            return SlotSession(engine.model, rows, settings, state, engine._capture,
                               lambda forward: forward(0)).run()

    eager = run(DecodeState(engine.model, shape, "sdpa", cuda_graph=False))
    with _cpu_graph_capture(monkeypatch) as captured:
        with torch.inference_mode():
            state = DecodeState(engine.model, shape, "sdpa", cuda_graph=True)
        owned = [weakref.ref(state.decoder), weakref.ref(state.cache), weakref.ref(state.sampler)]
        graph = state._replay
        del state
        gc.collect()
        assert all(ref() is not None for ref in owned), "the graph alone must keep its state alive"
        state = captured[-1]().__self__
        assert state._replay is graph
        graphed = run(state)
    for a, b in zip(eager, graphed, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.routing, b.routing)

    # the state and its graph refer to each other: handing the memory back must still free them
    engine._states._states["graphed"] = state
    del state, graph
    engine.release_memory()
    assert all(ref() is None for ref in owned)


@pytest.mark.parametrize("kind", ["moe", "deepseek"])
def test_compiled_layers_give_the_eager_steps_tokens_and_log_mu(kind, request):
    """rollout.hf.compile: each decoder layer through torch.compile (the experts' GEMMs opaque
    ops in it) — one compiled graph serves every layer, and the outputs are the eager step's: the
    same tokens and routing, log μ within summation-order error; a second generation compiles
    nothing more."""
    import torch._dynamo.utils as dynamo_utils

    moe_dir = request.getfixturevalue(f"{kind}_dir")
    requests = [GenerationRequest(f"q{i}", tuple(range(1, 3 + i)), SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, n=2, max_new_tokens=12, seed=i)) for i in range(4)]
    eager = HFEngine(moe_dir, capture_routing=True, max_batch_rows=4, refill_every=3).generate(requests)
    torch._dynamo.reset()
    earlier = dynamo_utils.counters["stats"]["unique_graphs"]  # the process's count (other tests compile too)
    engine = HFEngine(moe_dir, capture_routing=True, max_batch_rows=4, refill_every=3, compile_layers=True)
    compiled = engine.generate(requests)
    graphs_compiled = dynamo_utils.counters["stats"]["unique_graphs"] - earlier
    # one graph for every MoE layer, the experts' grouped GEMMs opaque ops inside it (no graph break);
    # DeepSeek-V3's dense first layer is a second graph
    assert graphs_compiled == {"moe": 1, "deepseek": 2}[kind]
    _same_samples(compiled, eager)
    _same_samples(engine.generate(requests), eager)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - earlier == graphs_compiled


def test_grouped_experts_equal_transformers_expert_loop(moe_dir):
    """The step's expert GEMMs against the model's own experts module, on tokens routed so that
    one expert gets no token (an empty group) and others several."""
    engine = HFEngine(moe_dir, capture_routing=False)
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
    for removed in ("transformers", "static"):  # the loops the engine no longer has: named with their successor
        with pytest.raises(ValueError, match=f"decode='{removed}' is gone.*one decode loop.*rollout.hf.decode=eager"):
            HFEngineOptions(decode=removed)
    for bad in (0, UNIFORM_BLOCK + 1):
        with pytest.raises(ValueError, match="refill_every must be between 1 and 64"):
            HFEngineOptions(refill_every=bad)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_path("auto", cpu, torch.float32) == "eager"
    assert resolve_path("auto", cuda, torch.float32) == "eager"
    assert resolve_path("auto", cuda, torch.bfloat16) == "cuda_graph"
    assert resolve_path("eager", cpu, torch.bfloat16) == "eager"
    assert resolve_path("eager", cuda, torch.float32) == "eager"
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        HFEngine(moe_dir, capture_routing=False, decode="cuda_graph")


def test_a_model_the_loop_does_not_decode_is_refused(tmp_path):
    import json

    config = json.loads((MODEL_CONFIGS / "tiny_qwen3" / "config.json").read_text())
    with pytest.raises(ValueError, match="sliding-window.*rollout.engine=sglang"):
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**config, "use_sliding_window": True}))
        HFEngine(model, capture_routing=False)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and FlashAttention need a GPU")


def _graph_and_eager(moe_dir, attention: str, scribble: bool):
    engine = HFEngine(moe_dir, capture_routing=True, dtype=torch.bfloat16, device="cuda", decode="eager")
    # the sampler's top-4 recorded too (score centering's input): written inside the graph as well
    rows = [SlotRow(r.prompt_tokens, r.sampling, seed, True) for r in _requests(200, top_logprobs=4)
            for seed in (1, 2, 3)]
    settings = SlotSettings(slots=4, refill_every=3, attention=attention, cuda_graph=False)
    shape = StateShape.of(rows, settings, capture=True)

    def run(cuda_graph: bool):
        with torch.inference_mode():
            state = DecodeState(engine.model, shape, attention, cuda_graph)
            if scribble:  # what a freed tensor's memory holds when something else reuses it
                junk = [torch.full((1 << 20,), 7e4, device="cuda") for _ in range(64)]
                del junk
            return SlotSession(engine.model, rows, settings, state, engine._capture, lambda forward: forward(0)).run()

    return run(False), run(True)


@cuda_only
@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_graph_replay_changes_no_number_on_cuda(moe_dir, attention):
    """The same step eager and replayed as a CUDA graph, with the memory freed after capture
    scribbled over before the first replay: capture must change nothing, so tokens, log μ, routing
    and the sampler's top-k are bit for bit the same."""
    for eager, graphed in zip(*_graph_and_eager(moe_dir, attention, scribble=True), strict=True):
        assert torch.equal(eager.tokens, graphed.tokens)
        assert torch.equal(eager.logprobs, graphed.logprobs)
        assert torch.equal(eager.routing, graphed.routing)
        assert eager.head_ids.shape == (eager.tokens.numel(), 4)
        assert torch.equal(eager.head_ids, graphed.head_ids) and torch.equal(eager.head_logprobs, graphed.head_logprobs)


@cuda_only
def test_cuda_graph_path_against_a_teacher_forced_recompute_on_cuda(moe_dir):
    """auto = cuda_graph on a GPU in bf16 (FlashAttention varlen, graphs kept per shape): log μ and
    routing against transformers' own bf16 forward over each whole sequence. bf16 kernels sum
    differently, so log μ agrees to bf16 precision and a near-tied router may flip."""
    engine = HFEngine(moe_dir, capture_routing=True, dtype=torch.bfloat16, device="cuda", max_batch_rows=4,
                      refill_every=3)
    assert engine.decode_path == "cuda_graph"
    samples = engine.generate(_requests(200))
    again = engine.generate(_requests(200))  # the kept graph, replayed for another generation
    _same_samples(again, samples)
    gaps, same = [], []
    for sample in samples:
        logprobs, routing = teacher_forced(engine.model, sample.tokens.cuda(), temperature=0.7)
        response = logprobs[sample.prompt_tokens.numel() - 1:].gather(1, sample.response_tokens.cuda()[:, None])[:, 0]
        gaps.append((response.cpu() - sample.rollout_logprobs).abs())
        same.append((routing.sort(-1).values.cpu().to(torch.uint8) == sample.routed_experts.sort(-1).values).all(-1))
    gaps, same = torch.cat(gaps), torch.cat([s.flatten() for s in same])
    assert float(gaps.mean()) <= 0.05, float(gaps.mean())
    assert float(same.float().mean()) >= 0.99, float(same.float().mean())
