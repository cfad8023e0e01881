"""The decode step captured as one CUDA graph (CUDA only; the CPU runs the same step eagerly).

A step launches a few hundred small kernels; replaying them as one graph removes the per-kernel
Python and launch cost that dominates decoding at small batch. The captured step reads its inputs
from static tensors and writes its outputs to tensors allocated during capture: callers copy new
inputs in, replay, and read the same output tensors every time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP_STEPS = 3  # eager runs on a side stream before capture, as torch.cuda.graph requires


class GraphedStep:
    """``step()`` captured once; calling replays it and returns the outputs captured."""

    def __init__(self, step: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._outputs = step()

    def __call__(self) -> tuple[torch.Tensor, ...]:
        self._graph.replay()
        return self._outputs
