"""The decode step captured as one CUDA graph (CUDA only; the CPU runs the same step eagerly).

A step launches a thousand-odd small kernels; replaying them as one graph removes the per-kernel
Python and launch cost that dominates decoding at small batch. The captured kernels read and
write raw device addresses: the step must only touch tensors that live as long as the graph, and
those tensors must not be freed while it may replay, or the replay reads whatever reuses their
memory. :class:`GraphedStep` therefore keeps the step callable itself — and through it the object
that owns every tensor the step touches (:class:`~bpo_megatron.rollout.hf.slots.DecodeState`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_STEPS = 3  # eager runs on a side stream before capture, as torch.cuda.graph requires


class GraphedStep:
    """``step()`` captured once; calling replays it. Holds ``step`` (and what it reaches) for as
    long as the graph can replay."""

    def __init__(self, step: Callable[[], object]) -> None:
        self._step = step  # owns what the graph reads: dropping it frees memory the replay still uses
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._outputs = step()

    def __call__(self) -> object:
        self._graph.replay()
        return self._outputs
