"""What a weight sync does at every push, decided once from the config (:class:`SyncPlan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bpo_megatron.weights.fp8 import SyncQuantization


@dataclass(frozen=True)
class SyncPlan:
    """How the trainer's weights reach one engine group, the same at every sync: made once by
    ``ExperimentConfig.sync_plan`` and handed to the trainer's ranks whole, so a new sync-time
    option is a field here and a step of :func:`~bpo_megatron.weight_sync.sender.send_weights`.

    ``transport``: a generic transport's name or an engine's ``module:Class`` (the engine spec's
    choice for where the engines sit); ``bucket_bytes``: the most one bucket holds
    (``weight_sync.bucket_mb``), on the trainer's side and the engine's; ``dtype``: the precision
    the tensors are sent in (None: as the trainer holds them); ``quantization``: how the engines
    hold the linear layers beyond their dtype (:class:`~bpo_megatron.weights.fp8.SyncQuantization`,
    None: as they are); ``verify``: fingerprint what every engine holds after the sync against
    what was sent; ``delta``: how a delta sync reaches the engines (``weight_sync.delta``; one of
    :data:`~bpo_megatron.weight_sync.delta.MODES`, "sparse" or "tensors", as the engine's spec
    takes it over this transport; None: every sync is a full one), with a full sync every
    ``full_every`` versions."""

    transport: str
    bucket_bytes: int
    dtype: torch.dtype | None = None
    quantization: SyncQuantization | None = None
    verify: bool = False
    delta: str | None = None
    full_every: int = 1

    def __post_init__(self) -> None:
        from bpo_megatron.weight_sync.delta import MODES

        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"a weight sync's buckets hold at least one byte, got bucket_bytes={self.bucket_bytes!r}")
        if self.delta is not None and self.delta not in MODES:
            raise ValueError(f"a delta sync reaches engines as one of {MODES}, not delta={self.delta!r}")
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"a delta sync needs full_every >= 1 (versions between full syncs), got {self.full_every!r}")
