"""Training prompts as a resumable stream, and generation requests built from them."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bpo_megatron.data.problems import FieldMap, Problem, load_problems
from bpo_megatron.data.procedural import generate
from bpo_megatron.rollout import GenerationRequest, SamplingParams

PROCEDURAL = "procedural:"


def load_eval_set(spec: str, root: str, *, count: int, seed: int) -> list[Problem]:
    if spec.startswith(PROCEDURAL):
        return generate(spec[len(PROCEDURAL):], count, seed=seed)
    return load_problems(spec, root)


class PromptStream:
    """Problems in a seeded shuffled order, epoch after epoch; ``cursor`` counts the problems
    handed out, so a resumed run continues with exactly the next ones."""

    EPOCH = 100_000  # problems per epoch of a procedural task

    def __init__(self, spec: str, root: str, *, seed: int, cursor: int = 0, fields: FieldMap | None = None) -> None:
        self.spec, self.root, self.seed, self.cursor = spec, root, seed, cursor
        self._procedural = spec[len(PROCEDURAL):] if spec.startswith(PROCEDURAL) else None
        self._fixed = None if self._procedural else load_problems(spec, root, fields)
        self._epoch, self._order = -1, []

    def _epoch_problems(self, epoch: int) -> list[Problem]:
        if self._procedural:
            return generate(self._procedural, self.EPOCH, seed=self.seed + epoch)
        order = list(self._fixed)
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[Problem]:
        size = self.EPOCH if self._procedural else len(self._fixed)
        batch = []
        for position in range(self.cursor, self.cursor + count):
            epoch, offset = divmod(position, size)
            if epoch != self._epoch:
                self._epoch, self._order = epoch, self._epoch_problems(epoch)
            batch.append(self._order[offset])
        self.cursor += count
        return batch


@dataclass(frozen=True)
class Encoded:
    problem: Problem
    prompt_tokens: tuple[int, ...]


def encode(problems: list[Problem], tokenizer, template: str, max_prompt_tokens: int) -> list[Encoded]:
    encoded = []
    for p in problems:
        tokens = tokenizer.encode(tokenizer.render_prompt(p.problem, template))
        if len(tokens) > max_prompt_tokens:
            raise ValueError(f"problem {p.id}: prompt of {len(tokens)} tokens exceeds data.max_prompt_tokens="
                             f"{max_prompt_tokens}; raise it or filter the dataset")
        encoded.append(Encoded(p, tuple(tokens)))
    return encoded


def requests(encoded: list[Encoded], *, tag: str, n: int, temperature: float, top_p: float, top_k: int,
             max_new_tokens: int, stop_token_ids: tuple[int, ...], seed: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}-{i}", e.prompt_tokens,
                              SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                             max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                             seed=seed * 1_000_003 + i * 1009, n=n))
            for i, e in enumerate(encoded)]
