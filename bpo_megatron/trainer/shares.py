"""A batch's data-parallel shares, decided once: checked, split and totalled the same way by the
driver that sends each share (:class:`~bpo_megatron.orchestration.groups.TrainerGroup`) and by a
rank given the whole batch (:meth:`~bpo_megatron.trainer.actor.TrainActor.train_step`), so both
refuse alike and put results back in sample order alike. Light: no model, no Megatron."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bpo_megatron.losses import BatchTotals, PolicyLossConfig
from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.trainer.balance import CostModel, data_parallel_shares
from bpo_megatron.trainer.packing import check_fits
from bpo_megatron.trainer.replay import check_routed_experts
from bpo_megatron.trainer.samples import TrainSample, check_samples


@dataclass(frozen=True)
class Shares:
    indices: list[list[int]]  # the samples each data-parallel rank takes, ascending
    totals: BatchTotals  # what the loss of the whole batch is normalised by


def prepare_shares(samples: list[TrainSample], hf: HFModelConfig, *, dp_size: int, budget: int, cost: CostModel,
                   replaying: bool, loss: PolicyLossConfig | None = None, routing_ids: bool = True,
                   cp: int = 1) -> Shares:
    """Refuse, before anything is sent or run, what any rank would refuse (:func:`check_batch`;
    with a token ``budget``, a sample that fits no micro-batch), then the shares
    (:func:`~bpo_megatron.trainer.balance.data_parallel_shares`) and the batch's totals. ``cp``: the
    context-parallel size, whose ranks split each sample (the budget counts one rank's positions)."""
    check_batch(samples, hf, replaying=replaying, dp_size=dp_size, loss=loss, routing_ids=routing_ids)
    if budget:
        check_fits(samples, budget, cp)
    return Shares(data_parallel_shares(samples, dp_size, budget=budget, cost=cost, cp=cp), minibatch_totals(samples))


def minibatch_totals(minibatch: list[TrainSample]) -> BatchTotals:
    """What the loss of a minibatch is normalised by, however it is split: the tokens it trains
    on and the responses holding one (tokens left out by a sample's ``train_mask`` count nowhere,
    as ``BatchTotals.of`` counts a mask)."""
    masked = [s.train_mask.sum() for s in minibatch if s.train_mask is not None]
    counts = iter(torch.stack(masked).tolist() if masked else [])  # one read for every masked sample
    trained = [s.num_response_tokens if s.train_mask is None else next(counts) for s in minibatch]
    return BatchTotals(tokens=float(sum(trained)), sequences=float(sum(count > 0 for count in trained)))


def check_batch(samples: list[TrainSample], hf: HFModelConfig, *, replaying: bool, dp_size: int,
                loss: PolicyLossConfig | None = None, routing_ids: bool = True) -> None:
    """Refuse samples the model cannot take (token ids, routing when ``replaying``), a batch
    that ``dp_size`` data-parallel ranks cannot share evenly, and one without what the ``loss``
    it trains with (None: scored only) is computed from: the behaviour log-probs of a mismatch
    correction, the sampler's top-k of score centering. ``routing_ids``:
    also read the expert ids (see :func:`~bpo_megatron.trainer.replay.check_routed_experts`:
    false where the routing came from an engine, which checked it on arrival)."""
    check_samples(samples, vocab_size=hf.vocab_size)
    if loss is not None and loss.correction.active and samples[0].old_logprobs is None:
        raise ValueError(f"loss.correction={loss.correction.name} needs each sample's old_logprobs (the trainer's "
                         "log-probs under the weights at the step's start): set train.recompute_old_logprobs=true")
    if loss is not None and loss.score_centering and samples[0].sampler_head_ids is None:
        raise ValueError("loss.score_centering needs each sample's sampler_head_ids and sampler_head_logprobs (the "
                         "engine's top-k log-probs of every response token, which the loop asks for with it on)")
    if (loss is not None and loss.score_centering and samples[0].old_logprobs is not None
            and samples[0].old_head_logprobs is None):
        raise ValueError("loss.score_centering with old_logprobs (train.recompute_old_logprobs) needs each sample's "
                         "old_head_logprobs too: π_old's log-probs of the sampler's top-k ids, which the recompute "
                         "pass returns for samples that carry those ids (loop.samples.with_old_logprobs)")
    if replaying:
        check_routed_experts(samples, num_moe_layers=len(hf.moe_layers), topk=hf.num_experts_per_tok,
                             num_experts=hf.num_experts, contents=routing_ids)
    if len(samples) % dp_size:
        raise ValueError(
            f"{len(samples)} samples cannot be split evenly over {dp_size} data-parallel "
            "ranks (every rank must run the same number of micro-batches); use a batch size that "
            "the data-parallel size divides"
        )
