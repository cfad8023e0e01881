"""Training samples, their validation, and padded micro-batches for the Megatron model.

A sample is one prompt+response token sequence with the rollout engine's log μ of each response
token, the response's advantage and (for R3) the experts each processed token was routed to. The
model is fed ``tokens[:-1]`` and predicts ``tokens[1:]``: position t's logits score token t+1, and
the engine routed exactly those n−1 input positions (the last sampled token is never fed back).

Micro-batches are right-padded to a common length (a multiple of the TP size, for sequence
parallelism). Padding sits after every real token, so causal attention never lets it influence a
real position; its loss mask is False and its routing is a fixed valid expert set. Under a token
budget the trainer packs samples end to end instead (``trainer/packing.py``); the loss still reads
this padded layout.

A sample may also exclude some of its response tokens from training (``train_mask``): they are
scored like the others but contribute nothing to the loss, its gradient or its normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bpo_megatron.losses.validation import LOGPROB_TOLERANCE


@dataclass(frozen=True)
class TrainSample:
    tokens: torch.Tensor  # [n] int: prompt then response
    response_start: int  # index of the first response token (the prompt length)
    rollout_logprobs: torch.Tensor  # [n - response_start] log μ of each response token
    advantage: float
    routed_experts: torch.Tensor | None = None  # [n - 1, num_moe_layers, topk] int
    # [n - response_start] the trainer's own log π_old of each response token
    # (train.recompute_old_logprobs): under the weights of the step's start, which sampled it in
    # the synchronous loop and are newer under train.async (decoupled PPO); for the corrections
    old_logprobs: torch.Tensor | None = None
    # [n - response_start] bool: the response tokens the loss trains on; None: all of them. R3
    # leaves out the tokens whose replayed routing is not the one they were sampled with
    # (rollout.types.Sample.routing_valid)
    train_mask: torch.Tensor | None = None
    # [n - response_start, k]: the sampler's k most likely token ids at each response token and
    # their log q under the distribution it drew from (loss.score_centering); None without it
    sampler_head_ids: torch.Tensor | None = None
    sampler_head_logprobs: torch.Tensor | None = None
    # [n - response_start, k]: the trainer's log π_old of those ids, recomputed with old_logprobs
    # (score centering anchored to π_old weighs each candidate against it); None otherwise
    old_head_logprobs: torch.Tensor | None = None

    @property
    def num_response_tokens(self) -> int:
        return self.tokens.numel() - self.response_start

    @property
    def num_train_tokens(self) -> int:
        """The response tokens the loss trains on."""
        return self.num_response_tokens if self.train_mask is None else int(self.train_mask.sum())


def check_samples(samples: list[TrainSample], *, vocab_size: int) -> None:
    """Refuse malformed samples before any compute, naming the sample and the field.

    Each sample's form (shapes, types, which optional fields it carries) is checked without
    reading a tensor; the values of all samples (ids in the vocabulary, log-probabilities finite and
    at most 0) at once, in one host read for the batch. Only a batch with a bad value is read
    sample by sample, to name the first bad one."""
    if not samples:
        raise ValueError("got an empty list of samples")
    for i, s in enumerate(samples):
        _check_form(f"sample {i}", s, samples[0])
    if _any_bad_value(samples, vocab_size):
        for i, s in enumerate(samples):
            _check_values(f"sample {i}", s, vocab_size)


def _check_form(where: str, s: TrainSample, first: TrainSample) -> None:
    if s.tokens.dim() != 1 or s.tokens.dtype.is_floating_point or s.tokens.dtype == torch.bool:
        raise ValueError(f"{where}: tokens must be a 1-D integer tensor, got {s.tokens.dtype} {tuple(s.tokens.shape)}")
    n = s.tokens.numel()
    if not 1 <= s.response_start < n:
        raise ValueError(
            f"{where}: response_start={s.response_start} must leave at least one prompt and one "
            f"response token in {n} tokens"
        )
    if s.rollout_logprobs.shape != (n - s.response_start,):
        raise ValueError(
            f"{where}: rollout_logprobs has shape {tuple(s.rollout_logprobs.shape)}, expected "
            f"({n - s.response_start},) = one per response token"
        )
    if (s.old_logprobs is None) != (first.old_logprobs is None):
        raise ValueError(f"{where}: old_logprobs given for some samples and not others")
    if s.old_logprobs is not None and s.old_logprobs.shape != s.rollout_logprobs.shape:
        raise ValueError(_old_logprobs_error(where, s))
    if not math.isfinite(s.advantage):
        raise ValueError(f"{where}: advantage must be finite, got {s.advantage}")
    _check_head_form(where, s, first, n - s.response_start)
    if s.train_mask is not None and (s.train_mask.dtype != torch.bool
                                     or s.train_mask.shape != (n - s.response_start,)):
        raise ValueError(f"{where}: train_mask must be bool, one per response token ({n - s.response_start}), "
                         f"got {s.train_mask.dtype} {tuple(s.train_mask.shape)}")


def _old_logprobs_error(where: str, s: TrainSample) -> str:
    return (f"{where}: old_logprobs must be finite log-probabilities (<= 0), one per response token "
            f"({s.num_response_tokens}), got shape {tuple(s.old_logprobs.shape)}")


def _check_head_form(where: str, s: TrainSample, first: TrainSample, responses: int) -> None:
    """The sampler's top-k of each response token: on every sample or none, one k for all."""
    ids, logprobs = s.sampler_head_ids, s.sampler_head_logprobs
    if (ids is None) != (logprobs is None) or (ids is None) != (first.sampler_head_ids is None):
        raise ValueError(f"{where}: sampler_head_ids and sampler_head_logprobs go together, on every sample or none")
    if ids is None:
        if s.old_head_logprobs is not None:
            raise ValueError(f"{where}: old_head_logprobs without the sampler's top-k ids they score")
        return
    k = first.sampler_head_ids.shape[-1]
    if ids.shape != (responses, k) or logprobs.shape != (responses, k) or ids.dtype.is_floating_point:
        raise ValueError(f"{where}: sampler_head_ids (integer) and sampler_head_logprobs must be [{responses}, {k}] "
                         f"(one row of k per response token), got {ids.dtype} {tuple(ids.shape)} and "
                         f"{tuple(logprobs.shape)}")
    old = s.old_head_logprobs
    if (old is None) != (first.old_head_logprobs is None) or (old is not None and s.old_logprobs is None):
        raise ValueError(f"{where}: old_head_logprobs go with old_logprobs and the sampler's top-k, on every sample "
                         "or none")
    if old is not None and old.shape != (responses, k):
        raise ValueError(f"{where}: old_head_logprobs must be [{responses}, {k}] like sampler_head_logprobs, got "
                         f"{tuple(old.shape)}")


def _any_bad_value(samples: list[TrainSample], vocab_size: int) -> bool:
    """Whether any sample holds a value :func:`_check_values` refuses: every sample's tensors of a
    field laid end to end (well-formed samples: :func:`_check_form`), one host read in all."""
    def joined(field: str) -> torch.Tensor:
        return torch.cat([getattr(s, field) for s in samples])

    def outside_vocabulary(ids: torch.Tensor) -> torch.Tensor:
        return ((ids < 0) | (ids >= vocab_size)).any()

    def no_logprob(values: torch.Tensor) -> torch.Tensor:
        return (~torch.isfinite(values) | (values > LOGPROB_TOLERANCE)).any()

    bad = [outside_vocabulary(joined("tokens")), no_logprob(joined("rollout_logprobs"))]
    if samples[0].old_logprobs is not None:
        bad.append(no_logprob(joined("old_logprobs")))
    if samples[0].sampler_head_ids is not None:
        head_logprobs = joined("sampler_head_logprobs")
        bad += [outside_vocabulary(joined("sampler_head_ids")),
                (torch.isnan(head_logprobs) | (head_logprobs > LOGPROB_TOLERANCE)).any()]
    if samples[0].old_head_logprobs is not None:
        bad.append(no_logprob(joined("old_head_logprobs")))
    return bool(torch.stack(bad).any())


def _check_values(where: str, s: TrainSample, vocab_size: int) -> None:
    """One well-formed sample's values, read one field at a time (only for a batch that holds a bad
    one: :func:`_any_bad_value`)."""
    if int(s.tokens.min()) < 0 or int(s.tokens.max()) >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}) (the model's vocabulary)")
    if not bool(torch.isfinite(s.rollout_logprobs).all()) or bool((s.rollout_logprobs > LOGPROB_TOLERANCE).any()):
        raise ValueError(f"{where}: rollout_logprobs must be finite log-probabilities (<= 0)")
    if s.old_logprobs is not None and (not bool(torch.isfinite(s.old_logprobs).all())
                                       or bool((s.old_logprobs > LOGPROB_TOLERANCE).any())):
        raise ValueError(_old_logprobs_error(where, s))
    ids, logprobs = s.sampler_head_ids, s.sampler_head_logprobs
    if ids is None:
        return
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{where}: sampler_head_ids must lie in [0, {vocab_size}) (the model's vocabulary)")
    # −inf is a token the sampler's filter left out (q = 0); NaN or a positive value is no log-probability
    if bool(torch.isnan(logprobs).any()) or bool((logprobs > LOGPROB_TOLERANCE).any()):
        raise ValueError(f"{where}: sampler_head_logprobs must be log-probabilities (<= 0, -inf allowed)")
    old = s.old_head_logprobs
    if old is not None and (not bool(torch.isfinite(old).all()) or bool((old > LOGPROB_TOLERANCE).any())):
        raise ValueError(f"{where}: old_head_logprobs must be finite log-probabilities (<= 0)")


@dataclass
class MicroBatch:
    """Right-padded tensors of a few samples; the sequence axis has the input positions."""

    input_ids: torch.Tensor  # [b, s]
    position_ids: torch.Tensor  # [b, s]
    targets: torch.Tensor  # [b, s] token at position t+1
    loss_mask: torch.Tensor  # [b, s] bool: the target is a response token
    train_mask: torch.Tensor  # [b, s] bool: the target is a response token the loss trains on
    rollout_logprobs: torch.Tensor  # [b, s] log μ of the target (0 off the mask)
    advantages: torch.Tensor  # [b]
    lengths: torch.Tensor  # [b] real input positions per row (n − 1)
    routed_experts: torch.Tensor | None  # [b, s, num_moe_layers, topk] or None
    old_logprobs: torch.Tensor | None = None  # [b, s] log π_old of the target (0 off the mask) or None
    # [b, s, k] the sampler's top-k ids at each target and their log q (score centering), or None;
    # ids are 0 and log q 0 off the mask
    head_ids: torch.Tensor | None = None
    sampler_head_logprobs: torch.Tensor | None = None
    old_head_logprobs: torch.Tensor | None = None  # [b, s, k] log π_old of those ids (0 off the mask) or None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    # The loss reads the padded layout; a packed micro-batch (trainer/packing.py) scatters its
    # row into it. Here the model's input already is that layout.
    @property
    def padded(self) -> "MicroBatch":
        return self

    def as_padded(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def packed_seq_params(self) -> None:
        """Rows are separate sequences: no packed-sequence parameters."""
        return None

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(self).items()}
        return MicroBatch(**moved)


def collate(samples: list[TrainSample], *, pad_to_multiple: int = 1, with_routing: bool = False) -> MicroBatch:
    """Right-pad ``samples`` into one micro-batch (length rounded up to ``pad_to_multiple``)."""
    lengths = [s.tokens.numel() - 1 for s in samples]
    seq = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    b = len(samples)
    input_ids = torch.zeros(b, seq, dtype=torch.long)
    targets = torch.zeros(b, seq, dtype=torch.long)
    loss_mask = torch.zeros(b, seq, dtype=torch.bool)
    train_mask = torch.zeros(b, seq, dtype=torch.bool)
    rollout_logprobs = torch.zeros(b, seq, dtype=torch.float32)
    old_logprobs = torch.zeros(b, seq, dtype=torch.float32) if samples[0].old_logprobs is not None else None
    head_ids = head_logprobs = old_head_logprobs = None
    if samples[0].sampler_head_ids is not None:
        k = samples[0].sampler_head_ids.shape[-1]
        head_ids = torch.zeros(b, seq, k, dtype=torch.long)
        head_logprobs = torch.zeros(b, seq, k, dtype=torch.float32)
        if samples[0].old_head_logprobs is not None:
            old_head_logprobs = torch.zeros(b, seq, k, dtype=torch.float32)
    routed = None
    if with_routing:
        layers, topk = samples[0].routed_experts.shape[1:]
        # Padding routes to experts 0..k-1: a valid, duplicate-free choice whose output is unused.
        # Ids keep the samples' (small) integer type until the trainer's device.
        routed = torch.arange(topk, dtype=samples[0].routed_experts.dtype).expand(b, seq, layers, topk).clone()
    for row, (s, n) in enumerate(zip(samples, lengths)):
        tokens = s.tokens.long()
        input_ids[row, :n] = tokens[:-1]
        targets[row, :n] = tokens[1:]
        first = s.response_start - 1  # the position whose target is the first response token
        loss_mask[row, first:n] = True
        train_mask[row, first:n] = True if s.train_mask is None else s.train_mask
        rollout_logprobs[row, first:n] = s.rollout_logprobs.float()
        if old_logprobs is not None:
            old_logprobs[row, first:n] = s.old_logprobs.float()
        if head_ids is not None:
            head_ids[row, first:n] = s.sampler_head_ids.long()
            head_logprobs[row, first:n] = s.sampler_head_logprobs.float()
        if old_head_logprobs is not None:
            old_head_logprobs[row, first:n] = s.old_head_logprobs.float()
        if routed is not None:
            routed[row, :n] = s.routed_experts
    return MicroBatch(
        input_ids=input_ids,
        position_ids=torch.arange(seq).expand(b, seq).clone(),
        targets=targets,
        loss_mask=loss_mask,
        train_mask=train_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
        lengths=torch.tensor(lengths),
        routed_experts=routed,
        old_logprobs=old_logprobs,
        head_ids=head_ids,
        sampler_head_logprobs=head_logprobs,
        old_head_logprobs=old_head_logprobs,
    )


def split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous, nearly equal slices (the first ones one longer)."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def chunk(items: list, size: int) -> list[list]:
    """Consecutive slices of at most ``size`` items."""
    return [items[i : i + size] for i in range(0, len(items), size)]
