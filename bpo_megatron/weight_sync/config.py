"""The ``weight_sync`` section: how the trainer's weights reach the engines after every update."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSyncConfig:
    """``bucket_mb``: the one weight bucket size, in MiB: the Hugging Face-named buckets the
    trainer exports and a transport sends, and the most an engine loads in one weight-update call
    (one bucket bounds the staging memory on either side). ``verify``: after every
    sync, fingerprint what each engine holds against the trainer's export, bit for bit (slow on big
    models; only engines that expose their weights allow it)."""

    bucket_mb: int = 512
    verify: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, int) or self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb must be a positive integer (MiB), got {self.bucket_mb!r}")

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb * 2**20
