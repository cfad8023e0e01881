"""Diagnostics every policy loss reports, kept as sums so they merge over micro-batches/ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from bpo_megatron.losses.terms import TokenTerms

# The masked share by the sign of Â and by the rollout probability μ of the token (where a band
# binds): μ < 0.2 (low), 0.2 ≤ μ < 0.9 (mid), μ ≥ 0.9 (high); absent for a bin without tokens.
MU_BIN_EDGES = (0.2, 0.9)
MU_BIN_METRICS = tuple(f"clip_frac_{sign}_mu_{bin_}" for sign in ("pos", "neg") for bin_ in ("low", "mid", "high"))
MEAN_METRICS = (
    "clip_frac",  # fraction of loss tokens the mask M drops
    "clip_frac_pos",  # ... among tokens with Â > 0
    "clip_frac_neg",  # ... among tokens with Â < 0
    *MU_BIN_METRICS,  # ... by sign and μ bin, in the order of ``bins`` in LossStatistics.compute
    "weight_mean",  # mean of the stop-gradient weight w
    "abs_logp_diff_mean",  # mean |log π − log μ|: train/rollout mismatch
    "kl_k3",  # k3 estimate of KL(μ‖π): r − 1 − log r with r = π/μ
    # with the trainer's recomputed behaviour log-probs π_old only (absent otherwise):
    "correction_weight_mean",  # mean correction weight (losses/corrections.py)
    "correction_drop_frac",  # fraction of loss tokens the correction drops
    # (under train.async π_old is the weights at the step's start, so these two add staleness)
    "mismatch_abs_logp_diff_mean",  # mean |log π_old − log μ|: engine/trainer numerics
    "mismatch_kl_k3",  # k3 estimate of KL(μ‖π_old)
    # with loss.score_centering only (absent otherwise; losses/score_centering.py):
    "score_centering_rho",  # mean tail ratio ρ: the sampler's mass off its top-k over the trainer's
    "score_centering_head_mass",  # mean sampler mass on its top-k
)
BEHAVIOUR_METRICS = MEAN_METRICS[-6:-2]
CENTERING_METRICS = MEAN_METRICS[-2:]
OPTIONAL_METRICS = BEHAVIOUR_METRICS + MU_BIN_METRICS + CENTERING_METRICS  # reported only where they have tokens
MAX_METRICS = ("weight_max",)


@dataclass
class LossStatistics:
    """Numerators/denominators of the mean metrics, maxima of the max metrics, and the token count."""

    numerators: torch.Tensor  # [len(MEAN_METRICS)]
    denominators: torch.Tensor  # [len(MEAN_METRICS)]
    maxima: torch.Tensor  # [len(MAX_METRICS)]

    @staticmethod
    def compute(terms: TokenTerms, weight: torch.Tensor, keep: torch.Tensor, *, behaviour: TokenTerms | None = None,
                correction: tuple[torch.Tensor, torch.Tensor] | None = None,
                centering: tuple[torch.Tensor, torch.Tensor] | None = None) -> "LossStatistics":
        """``weight``/``keep``: the loss's own; ``behaviour``: π_old against μ, and ``correction``
        the correction's (weight, keep) applied on top; ``centering``: score centering's (ρ, the
        sampler's top-k mass) per token."""
        mask = terms.mask
        dropped = mask & ~keep
        pos, neg = mask & terms.positive, mask & terms.negative
        count = mask.sum()
        mu = terms.rollout_logprobs.exp()
        low, high = mu < MU_BIN_EDGES[0], mu >= MU_BIN_EDGES[1]
        bins = [side & in_bin for side in (pos, neg) for in_bin in (low, ~low & ~high, high)]
        zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
        w = torch.where(mask, weight, zero)
        abs_diff = torch.where(mask, (terms.logprobs - terms.rollout_logprobs).abs(), zero)
        k3 = torch.where(mask, terms.ratio - 1.0 - terms.log_ratio, zero)
        if behaviour is not None and correction is not None:
            extra = [torch.where(mask, correction[0], zero).sum(), (mask & ~correction[1]).sum(),
                     torch.where(mask, (behaviour.logprobs - behaviour.rollout_logprobs).abs(), zero).sum(),
                     torch.where(mask, behaviour.ratio - 1.0 - behaviour.log_ratio, zero).sum()]
            extra_counts = [count] * 4
        else:
            extra, extra_counts = [zero] * 4, [zero] * 4
        if centering is not None:
            extra += [torch.where(mask, centering[0].to(zero.dtype), zero).sum(),
                      torch.where(mask, centering[1].to(zero.dtype), zero).sum()]
            extra_counts += [count] * 2
        else:
            extra, extra_counts = extra + [zero] * 2, extra_counts + [zero] * 2
        numerators = torch.stack(
            [dropped.sum(), (dropped & pos).sum(), (dropped & neg).sum(), *[(dropped & b).sum() for b in bins],
             w.sum(), abs_diff.sum(), k3.sum(), *extra]
        ).to(torch.float64)
        denominators = torch.stack([count, pos.sum(), neg.sum(), *[b.sum() for b in bins], count, count, count,
                                    *extra_counts]).to(torch.float64)
        # the masked-out cells of w are 0, the maximum of a mask without tokens
        weight_max = w.max() if w.numel() else zero
        return LossStatistics(numerators, denominators, weight_max.reshape(1).to(torch.float64))

    def merge(self, other: "LossStatistics") -> "LossStatistics":
        return LossStatistics(
            self.numerators + other.numerators,
            self.denominators + other.denominators,
            torch.maximum(self.maxima, other.maxima),
        )

    def all_reduce(self, group: dist.ProcessGroup | None = None) -> "LossStatistics":
        """Combine the statistics of every rank of ``group`` (e.g. data parallel)."""
        sums = torch.cat([self.numerators, self.denominators])
        maxima = self.maxima.clone()
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        n = len(MEAN_METRICS)
        return LossStatistics(sums[:n], sums[n:], maxima)

    def as_metrics(self) -> dict[str, float]:
        return self.metrics_of(self.packed().tolist())

    def packed(self) -> torch.Tensor:
        """Everything :meth:`metrics_of` needs in one float64 tensor (read to the host at once)."""
        return torch.cat([self.numerators, self.denominators, self.maxima])

    @staticmethod
    def metrics_of(values: list[float]) -> dict[str, float]:
        """The metrics from :meth:`packed`'s values on the host."""
        n = len(MEAN_METRICS)
        numerators, denominators, maxima = values[:n], values[n : 2 * n], values[2 * n :]
        metrics = {name: numerator / max(count, 1.0)
                   for name, numerator, count in zip(MEAN_METRICS, numerators, denominators, strict=True)
                   if count > 0 or name not in OPTIONAL_METRICS}
        metrics.update(zip(MAX_METRICS, maxima, strict=True))
        metrics["num_tokens"] = denominators[0]
        return metrics
