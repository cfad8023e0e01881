"""Shaping a step's batch before the update (DAPO): dynamic sampling and soft overlong punishment.

* **Dynamic sampling** (``train.dynamic_sampling``): a group whose responses all earned the same
  reward has zero advantage everywhere and teaches nothing, yet dilutes the batch. Such groups
  are dropped and more prompts are drawn (at most ``train.dynamic_sampling_max_rounds`` rounds in
  all) until ``train.prompts_per_step`` groups with varied rewards are in hand. If the rounds run
  out first, the batch is filled with dropped groups (zero advantage: they change nothing), so the
  batch keeps its size and its split into minibatches and data-parallel shares.
* **Soft overlong punishment** (``train.overlong_buffer`` L_c, ``train.overlong_penalty`` f): with
  L = ``rollout.max_new_tokens``, a response of |y| tokens gets
  ``f · min(0, ((L − L_c) − |y|) / L_c)`` added to its reward: nothing up to L − L_c tokens, then a
  penalty growing linearly to −f at the length limit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bpo_megatron.rollout import Sample

# draw(prompts, round) -> (samples grouped by prompt, the verifier's rewards)
Draw = Callable[[int, int], tuple[list[Sample], torch.Tensor]]


def varied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: the groups whose rewards are not all equal."""
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) > grouped.amin(dim=1)


def dynamic_batch(draw: Draw, groups_wanted: int, group_size: int, max_rounds: int
                  ) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
    """``groups_wanted`` groups, those with varied rewards first (see the module docstring)."""
    kept: list[tuple[list[Sample], torch.Tensor]] = []
    dropped: list[tuple[list[Sample], torch.Tensor]] = []
    drawn = rounds = 0
    while len(kept) < groups_wanted and rounds < max_rounds:
        samples, rewards = draw(groups_wanted - len(kept), rounds)
        rounds += 1
        for group, varied in enumerate(varied_groups(rewards, group_size).tolist()):
            span = slice(group * group_size, (group + 1) * group_size)
            (kept if varied else dropped).append((samples[span], rewards[span]))
        drawn += rewards.numel() // group_size
    filled = max(0, groups_wanted - len(kept))
    chosen = kept[:groups_wanted] + dropped[:filled]
    metrics = {"dynamic/rounds": float(rounds), "dynamic/drawn_groups": float(drawn),
               "dynamic/kept_frac": len(kept) / drawn, "dynamic/filled_groups": float(filled)}
    return [s for samples, _ in chosen for s in samples], torch.cat([r for _, r in chosen]), metrics


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of ``lengths`` tokens (≤ 0, see above)."""
    free = max_tokens - buffer
    return factor * ((free - lengths.to(torch.float32)) / buffer).clamp(min=-1.0, max=0.0)


def punish_overlong(samples: list[Sample], rewards: torch.Tensor, max_tokens: int, buffer: int, factor: float
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards with the overlong penalty added, and what it took."""
    lengths = torch.tensor([s.response_tokens.numel() for s in samples])
    penalty = overlong_penalty(lengths, max_tokens, buffer, factor)
    return rewards + penalty, {"overlong/penalty_mean": float(penalty.mean()),
                               "overlong/penalized_frac": float((penalty < 0).float().mean())}
