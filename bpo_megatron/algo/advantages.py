"""Group-relative advantages (paper eq. 2): Â_i = (R_i − mean_group(R)) / std_group(R)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class GroupAdvantages(NamedTuple):
    advantages: torch.Tensor  # [N] per response, N = num_groups · group_size
    metrics: dict[str, float]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> GroupAdvantages:
    """Per-response advantages from rewards laid out group by group.

    Args:
        rewards: [N] rewards; responses ``g*group_size ... (g+1)*group_size-1`` share prompt g.
        group_size: responses per prompt (G).
        normalize_std: divide by the group's standard deviation (paper, GRPO); False keeps only
            the mean baseline (Dr. GRPO).
        eps: a group whose reward std is at most ``eps`` carries no learning signal; its
            advantages are exactly 0 (not ±noise/eps).

    Returns:
        ``(advantages, metrics)``; metrics count the groups with zero spread
        (``zero_std_groups``, ``zero_std_frac``) and summarise the rewards.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a positive multiple of group_size={group_size}"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contains non-finite values; fix the reward function before training")
    grouped = rewards.to(torch.float64).view(-1, group_size)
    mean = grouped.mean(dim=-1, keepdim=True)
    # Unbiased std (torch's default), as GRPO implementations use; a single-response group has none.
    std = grouped.std(dim=-1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    degenerate = std <= eps
    centred = grouped - mean
    advantages = centred / std.clamp(min=eps) if normalize_std else centred
    advantages = torch.where(degenerate, 0.0, advantages)
    num_groups = grouped.shape[0]
    zero_std = int(degenerate.sum())
    metrics = {
        "num_groups": float(num_groups),
        "zero_std_groups": float(zero_std),
        "zero_std_frac": zero_std / num_groups,
        "reward_mean": float(grouped.mean()),
        "reward_std": float(grouped.std()) if grouped.numel() > 1 else 0.0,
        "advantage_abs_mean": float(advantages.abs().mean()),
    }
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return GroupAdvantages(advantages.reshape(-1).to(out_dtype), metrics)
