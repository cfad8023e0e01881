"""Avg@k: k samples per question, mean correctness per question, then mean over questions.

The paper reports Avg@32 on AIME 2024/2025/2026 and their arithmetic mean, and picks the
checkpoint with the highest mean (the earlier one on ties).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bpo_megatron.loop.prompts import encode, load_eval_set, requests
from bpo_megatron.loop.scoring import score


@dataclass
class EvalResult:
    step: int
    scores: dict[str, float]  # dataset -> Avg@k

    @property
    def mean(self) -> float:
        return sum(self.scores.values()) / len(self.scores)

    def metrics(self, k: int) -> dict[str, float]:
        out = {f"eval/{name}_avg@{k}": value for name, value in self.scores.items()}
        out[f"eval/mean_avg@{k}"] = self.mean
        return out


def avg_at_k(correct: torch.Tensor, k: int) -> float:
    """``correct`` [questions × k] of 0/1, grouped by question."""
    return float(correct.view(-1, k).mean(dim=1).mean())


def evaluate(generate, tokenizer, reward_fn, cfg, step: int) -> EvalResult:
    """``generate(requests) -> samples``: any engine or engine group."""
    ev = cfg.eval
    scores = {}
    for index, spec in enumerate(ev.datasets):
        problems = load_eval_set(spec, cfg.data.root, count=ev.procedural_count, seed=10_000 + index)
        problems = problems[: ev.limit] if ev.limit else problems
        encoded = encode(problems, tokenizer, cfg.data.template, cfg.data.max_prompt_tokens)
        batch = requests(encoded, tag=f"eval{step}-{spec}", n=ev.k, temperature=ev.temperature, top_p=ev.top_p,
                         top_k=0, max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens,
                         stop_token_ids=stop_tokens(cfg, tokenizer), seed=cfg.train.seed + 7 * step + index)
        samples = generate(batch)
        answers = [p.answer for p in problems for _ in range(ev.k)]
        scores[spec] = avg_at_k(score(samples, answers, tokenizer, reward_fn), ev.k)
    return EvalResult(step, scores)


def stop_tokens(cfg, tokenizer) -> tuple[int, ...]:
    return tuple(sorted(set(tokenizer.eos_token_ids) | set(cfg.rollout.stop_token_ids)))


@dataclass
class BestCheckpoint:
    """The paper's rule: highest mean accuracy, the earlier step on ties."""

    step: int | None = None
    mean: float = float("-inf")
    history: list[tuple[int, float]] = field(default_factory=list)

    def update(self, result: EvalResult) -> bool:
        self.history.append((result.step, result.mean))
        if result.mean > self.mean:
            self.step, self.mean = result.step, result.mean
            return True
        return False
