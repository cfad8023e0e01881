"""The fused triton log-prob kernels (``bpo_megatron/ops/fused_logprobs.py``) against a
full-vocabulary fp64 ``log_softmax`` with plain autograd, and the choice between them and the
chunked op.

The product runs the kernels on CUDA only. Triton's interpreter runs the same kernels with numpy
on CPU tensors, so their arithmetic (blocks, row splits, the online rescale, padding columns,
temperature, rows of zero gradient, the in-place gradient, the TP combination over gloo) is checked
here; compiling them and their speed are left to a GPU session (docs/gpu-validation.md). The
interpreter is switched on by ``TRITON_INTERPRET=1`` in the environment of one child process,
which computes every case and saves the results; the references are computed in this process.

Needs triton importable: ``.ci/run`` runs this file with ``.megatron-newest`` (whose megatron-core
brings triton 3.9.0) first on ``PYTHONPATH``; without triton the interpreter tests skip.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.distributed as dist
from test_vocab_parallel import SHAPE, VOCAB, full_logits

from bpo_megatron.ops import vocab_parallel_logprobs
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.testing.triton_interpreter import interpreted_results

# (block, programs): one block per split and several splits; several blocks in one program (the
# online rescale); one block with lanes past the row's end
LAUNCHES = [(16, 63), (16, 1), (128, 1024)]
SINGLE = list(itertools.product(LAUNCHES, [1.0, 0.7], [False, True]))  # launch, T, inplace
TP2 = list(itertools.product([1.0, 0.7], [False, True]))
PADDED = [(1, 83, 0.0), (2, 83, 0.0), (2, 40, 0.0), (2, 40, -300.0)]  # world, real vocab, shift
ZERO_ROWS = (0, slice(0, 3))  # upstream gradient 0 on these rows (prompt and padding positions)


def _upstream() -> torch.Tensor:
    upstream = full_logits()[2].clone()
    upstream[ZERO_ROWS] = 0.0
    return upstream


# ---- run in the interpreter's child process (and its gloo ranks) ----

def _fused(local, targets, group, temperature, inplace, *, launch=(16, 63), vocab_size=None):
    from bpo_megatron.ops.fused_logprobs import fused_vocab_parallel_logprobs

    leaf = local.clone().requires_grad_()
    x = leaf * 1.0 if inplace else leaf  # in place needs a buffer the caller gives up
    block, programs = launch
    logp, entropy = fused_vocab_parallel_logprobs(x, targets, group, temperature, True, inplace, vocab_size,
                                                  block=block, programs=programs)
    (grad,) = torch.autograd.grad(logp, x, _upstream().to(local.device))
    return {"logp": logp.detach().cpu(), "entropy": entropy.cpu(), "grad": grad.cpu(),
            "untouched": torch.equal(leaf.detach(), local),
            "grad_in_logits_buffer": grad.data_ptr() == x.data_ptr()}


def _shard(logits: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = logits.shape[-1] // world
    return logits[..., rank * shard: (rank + 1) * shard].contiguous()


def _tp2_rank():
    logits, targets, _ = full_logits()
    return [_fused(_shard(logits), targets, dist.group.WORLD, t, inplace) for t, inplace in TP2]


def _padded_rank(real_vocab, shift):
    logits, targets, _ = full_logits()
    local = _shard(logits + shift)
    return [_fused(local, targets % real_vocab, dist.group.WORLD, 1.0, inplace, vocab_size=real_vocab)
            for inplace in (False, True)]


def interpret_all(out: str) -> None:
    """Every case through the kernels, saved to ``out`` (the child process's entry point)."""
    logits, targets, _ = full_logits()
    results = {("single", *case): _fused(logits, targets, None, case[1], case[2], launch=case[0])
               for case in SINGLE}
    for inplace in (False, True):
        results[("bf16", inplace)] = _fused(logits.bfloat16(), targets, None, 0.7, inplace)
    results["tp2"] = run_gloo_world(_tp2_rank, 2, timeout=300)
    for case in PADDED:
        results[("padded", *case)] = run_gloo_world(_padded_rank, case[0], *case[1:], timeout=300)
    from bpo_megatron.ops.fused_logprobs import fused_vocab_parallel_logprobs

    x = logits.clone()
    with torch.no_grad():
        logp = fused_vocab_parallel_logprobs(x, targets, None, 1.0, False, True, None, block=16, programs=63)
    results["no_grad"] = {"logp": logp, "untouched": torch.equal(x, logits)}
    torch.save(results, out)


# ---- this process: the references and the comparisons ----

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed: .ci/run runs this file with .megatron-newest (bash tools/setup.sh "
           "--megatron-newest, which brings triton 3.9.0) first on PYTHONPATH")


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory.mktemp("fused") / "results.pt", timeout=900)


def _reference(temperature, logits, real_vocab=None):
    """fp64 log π, entropy and ∂(Σ upstream · log π)/∂logits by plain autograd through a
    full-vocabulary log_softmax; padding columns (past ``real_vocab``) are left out of the softmax
    and given zero gradient."""
    _, targets, _ = full_logits()
    targets = targets % (real_vocab or VOCAB)
    x = logits.double()[..., :real_vocab].requires_grad_()
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (grad,) = torch.autograd.grad(logp, x, _upstream().double())
    pad = torch.zeros(*SHAPE, logits.shape[-1] - x.shape[-1], dtype=torch.float64)
    return logp.detach(), entropy.detach(), torch.cat([grad, pad], -1)


def _assert_close(got, ref, tol, what):
    logp, entropy, grad = ref
    torch.testing.assert_close(got["logp"].double(), logp, rtol=tol, atol=tol, msg=f"log-probs {what}")
    torch.testing.assert_close(got["entropy"].double(), entropy, rtol=tol, atol=tol, msg=f"entropy {what}")
    torch.testing.assert_close(got["grad"].double(), grad, rtol=tol, atol=tol, msg=f"gradient {what}")
    assert torch.all(got["grad"][ZERO_ROWS] == 0), f"rows of zero incoming gradient get exactly 0 {what}"


# fp32 kernels: log-probs reach −25 here, where one fp32 ulp is 2e-6; the online rescale and the
# splits' combination add a few roundings, so 1e-5 (relative and absolute) with room to spare
FP32_TOL = 1e-5


@needs_triton
@pytest.mark.parametrize("launch, temperature, inplace", SINGLE)
def test_single_rank_equals_full_vocabulary_log_softmax(fused, launch, temperature, inplace):
    got = fused[("single", launch, temperature, inplace)]
    _assert_close(got, _reference(temperature, full_logits()[0]), FP32_TOL, (launch, temperature, inplace))
    # in place: the gradient lies in the logits buffer; copy-safe: the caller's logits are as they were
    assert got["grad_in_logits_buffer"] if inplace else got["untouched"]


@needs_triton
@pytest.mark.parametrize("inplace", [False, True])
def test_bf16_logits_give_fp32_logprobs_and_bf16_gradients(fused, inplace):
    got = fused[("bf16", inplace)]
    assert got["logp"].dtype == torch.float32 and got["grad"].dtype == torch.bfloat16
    logp, entropy, grad = _reference(0.7, full_logits()[0].bfloat16())  # exact for the rounded logits
    torch.testing.assert_close(got["logp"].double(), logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["entropy"].double(), entropy, rtol=0, atol=1e-5)
    # fp32 arithmetic, one rounding to bf16 on the way out. A GPU rounds to nearest (half an ulp:
    # the kit's logprobs_kernel check holds it to that); the interpreter truncates, which is up to
    # one ulp, and one ulp of the largest entry is at most 2^-7 of it
    assert (got["grad"].double() - grad).abs().max() <= grad.abs().max() * 2.0**-7
    assert torch.all(got["grad"][ZERO_ROWS] == 0)


@needs_triton
def test_tp2_equals_full_vocabulary_log_softmax(fused):
    per_rank = fused["tp2"]
    for i, (temperature, inplace) in enumerate(TP2):
        rank0, rank1 = per_rank[0][i], per_rank[1][i]
        assert torch.equal(rank0["logp"], rank1["logp"]) and torch.equal(rank0["entropy"], rank1["entropy"])
        got = rank0 | {"grad": torch.cat([rank0["grad"], rank1["grad"]], dim=-1)}
        _assert_close(got, _reference(temperature, full_logits()[0]), FP32_TOL, ("tp2", temperature, inplace))


# 83 of 96 columns real: rank 1 of 2 holds a few; 40: rank 1 holds none (a 128-token vocabulary at
# TP=2), also with every logit near −300, where a rank of padding must not offer the max (one
# fp32 ulp there is 3e-5, so that case is compared to 1e-4)
@needs_triton
@pytest.mark.parametrize("world, real_vocab, shift", PADDED)
def test_padding_columns_are_not_tokens(fused, world, real_vocab, shift):
    per_rank = fused[("padded", world, real_vocab, shift)]
    ref = _reference(1.0, full_logits()[0] + shift, real_vocab)
    for mode in (0, 1):
        got = per_rank[0][mode] | {"grad": torch.cat([rank[mode]["grad"] for rank in per_rank], dim=-1)}
        _assert_close(got, ref, 1e-4 if shift else FP32_TOL, ("padded", world, real_vocab, shift, mode))


@needs_triton
def test_forward_only_leaves_logits_untouched_even_inplace(fused):
    got = fused["no_grad"]
    assert got["untouched"]
    torch.testing.assert_close(got["logp"].double(), _reference(1.0, full_logits()[0])[0], rtol=FP32_TOL, atol=FP32_TOL)


# ---- compiled on a GPU (a GPU session runs these; CI has none) ----

@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="the compiled kernels need CUDA and triton")
@pytest.mark.parametrize("launch", LAUNCHES + [(4096, 1024)])  # the last: the product's own launch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_on_cuda_equal_full_vocabulary_log_softmax(launch, dtype):
    logits, targets, _ = full_logits()
    for temperature, inplace in itertools.product([1.0, 0.7], [False, True]):
        got = _fused(logits.to("cuda", dtype), targets.cuda(), None, temperature, inplace, launch=launch)
        ref = _reference(temperature, logits.to(dtype))
        if dtype == torch.float32:
            _assert_close(got, ref, FP32_TOL, (launch, temperature, inplace))
        else:  # round to nearest on a GPU: half a bf16 ulp of the largest entry
            torch.testing.assert_close(got["logp"].double(), ref[0], rtol=0, atol=1e-5)
            assert (got["grad"].double() - ref[2]).abs().max() <= ref[2].abs().max() * 2.0**-8
            assert torch.all(got["grad"][ZERO_ROWS] == 0)
        assert got["grad_in_logits_buffer"] if inplace else got["untouched"]


# ---- the choice of kernel (no triton needed) ----

def test_fused_kernel_refuses_cpu_logits_and_unknown_kernels():
    logits, targets, _ = full_logits()
    with pytest.raises(ValueError, match="kernel='fused' needs logits on a CUDA device"):
        vocab_parallel_logprobs(logits, targets, kernel="fused")
    with pytest.raises(ValueError, match="kernel must be one of"):
        vocab_parallel_logprobs(logits, targets, kernel="triton")


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="the fused path is chosen on CUDA with triton only")
def test_auto_on_cuda_is_the_fused_op():
    logits, targets, _ = full_logits()
    x = logits.cuda().requires_grad_()
    logp = vocab_parallel_logprobs(x, targets.cuda())
    assert type(logp.grad_fn).__name__ == "_FusedLogProbsBackward"


def test_auto_on_cpu_is_the_chunked_op():
    logits, targets, _ = full_logits()
    auto = vocab_parallel_logprobs(logits, targets, with_entropy=True)
    chunked = vocab_parallel_logprobs(logits, targets, with_entropy=True, kernel="chunked")
    assert all(torch.equal(a, c) for a, c in zip(auto, chunked))
