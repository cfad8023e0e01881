"""The ``weight_sync`` section: how the trainer's weights reach the engines after every update."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSyncConfig:
    """``bucket_mb``: the one weight bucket size, in MiB: the Hugging Face-named buckets the
    trainer exports and a transport sends, and the most an engine loads in one weight-update call
    (one bucket bounds the staging memory on either side). ``verify``: after every
    sync, fingerprint what each engine holds against the trainer's export, bit for bit (slow on big
    models; only engines that expose their weights allow it).

    ``delta``: send only what changed since the version the engines hold (per bucket, the changed
    elements as flat indices and values, or the changed tensors whole where that is fewer bytes;
    engines that take whole tensors only get the changed tensors whole); each sending trainer rank
    keeps a host copy of what the engines hold to diff against, one copy of the model in the sync's
    dtype per engine group: rank 0 alone, but every trainer rank for the CUDA IPC transports (each
    receives the whole model), so host memory holds one model per GPU there. SGLang engines that
    share the trainer's devices drop their weights at every train phase, so each sync to them would
    be a full one: `train --check` refuses ``delta`` with them (rule
    ``delta_sync_needs_engines_that_keep_weights``). Off by default, by the changed share measured here (docs/benchmarks.md, "The changed
    share per sync, measured"): at the learning rates of the CPU recipes (1e-4 to 3e-4) 30–58 % of
    the elements change per sync and a delta sends 0.87–0.98 of a full sync's bytes; at 1e-6 (the
    cluster recipes') 1–3 % change, so a sparse delta sends 3–6 % of the bytes, but every tensor has
    a change, so over the paths that take whole tensors only (SGLang's NCCL broadcast and IPC) a
    delta skips nothing while the host copy costs a model's bytes. Turn it on for the embedded
    engine at small learning rates. ``full_every``: with ``delta``, every this many versions the
    sync is a full one (bounds any drift between the copy and the engines; the first sync, and any
    engine replaced or holding another version, get a full sync anyway)."""

    bucket_mb: int = 512
    verify: bool = False
    delta: bool = False
    full_every: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, int) or self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb must be a positive integer (MiB), got {self.bucket_mb!r}")
        if not isinstance(self.delta, bool):
            raise ValueError(f"weight_sync.delta must be true or false, got {self.delta!r}")
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"weight_sync.full_every must be a positive integer (versions between full syncs), "
                             f"got {self.full_every!r}")

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb * 2**20
