"""Whether generation and training keep pace when the engines run on GPUs of their own: an
estimate of one step's rollout and training times, and the engines that make the rollout no
slower than the training (under ``train.async`` the next step's responses are generated while
a step trains, so the slower side sets the step's time and the other waits).

Times follow from stated assumptions, not measurements (the GPU kit measures rates on one GPU):

* the GPUs are H100 SXM: ``PEAK_FLOPS`` dense bf16 and ``HBM_BYTES_PER_S``;
* training runs at ``TRAIN_MFU`` of the peak over the trainer's GPUs, on the model's FLOPs as the
  trainer's balancer counts them (:class:`~bpo_megatron.trainer.balance.CostModel`: 2 FLOPs per
  active weight of the matrix products and causal attention, per position): forward and backward
  (3 forwards) over a step's samples, a forward more under full recompute, and the log-prob pass
  when ``train.recompute_old_logprobs`` is on;
* an SGLang decode step reads an engine GPU's share of the weights (every expert: a batch of
  in-flight requests routes to nearly all of them) and the KV cache of its requests, at
  ``DECODE_HBM_EFFICIENCY`` of the bandwidth, and yields one token per request in flight
  (:attr:`~bpo_megatron.planner.rollout.RolloutMemory.inflight`); responses have the lengths
  of the ``paper`` distribution (:mod:`bpo_megatron.planner.batches`), and a step lasts at least
  as long as its longest response's decoding.

Not counted: under ``train.async`` each weight update pauses the engines with ``retract``, and
SGLang prefills every request then in flight again (prompt and output so far) with the new weights;
that prefill adds to the rollout time of each step.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.planner.batches import LENGTH_DISTRIBUTIONS
from bpo_megatron.planner.rollout import ENGINE_BYTES

if TYPE_CHECKING:
    from bpo_megatron.planner.plan import Plan

PEAK_FLOPS = 989e12  # H100 SXM, dense bf16
HBM_BYTES_PER_S = 3.35e12  # H100 SXM
TRAIN_MFU = 0.25  # Megatron-Core MoE training, assumed
DECODE_HBM_EFFICIENCY = 0.5  # of the bandwidth a large-batch decode step reaches, assumed
TRAIN_FACTOR = 3.0  # forward, and the backward's two products per forward product
LENGTHS = "paper"
SEED = 0


@dataclass(frozen=True)
class StepTimes:
    rollout_s: float  # generating a step's responses on the planned engines
    train_s: float  # training on them (and the log-prob pass when on)
    engines: int  # the planned engines
    engines_to_keep_pace: int | None  # the fewest engines whose rollout is no slower than training; None: none is
    decode_step_s: float  # one decode step of an engine with its requests in flight
    response_tokens: int  # a step's, mean over the drawn lengths

    @property
    def waits(self) -> str:
        return "the trainer waits for the engines" if self.rollout_s > self.train_s else "the engines wait for the trainer"


def _lengths(plan: Plan) -> list[tuple[int, int]]:
    cfg = plan.cfg
    rng = random.Random(SEED)
    draw = LENGTH_DISTRIBUTIONS[LENGTHS].draw
    return [draw(rng, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens) for _ in range(cfg.responses_per_step)]


def forward_flops(plan: Plan, lengths: list[tuple[int, int]]) -> float:
    """A forward pass over samples of these (prompt, response) lengths: 2 FLOPs per matrix-product
    weight per position, attention included, by the balancer's cost model."""
    from bpo_megatron.trainer.balance import CostModel

    hf = plan.hf
    cost = CostModel.of(hf)
    matmul = plan.model_size[1] - (0 if hf.tie_word_embeddings else hf.vocab_size * hf.hidden_size)
    return 2.0 * matmul * sum(cost(p + r - 1) for p, r in lengths)


def train_seconds(plan: Plan, lengths: list[tuple[int, int]]) -> float:
    cfg = plan.cfg
    forward = forward_flops(plan, lengths)
    passes = TRAIN_FACTOR + (1.0 if cfg.model.options.recompute == "full" else 0.0)
    passes += 1.0 if cfg.train.recompute_old_logprobs else 0.0
    return forward * passes / (cfg.cluster.trainer_ranks * PEAK_FLOPS * TRAIN_MFU)


def decode_step_seconds(plan: Plan, mean_tokens: float) -> float:
    """One decode step of an engine GPU: its weights and the KV cache of its requests in flight,
    each at ``mean_tokens``, read once."""
    r = plan.rollout
    kv = r.inflight * mean_tokens * r.kv_bytes_per_token
    return (plan.model_size[0] * ENGINE_BYTES / r.profile.tp + kv) / (HBM_BYTES_PER_S * DECODE_HBM_EFFICIENCY)


def rollout_seconds(plan: Plan, lengths: list[tuple[int, int]], engines: int) -> float:
    responses = sum(r for _, r in lengths)
    # a request's cache grows from its prompt to its end: on average half its response is there
    mean_tokens = sum(p + r / 2 for p, r in lengths) / len(lengths)
    step = decode_step_seconds(plan, mean_tokens)
    waves = responses / (engines * plan.rollout.inflight)
    return max(waves, max(r for _, r in lengths)) * step


def step_times(plan: Plan, max_engines: int = 1024) -> StepTimes | None:
    """The estimate for ``plan`` (None without GPU engines planned)."""
    if plan.rollout is None or not plan.rollout.inflight or not plan.stages:
        return None
    lengths = _lengths(plan)
    engines = plan.cfg.rollout.num_engines
    train = train_seconds(plan, lengths)
    keep_pace = next((n for n in range(1, max_engines + 1) if rollout_seconds(plan, lengths, n) <= train), None)
    mean_tokens = sum(p + r / 2 for p, r in lengths) / len(lengths)
    return StepTimes(rollout_s=rollout_seconds(plan, lengths, engines), train_s=train, engines=engines,
                     engines_to_keep_pace=keep_pace, decode_step_s=decode_step_seconds(plan, mean_tokens),
                     response_tokens=math.ceil(sum(r for _, r in lengths)))
