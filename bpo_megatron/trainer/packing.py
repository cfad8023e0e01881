"""Packed micro-batches: samples laid end to end in one row under a token budget.

A padded micro-batch (:func:`~bpo_megatron.trainer.samples.collate`) spends compute on padding up
to its longest sample; a packed one holds only real input positions. Each sample contributes its
n − 1 input positions (``tokens[:-1]``), and a pack holds at most
``trainer.max_tokens_per_micro_batch`` of them. Which samples share a pack, and which rank runs it,
is :mod:`bpo_megatron.trainer.balance`'s choice (balanced by estimated cost); inside a pack samples
keep their relative order, and the trainer returns results in sample order.

The model sees one row ``[1, T]`` with Megatron's ``thd`` packed-sequence parameters: the
segment bounds ``cu_seqlens`` keep attention inside each sample and restart RoPE at every
sample's first position. With sequence parallelism ``T`` is rounded up to a multiple of the TP
size by a trailing padding segment of its own, trained on by nothing (a budget that is a multiple
of TP keeps ``T`` within it). Context parallelism (``parallel.cp``) splits each segment, not the
row: every sample is padded to a multiple of 2 × CP (padding after its last position, which
causal attention never lets reach a real one) and each CP rank holds one chunk from each end of
every sample (:mod:`bpo_megatron.parallel.context`), ``T / CP`` positions of the row. Under CP
the budget counts one rank's positions, so a sample longer than the budget trains if its share is
within it.

The loss never reads the packed row directly: each pack also carries the padded ``[b, s]``
tensors ``collate`` builds for its samples and, for every padded cell, the packed position it
comes from. The trainer scatters the packed log-probs into that layout and calls the same policy
loss as the padded path, so every aggregation, correction and statistic is the padded path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bpo_megatron.parallel.context import ContextSplit, context_parallel_group
from bpo_megatron.trainer.samples import MicroBatch, TrainSample, collate

BUDGET_SETTING = "trainer.max_tokens_per_micro_batch"


def input_positions(sample: TrainSample, cp: int = 1) -> int:
    """What a sample costs a pack on each rank: the positions the model reads (all tokens but the
    last), under context parallelism its share on each CP rank (:func:`rank_positions`)."""
    return rank_positions(sample.tokens.numel() - 1, cp)


def rank_positions(positions: int, cp: int) -> int:
    """A sample of ``positions`` input positions on each of ``cp`` context-parallel ranks: padded
    to a multiple of 2 × ``cp`` and split ``cp`` ways."""
    if cp == 1:
        return positions
    return -(-positions // (2 * cp)) * 2


def check_fits(samples: list[TrainSample], budget: int, cp: int = 1) -> None:
    """Refuse, before any compute, a sample that no pack of ``budget`` positions can hold."""
    for i, sample in enumerate(samples):
        length = input_positions(sample, cp)
        if length > budget:
            share = "" if cp == 1 else f", {length} on each of parallel.cp={cp} ranks"
            raise ValueError(f"sample {i} has {input_positions(sample)} input positions (len(tokens) − 1 = "
                             f"{input_positions(sample)}{share}), more than {BUDGET_SETTING}={budget}: raise the "
                             f"budget to at least {'the longest sample' if cp == 1 else 'its share, or parallel.cp'}")


@dataclass
class PackedMicroBatch:
    """A few samples end to end in one row, the segment bounds Megatron needs, and the padded
    layout of the same samples that the loss reads."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T] 0, 1, … restarting at every segment
    targets: torch.Tensor  # [1, T] token at position t+1 of the same sample (0 in padding)
    cu_seqlens: torch.Tensor  # [segments + 1] int32: segment starts, then T (the samples, then padding)
    max_seqlen: int  # the longest segment
    routed_experts: torch.Tensor | None  # [1, T, num_moe_layers, topk] or None
    padded: MicroBatch  # collate of the same samples (loss tensors; without routing)
    source: torch.Tensor  # [b, s] long: packed position of each padded cell; T where the cell is padding
    head_ids: torch.Tensor | None = None  # [1, T, k] the sampler's top-k ids at each target (score centering)
    # under context parallelism: this rank's positions of the row (the tensors above hold only
    # those, T / CP of them; cu_seqlens and max_seqlen describe the whole row, as Megatron expects)
    split: ContextSplit | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def packed_seq_params(self):
        """Megatron's ``thd`` parameters: attention and RoPE per segment (of the whole row, and
        this rank's split of it, under context parallelism)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        if self.split is not None:
            from bpo_megatron.models.context_attention import ContextParallelSeqParams

            # each sample is padded inside its segment: its padded bounds are its bounds
            return ContextParallelSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens,
                                            cu_seqlens_kv=self.cu_seqlens, cu_seqlens_q_padded=self.cu_seqlens,
                                            cu_seqlens_kv_padded=self.cu_seqlens, max_seqlen_q=self.max_seqlen,
                                            max_seqlen_kv=self.max_seqlen, split=self.split)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def as_padded(self, values: torch.Tensor) -> torch.Tensor:
        """``[1, T, …]`` values per packed position → ``[b, s, …]`` in :attr:`padded`'s layout,
        zero in padding cells (indexing, so gradients flow back to the packed positions). Under
        context parallelism the values of this rank's positions are first gathered into the
        whole row from every CP rank (all of which call this at once and compute alike from it)."""
        if self.split is not None:
            values = self.split.gather(values[0], context_parallel_group()).unsqueeze(0)
        flat = torch.cat([values[0], values.new_zeros((1, *values.shape[2:]))])
        return flat[self.source]

    def to(self, device: torch.device) -> PackedMicroBatch:
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(self).items()}
        moved["padded"] = self.padded.to(device)
        moved["split"] = None if self.split is None else self.split.to(device)
        return PackedMicroBatch(**moved)


def pack(samples: list[TrainSample], *, pad_to_multiple: int = 1, with_routing: bool = False,
         cp_size: int = 1, cp_rank: int = 0) -> PackedMicroBatch:
    """``samples`` end to end in one row, ``T`` rounded up to ``pad_to_multiple`` by a trailing
    padding segment (loss-masked; routed to experts 0..k−1 as :func:`collate` routes padding).
    With ``cp_size`` > 1 each sample is padded to a multiple of 2 × ``cp_size`` and the row
    split over the CP ranks: rank ``cp_rank``'s positions, of which ``pad_to_multiple`` divides
    the number. Its segment bounds are checked here, on the host, once per micro-batch; the
    attention layers take them as they are."""
    from bpo_megatron.models.packed_attention import check_packed_seq_params

    lengths = [input_positions(s) for s in samples]
    unit = 1 if cp_size == 1 else 2 * cp_size
    spans = [-(-n // unit) * unit for n in lengths]
    real = sum(spans)
    multiple = pad_to_multiple * unit
    total = -(-real // multiple) * multiple
    segments = spans + ([total - real] if total > real else [])
    bounds = [0]
    for length in segments:
        bounds.append(bounds[-1] + length)
    input_ids = torch.zeros(1, total, dtype=torch.long)
    targets = torch.zeros(1, total, dtype=torch.long)
    position_ids = torch.cat([torch.arange(length) for length in segments]).unsqueeze(0)
    padded = collate(samples)
    source = torch.full(padded.shape, total, dtype=torch.long)
    routed = None
    if with_routing:
        layers, topk = samples[0].routed_experts.shape[1:]
        routed = torch.arange(topk, dtype=samples[0].routed_experts.dtype).expand(1, total, layers, topk).clone()
    head_ids = None if padded.head_ids is None else torch.zeros(1, total, padded.head_ids.shape[-1], dtype=torch.long)
    for row, (sample, start, n) in enumerate(zip(samples, bounds, lengths)):
        tokens = sample.tokens.long()
        input_ids[0, start : start + n] = tokens[:-1]
        targets[0, start : start + n] = tokens[1:]
        source[row, :n] = torch.arange(start, start + n)
        if head_ids is not None:
            head_ids[0, start : start + n] = padded.head_ids[row, :n]
        if routed is not None:
            routed[0, start : start + n] = sample.routed_experts
    micro = PackedMicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        targets=targets,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max(segments),
        routed_experts=routed,
        padded=padded,
        source=source,
        head_ids=head_ids,
    )
    check_packed_seq_params(micro.packed_seq_params(), total=total)
    if cp_size == 1:
        return micro
    split = ContextSplit.of(bounds, cp_size, cp_rank)
    for name in ("input_ids", "position_ids", "targets", "routed_experts", "head_ids"):
        value = getattr(micro, name)
        if value is not None:
            setattr(micro, name, value[:, split.held])
    micro.split = split
    return micro
