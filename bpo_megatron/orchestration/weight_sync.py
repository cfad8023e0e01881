"""Trainer → engines weight sync: HF-named tensors in buckets, engines paused around it."""

from __future__ import annotations

from bpo_megatron.rollout.checksums import compare


def sync_weights(trainer, engines, *, bucket_bytes: int, verify: bool = False, only: list[int] | None = None,
                 dtype: str | None = None) -> dict:
    """Push the trainer's weights to the engines (``only``: those indices), converted to ``dtype``
    when given; returns throughput.

    A full sync first replaces the engines that died since the last one; an engine that dies
    during the sync is replaced and synced again (within the engines' restart budget), so every
    engine holds the new weights when this returns. With ``verify`` every engine's weights are
    fingerprinted afterwards and compared with what the trainer sent; any difference raises
    ``WeightMismatch`` naming the tensors.
    """
    if only is None:
        engines.replace_unhealthy()
    targets = list(range(len(engines.workers))) if only is None else list(only)
    sent = seconds = 0.0
    while targets:
        engines.call("pause", only=targets)
        report = trainer.call("push_weights", [engines.workers[i] for i in targets], bucket_bytes, verify, dtype)[0]
        lost = [targets[j] for j in report["failed"]]
        engines.call("resume", only=[i for i in targets if i not in lost])
        sent, seconds = sent + report["bytes"], seconds + report["seconds"]
        if verify:
            import ray

            synced = [i for i in targets if i not in lost]
            for index, fingerprints in zip(synced, ray.get([engines.workers[i].fingerprints.remote() for i in synced])):
                compare(report["fingerprints"], fingerprints, engine=f"rollout engine {index}")
        if lost:
            engines.replace(lost, load_weights=False)
        targets = lost
    seconds = max(seconds, 1e-9)
    return {"sync_bytes": float(sent), "sync_seconds": seconds, "sync_bytes_per_s": sent / seconds}
