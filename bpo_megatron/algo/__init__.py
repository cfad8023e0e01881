"""RL algorithm pieces that are not the policy loss: advantages."""

from bpo_megatron.algo.advantages import GroupAdvantages, group_advantages

__all__ = ["GroupAdvantages", "group_advantages"]
