"""The checks of the smoke run, by name; each is ``run(profile, workdir) -> Outcome`` in a module
of this package, imported only in the process that runs it."""

from __future__ import annotations

from collections.abc import Callable

from bpo_megatron.registry import LazyRegistry

# name -> module; run in this order (cheap correctness first, the long runs last: the throughput
# step, then the RL loop through Ray)
CHECKS = LazyRegistry({
    "trainer_step": "bpo_megatron.gpu_smoke.checks.trainer_step",
    "logprobs_kernel": "bpo_megatron.gpu_smoke.checks.logprobs_kernel",
    "engine_replay": "bpo_megatron.gpu_smoke.checks.engine_replay",
    "ipc_weights": "bpo_megatron.gpu_smoke.checks.ipc_weights",
    "trainer_offload": "bpo_megatron.gpu_smoke.checks.trainer_offload",
    "driver_payloads": "bpo_megatron.gpu_smoke.checks.driver_payloads",
    "rollout_decode": "bpo_megatron.gpu_smoke.checks.rollout_decode",
    "fp8_rollout": "bpo_megatron.gpu_smoke.checks.fp8_rollout",
    "rl_throughput": "bpo_megatron.gpu_smoke.checks.rl_throughput",
    "train_fast_paths": "bpo_megatron.gpu_smoke.checks.train_fast_paths",
    "rl_loop": "bpo_megatron.gpu_smoke.checks.rl_loop",
}, unknown="unknown check {name!r}; choose from {listed}")


def check_function(name: str) -> Callable:
    return CHECKS.load(name).run
