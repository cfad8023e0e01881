"""Avg@k: k samples per question, mean correctness per question, then mean over questions.

The paper reports Avg@32 on AIME 2024/2025/2026 and their arithmetic mean, and picks the
checkpoint with the highest mean (the earlier one on ties).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bpo_megatron.data.problems import Rejected
from bpo_megatron.tasks.prompts import Encoded, PromptFormat, load_eval_set, requests, stop_tokens
from bpo_megatron.tasks.scoring import score
from bpo_megatron.tasks.stream import usable


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


@dataclass(frozen=True)
class EvalSet:
    """One evaluation dataset, screened: the questions asked and those left out."""

    name: str
    prompts: list[Encoded]
    rejected: list[Rejected]


def load_eval_sets(ev, root: str, fmt: PromptFormat, *, skip_bad: bool) -> list[EvalSet]:
    """``eval.datasets`` (the first ``eval.limit`` questions of each), screened like training
    prompts: a question that cannot be asked raises unless ``skip_bad``."""
    sets = []
    for index, spec in enumerate(ev.datasets):
        try:
            problems = load_eval_set(spec, root, count=ev.procedural_count, seed=10_000 + index)
        except (OSError, ValueError) as exc:
            raise ValueError(f"eval.datasets[{index}]={spec!r}: {exc}") from exc
        problems = problems[: ev.limit] if ev.limit else problems
        prompts, rejected = usable(problems, [], fmt, setting=f"eval.datasets[{index}]={spec}", skip_bad=skip_bad)
        sets.append(EvalSet(spec, prompts, rejected))
    return sets


def evaluate(generate, sets: list[EvalSet], tokenizer, reward_fn, cfg, step: int) -> EvalResult:
    """``generate(requests) -> samples``: any engine or engine group."""
    ev = cfg.eval
    scores = {}
    for index, eval_set in enumerate(sets):
        batch = requests(eval_set.prompts, tag=f"eval{step}-{eval_set.name}", n=ev.k, temperature=ev.temperature,
                         top_p=ev.top_p, top_k=0, max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens,
                         stop_token_ids=stop_tokens(tokenizer, cfg.rollout.stop_token_ids),
                         seed=cfg.train.seed + 7 * step + index)
        samples = generate(batch)
        answers = [e.problem.answer for e in eval_set.prompts for _ in range(ev.k)]
        scores[eval_set.name] = avg_at_k(score(samples, answers, tokenizer, reward_fn), ev.k)
    return EvalResult(step, scores)


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
