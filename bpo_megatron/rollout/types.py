"""What crosses the rollout-engine boundary: sampling settings, requests and samples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "abort"]


def finish_reason(reported: str | None) -> FinishReason:
    """An engine server's finish reason as a sample's: ``stop`` and ``length`` as reported,
    anything else (an abort, or a reason this version does not know) ``abort``."""
    return reported if reported in ("stop", "length") else "abort"  # type: ignore[return-value]


class ProtocolError(ValueError):
    """An engine answered something other than what was asked (never trained on)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request. ``top_k=0`` and ``top_p=1.0`` disable those filters.

    Log-probabilities reported for the sampled tokens are always those of the temperature-scaled
    distribution *before* top-p/top-k filtering: the distribution the trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1  # responses per prompt
    # report, for each generated token, the sampler's this many most likely tokens and their log q
    # under the distribution it drew from (after temperature and top-k/top-p, renormalised): score
    # centering's input (Sample.sampler_head_ids / sampler_head_logprobs); 0: none
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature} (greedy decoding is not sampling from π)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0 (0: none), got {self.top_logprobs}")


@dataclass(frozen=True)
class GenerationRequest:
    """``capture_routing``: whether the engine should return this request's routed experts. An
    engine returns them only when it was itself started with capture
    (``rollout.capture_routed_experts``, R3) and the request asks; the samples of a request that
    does not ask carry ``routed_experts=None``. Training rollouts ask; evaluation, whose routing
    nothing replays, does not (at long responses that routing is gigabytes per evaluation).

    ``routing_from``: the positions before it are ones whose routing the caller already has (a
    conversation's later turn: its earlier turns reported them), so an engine that can may report
    routed experts from that position on only (SGLang's ``routed_experts_start_len``); the sample
    says where its routing starts (``Sample.routing_start``)."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    capture_routing: bool = True
    routing_from: int = 0
    # the engine (an engine group's ``Sample.served_by``) that served the conversation's previous
    # turn, whose prefix cache holds that turn: a group sends the request there while that engine
    # lives and is not full (orchestration/engine_group.py); None: wherever the load is least
    affinity: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        if not 0 <= self.routing_from <= len(self.prompt_tokens):
            raise ValueError(f"request {self.request_id!r}: routing_from={self.routing_from} must be within its "
                             f"{len(self.prompt_tokens)} prompt tokens")


@dataclass
class Sample:
    """One generated response. ``index`` tells the n responses of a request apart."""

    request_id: str
    index: int
    prompt_tokens: torch.Tensor  # [P] int64
    response_tokens: torch.Tensor  # [R] int64 (includes the stop token when one ended it)
    rollout_logprobs: torch.Tensor  # [R] float32, log μ of each response token
    finish_reason: FinishReason
    routed_experts: torch.Tensor | None = None  # [P + R − 1 − routing_start, MoE layers, top-k] when captured
    # the first position ``routed_experts`` covers: 0, or a later turn's ``GenerationRequest.routing_from``
    routing_start: int = 0
    weight_version: int = 0  # the engine's weights that produced it (the trainer's update count); the oldest
    # [R] int64: the weights version that sampled each response token, where the engine records it
    # (a partial rollout, paused for a weight update and continued, spans two or more)
    token_versions: torch.Tensor | None = None
    # [R] bool: whether ``routed_experts`` holds, for every position a response token was sampled
    # from, the experts that sampled it. False where the engine recomputed that routing with other
    # weights after the token was sampled (SGLang re-prefills a request a weight update paused,
    # rollout/sglang/protocol.py); R3 must not train such a token, as the trainer would replay
    # experts that did not produce its μ. None: every token's routing is its own.
    routing_valid: torch.Tensor | None = None
    # SGLang retracted the request for KV space (same weights) and re-prefilled it: the routing it
    # reports for the positions before that is the re-prefill's, not what sampled the tokens decoded
    # before it, and SGLang does not say where that was, so routing_valid is False for every token
    # (rollout/sglang/protocol.py; counted as rollout/retracted_frac)
    retracted_for_space: bool = False
    # the prompt tokens the engine took from its prefix cache instead of computing them for this
    # request (SGLang's ``meta_info.cached_tokens``; 0 from an engine without a prefix cache);
    # None: the engine does not say
    cached_tokens: int | None = None
    # (engine index, how many times that index was started before) of the engine-group member that
    # generated it, set by the group; None: a bare engine
    served_by: tuple[int, int] | None = None
    # the model tokens of the later turns of a multi-turn response that were sampled after a
    # routing of the conversation's earlier positions other than the one R3 replays for them (the
    # engine recomputed that prefix: another engine, an evicted cache, newer weights, a pause):
    # masked for R3 (rollout/agents/conversation.py; rollout/r3_prefix_mismatch_frac)
    prefix_rerouted_tokens: int = 0
    # a multi-turn response's turns as the engines served them (None: single-turn)
    conversation: ConversationStats | None = None
    # [R] bool: the response tokens the environment inserted between the model's turns (a tool's
    # output, rollout/agents): the model sampled none of them, so they carry no μ (0 there, never
    # read), no loss and no routing of their own to replay. None: every response token is the model's.
    from_environment: torch.Tensor | None = None
    # [R, k] when the request asked (SamplingParams.top_logprobs = k): the sampler's k most likely
    # token ids at each response token (int32) and their log q (float32) under the distribution it
    # drew from, most likely first
    sampler_head_ids: torch.Tensor | None = None
    sampler_head_logprobs: torch.Tensor | None = None

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([self.prompt_tokens, self.response_tokens])

    @property
    def model_tokens(self) -> torch.Tensor:
        """[R] bool: the response tokens the model sampled (all of them in a single-turn sample)."""
        if self.from_environment is None:
            return torch.ones(self.response_tokens.numel(), dtype=torch.bool)
        return ~self.from_environment

    @property
    def final_turn(self) -> torch.Tensor:
        """The model's last turn: the response tokens after the environment's last ones (the
        whole response of a single-turn sample). What a multi-turn sample answers with."""
        if self.from_environment is None or not bool(self.from_environment.any()):
            return self.response_tokens
        last = int(self.from_environment.nonzero()[-1])
        return self.response_tokens[last + 1:]

    def check(self, *, num_moe_layers: int | None = None, topk: int | None = None) -> None:
        """Raise ValueError if the pieces disagree (e.g. a decoding bug in an engine client)."""
        r = self.response_tokens.numel()
        if self.rollout_logprobs.shape != (r,):
            raise ValueError(f"sample {self.request_id}/{self.index}: {self.rollout_logprobs.numel()} "
                             f"log-probs for {r} response tokens")
        for name in ("token_versions", "routing_valid", "from_environment"):
            value = getattr(self, name)
            if value is not None and value.shape != (r,):
                raise ValueError(f"sample {self.request_id}/{self.index}: {name} has shape {tuple(value.shape)} for "
                                 f"{r} response tokens")
        for name in ("routing_valid", "from_environment"):
            value = getattr(self, name)
            if value is not None and value.dtype != torch.bool:
                raise ValueError(f"sample {self.request_id}/{self.index}: {name} must be bool, got {value.dtype}")
        if self.from_environment is not None and bool(self.rollout_logprobs[self.from_environment].any()):
            raise ValueError(f"sample {self.request_id}/{self.index}: tokens from the environment carry no log μ "
                             "(0 there): the model did not sample them")
        if (self.sampler_head_ids is None) != (self.sampler_head_logprobs is None) or (
                self.sampler_head_ids is not None and (self.sampler_head_ids.shape != self.sampler_head_logprobs.shape
                                                       or self.sampler_head_ids.shape[0] != r)):
            raise ValueError(f"sample {self.request_id}/{self.index}: sampler_head_ids and sampler_head_logprobs must "
                             f"both be [{r}, k]")
        if self.routed_experts is not None:
            want = (self.prompt_tokens.numel() + r - 1 - self.routing_start, num_moe_layers, topk)
            got = tuple(self.routed_experts.shape)
            if got[0] != want[0] or (num_moe_layers is not None and got[1:] != want[1:]):
                raise ValueError(f"sample {self.request_id}/{self.index}: routed experts {got}, expected {want}")


@dataclass(frozen=True)
class ConversationStats:
    """How a multi-turn response's later turns (the second on) met the engines: ``hops`` of them
    went to another engine than the turn before (or to a replacement of it); of the
    ``prefix_tokens`` earlier positions they fed (counted where the engine reports its prefix
    cache), ``cached_prefix_tokens`` came from the engine's cache; ``recomputed_turns`` were sampled
    after a routing of those positions other than the replayed one (their tokens masked for R3)."""

    later_turns: int = 0
    hops: int = 0
    prefix_tokens: int = 0
    cached_prefix_tokens: int = 0
    recomputed_turns: int = 0


@dataclass(frozen=True)
class EngineHealth:
    healthy: bool
    detail: str = ""


@dataclass(frozen=True)
class ResponseSlot:
    """One response to produce: a request and its sample index, with that response's own id and
    seed (so the n responses of a request differ, and none can be lost or merged)."""

    request: GenerationRequest
    index: int

    @property
    def rid(self) -> str:
        return f"{self.request.request_id}#{self.index}"

    @property
    def seed(self) -> int | None:
        seed = self.request.sampling.seed
        return None if seed is None else seed + self.index


def response_slots(requests: list[GenerationRequest]) -> list[ResponseSlot]:
    """Every request's n responses, in request order then index order."""
    return [ResponseSlot(r, i) for r in requests for i in range(r.sampling.n)]
