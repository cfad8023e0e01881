"""Trainer → engines weight sync: HF-named tensors in buckets, engines paused around it."""

from __future__ import annotations

from bpo_megatron.rollout.checksums import compare


def sync_weights(trainer, engines, *, bucket_bytes: int, verify: bool = False, only: list[int] | None = None,
                 dtype: str | None = None) -> dict:
    """Push the trainer's weights to the engines (``only``: those indices), converted to ``dtype``
    when given; returns throughput.

    With ``verify`` every engine's weights are fingerprinted afterwards and compared with what the
    trainer sent; any difference raises ``WeightMismatch`` naming the tensors.
    """
    targets = [engines.workers[i] for i in (only if only is not None else range(len(engines.workers)))]
    engines.call("pause")
    try:
        report = trainer.call("push_weights", targets, bucket_bytes, verify, dtype)[0]
    finally:
        engines.call("resume")
    if verify:
        import ray

        for index, fingerprints in zip(only or range(len(targets)), ray.get([w.fingerprints.remote() for w in targets])):
            compare(report["fingerprints"], fingerprints, engine=f"rollout engine {index}")
    seconds = max(report["seconds"], 1e-9)
    return {"sync_bytes": float(report["bytes"]), "sync_seconds": seconds,
            "sync_bytes_per_s": report["bytes"] / seconds}
