"""Host memory of the driver: it holds one step's samples twice (as the engines return them, and as
training samples with advantages) besides Python, Ray's client and the datasets."""

from __future__ import annotations

import math

GiB = 2**30
DRIVER_BASE_GIB = 16  # interpreter, Ray client, tokenizer, prompt datasets, metrics


def step_sample_bytes(cfg) -> int:
    """Bytes of one step's samples at their longest: per token its id (int64), log μ (fp32) and,
    with routing replay, its routed experts (uint8 per MoE layer and top-k slot; counted when the
    model's config is readable here: a launch may name a checkpoint only the cluster has)."""
    routing = 0
    if cfg.model.routing_replay:
        try:
            hf = cfg.hf_config()
        except (OSError, ValueError):
            hf = None
        routing = len(hf.moe_layers) * hf.num_experts_per_tok if hf is not None else 0
    per_token = 8 + 4 + routing
    tokens = cfg.train.prompts_per_step * cfg.rollout.group_size * (cfg.data.max_prompt_tokens
                                                                       + cfg.rollout.max_new_tokens)
    return tokens * per_token


def driver_memory_gib(cfg) -> int:
    """What the driver's host (a Slurm head node step, a KubeRay head pod) should have."""
    return math.ceil(2 * step_sample_bytes(cfg) / GiB) + DRIVER_BASE_GIB
