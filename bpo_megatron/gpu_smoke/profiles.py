"""How big each check runs: one profile for a GPU, one tiny profile for a CPU (CI)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from bpo_megatron.testing.models import qwen3_moe_config

# Dense bf16 tensor-core peaks (no sparsity) from NVIDIA's data sheets; MFU is measured against them.
BF16_PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989.4e12, "H200": 989.4e12,
                   "A100": 312e12}

# Data-sheet memory bandwidth (bytes/s); a decode step reads every weight and the KV cache once,
# so bytes read per step / step time against this is how close decoding runs to its floor.
HBM_PEAK_BYTES_PER_S = {"H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "H200": 4.8e12,
                        "A100": 2.039e12}


def _by_device_name(table: dict[str, float], device_name: str) -> float | None:
    for key in sorted(table, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if all(part in device_name for part in key.split()):
            return table[key]
    return None


def bf16_peak_flops(device_name: str) -> float | None:
    """The data-sheet bf16 peak of a GPU named like ``NVIDIA H100 80GB HBM3`` (None if unknown)."""
    return _by_device_name(BF16_PEAK_FLOPS, device_name)


def hbm_peak_bytes_per_s(device_name: str) -> float | None:
    """The data-sheet memory bandwidth of a GPU named like ``NVIDIA H100 80GB HBM3`` (None if unknown)."""
    return _by_device_name(HBM_PEAK_BYTES_PER_S, device_name)


@dataclass(frozen=True)
class DecodePoint:
    """A context at which ``rollout_decode`` times the replayed decode step: ``label`` names its
    numbers (the GPU's context: ``ctx576``), ``context`` the keys and values each row attends over
    (the label's on a GPU, scaled down on a CPU)."""

    label: str
    context: int


@dataclass(frozen=True)
class Profile:
    device: str  # "cuda" or "cpu"
    dtype: str  # the trainer's and engines' precision: "bf16" on a GPU, "fp32" on a CPU
    small_model: dict[str, Any]  # correctness checks
    large_model: dict[str, Any]  # throughput (~1B parameters on a GPU)
    # training MFU of a model of Qwen3-30B-A3B's exact layer shapes with few layers and its vocabulary
    slice_model: dict[str, Any]
    recipe_micro_batch_positions: int  # configs/qwen3_moe_1gpu.yaml's trainer.max_tokens_per_micro_batch
    kernel_tokens: tuple[int, ...]
    kernel_vocab: int
    kernel_repeats: int
    engine_prompts: int
    engine_n: int
    engine_new_tokens: int
    rl_prompts: int
    rl_n: int
    rl_prompt_tokens: int
    rl_new_tokens: int
    rl_micro_batch: int
    decode_sequences: tuple[int, ...]  # rows decoded together, each size timed on both decode paths
    decode_prompt_tokens: int
    decode_new_tokens: int
    decode_scored_tokens: int  # the eager loop's responses, and the tokens of each path scored against a recompute
    decode_points: tuple[DecodePoint, ...]  # contexts the replayed step is timed at (largest size)
    decode_point_steps: int  # replays timed at each point
    ipc_bytes: int  # size of the raw buffer the IPC bandwidth is measured with
    # rl_loop: RL steps of configs/qwen3_moe_1gpu.yaml through `bpo-megatron train` (the steady state is
    # the median of steps ≥ 3: at least 4), with these overrides ({models}: the recipes' model directory)
    loop_steps: int
    loop_overrides: tuple[str, ...]
    loop_routing_min: float  # the trainer's own routing equals the engine's on at least this share
    # Stated tolerances (see docs/gpu-validation.md for why these values)
    loss_rel_tol: float  # step-0 loss vs the fp32 CPU reference, relative
    logp_mean_tol: float  # mean |log π − reference| over response tokens, nats
    tags: dict[str, str] = field(default_factory=dict)


GPU = Profile(
    device="cuda", dtype="bf16",
    small_model=qwen3_moe_config(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                           num_hidden_layers=4, num_experts=16, num_experts_per_tok=4,
                           vocab_size=16384, max_position_embeddings=4096),
    large_model=qwen3_moe_config(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                           num_hidden_layers=16, num_experts=32, num_experts_per_tok=4,
                           vocab_size=151936, max_position_embeddings=4096),
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B) but 4 of its 48 layers: ≈ 3.1 B parameters;
    # `bpo-megatron plan` puts its training at 32,768 positions a micro-batch at 98.9 GB (fits an H200)
    slice_model=qwen3_moe_config(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                 num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                 num_hidden_layers=4, num_experts=128, num_experts_per_tok=8,
                                 vocab_size=151936, max_position_embeddings=40960),
    recipe_micro_batch_positions=32768,
    kernel_tokens=(4096, 16384), kernel_vocab=151936, kernel_repeats=5,
    engine_prompts=8, engine_n=4, engine_new_tokens=128,
    rl_prompts=16, rl_n=4, rl_prompt_tokens=64, rl_new_tokens=1024, rl_micro_batch=4,
    decode_sequences=(64, 256), decode_prompt_tokens=64, decode_new_tokens=256, decode_scored_tokens=64,
    # today's rollout (64 prompt + 256 new tokens: 192 on average) and RL-shaped ones (512 or 1,024
    # prompt tokens + 128 new)
    decode_points=(DecodePoint("ctx192", 192), DecodePoint("ctx576", 576), DecodePoint("ctx1088", 1088)),
    decode_point_steps=32,
    ipc_bytes=2 * 2**30,
    loop_steps=4, loop_overrides=(),  # the recipe as written: the kit's throughput model, bf16
    # a capture misaligned by a token or a layer agrees on ~0% of (token, layer) pairs; bf16 near-ties
    # flipped 2.5% of them between engine and trainer in engine_replay (H100), random weights more
    loop_routing_min=0.9,
    # bf16 keeps 8 significant bits (relative rounding 2^-9 ≈ 2e-3 per operation); through a few
    # layers and a 16k-way softmax that accumulates to ~1e-2 in log-probs.
    loss_rel_tol=2e-2, logp_mean_tol=0.1,
)

CPU = Profile(
    device="cpu", dtype="fp32",
    small_model=qwen3_moe_config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                           vocab_size=512, max_position_embeddings=256),
    large_model=qwen3_moe_config(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                           vocab_size=1024, max_position_embeddings=256),
    slice_model=qwen3_moe_config(hidden_size=64, intermediate_size=128, moe_intermediate_size=24,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                 num_hidden_layers=2, num_experts=16, num_experts_per_tok=4,
                                 vocab_size=2048, max_position_embeddings=256),
    recipe_micro_batch_positions=256,
    kernel_tokens=(256,), kernel_vocab=8192, kernel_repeats=2,
    engine_prompts=4, engine_n=2, engine_new_tokens=12,
    rl_prompts=4, rl_n=2, rl_prompt_tokens=8, rl_new_tokens=24, rl_micro_batch=4,
    decode_sequences=(4, 8), decode_prompt_tokens=8, decode_new_tokens=16, decode_scored_tokens=12,
    decode_points=(DecodePoint("ctx192", 12), DecodePoint("ctx576", 36), DecodePoint("ctx1088", 68)),
    decode_point_steps=4,
    ipc_bytes=16 * 2**20,
    loop_steps=4,
    loop_overrides=(  # the CPU demo's model in fp32, no GPU, short responses, one engine thread
        "model.path={models}/tiny_qwen3_moe", "model.params_dtype=fp32", "cluster.gpus_per_node=0",
        "cluster.gpus_per_trainer_rank=0", "cluster.gpus_per_engine=0", "rollout.hf.dtype=fp32",
        "rollout.threads_per_engine=1", "rollout.max_new_tokens=8", "train.prompts_per_step=8",
        "trainer.max_tokens_per_micro_batch=64"),
    loop_routing_min=0.99,
    loss_rel_tol=1e-5, logp_mean_tol=1e-4,  # fp32 against fp32: summation order only
)

PROFILES = {"cuda": GPU, "cpu": CPU}


def finite(*values: float) -> bool:
    return all(math.isfinite(float(v)) for v in values)
