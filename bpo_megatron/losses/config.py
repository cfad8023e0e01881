"""Typed configuration of the policy loss (owned by the loss component)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from bpo_megatron.losses.aggregation import AGGREGATIONS
from bpo_megatron.losses.corrections import CORRECTIONS
from bpo_megatron.losses.registry import POLICY_LOSSES
from bpo_megatron.losses.score_centering import SEQUENCE_LEVEL_CORRECTIONS, SEQUENCE_LEVEL_LOSSES


@dataclass(frozen=True)
class CorrectionConfig:
    """``loss.correction``: the engine/trainer mismatch correction (losses/corrections.py) — none,
    tis, mis or icepop — and its bounds. Any but none needs the trainer's recomputed log-probs of
    the behaviour weights (train.recompute_old_logprobs). Defaults: TIS and MIS caps 2 (Yao et al.;
    Liu et al.), IcePop's interval [0.5, 5]. ``loss.correction: tis`` is short for
    ``loss.correction: {name: tis}``."""

    SHORTHAND: ClassVar[str] = "name"

    name: str = "none"
    tis_cap: float = 2.0  # tis: each token's weight min(ρ_t, tis_cap)
    mis_cap: float = 2.0  # mis: a response whose sequence ratio ρ_seq exceeds this is dropped
    icepop_low: float = 0.5  # icepop: tokens with ρ_t below this are dropped
    icepop_high: float = 5.0  # icepop: tokens with ρ_t above this are dropped

    def __post_init__(self) -> None:
        if self.name not in CORRECTIONS:
            raise ValueError(f"loss.correction={self.name!r} is unknown; choose one of {sorted(CORRECTIONS)}")
        for cap in ("tis_cap", "mis_cap"):
            if not getattr(self, cap) >= 1:
                raise ValueError(f"loss.correction.{cap} must be >= 1 (it caps the behaviour ratio, which is 1 "
                                 f"when engine and trainer agree), got {getattr(self, cap)}")
        if not 0 < self.icepop_low <= 1 <= self.icepop_high:
            raise ValueError(f"loss.correction.icepop_low={self.icepop_low} and icepop_high={self.icepop_high} must "
                             "satisfy 0 < icepop_low <= 1 <= icepop_high (a token whose ratio is 1 is kept)")

    @property
    def active(self) -> bool:
        return self.name != "none"


@dataclass(frozen=True)
class PolicyLossConfig:
    """Which policy loss to use and its hyper-parameters.

    Defaults are the paper's settings: BPO ε=0.1, C=3.0; GRPO-ClipHigher clip interval
    [1-0.2, 1+0.28] (DAPO), which BPO's mask also uses; CISPO cap 3.0; DPPO δ=0.1; GSPO clip
    interval [1-3e-3, 1+5e-3]; ``seq-mean-token-mean`` aggregation. Beyond the paper: GRPO
    dual-clip bound c=3 (verl's ``clip_ratio_c``); SAPO temperatures τ_pos=1.0, τ_neg=1.05 (the
    SAPO paper's settings).
    """

    name: str = "bpo"  # the policy loss: a name of losses.registry.POLICY_LOSSES (docs/guide.md#policy-losses)
    eps_low: float = 0.2  # GRPO-ClipHigher's clip interval [1 - eps_low, 1 + eps_high], also BPO's mask
    eps_high: float = 0.28
    bpo_eps: float = 0.1  # BPO's ε, the smoothing of its mismatch weight ω
    bpo_cap: float = 3.0  # BPO's C, the cap of its weight min(ω, C) (>= 1)
    cispo_cap: float = 3.0  # CISPO's cap of the importance weight
    dppo_delta: float = 0.1  # DPPO's trust region δ (total variation or KL)
    dppo_ratio_cap: float = 10.0  # DPPO's c, the cap of its weight min(r, c)
    gspo_eps_low: float = 3e-3  # GSPO's clip interval of the sequence ratio [1 - gspo_eps_low, 1 + gspo_eps_high]
    gspo_eps_high: float = 5e-3
    # grpo_dualclip: a negative-advantage token whose ratio exceeds this is dropped as well.
    dual_clip_c: float = 3.0
    # sapo: temperature of the sigmoid gate for Â>0 (sapo_tau_pos) and for Â<0 tokens (sapo_tau_neg;
    # a larger τ narrows the gate).
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    agg: str = "seq-mean-token-mean"  # how token losses make the loss: a name of losses.aggregation.AGGREGATIONS
    # Constant divisor of each sequence's token sum for ``seq-mean-token-sum-norm`` (set it to
    # the maximum response length so it does not vary between micro-batches); None uses the
    # padded length T of the call.
    norm_length: int | None = None
    # |log π − log μ| is clamped to this before exponentiating into a ratio, so a wildly
    # off-policy token yields a huge but finite weight instead of inf/NaN.
    max_log_ratio: float = 20.0
    # Engine/trainer mismatch correction and its bounds (a name alone: its default bounds)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    # Score centering (losses/score_centering.py): an additive term built from the sampler's
    # top-k log-probs of each generated token, which the engines return when asked; its
    # coefficients weigh each candidate token as the loss (and correction) weighs the sampled one,
    # so it composes with every token-level loss and correction, not with GSPO's or MIS's
    # sequence-level weights. score_centering_top_k: how many (k)
    score_centering: bool = False
    score_centering_top_k: int = 32

    def __post_init__(self) -> None:
        if self.name not in POLICY_LOSSES:
            raise ValueError(
                f"PolicyLossConfig.name={self.name!r} is unknown; choose one of {sorted(POLICY_LOSSES)}"
            )
        if self.agg not in AGGREGATIONS:
            raise ValueError(
                f"PolicyLossConfig.agg={self.agg!r} is unknown; choose one of {sorted(AGGREGATIONS)}"
            )
        if not isinstance(self.correction, CorrectionConfig):  # YAML's shorthand is expanded by the loader
            raise TypeError(f"PolicyLossConfig.correction must be a CorrectionConfig, e.g. CorrectionConfig(name="
                            f"'tis'), got {self.correction!r}")
        if not self.dual_clip_c > 1:
            raise ValueError(f"PolicyLossConfig.dual_clip_c must be > 1 (it bounds the ratio of negative-advantage "
                             "tokens from above and must leave room above the on-policy ratio 1), "
                             f"got {self.dual_clip_c}")
        for setting in ("bpo_eps", "dppo_delta", "max_log_ratio", "sapo_tau_pos", "sapo_tau_neg"):
            value = getattr(self, setting)
            if not value > 0:
                raise ValueError(f"PolicyLossConfig.{setting} must be > 0, got {value}")
        # A cap below 1 would also shrink the on-policy weight (w = 1 when π = μ): every update
        # would be scaled down instead of only the off-policy ones bounded.
        for setting in ("bpo_cap", "cispo_cap", "dppo_ratio_cap"):
            value = getattr(self, setting)
            if not value >= 1:
                raise ValueError(f"PolicyLossConfig.{setting} must be >= 1 (it caps the importance weight, "
                                 f"which is 1 on-policy), got {value}")
        for setting in ("eps_low", "gspo_eps_low"):
            value = getattr(self, setting)
            if not 0 <= value < 1:
                raise ValueError(f"PolicyLossConfig.{setting} must be in [0, 1), got {value}")
        for setting in ("eps_high", "gspo_eps_high"):
            value = getattr(self, setting)
            if not value >= 0:
                raise ValueError(f"PolicyLossConfig.{setting} must be >= 0, got {value}")
        if self.score_centering and self.name in SEQUENCE_LEVEL_LOSSES:
            raise ValueError(f"loss.score_centering with loss.name={self.name}: its weight is a ratio of the whole "
                             "response, later tokens included, so the centering's expectation over one position's "
                             "token is not defined (losses/score_centering.py); use a token-level loss (e.g. "
                             "loss.name=grpo) or loss.score_centering=false")
        if self.score_centering and self.correction.name in SEQUENCE_LEVEL_CORRECTIONS:
            raise ValueError(f"loss.score_centering with loss.correction={self.correction.name}: its weight is a ratio of "
                             "the whole response, later tokens included, so the centering's expectation over one "
                             "position's token is not defined (losses/score_centering.py); use a token-level correction "
                             "(tis, icepop) or loss.score_centering=false")
        if self.score_centering_top_k < 1:
            raise ValueError(f"PolicyLossConfig.score_centering_top_k must be >= 1 (the sampler's most likely tokens "
                             f"the term is built from), got {self.score_centering_top_k}")
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(
                f"PolicyLossConfig.norm_length must be a positive token count or None, got {self.norm_length}"
            )
