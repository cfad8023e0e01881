"""The fused sampler (``bpo_megatron/rollout/hf/fused_sampling.py``) against the torch sampler it
replaces on a GPU (``sampling.draw``): the same token for the same uniform and the same log μ, on
bf16 and fp16 logits, unfiltered and filtered (top-k, top-p, both, neither; settings mixed per row),
with ties (equal logits, and distinct logits whose log-probabilities round to the same value) and
with uniforms placed at and beside the boundaries between two tokens.

"The same token" means: exactly the reference's token wherever the uniform's target lies farther
from a boundary between two tokens than floating-point summation order can move it (the kernels sum
the same probabilities in another order: blocks, a parallel cumulative sum); at a boundary itself,
one of the two tokens it separates — as the reference's own token may be. The same holds for the
top-p threshold: where top_p · c_k equals a prefix's mass up to rounding (exactly tied
probabilities with top_k · top_p an integer: 20 tokens at 0.8 keep 16 or 17), rounding decides
whether one more token stays, in torch's sampler as in the kernel; the tied cases below avoid such
ratios. log μ within 1e-5 (fp32, another order of the same sum). Ties break by token id in both.

Triton's interpreter runs the kernels on CPU tensors in a child process (``TRITON_INTERPRET=1``,
as tests/test_fused_logprobs.py does); the references are computed here. Compiling the kernels for
a Hopper GPU is checked too (no GPU needed: triton compiles to a cubin offline); their speed is the
GPU kit's (``rollout_decode``). Needs triton importable (``.ci/run`` puts ``.megatron-newest`` on
``PYTHONPATH``); without triton these tests skip.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bpo_megatron.rollout.hf.sampling import CODES, draw
from bpo_megatron.testing.triton_interpreter import interpreted_results

VOCAB = 3001  # not a multiple of any block
# (top_k, top_p, temperature) per row: every filter alone, both, neither, k past the vocabulary, k = 1
MIXED = [(0, 1.0, 1.0), (5, 1.0, 0.7), (0, 0.9, 1.0), (20, 0.83, 1.3), (1, 1.0, 1.0), (VOCAB + 10, 0.5, 2.0),
         (0, 0.05, 1.0), (300, 0.987, 0.6), (2, 0.3, 1.0), (0, 1.0, 0.5)]
SMALL_LAUNCH = dict(block=16, chunk=32)  # several blocks and histogram chunks on a small row


def _settings(rows: list[tuple[int, float, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    top_k = torch.tensor([r[0] for r in rows])
    top_p = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    temperature = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    return temperature, top_k, top_p


def _spread_logits(rows: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """~N(0, 2²), as the kit's model's: many tokens share a 16-bit value."""
    return (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def _tied_logits(rows: int) -> torch.Tensor:
    """Integers −4 … 3: hundreds of tokens per value, so every cut and draw lands inside a tie."""
    return torch.randint(-4, 4, (rows, VOCAB), generator=torch.Generator().manual_seed(1)).bfloat16()


def _collapsed_logits() -> torch.Tensor:
    """Distinct 16-bit logits whose log-probabilities are equal in fp32: next to a largest logit of
    1.0, (z − 1) − log Σ rounds ±0 and |z| < 3e-8 to one value. They hold most of the mass here, so
    the draw lands among them and must order them by id, not by value."""
    row = torch.full((VOCAB,), -6.0)
    row[7] = 1.0
    tiny = torch.tensor([0.0, -0.0, 1e-9, -2e-9, 5e-10, 2.9e-8, -2.9e-8, 1e-12, -1e-12])
    positions = torch.randperm(VOCAB - 8, generator=torch.Generator().manual_seed(2))[:900] + 8
    row[positions] = tiny.repeat(100)[:900]
    return row[None].repeat(8, 1).bfloat16()


def _uniforms(rows: int, seed: int) -> torch.Tensor:
    return torch.rand(rows, generator=torch.Generator().manual_seed(seed))


def _boundary_uniforms(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       filtered: bool, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, a uniform whose target lies ``offset`` (a fraction of the smaller of the two tokens'
    probabilities) after the boundary between two consecutive tokens of the reference's order, both
    of probability ≥ 1e-4 (a uniform is fp32: it places a target to ~1e-7 of the total), and the two
    tokens: the one ending there and the one starting there."""
    uniforms, pairs = [], []
    for i in range(logits.shape[0]):
        logprobs = torch.log_softmax(logits[i].double() / float(temperature[i]), -1)
        order = logprobs.sort(descending=True, stable=True).indices if filtered else torch.arange(VOCAB)
        probs = logprobs[order].exp()
        if filtered:
            k = int(top_k[i]) if 0 < int(top_k[i]) < VOCAB else VOCAB
            probs[k:] = 0
            before = probs.cumsum(0) - probs
            probs = torch.where(before < float(top_p[i]) * probs.sum(), probs, 0.0)
        live = (probs > 0).nonzero()[:, 0]
        likely = [j for j in range(1, live.numel()) if live[j] == live[j - 1] + 1
                  and min(probs[live[j - 1]], probs[live[j]]) >= 1e-4]
        if not likely:  # one kept token (top_k = 1): any uniform draws it
            uniforms.append(0.5)
            pairs.append((int(order[live[0]]),) * 2)
            continue
        a, b = live[likely[len(likely) // 2] - 1], live[likely[len(likely) // 2]]
        boundary = probs[:b].sum()
        step = offset * min(probs[a], probs[b])
        uniforms.append(float((boundary + step) / probs.sum()))
        pairs.append((int(order[a]), int(order[b])))
    return torch.tensor(uniforms, dtype=torch.float32), torch.tensor(pairs)


def _cases() -> dict[str, dict]:
    """Inputs of every case (the child draws them with the kernels, this process with the reference)."""
    temperature, top_k, top_p = _settings(MIXED)
    rows = len(MIXED)
    spread = _spread_logits(rows)
    cases = {
        "spread": dict(logits=spread, uniforms=_uniforms(rows, 3)),
        "spread_fp16": dict(logits=_spread_logits(rows, torch.float16, seed=4), uniforms=_uniforms(rows, 5)),
        "ties": dict(logits=_tied_logits(rows), uniforms=_uniforms(rows, 6)),
        "ties_small_launch": dict(logits=_tied_logits(rows), uniforms=_uniforms(rows, 7), launch=SMALL_LAUNCH),
        "collapsed": dict(logits=_collapsed_logits(), uniforms=_uniforms(8, 8), settings=_settings(
            [(0, 1.0, 1.0), (0, 0.9, 1.0), (50, 1.0, 1.0), (400, 0.7, 1.0), (0, 1.0, 1.0), (5, 1.0, 1.0),
             (0, 0.5, 1.0), (1, 1.0, 1.0)])),
    }
    for case in list(cases.values()):
        case.setdefault("settings", (temperature, top_k, top_p))
    for filtered in (False, True):
        for offset in (0.1, -0.1, 0.0):  # beside the boundary on either side, and on it
            uniforms, pairs = _boundary_uniforms(spread.float(), temperature, top_k, top_p, filtered, offset)
            cases[f"boundary_{filtered}_{offset}"] = dict(logits=spread, uniforms=uniforms, pairs=pairs,
                                                          settings=(temperature, top_k, top_p), only=filtered)
    return cases


# ---- run in the interpreter's child process ----

def interpret_all(out: str) -> None:
    from bpo_megatron.rollout.hf import fused_sampling

    results = {}
    for name, case in _cases().items():
        temperature, top_k, top_p = case["settings"]
        logits, uniforms = case["logits"], case["uniforms"]
        rows = logits.shape[0]
        for filtered in (False, True):
            if case.get("only", filtered) != filtered:
                continue
            tokens = torch.full((rows,), -7, dtype=torch.long)
            logprobs = torch.full((rows,), float("nan"))
            counts = torch.zeros(rows + 2, CODES, dtype=torch.int32)  # rows past the batch stay untouched
            if filtered:
                fused_sampling.filtered_draw(logits, temperature, top_k, top_p, uniforms, counts, tokens, logprobs,
                                             **case.get("launch", {}))
            else:
                fused_sampling.plain_draw(logits, temperature, uniforms, tokens, logprobs,
                                          **{k: v for k, v in case.get("launch", {}).items() if k == "block"})
            results[(name, filtered)] = dict(tokens=tokens, logprobs=logprobs, counts_left=int(counts.abs().sum()))
    results["session"] = {fused: _session(fused) for fused in (False, True)}
    torch.save(results, out)


def _session(fused: bool) -> list:
    """A bf16 slot session (6 rows through 3 slots, refilled; top-k/top-p rows and plain ones) on the
    decode step captured as a graph (capture faked as in tests/test_hf_decode_path.py), sampled by
    the fused kernels or by torch."""
    import tempfile

    from test_hf_decode_path import _cpu_graph_capture

    from bpo_megatron.rollout import SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine
    from bpo_megatron.rollout.hf.slots import DecodeState, SlotRow, SlotSession, SlotSettings, StateShape
    from bpo_megatron.testing import MODEL_CONFIGS
    from bpo_megatron.testing.models import random_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
        path = random_checkpoint(MODEL_CONFIGS / "tiny_qwen3_moe", Path(tmp), seed=0)
        engine = HFEngine(path, capture_routing=True, dtype=torch.bfloat16)
        rows = [SlotRow(tuple(range(3, 3 + 2 * i)), SamplingParams(
            temperature=0.8, top_k=(0, 7, 0)[i % 3], top_p=(1.0, 1.0, 0.9)[i % 3], max_new_tokens=6 + i, seed=i), i, True)
            for i in range(1, 7)]
        settings = SlotSettings(slots=3, refill_every=2, attention="sdpa", cuda_graph=True, fused_sampler=fused)
        shape = StateShape.of(rows, settings, capture=True)
        with _cpu_graph_capture(monkeypatch), torch.inference_mode():
            state = DecodeState(engine.model, shape, "sdpa", cuda_graph=True, fused_sampler=fused)
            assert state.sampler.fused is fused
            outputs = SlotSession(engine.model, rows, settings, state, engine._capture, lambda forward: forward(0)).run()
    return [dict(tokens=o.tokens, logprobs=o.logprobs, routing=o.routing) for o in outputs]  # what torch.load takes


# ---- this process: the references and the comparisons ----

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed: .ci/run runs this file with .megatron-newest (bash tools/setup.sh "
           "--megatron-newest, which brings triton) first on PYTHONPATH")


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory.mktemp("fused_sampling") / "results.pt", timeout=1200)


def _reference(case: dict, filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    temperature, top_k, top_p = case["settings"]
    tokens, logprobs, _ = draw(case["logits"], temperature, top_k, top_p, case["uniforms"], filtered)
    return tokens, logprobs


CASES = _cases()
DRAWN = [(name, filtered) for name, case in CASES.items() if not name.startswith("boundary")
         for filtered in (False, True)]


@needs_triton
@pytest.mark.parametrize("name, filtered", DRAWN)
def test_the_fused_draw_is_the_torch_draw(fused, name, filtered):
    got = fused[(name, filtered)]
    tokens, logprobs = _reference(CASES[name], filtered)
    assert torch.equal(got["tokens"], tokens), (got["tokens"], tokens)
    torch.testing.assert_close(got["logprobs"], logprobs, rtol=0, atol=1e-5)
    assert got["counts_left"] == 0, "the filtered draw leaves its histogram scratch zeroed"


@needs_triton
@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("offset", [0.1, -0.1])
def test_a_target_beside_a_boundary_draws_the_token_on_its_side(fused, filtered, offset):
    case = CASES[f"boundary_{filtered}_{offset}"]
    got = fused[(f"boundary_{filtered}_{offset}", filtered)]["tokens"]
    expected = case["pairs"][:, 1 if offset > 0 else 0]
    reference, _ = _reference(case, filtered)
    assert torch.equal(reference, expected)
    assert torch.equal(got, expected)


@needs_triton
@pytest.mark.parametrize("filtered", [False, True])
def test_a_target_on_a_boundary_draws_one_of_the_two_tokens_it_separates(fused, filtered):
    case = CASES[f"boundary_{filtered}_0.0"]
    got = fused[(f"boundary_{filtered}_0.0", filtered)]["tokens"]
    reference, _ = _reference(case, filtered)
    pairs = case["pairs"]
    assert all(int(g) in pairs[i].tolist() and int(r) in pairs[i].tolist()
               for i, (g, r) in enumerate(zip(got, reference)))


@needs_triton
def test_the_decode_step_samples_with_the_fused_kernels_as_with_torch(fused):
    """The fused sampler inside the (faked) captured step and in the prefill's first draw, on a
    bf16 model's logits, over refilled slots with top-k, top-p and plain rows mixed: the tokens and
    routing the torch sampler gives, log μ within 1e-5."""
    reference, got = fused["session"][False], fused["session"][True]
    for a, b in zip(reference, got, strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["routing"], b["routing"])
        torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)


@needs_triton
def test_the_kernels_compile_for_a_hopper_gpu():
    """Triton's compiler without a GPU: what the interpreter accepts but the GPU compiler would
    refuse (types carried around loops, globals, scalar conditions) fails here, not on a GPU visit."""
    code = ("from bpo_megatron.rollout.hf import fused_sampling as f; import triton; "
            "from triton.backends.compiler import GPUTarget; from triton.compiler import ASTSource\n"
            "common = dict(logits_ptr='*bf16', stride='i32', vocab='i32', temperature_ptr='*fp32', uniform_ptr='*fp32', "
            "token_ptr='*i64', logprob_ptr='*fp32', BLOCK='constexpr')\n"
            "for fn, extra, constants in ((f._plain_kernel, dict(BLOCKS='constexpr'), dict(BLOCK=f.BLOCK, BLOCKS=128)), "
            "(f._filtered_kernel, dict(top_k_ptr='*i64', top_p_ptr='*fp32', counts_ptr='*i32', counts_stride='i32', "
            "CHUNK='constexpr'), dict(BLOCK=f.BLOCK, CHUNK=f.CHUNK))):\n"
            "    triton.compile(ASTSource(fn=fn, signature=common | extra, constexprs=constants), "
            "target=GPUTarget('cuda', 90, 32), options=dict(num_warps=f.NUM_WARPS))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"TRITON_DEFAULT_FP_FUSION": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


# ---- compiled on a GPU (the GPU round runs these; CI has none) ----

def _margins(case: dict, filtered: bool) -> torch.Tensor:
    """Per row, how far (a fraction of the drawn mass) the reference's target, and the top-p
    threshold, lie from the nearest boundary between two tokens (fp64)."""
    temperature, top_k, top_p = case["settings"]
    logits, uniforms = case["logits"].double(), case["uniforms"].double()
    margins = []
    for i in range(logits.shape[0]):
        probs = torch.softmax(logits[i] / float(temperature[i]), -1)
        gaps = []
        if filtered:
            probs = probs.sort(descending=True, stable=True).values
            k = int(top_k[i]) if 0 < int(top_k[i]) < probs.numel() else probs.numel()
            probs[k:] = 0
            cdf = probs.cumsum(0)
            threshold = float(top_p[i]) * cdf[-1]
            if float(top_p[i]) < 1:
                gaps.append(((cdf - probs)[:k] - threshold).abs().min() / cdf[-1])
            probs = torch.where(cdf - probs < threshold, probs, 0.0)
        cdf = probs.cumsum(0)
        target = uniforms[i] * cdf[-1]
        gaps.append((cdf[probs > 0] - target).abs().min() / cdf[-1])
        margins.append(min(float(g) for g in gaps))
    return torch.tensor(margins)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                               reason="the compiled kernels need CUDA and triton")


@cuda_only
@pytest.mark.parametrize("name, filtered", DRAWN)
def test_compiled_kernels_on_cuda_draw_the_torch_draws_tokens(name, filtered):
    """On the GPU the kernels' exp and log are the device's (a few ulps from the CPU's): the tokens
    equal the CPU reference's on every row whose target and top-p threshold lie farther than 1e-5
    of the mass from a boundary (almost all of them), log μ within 1e-4."""
    from bpo_megatron.rollout.hf.sampling import fused_draw

    case = CASES[name]
    temperature, top_k, top_p = case["settings"]
    counts = torch.zeros(case["logits"].shape[0], CODES, dtype=torch.int32, device="cuda")
    tokens, logprobs = fused_draw(case["logits"].cuda(), temperature.cuda(), top_k.cuda(), top_p.cuda(),
                                  case["uniforms"].cuda(), filtered, counts)
    reference, ref_logprobs = _reference(case, filtered)
    clear = _margins(case, filtered) > 1e-5
    assert clear.float().mean() >= 0.5  # most rows: the comparison is not empty
    assert torch.equal(tokens.cpu()[clear], reference[clear])
    torch.testing.assert_close(logprobs.cpu(), ref_logprobs, rtol=0, atol=1e-4)
    assert int(counts.abs().sum()) == 0


@cuda_only
@pytest.mark.parametrize("filtered", [False, True])
def test_the_fused_draw_replays_in_a_cuda_graph_on_cuda(filtered):
    """What the decode step needs: no host read, static shapes — captured once, a replay on new
    logits and uniforms written into the captured inputs draws what an eager call draws."""
    from bpo_megatron.rollout.hf.sampling import fused_draw

    temperature, top_k, top_p = (t.cuda() for t in _settings(MIXED))
    rows = len(MIXED)
    logits = _spread_logits(rows).cuda()
    uniforms = _uniforms(rows, 11).cuda()
    counts = torch.zeros(rows, CODES, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_draw(logits, temperature, top_k, top_p, uniforms, filtered, counts)  # compile before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_draw(logits, temperature, top_k, top_p, uniforms, filtered, counts)
    logits.copy_(_spread_logits(rows, seed=12).cuda())
    uniforms.copy_(_uniforms(rows, 13).cuda())
    graph.replay()
    eager = fused_draw(logits, temperature, top_k, top_p, uniforms, filtered, counts)
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert int(counts.abs().sum()) == 0
