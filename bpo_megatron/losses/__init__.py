"""The policy-loss family: BPO, GRPO-ClipHigher, GSPO, CISPO and DPPO (TV and binary-KL); GRPO
dual-clip, SAPO, and the two halves of BPO each paired with the other half of GRPO.

    from bpo_megatron.losses import PolicyLossConfig, compute_policy_loss, POLICY_LOSSES
    loss, metrics = compute_policy_loss(logprobs, rollout_logprobs, advantages, loss_mask,
                                        PolicyLossConfig(name="bpo"))
"""

from bpo_megatron.losses import family as _family  # noqa: F401  (registers the built-in losses)
from bpo_megatron.losses.aggregation import AGGREGATIONS, BatchTotals
from bpo_megatron.losses.config import CorrectionConfig, PolicyLossConfig
from bpo_megatron.losses.core import compute_policy_loss, policy_loss
from bpo_megatron.losses.registry import POLICY_LOSSES, PolicyLoss, register_policy_loss
from bpo_megatron.losses.statistics import LossStatistics
from bpo_megatron.losses.terms import TokenTerms
from bpo_megatron.losses.validation import DeferredChecks

__all__ = [
    "AGGREGATIONS",
    "BatchTotals",
    "LossStatistics",
    "POLICY_LOSSES",
    "PolicyLoss",
    "CorrectionConfig",
    "DeferredChecks",
    "PolicyLossConfig",
    "TokenTerms",
    "compute_policy_loss",
    "policy_loss",
    "register_policy_loss",
]
