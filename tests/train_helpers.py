"""What tests run inside gloo ranks share: the tiny Qwen3-MoE, samples, and the one way tests
build a train actor (pytest fixtures live in ``conftest.py``; rank functions cannot use them)."""

from __future__ import annotations

from pathlib import Path

import torch

from bpo_megatron.trainer.samples import TrainSample

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Qwen3-30B-A3B's published config.json: the recipes' own copy is the one the tests read
QWEN3_30B_A3B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3_30b_a3b"
TINY_MOE = FIXTURES / "tiny_qwen3_moe" / "config.json"


def tiny_moe():
    from bpo_megatron.models import HFModelConfig

    return HFModelConfig.load(TINY_MOE)


def random_routing(n: int, hf, gen: torch.Generator) -> torch.Tensor:
    """Distinct top-k expert ids for n positions of every MoE layer."""
    scores = torch.rand(n, len(hf.moe_layers), hf.num_experts, generator=gen)
    return scores.argsort(dim=-1)[..., : hf.num_experts_per_tok]


def make_samples(count: int, *, seed: int, routing: bool = False, hf=None) -> list[TrainSample]:
    """Prompts of 2–5 and responses of 2–7 tokens; advantages of both signs (for ``hf``, by
    default the tiny MoE)."""
    hf = hf or tiny_moe()
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = int(torch.randint(2, 6, (1,), generator=gen))
        response = int(torch.randint(2, 8, (1,), generator=gen))
        tokens = torch.randint(0, hf.vocab_size, (prompt + response,), generator=gen)
        samples.append(TrainSample(
            tokens=tokens,
            response_start=prompt,
            rollout_logprobs=-torch.rand(response, generator=gen) * 4 - 3,
            advantage=(1.0 if i % 2 == 0 else -1.0) * (0.5 + i / count),
            routed_experts=random_routing(prompt + response - 1, hf, gen) if routing else None,
        ))
    return samples


def samples_of_lengths(positions: tuple[int, ...], prompts: tuple[int, ...], *, seed: int, old_spread: float,
                       masked: tuple[int, ...] = (), hf=None) -> list[TrainSample]:
    """Samples of the given input positions (len(tokens) − 1) and prompt lengths with R3 routing,
    log μ, log π_old within ``old_spread`` of it (clamped to ≤ 0), advantages of both signs, and
    for the samples ``masked`` a ``train_mask`` leaving some response tokens out (never the last)."""
    hf = hf or tiny_moe()
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, (length, prompt) in enumerate(zip(positions, prompts)):
        response = length + 1 - prompt
        rollout = -torch.rand(response, generator=gen) * 2 - 0.5
        old = (rollout + (torch.rand(response, generator=gen) * 2 - 1) * old_spread).clamp(max=0.0)
        train_mask = None
        if i in masked:
            train_mask = torch.rand(response, generator=gen) > 0.4
            train_mask[-1] = True
        samples.append(TrainSample(
            tokens=torch.randint(0, hf.vocab_size, (length + 1,), generator=gen), response_start=prompt,
            rollout_logprobs=rollout, advantage=(1.0 if i % 3 else -1.5) * (0.5 + i / 8),
            routed_experts=random_routing(length, hf, gen), old_logprobs=old, train_mask=train_mask))
    return samples


def build_actor(hf=None, *, tp=1, pp=1, ep=1, etp=None, replay=False, recompute="none", lr=1e-3, loss="bpo",
                micro_batch_size=2, grad_clip=1.0, temperature=1.0, weights: str | None = None,
                max_tokens_per_micro_batch=0):
    """A train actor of ``hf`` (an ``HFModelConfig``, a config dict or path; the tiny MoE by
    default) in the current gloo world; ``loss``: a loss name or a ``PolicyLossConfig``;
    ``weights``: a Hugging Face directory to load. Release it with ``actor.close()``."""
    from bpo_megatron.weights import load_hf_weights
    from bpo_megatron.losses import PolicyLossConfig
    from bpo_megatron.models import HFModelConfig, ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.trainer.actor import TrainActor
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings

    hf = tiny_moe() if hf is None else hf if isinstance(hf, HFModelConfig) else HFModelConfig.load(hf)
    actor = TrainActor(
        hf,
        parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp),
        model=ModelOptions(routing_replay=replay, recompute=recompute),
        loss=loss if isinstance(loss, PolicyLossConfig) else PolicyLossConfig(name=loss),
        optimizer=OptimizerSettings(lr=lr, grad_clip=grad_clip),
        trainer=TrainerConfig(micro_batch_size=micro_batch_size, temperature=temperature,
                              max_tokens_per_micro_batch=max_tokens_per_micro_batch),
    )
    if weights is not None:
        load_hf_weights(actor.model, hf, weights)
        actor.reload_optimizer_params()
    return actor


def flat_params(actor) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in actor.model.named_parameters()}
