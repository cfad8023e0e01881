"""From problems to generation requests: prompt rendering and screening, stop tokens, requests.

A problem is usable when its prompt encodes with the run's tokenizer within
``data.max_prompt_tokens`` (and, for a supervised warm start, its answer encodes too).
:func:`screen` sorts problems into usable ones (already encoded) and rejected ones with the
reason, so a run can refuse bad data before it starts or skip it by its own rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from bpo_megatron.data.config import PROCEDURAL
from bpo_megatron.data.problems import Problem, Rejected, load_problems
from bpo_megatron.data.procedural import generate
from bpo_megatron.rollout import GenerationRequest, SamplingParams


@dataclass(frozen=True)
class Encoded:
    problem: Problem
    prompt_tokens: tuple[int, ...]


@dataclass(frozen=True)
class PromptFormat:
    """How problems become prompt tokens: the tokenizer, the template (``data.template`` for
    training prompts, ``eval.template`` for evaluation's) and the length bound
    ``data.max_prompt_tokens``; ``with_answers`` also requires encodable reference answers (a
    supervised warm start trains on them), each with its end-of-sequence token within
    ``max_answer_tokens`` (the response budget, ``rollout.max_new_tokens``) when given."""

    tokenizer: object
    template: str
    max_prompt_tokens: int
    with_answers: bool = False
    max_answer_tokens: int | None = None

    def encode(self, problem: Problem) -> Encoded:
        """The encoded prompt, or ValueError saying what is wrong with this problem."""
        tokens = self.tokenizer.encode(self.tokenizer.render_prompt(problem.problem, self.template))
        if len(tokens) > self.max_prompt_tokens:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds data.max_prompt_tokens={self.max_prompt_tokens}")
        if self.with_answers:
            answer = len(self.tokenizer.encode(problem.answer)) + 1  # and end-of-sequence
            if self.max_answer_tokens is not None and answer > self.max_answer_tokens:
                raise ValueError(f"reference answer of {answer} tokens (with end-of-sequence) exceeds "
                                 f"rollout.max_new_tokens={self.max_answer_tokens}, the response budget the warm "
                                 "start (train.sft_warmup_steps) trains within")
        return Encoded(problem, tuple(tokens))


def screen(problems: list[Problem], fmt: PromptFormat) -> tuple[list[Encoded], list[Rejected]]:
    """Usable problems, encoded, in their order; and the rejected ones with the reason."""
    kept, rejected = [], []
    for p in problems:
        try:
            kept.append(fmt.encode(p))
        except ValueError as exc:
            where = p.origin or f"problem {p.id!r}"
            rejected.append(Rejected(where, f"(id {p.id!r}) {exc}" if p.origin else str(exc)))
    return kept, rejected


def load_eval_set(spec: str, root: str, *, count: int, seed: int) -> list[Problem]:
    if spec.startswith(PROCEDURAL):
        return generate(spec[len(PROCEDURAL):], count, seed=seed)
    return load_problems(spec, root)


def stop_tokens(tokenizer, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence tokens, the end-of-turn token of its chat template (prompts
    are rendered as a chat turn, so a response ends where the turn does; a base model's
    end-of-sequence token alone would let it run on into a turn of its own), and
    ``rollout.stop_token_ids``."""
    return tuple(sorted(set(tokenizer.eos_token_ids) | set(tokenizer.end_of_turn_ids) | set(extra)))


def requests(encoded: list[Encoded], *, tag: str, n: int, temperature: float, top_p: float, top_k: int,
             max_new_tokens: int, stop_token_ids: tuple[int, ...], seed: int,
             capture_routing: bool = True, top_logprobs: int = 0) -> list[GenerationRequest]:
    """``capture_routing``: whether an engine that captures routed experts returns them for these
    requests (training rollouts, which R3 replays; evaluation's are thrown away); ``top_logprobs``:
    the sampler's most likely tokens returned per generated token (score centering's)."""
    return [GenerationRequest(f"{tag}-{i}", e.prompt_tokens,
                              SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                             max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                             seed=seed * 1_000_003 + i * 1009, n=n, top_logprobs=top_logprobs),
                              capture_routing=capture_routing)
            for i, e in enumerate(encoded)]
