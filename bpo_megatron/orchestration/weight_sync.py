"""Trainer → engines weight sync: HF-named tensors in buckets, inside each engine's update session."""

from __future__ import annotations

from bpo_megatron.rollout.checksums import compare


def sync_weights(trainer, engines, *, version: int, bucket_bytes: int, verify: bool = False,
                 only: list[int] | None = None, dtype: str | None = None) -> dict:
    """Push the trainer's weights, the ``version``-th update, to the engines (``only``: those
    indices), converted to ``dtype`` when given; returns throughput. Each engine checks
    afterwards that it holds that version.

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
        _, lost = engines.call_surviving("begin_weight_update", version, only=targets)
        opened = [i for i in targets if i not in lost]
        report = trainer.call("push_weights", [engines.workers[i] for i in opened], bucket_bytes, verify, dtype)[0]
        lost += [opened[j] for j in report["failed"]]
        _, died = engines.call_surviving("end_weight_update", only=[i for i in opened if i not in lost])
        lost += died
        synced = [i for i in targets if i not in lost]
        held, died = engines.call_surviving("weight_version", only=synced)
        lost += died
        synced = [i for i in synced if i not in died]
        if any(held[i] != version for i in synced):
            raise RuntimeError(f"after the weight sync, engines {synced} report weight versions "
                               f"{[held[i] for i in synced]}, not {version}")
        sent, seconds = sent + report["bytes"], seconds + report["seconds"]
        if verify:
            import ray

            for index, fingerprints in zip(synced, ray.get([engines.workers[i].fingerprints.remote() for i in synced])):
                compare(report["fingerprints"], fingerprints, engine=f"rollout engine {index}")
        if lost:
            engines.replace(lost, load_weights=False)
        targets = lost
    seconds = max(seconds, 1e-9)
    return {"sync_bytes": float(sent), "sync_seconds": seconds, "sync_bytes_per_s": sent / seconds}
