"""What a delta weight sync sends: the encoding rule per bucket, and the tensor kinds it is measured by.

A delta sync sends, per bucket, only the elements whose bytes changed since the version the
engine holds: each as its flat index in the bucket and its new value (sparse), or the whole bucket
(dense) where that is fewer bytes; a bucket with nothing changed is not sent. With bf16 values
(2 bytes) and int32 indices (4 bytes) sparse is cheaper below a third of the bucket changed; a
bucket of 2^31 elements or more needs int64 indices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INDEX_LIMIT_INT32 = 2**31


def index_bytes(elements: int) -> int:
    """Bytes of one flat index into a bucket of ``elements``."""
    return 4 if elements <= INDEX_LIMIT_INT32 else 8


@dataclass(frozen=True)
class BucketDelta:
    encoding: str  # "skip" (nothing changed), "sparse" (indices and values) or "dense" (every element)
    nbytes: int  # bytes on the wire, headers aside


def bucket_delta(elements: int, changed: int, itemsize: int = 2) -> BucketDelta:
    """How a bucket of ``elements`` values of ``itemsize`` bytes, ``changed`` of them different,
    goes over the wire in a delta sync, and its bytes: the cheaper of sparse and dense."""
    if elements < 0 or not 0 <= changed <= elements or itemsize < 1:
        raise ValueError(f"a bucket needs 0 <= changed <= elements and itemsize >= 1; got elements={elements}, "
                         f"changed={changed}, itemsize={itemsize}")
    if changed == 0:
        return BucketDelta("skip", 0)
    sparse, dense = changed * (index_bytes(elements) + itemsize), elements * itemsize
    return BucketDelta("sparse", sparse) if sparse < dense else BucketDelta("dense", dense)


def bucket_wire_bytes(elements: int, changed: int, itemsize: int = 2) -> int:
    """Bytes a delta sync sends for one bucket (:func:`bucket_delta`)."""
    return bucket_delta(elements, changed, itemsize).nbytes


def delta_wire_bytes(total_elements: int, bucket_elements: int, changed_share: float, itemsize: int = 2) -> int:
    """Bytes a delta sync sends for a model of ``total_elements`` in buckets of ``bucket_elements``
    (the last one the remainder), each with ``changed_share`` of its elements changed (rounded up
    per bucket): the simulation's form of :func:`bucket_wire_bytes`."""
    if not 0.0 <= changed_share <= 1.0:
        raise ValueError(f"changed_share must be within [0, 1], got {changed_share}")
    if bucket_elements < 1:
        raise ValueError(f"bucket_elements must be >= 1, got {bucket_elements}")
    full, rest = divmod(total_elements, bucket_elements)
    sizes = [bucket_elements] * full + ([rest] if rest else [])
    return sum(bucket_wire_bytes(size, min(size, _ceil(size * changed_share)), itemsize) for size in sizes)


def _ceil(value: float) -> int:
    whole = int(value)
    return whole + (value > whole)


# Hugging Face tensor name -> kind, first match wins (Qwen3-MoE, GLM-4.5 and DeepSeek-V3 names)
KINDS = (
    ("experts", re.compile(r"\.mlp\.experts\.")),
    ("shared experts", re.compile(r"\.mlp\.shared_experts?\.")),
    ("router", re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")),
    ("dense MLP", re.compile(r"\.mlp\.(gate|up|down)_proj\.")),
    ("attention", re.compile(r"\.self_attn\.")),
    ("embeddings", re.compile(r"(embed_tokens|lm_head)\.")),
    ("norms", re.compile(r"norm\.weight$")),
)


def tensor_kind(name: str) -> str:
    """The kind of a Hugging Face weight by its name ("other" if none matches)."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")
