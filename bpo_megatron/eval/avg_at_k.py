"""Avg@k: k samples per question, mean correctness per question, then mean over questions.

The paper reports Avg@32 on AIME 2024/2025/2026 and their arithmetic mean, and picks the
checkpoint with the highest mean (the earlier one on ties). Every question has k responses, so a
dataset's Avg@k is its correct responses over all its responses; evaluations keep those counts
and compare means as exact fractions of them. They are also kept for two fixed halves of each
dataset, its questions at even and at odd positions: with one evaluation dataset, a checkpoint
can then be selected on one half and reported on the other (``compare --stat heldout-peak``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from bpo_megatron.data.problems import Rejected
from bpo_megatron.tasks.prompts import Encoded, PromptFormat, load_eval_set, requests, stop_tokens
from bpo_megatron.tasks.scoring import RewardTally, score
from bpo_megatron.tasks.stream import usable

if TYPE_CHECKING:
    from bpo_megatron.rollout import GenerationRequest

Counts = dict[str, tuple[int, int]]  # dataset -> (correct responses, responses)
HALVES = ("even", "odd")  # a dataset's questions at even and at odd positions


def exact_mean(counts: Counts) -> Fraction:
    """The mean over datasets of Avg@k, exactly."""
    return sum((Fraction(correct, total) for correct, total in counts.values()), Fraction(0)) / len(counts)


@dataclass
class EvalResult:
    step: int
    counts: Counts
    # dataset -> half ("even", "odd") -> (correct responses, responses); empty when not measured
    halves: dict[str, Counts] = field(default_factory=dict)
    # dataset -> responses a user reward failed to score (raised, timed out, returned an invalid
    # value: scored 0), and its first failure; empty for the built-in verifiers
    reward_failed: dict[str, int] = field(default_factory=dict)
    first_failure: dict[str, str] = field(default_factory=dict)

    def unscored(self, spec: str, max_failed_frac: float) -> str | None:
        """Why this evaluation measured nothing, or None: on some dataset the reward (``spec``,
        ``data.reward``) failed on more than ``max_failed_frac`` of the responses, as a training
        batch that is not trained on (``data.reward_max_failed_frac``). Its accuracies count
        failures as wrong answers: no measurement of the policy, and no candidate for the best
        checkpoint."""
        for name, failed in self.reward_failed.items():
            total = self.counts[name][1]
            if total and failed > max_failed_frac * total:
                return (f"data.reward={spec} failed on {failed} of the {total} responses of {name} "
                        f"({failed / total:.0%}, more than data.reward_max_failed_frac={max_failed_frac:g}; the first, "
                        f"{self.first_failure[name]})")
        return None

    @property
    def scores(self) -> dict[str, float]:
        """Dataset -> Avg@k."""
        return {name: correct / total for name, (correct, total) in self.counts.items()}

    @property
    def exact_mean(self) -> Fraction:
        return exact_mean(self.counts)

    @property
    def mean(self) -> float:
        return float(self.exact_mean)

    def metrics(self, k: int, *, measured: bool = True) -> dict[str, float]:
        """The evaluation's metrics; with a user reward, ``eval/<dataset>_reward_failed`` too. An
        evaluation that measured nothing (``measured=False``, see :meth:`unscored`) reports only
        those counts: its accuracies would read as the policy's."""
        out = {f"eval/{name}_reward_failed": failed for name, failed in self.reward_failed.items()}
        if not measured:
            return out
        out.update({f"eval/{name}_avg@{k}": value for name, value in self.scores.items()})
        out[f"eval/mean_avg@{k}"] = self.mean
        for name, halves in self.halves.items():
            for half, (correct, total) in halves.items():
                out[f"eval/{name}_correct_{half}"] = correct
                out[f"eval/{name}_responses_{half}"] = total
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
    prompts (``fmt``, the training prompts' format) but rendered with ``eval.template`` when set:
    a question that cannot be asked raises unless ``skip_bad``."""
    if ev.template is not None:
        fmt = dataclasses.replace(fmt, template=ev.template)
    sets = []
    for index, spec in enumerate(ev.datasets):
        try:
            problems = load_eval_set(spec, root, count=ev.limit or ev.procedural_count, seed=10_000 + index)
        except (OSError, ValueError) as exc:
            raise ValueError(f"eval.datasets[{index}]={spec!r}: {exc}") from exc
        if ev.limit and ev.limit > len(problems):
            raise ValueError(f"eval.limit={ev.limit} asks for more questions than eval.datasets[{index}]={spec!r} "
                             f"holds ({len(problems)}): set eval.limit <= {len(problems)} (or null: all of them)")
        problems = problems[: ev.limit] if ev.limit else problems
        prompts, rejected = usable(problems, [], fmt, setting=f"eval.datasets[{index}]={spec}", skip_bad=skip_bad)
        sets.append(EvalSet(spec, prompts, rejected))
    return sets


def eval_requests(sets: list[EvalSet], tokenizer, cfg, step: int) -> list[GenerationRequest]:
    """The requests of an evaluation at ``step``: every dataset's, in order, ``eval.k`` responses
    each. They do not ask for routed experts (``capture_routing=False``): nothing replays an
    evaluation's routing, and at long responses it would be gigabytes per evaluation."""
    ev = cfg.eval
    return [request for index, eval_set in enumerate(sets)
            for request in requests(eval_set.prompts, tag=f"eval{step}-{eval_set.name}", n=ev.k,
                                    temperature=ev.temperature, top_p=ev.top_p, top_k=0,
                                    max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens,
                                    stop_token_ids=stop_tokens(tokenizer, cfg.rollout.stop_token_ids),
                                    seed=cfg.seed + 7 * step + index, capture_routing=False)]


def evaluate(generate, sets: list[EvalSet], tokenizer, reward_fn, cfg, step: int) -> EvalResult:
    """``generate(requests) -> samples``: any engine or engine group."""
    # every dataset in one generation: the engines work through all of them at once instead of
    # idling at the tail of each (each request keeps its own seed, so the samples are the same)
    return score_evaluation(generate(eval_requests(sets, tokenizer, cfg, step)), sets, tokenizer, reward_fn, cfg, step)


def score_evaluation(generated: list, sets: list[EvalSet], tokenizer, reward_fn, cfg, step: int) -> EvalResult:
    """The result of an evaluation at ``step`` from the samples of its requests
    (:func:`eval_requests`, in their order)."""
    ev = cfg.eval
    counts: Counts = {}
    halves: dict[str, Counts] = {}
    failed: dict[str, int] = {}
    first_failure: dict[str, str] = {}
    offset = 0
    for eval_set in sets:
        problems = [e.problem for e in eval_set.prompts for _ in range(ev.k)]
        samples, offset = generated[offset:offset + len(problems)], offset + len(problems)
        # A truncated response is wrong here whatever data.truncated_reward makes of it in
        # training: Avg@k counts correct answers (a user's reward: responses it scores 1).
        tally = RewardTally()  # a user reward's failures, counted (they score 0: not wrong answers)
        correct = score(samples, problems, tokenizer, reward_fn, truncated_reward=0.0, tally=tally) == 1.0
        counts[eval_set.name] = (int(correct.sum()), correct.numel())
        by_question = correct.view(-1, ev.k)  # each question's k responses are consecutive
        halves[eval_set.name] = {half: (int(by_question[start::2].sum()), by_question[start::2].numel())
                                 for start, half in enumerate(HALVES)}
        if tally.used:
            failed[eval_set.name] = tally.failed
            if tally.first_failure is not None:
                first_failure[eval_set.name] = tally.first_failure
    return EvalResult(step, counts, halves, failed, first_failure)


@dataclass
class BestCheckpoint:
    """The paper's rule: the highest mean Avg@k, the earlier step on ties, decided on the exact
    counts: float means of equal means, summed from different per-dataset fractions, can differ
    in their last bit, which would make a tie a win of the later step.

    ``history`` holds ``(step, mean, counts)`` per evaluation, counts as ``{dataset: [correct,
    responses]}``: plain data, saved in each checkpoint's trainer state, from which the best's
    counts are read back on resume. A run checkpointed before counts were kept has ``(step,
    mean)`` entries; while one of those is the best, a new evaluation must beat its float mean.
    """

    step: int | None = None
    mean: float = float("-inf")
    history: list = field(default_factory=list)

    def update(self, result: EvalResult) -> bool:
        self.history.append((result.step, result.mean,
                             {name: [correct, total] for name, (correct, total) in result.counts.items()}))
        if self.step is None or self._beaten_by(result):
            self.step, self.mean = result.step, result.mean
            return True
        return False

    def best_counts(self) -> Counts | None:
        """The best evaluation's counts; None for none, or one recorded before counts were kept."""
        for entry in reversed(self.history):
            if entry[0] == self.step and len(entry) > 2:
                return {name: (int(correct), int(total)) for name, (correct, total) in entry[2].items()}
        return None

    def _beaten_by(self, result: EvalResult) -> bool:
        best = self.best_counts()
        if best is None:
            return result.mean > self.mean
        return result.exact_mean > exact_mean(best)
