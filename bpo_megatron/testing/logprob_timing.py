"""The one measurement of the log-prob op against Megatron-Core's, shared by ``bpo-megatron bench
logprobs`` (gloo ranks on a CPU, TP 1 and 2, its ratio table) and the GPU kit's ``logprobs_kernel``
check (one device, its thresholds): the same methods, run on the same logits in the same order,
forward + backward time (median of repeats after a warm-up), peak memory on top of the logits,
the largest difference from Megatron's log-probs, and, at TP 1, the errors against an fp64
log-softmax of the same (already rounded) logits.

Each caller brings what differs between a gloo rank on a CPU and a device: how peak memory is read
(``peak``), how the device is synchronised and the ranks lined up (``synchronize``, ``barrier``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# every way of computing the sampled tokens' log-probs that is compared; "megatron" is the reference
METHODS = ("naive", "megatron", "ours", "ours-inplace", "fused", "fused-inplace")

LogProbFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def method_fns(group) -> dict[str, LogProbFn]:
    """Each method as ``fn(logits, targets, temperature)`` over the tensor-parallel ``group``:
    a naive full-vocabulary log-softmax (the vocabulary gathered at TP > 1), Megatron-Core's
    ``vocab_parallel_cross_entropy``, and our op chunked or fused, copy-safe or in place."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, vocab_parallel_cross_entropy

    from bpo_megatron.ops import vocab_parallel_logprobs

    def naive(logits, targets, temperature):
        full = gather_from_tensor_model_parallel_region(logits) if group.size() > 1 else logits
        scaled = full.float() / temperature if temperature != 1.0 else full.float()
        return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def megatron(logits, targets, temperature):
        return -vocab_parallel_cross_entropy(logits / temperature if temperature != 1.0 else logits, targets)

    def ours(kernel, inplace):
        def fn(logits, targets, temperature):
            return vocab_parallel_logprobs(logits, targets, group, temperature=temperature, inplace=inplace,
                                           kernel=kernel)
        return fn

    return {"naive": naive, "megatron": megatron, "ours": ours("chunked", False),
            "ours-inplace": ours("chunked", True), "fused": ours("fused", False), "fused-inplace": ours("fused", True)}


@dataclass
class Timing:
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    diff_vs_megatron: float = 0.0  # the largest |log π| difference from Megatron's (the warm-up run)
    logp_err_vs_fp64: float | None = None  # at TP 1 only: the first ``fp64_rows`` rows
    grad_err_vs_fp64: float | None = None

    @property
    def forward_ms(self) -> float:
        return 1e3 * statistics.median(self.forward_s)

    @property
    def backward_ms(self) -> float:
        return 1e3 * statistics.median(self.backward_s)


class NoPeak:
    """A peak meter that reads nothing (where no allocator can be asked)."""

    extra_bytes = 0

    def __enter__(self) -> "NoPeak":
        return self

    def __exit__(self, *exc) -> None:
        return None


class DevicePeak:
    """The CUDA allocator's peak above what was allocated when the region began."""

    extra_bytes = 0

    def __enter__(self) -> "DevicePeak":
        torch.cuda.reset_peak_memory_stats()
        self._start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        self.extra_bytes = torch.cuda.max_memory_allocated() - self._start


def time_methods(methods: list[str], group, fresh: Callable[[], torch.Tensor], targets: torch.Tensor,
                 grad_out: torch.Tensor, *, repeats: int, temperature: float = 1.0,
                 peak: Callable[[], object] = NoPeak, synchronize: Callable[[], None] = lambda: None,
                 barrier: Callable[[], None] = lambda: None, fp64_rows: int = 0) -> dict[str, Timing]:
    """Megatron's method first (the reference), then ``methods`` in order, each ``repeats + 1``
    times on new logits from ``fresh()`` (in-place methods consume theirs); the first run warms up
    and is the one compared. ``fp64_rows`` > 0 (TP 1: a rank's logits are the whole vocabulary):
    also the errors of the first that many rows against an fp64 log-softmax and its gradient."""
    fns = method_fns(group)
    exact = None
    if fp64_rows:
        with torch.no_grad():
            full = torch.log_softmax(fresh()[:fp64_rows].double() / temperature, dim=-1)
        rows = targets[:fp64_rows]
        exact = (full.gather(-1, rows[:, None]).squeeze(-1),
                 (torch.nn.functional.one_hot(rows, full.shape[-1]).double() - full.exp())
                 * grad_out[:fp64_rows, None].double() / temperature)
        del full
    reference = None
    results: dict[str, Timing] = {}
    for name in ["megatron", *(m for m in methods if m != "megatron")]:
        fn, result = fns[name], Timing()
        for repeat in range(repeats + 1):
            logits = fresh().requires_grad_()
            barrier()
            synchronize()
            with peak() as meter:
                start = time.perf_counter()
                logprobs = fn(logits, targets, temperature)
                synchronize()
                mid = time.perf_counter()
                (grad,) = torch.autograd.grad(logprobs, logits, grad_out)
                synchronize()
                end = time.perf_counter()
            if repeat == 0:
                got = logprobs.detach().float()
                reference = got if reference is None else reference
                result.diff_vs_megatron = float((got - reference).abs().max())
                if exact is not None:
                    result.logp_err_vs_fp64 = float((logprobs.detach()[:fp64_rows].double() - exact[0]).abs().max())
                    result.grad_err_vs_fp64 = float((grad.detach()[:fp64_rows].double() - exact[1]).abs().max())
            else:
                result.forward_s.append(mid - start)
                result.backward_s.append(end - mid)
                result.peak_bytes = max(result.peak_bytes, meter.extra_bytes)
            del logprobs, grad, logits
        results[name] = result
    return results
