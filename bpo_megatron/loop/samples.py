"""From scored samples to training samples: group-normalised advantages and response statistics."""

from __future__ import annotations

import dataclasses

import torch

from bpo_megatron.algo import group_advantages
from bpo_megatron.rollout import Sample
from bpo_megatron.trainer.samples import TrainSample


def training_samples(samples: list[Sample], rewards: torch.Tensor, group_size: int, *, keep_routing: bool,
                     asynchronous: bool = False) -> tuple[list[TrainSample], dict[str, float]]:
    """Samples arrive grouped (the G responses of a prompt together), as advantages need.

    With ``keep_routing`` (R3) the response tokens whose recorded routing is not the one they were
    sampled with (``Sample.routing_valid``: SGLang re-prefilled them after a weight update) are left
    out of the loss, since replaying it would train them against experts that did not produce
    their μ (all the tokens of a response SGLang retracted for KV space, whose share of the samples
    is ``rollout/retracted_frac``); under ``asynchronous`` (train.async, where updates reach generations under way) their
    share of the step's model tokens is reported as ``async/r3_masked_frac``.

    Tokens the environment inserted into a multi-turn response (``Sample.from_environment``: a
    tool's output) are never trained on: the model did not sample them. Such steps also report
    ``agent/tool_calls_mean`` (environment turns per response) and ``agent/env_token_frac``.

    ``rollout/neg_log_mu_mean``: the mean −log μ of the model's sampled tokens, an entropy proxy
    (its expectation under μ is the sampling policy's entropy at the states visited).
    """
    advantages, metrics = group_advantages(rewards, group_size)
    train = [TrainSample(tokens=s.tokens, response_start=s.prompt_tokens.numel(),
                         rollout_logprobs=s.rollout_logprobs, advantage=float(a),
                         routed_experts=s.routed_experts if keep_routing else None,
                         train_mask=_train_mask(s, keep_routing), sampler_head_ids=s.sampler_head_ids,
                         sampler_head_logprobs=s.sampler_head_logprobs)
             for s, a in zip(samples, advantages.tolist())]
    lengths = torch.tensor([s.response_tokens.numel() for s in samples], dtype=torch.float32)
    metrics.update(response_length_mean=float(lengths.mean()), response_length_max=float(lengths.max()),
                   truncated_frac=sum(s.finish_reason == "length" for s in samples) / len(samples))
    model_tokens = sum(int(s.model_tokens.sum()) for s in samples)
    # an entropy proxy: the mean surprisal −log μ of the tokens the model sampled (the environment's
    # tokens have none). Its expectation under μ is the policy's entropy at the visited states.
    surprisal = sum(float(-s.rollout_logprobs[s.model_tokens].double().sum()) for s in samples)
    metrics["rollout/neg_log_mu_mean"] = surprisal / max(model_tokens, 1)
    if keep_routing:  # responses SGLang retracted for KV space: their routing is not what sampled them, masked
        metrics["rollout/retracted_frac"] = sum(s.retracted_for_space for s in samples) / len(samples)
    if keep_routing and asynchronous:
        masked = sum(int((s.model_tokens & ~s.routing_valid).sum()) for s in samples if s.routing_valid is not None)
        metrics["async/r3_masked_frac"] = masked / max(model_tokens, 1)
    if any(s.from_environment is not None for s in samples):
        metrics["agent/tool_calls_mean"] = sum(environment_turns(s) for s in samples) / len(samples)
        metrics["agent/env_token_frac"] = 1.0 - model_tokens / max(float(lengths.sum()), 1.0)
    metrics.update(turn_metrics(samples, model_tokens, keep_routing=keep_routing))
    return train, metrics


def turn_metrics(samples: list[Sample], model_tokens: int, *, keep_routing: bool) -> dict[str, float]:
    """How the later turns of multi-turn responses met the engines (``Sample.conversation``; none
    for single-turn samples): ``rollout/multi_turn_hop_frac``, the later turns served by another
    engine than the turn before; ``rollout/prefix_cache_hit_rate``, the share of the earlier
    positions those turns fed that the engine took from its prefix cache (engines that report it);
    under R3 ``rollout/multi_turn_prefix_recomputed_frac``, the later turns sampled after a routing
    of those positions other than the replayed one, and ``rollout/r3_prefix_mismatch_frac``, their
    share of the model tokens (masked for R3)."""
    stats = [s.conversation for s in samples if s.conversation is not None]
    later = sum(c.later_turns for c in stats)
    if not later:
        return {}
    metrics = {"rollout/multi_turn_hop_frac": sum(c.hops for c in stats) / later}
    prefix = sum(c.prefix_tokens for c in stats)
    if prefix:
        metrics["rollout/prefix_cache_hit_rate"] = sum(c.cached_prefix_tokens for c in stats) / prefix
    if keep_routing:
        metrics["rollout/multi_turn_prefix_recomputed_frac"] = sum(c.recomputed_turns for c in stats) / later
        metrics["rollout/r3_prefix_mismatch_frac"] = sum(s.prefix_rerouted_tokens for s in samples) / max(model_tokens, 1)
    return metrics


def _train_mask(sample: Sample, keep_routing: bool) -> torch.Tensor | None:
    """The response tokens the loss trains on: the model's own, and under R3 only those whose
    recorded routing sampled them; None: all."""
    mask = sample.model_tokens if sample.from_environment is not None else None
    if keep_routing and sample.routing_valid is not None:
        mask = sample.routing_valid if mask is None else mask & sample.routing_valid
    return mask


def environment_turns(sample: Sample) -> int:
    """How many times the environment answered within ``sample`` (its runs of environment tokens)."""
    if sample.from_environment is None:
        return 0
    env = sample.from_environment.to(torch.int8)
    return int(((env[1:] - env[:-1]) == 1).sum()) + int(env[:1].sum())


def with_old_logprobs(trainer, samples: list[TrainSample]) -> list[TrainSample]:
    """The samples with the trainer's log π_old of each response token under the current weights
    (one forward pass over the batch, routing replayed as in training): the weights that sampled
    them in the synchronous loop; under train.async the newer weights of the step's start, so π_old
    carries the responses' staleness (decoupled PPO). Samples that carry the sampler's top-k
    (score centering) get π_old's log-probs of those ids too."""
    scored = trainer.compute_logprobs(samples)
    heads = scored.head_logprobs or [None] * len(samples)
    return [dataclasses.replace(sample, old_logprobs=logprobs, old_head_logprobs=head)
            for sample, logprobs, head in zip(samples, scored.logprobs, heads, strict=True)]
