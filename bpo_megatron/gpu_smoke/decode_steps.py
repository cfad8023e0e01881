"""The embedded engine's decode step timed and profiled at set contexts, by replaying it
(``rollout_decode``'s decode points).

A generation's step time mixes contexts (each row's grows as it decodes) and needs a prefill of
every prompt first. Here the engine's own decode state (:class:`~bpo_megatron.rollout.hf.slots.DecodeState`:
the step captured as a CUDA graph on a GPU, its layers compiled or not, the sampler plain or
filtered) is built once with room for the longest context; at each point every row is set to attend
over ``context`` positions and fed a random token (so routing spreads over the experts as in a real
batch), and the step is replayed: its mean time over ``steps`` replays (a replay adds a position to
each row: they are centred on ``context``) and one replay under ``torch.profiler`` (its kernels,
the time the GPU was busy, the trace). The cache holds whatever the replays wrote: the kernels'
work does not depend on the values.
"""

from __future__ import annotations

import gzip
import shutil
import time
from pathlib import Path

import torch

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.common import synchronize
from bpo_megatron.rollout import SamplingParams
from bpo_megatron.rollout.hf.decode import attention_for
from bpo_megatron.rollout.hf.sampling import UNIFORM_BLOCK, fused_applies
from bpo_megatron.rollout.hf.slots import MIN_STOP_WIDTH, DecodeState, StateShape

WARMUP = 3  # replays before the timed ones (a compiled step's first calls may still autotune)
# the filtered batch: rows alternate between top-p and top-k, each row's own setting
FILTERED = (SamplingParams(top_p=0.95), SamplingParams(top_k=50))


def build_state(model: torch.nn.Module, rows: int, length: int, *, cuda_graph: bool, compile_layers: bool,
                filtered: bool) -> DecodeState:
    """A decode state as the engine builds it for ``rows`` rows of up to ``length`` positions, its
    rows assigned (plain sampling at temperature 1, or :data:`FILTERED`)."""
    parameter = next(model.parameters())
    shape = StateShape(slots=rows, length=length, routing=True, filtered=filtered, stop_width=MIN_STOP_WIDTH)
    with torch.inference_mode():
        state = DecodeState(model, shape, attention_for(parameter.device, parameter.dtype), cuda_graph,
                            compile_layers, fused_applies(parameter.device))
        params = [FILTERED[i % 2] if filtered else SamplingParams() for i in range(rows)]
        params = [SamplingParams(top_p=p.top_p, top_k=p.top_k, max_new_tokens=length) for p in params]
        state.sampler.assign(list(range(rows)), params, list(range(rows)))
    return state


def time_step(state: DecodeState, context: int, steps: int, vocab: int) -> float:
    """Mean seconds of one replayed step with every row at ``context`` positions on average."""
    rows = state.shape.slots
    if WARMUP + steps + 1 > UNIFORM_BLOCK or context + steps >= state.shape.length:
        raise ValueError(f"{steps} timed steps at context {context} need a longer state than "
                         f"{state.shape.length} positions and at most {UNIFORM_BLOCK} uniforms a row")
    with torch.inference_mode():
        state.position.fill_(context - steps // 2 - WARMUP)
        state.count.fill_(1)  # each row's uniforms: the first block, drawn at assignment
        state.done.fill_(False)
        state.stopped.fill_(False)
        tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(context))
        state.feed.copy_(tokens.to(state.device))
        for _ in range(WARMUP):
            state.run_step(0)
        synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            state.run_step(0)
        synchronize()
    return (time.perf_counter() - start) / steps


def profile_step(state: DecodeState, trace: Path) -> dict[str, float]:
    """One replay under ``torch.profiler``: the GPU's operations (kernels, copies), the time it was
    busy, the replay's span; the trace gzipped to ``trace``."""
    import torch.profiler

    from bpo_megatron.gpu_smoke.trace import covered_length

    cuda = platform.has_cuda()
    activity = torch.profiler.ProfilerActivity
    synchronize()
    with torch.profiler.profile(activities=[activity.CPU] + ([activity.CUDA] if cuda else [])) as prof:
        with torch.inference_mode():
            state.run_step(0)
        synchronize()
    events = prof.events()
    device = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    starts, ends = [e.time_range.start for e in events], [e.time_range.end for e in events]
    trace.parent.mkdir(parents=True, exist_ok=True)
    raw = trace.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return {"gpu_ops": float(len(device)), "gpu_busy_ms": covered_length(device) / 1e3,
            "profiled_ms": (max(ends) - min(starts)) / 1e3 if starts else 0.0}
