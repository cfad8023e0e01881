"""The Ray actors: one train worker per trainer rank, one engine worker per rollout engine.

Both are plain classes; :mod:`bpo_megatron.orchestration.groups` turns them into Ray actors.
Keeping Ray out of them keeps them testable and lets the trainer world run without Ray too.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.observability.library_logs import quiet_library_logs


class TrainWorker:
    """One rank of the trainer world: a :class:`~bpo_megatron.trainer.actor.TrainActor`."""

    def __init__(self, cfg, rank: int, world_size: int, master: str, threads: int = 1) -> None:
        quiet_library_logs()
        from bpo_megatron.trainer.actor import TrainActor
        from bpo_megatron.trainer.config import TrainerConfig

        torch.set_num_threads(threads)
        dist.init_process_group(backend=platform.distributed_backend(), init_method=f"tcp://{master}",
                                rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=30))
        self.cfg, self.rank = cfg, rank
        self.hf = cfg.hf_config()
        self.actor = TrainActor(
            self.hf, parallel=cfg.parallel, model=cfg.model.options(), loss=cfg.loss, optimizer=cfg.optimizer,
            trainer=TrainerConfig(micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature,
                                  seed=cfg.train.seed),
        )

    def ready(self) -> bool:
        return True

    def load_hf(self, directory: str) -> int:
        from bpo_megatron.convert import load_hf_weights

        loaded = load_hf_weights(self.actor.model, self.hf, directory)
        self.actor.reload_optimizer_params()
        return loaded

    def set_learning_rate(self, lr: float) -> None:
        self.actor.set_learning_rate(lr)

    def compute_logprobs(self, samples, record_routing: bool = False):
        return self.actor.compute_logprobs(samples, record_routing=record_routing)

    def train_step(self, minibatch) -> dict[str, float]:
        return self.actor.train_step(minibatch)

    def offload(self) -> int:
        return self.actor.offload()

    def onload(self) -> int:
        return self.actor.onload()

    def save(self, root: str, step: int, trainer_state: dict[str, Any], keep_last: int | None) -> str:
        return self.actor.save(root, trainer_state=trainer_state, keep_last=keep_last, step=step)

    def load(self, root: str, verify: bool = True) -> dict[str, Any]:
        return self.actor.load(root, verify=verify)

    def push_weights(self, engines: list, bucket_bytes: int, verify: bool, dtype: str | None = None) -> dict[str, Any]:
        """Stream the model as Hugging Face tensors; rank 0 sends them to every engine in buckets.

        Every rank takes part in gathering the shards; only rank 0 talks to the engines. ``dtype``
        (``fp32``/``bf16``) converts the tensors to the engines' precision first. An engine that
        dies meanwhile is left out of the rest and reported in ``failed`` (its position in
        ``engines``): the driver replaces it, while the trainer goes on. With ``verify``, rank 0
        also returns the fingerprints of what it sent for the equality check.
        """
        import ray

        from bpo_megatron.convert import iter_hf_weights
        from bpo_megatron.models.options import TORCH_DTYPES
        from bpo_megatron.rollout.checksums import fingerprint
        from bpo_megatron.rollout.weight_buckets import buckets, on_host, tensor_bytes

        start, sent, expected = time.perf_counter(), 0, {}
        alive, failed = list(range(len(engines))), []
        stream = on_host(iter_hf_weights(self.actor.model, self.hf, dst=0), TORCH_DTYPES[dtype] if dtype else None)
        for bucket in buckets(stream, bucket_bytes):
            if verify:
                expected.update((name, fingerprint(tensor)) for name, tensor in bucket)
            ref = ray.put(bucket)
            replies = [(i, engines[i].update_weights.remote(ref)) for i in alive]
            for i, reply in replies:
                try:
                    ray.get(reply)
                except ray.exceptions.RayActorError:
                    alive.remove(i)
                    failed.append(i)
            sent += sum(tensor_bytes(t) for _, t in bucket)
        return {"bytes": sent, "seconds": time.perf_counter() - start, "fingerprints": expected, "failed": failed}

    def shutdown(self) -> None:
        self.actor.close()
        dist.destroy_process_group()


class EngineWorker:
    """One rollout engine, built from the experiment's ``rollout`` section."""

    def __init__(self, cfg, model_dir: str, index: int, devices: tuple[int, ...] = ()) -> None:
        quiet_library_logs()
        from bpo_megatron.models.routing import RoutingLayout
        from bpo_megatron.rollout import EngineContext

        hf = cfg.hf_config()
        capture = cfg.rollout.capture_routed_experts and hf.num_experts > 0
        context = EngineContext(model_dir=model_dir, index=index, routing=RoutingLayout.of(hf) if capture else None,
                                threads=cfg.rollout.threads_per_engine, colocated=cfg.cluster.colocate,
                                devices=devices)
        self.engine = cfg.rollout.spec.build(cfg.rollout.options, context)

    def captures_routing(self) -> bool:
        return self.engine.capabilities.captures_routing

    def generate(self, requests):
        return self.engine.generate(requests)

    def update_weights(self, bucket) -> int:
        return self.engine.update_weights(bucket)

    def fingerprints(self) -> dict[str, str]:
        from bpo_megatron.rollout.checksums import fingerprints

        return fingerprints(self.engine.named_hf_weights())

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        self.engine.resume_memory(tags)

    def begin_weight_update(self, version: int) -> None:
        self.engine.begin_weight_update(version)

    def end_weight_update(self) -> None:
        self.engine.end_weight_update()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def healthy(self) -> bool:
        return self.engine.health().healthy

    def shutdown(self) -> None:
        self.engine.shutdown()
