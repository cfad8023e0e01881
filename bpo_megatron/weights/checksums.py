"""Exact fingerprints of named tensors, to prove an engine holds the trainer's weights."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def fingerprint(tensor: torch.Tensor) -> str:
    """A hash of the tensor's dtype, shape and bytes (any bit flip changes it)."""
    data = tensor.detach().contiguous().cpu()
    if data.data_ptr() == tensor.data_ptr():  # .numpy() would mark the source's storage unresizable
        data = data.clone()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def fingerprints(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: fingerprint(tensor) for name, tensor in named}


class WeightMismatch(RuntimeError):
    pass


def compare(expected: dict[str, str], actual: dict[str, str], *, engine: str) -> None:
    """Raise WeightMismatch naming every tensor that differs, is missing, or is extra."""
    wrong = sorted(n for n in expected if n in actual and actual[n] != expected[n])
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))  # weights the sync never sent: stale on the engine
    if wrong or missing or extra:
        parts = []
        if wrong:
            parts.append(f"{len(wrong)} tensors differ (e.g. {', '.join(wrong[:3])})")
        if missing:
            parts.append(f"{len(missing)} tensors were not received (e.g. {', '.join(missing[:3])})")
        if extra:
            parts.append(f"{len(extra)} engine tensors were never sent (e.g. {', '.join(extra[:3])})")
        raise WeightMismatch(f"after weight sync, {engine} does not hold the trainer's weights: {'; '.join(parts)}")
