"""What the checks share: a one-rank world, random checkpoints, a train actor, a timer."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.gpu_smoke.profiles import Profile


@contextlib.contextmanager
def single_rank_world(timeout_s: float = 300.0) -> Iterator[None]:
    """A torch.distributed world of this process alone (NCCL on a GPU, gloo on a CPU), as a
    trainer with world size 1 runs; torn down on exit."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if platform.has_cuda():
        torch.cuda.set_device(platform.device())
    dist.init_process_group(backend=platform.distributed_backend(), init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def synchronize() -> None:
    if platform.has_cuda():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    """Wall time of the block in seconds (device work included), stored as ``into[key]``."""
    synchronize()
    start = time.perf_counter()
    yield
    synchronize()
    into[key] = time.perf_counter() - start


def write_config(config: dict[str, Any], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def random_model_dir(config: dict[str, Any], directory: Path, *, seed: int) -> Path:
    """A random Hugging Face checkpoint of ``config`` (logits and router scores kept far from
    uniform, so a wrong weight or expert shows in log-probs)."""
    from bpo_megatron.testing.models import random_checkpoint

    if not (directory / "model.safetensors").exists() and not (directory / "model.safetensors.index.json").exists():
        random_checkpoint(write_config(config, directory) / "config.json", directory, seed=seed)
    return directory


def build_actor(profile: Profile, config: dict[str, Any], *, replay: bool, micro_batch_size: int,
                lr: float = 1e-5, weights: Path | None = None, temperature: float = 1.0):
    """A one-rank Megatron train actor in the profile's precision (bf16 + Megatron's distributed
    optimizer on a GPU; fp32 on a CPU), loaded from ``weights`` if given."""
    from bpo_megatron.losses import PolicyLossConfig
    from bpo_megatron.models import HFModelConfig, ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.trainer.actor import TrainActor
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings
    from bpo_megatron.weights.load import load_hf_weights

    hf = HFModelConfig.load(config)
    actor = TrainActor(
        hf, parallel=ParallelConfig(), model=ModelOptions(params_dtype=profile.dtype, routing_replay=replay),
        loss=PolicyLossConfig(name="bpo"), optimizer=OptimizerSettings(lr=lr),
        trainer=TrainerConfig(micro_batch_size=micro_batch_size, temperature=temperature),
    )
    if weights is not None:
        load_hf_weights(actor.model, hf, str(weights))
        actor.reload_optimizer_params()
    return actor


def train_samples(samples: list, advantages: torch.Tensor) -> list:
    """Training samples of engine samples (routing kept for R3), with the given advantages."""
    from bpo_megatron.trainer.samples import TrainSample

    return [TrainSample(tokens=s.tokens, response_start=s.prompt_tokens.numel(), rollout_logprobs=s.rollout_logprobs,
                        advantage=float(a), routed_experts=s.routed_experts) for s, a in zip(samples, advantages.tolist())]


def long_tailed(samples: list, *, seed: int, at_cap: float = 0.3, shortest: float = 1 / 16) -> list:
    """``samples`` (training samples) with their responses cut to RL's long-tailed lengths: a
    share ``at_cap`` keeps its whole response, the rest keep a log-uniform length between
    ``shortest`` of it and all of it (log μ and routing cut alike)."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(seed)
    cut = []
    for s in samples:
        full = s.num_response_tokens
        if float(torch.rand((), generator=gen)) < at_cap:
            keep = full
        else:
            low = math.log(max(1.0, full * shortest))
            keep = max(1, min(full, round(math.exp(low + float(torch.rand((), generator=gen)) * (math.log(full) - low)))))
        end = s.response_start + keep
        cut.append(replace(s, tokens=s.tokens[:end], rollout_logprobs=s.rollout_logprobs[:keep],
                           routed_experts=None if s.routed_experts is None else s.routed_experts[:end - 1],
                           old_logprobs=None if s.old_logprobs is None else s.old_logprobs[:keep],
                           train_mask=None if s.train_mask is None else s.train_mask[:keep]))
    return cut


def random_tokens(count: int, length: int, vocab: int, *, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (length,), generator=gen).tolist()) for _ in range(count)]


def same_expert_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per (token, layer): do two top-k expert lists name the same experts?"""
    return (a.long().sort(dim=-1).values == b.long().sort(dim=-1).values).all(dim=-1)


class DispatchRecorder:
    """The experts every Megatron router actually sent each token to, read from the routers'
    output ``routing_map`` whatever produced it (free routing or replay). One rank, no sequence
    parallelism."""

    def __init__(self, model: torch.nn.Module, topk: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.topk = topk
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.maps: list[list[torch.Tensor]] = [[] for _ in routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def record(_module, _args, output) -> None:
            self.maps[layer].append(output[1].detach().to("cpu"))
        return record

    def per_sample(self, samples: list, micro_batch_size: int) -> list[torch.Tensor]:
        """``[len(tokens) − 1, MoE layers, K]`` per sample, in sample order."""
        from bpo_megatron.trainer.samples import chunk

        for handle in self._handles:
            handle.remove()
        out = []
        for k, group in enumerate(chunk(samples, micro_batch_size)):
            layers = []
            for maps in self.maps:
                experts = maps[k].float().topk(self.topk, dim=-1).indices
                layers.append(experts.reshape(-1, len(group), self.topk))  # [s, b, K]
            routed = torch.stack(layers, dim=2)
            out += [routed[: s.tokens.numel() - 1, row] for row, s in enumerate(group)]
        return out


def device_name() -> str:
    return torch.cuda.get_device_name() if platform.has_cuda() else "cpu"
