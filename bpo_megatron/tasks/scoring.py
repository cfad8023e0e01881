"""Rewards of generated responses: decode, then verify against the reference answers (a built-in
verifier) or score against the problem records (a user's reward, which may report more)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from bpo_megatron.data.problems import Problem
from bpo_megatron.data.reward_values import Outcome, RecordReward, RewardFailed, record_of
from bpo_megatron.rollout import Sample


def response_texts(samples: list[Sample], tokenizer) -> list[str]:
    """What each sample answers: its response's text, or a multi-turn sample's last turn (what the
    model said after the environment's last output: ``Sample.final_turn``), without stop tokens."""
    stops = set(tokenizer.eos_token_ids) | set(tokenizer.end_of_turn_ids)
    return [tokenizer.decode([t for t in s.final_turn.tolist() if t not in stops]) for s in samples]


def truncated(sample: Sample) -> bool:
    """Cut off by the length limit: whatever its text ends with, the response never finished."""
    return sample.finish_reason == "length"


@dataclass
class RewardTally:
    """What a user reward reported over a step's scoring calls, besides the scores: responses
    scored 0 for an invalid value (``reward/invalid``) or a failed call (``reward/errors``), and
    each extra value's mean over the responses that reported it (``reward/<name>``). A step
    scored by a built-in verifier reports nothing here."""

    invalid: int = 0
    errors: int = 0
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    used: bool = False  # a user reward scored (maybe nothing: every response truncated)
    first_failure: str | None = None  # the first failed call: its record and what it raised or returned

    @property
    def failed(self) -> int:
        """Responses whose scoring failed (an invalid value or a failed call), scored 0."""
        return self.invalid + self.errors

    def add(self, outcomes: list[Outcome], records: list[dict[str, str]] | None = None) -> None:
        self.used = True
        for index, outcome in enumerate(outcomes):
            self.invalid += outcome.failure == "invalid"
            self.errors += outcome.failure == "error"
            if outcome.failure is not None and self.first_failure is None:
                self.first_failure = (f"record {records[index]['id']!r} {outcome.detail}" if records is not None
                                      else outcome.detail)
            for name, value in outcome.extras.items():
                self.sums[name] += value
                self.counts[name] += 1

    def metrics(self) -> dict[str, float]:
        if not self.used:
            return {}
        return {"reward/invalid": self.invalid, "reward/errors": self.errors,
                **{f"reward/{name}": self.sums[name] / self.counts[name] for name in sorted(self.sums)}}


def refuse_failed_batch(spec: str, records: list[dict[str, str]], outcomes: list[Outcome],
                        max_failed_frac: float) -> None:
    """:class:`RewardFailed` when more than ``max_failed_frac`` of a batch's scoring calls failed
    (raised, timed out, returned an invalid value): a batch scored mostly 0 by a broken reward
    would train the policy on noise. The message names the reward, the share and the first failed
    record with what it raised or returned."""
    failed = [(record, outcome) for record, outcome in zip(records, outcomes) if outcome.failure is not None]
    if not outcomes or len(failed) <= max_failed_frac * len(outcomes):
        return
    record, outcome = failed[0]
    raise RewardFailed(f"data.reward={spec}: {len(failed)} of the batch's {len(outcomes)} scored responses failed "
                       f"({len(failed) / len(outcomes):.0%}, more than data.reward_max_failed_frac={max_failed_frac:g}); "
                       f"the first, record {record['id']!r}, {outcome.detail}. Nothing was trained on this batch: fix "
                       "the reward (or set data.on_reward_failure=skip_step to skip such steps)")


def score(samples: list[Sample], problems: list[Problem], tokenizer, reward_fn, *, truncated_reward: float,
          tally: RewardTally | None = None, max_failed_frac: float | None = None) -> torch.Tensor:
    """Rewards in sample order (``problems`` holds each sample's problem). A truncated response
    scores ``truncated_reward`` (``data.truncated_reward``) unverified: its text may end in the
    reference answer mid-derivation, and rewarding that teaches nothing about finishing.

    A built-in verifier reads the reference answers; a user's reward
    (:class:`~bpo_megatron.data.reward_values.RecordReward`) the whole problem records, and what it
    reports besides the scores is added to ``tally``; with ``max_failed_frac`` a batch that failed
    beyond it raises :class:`RewardFailed` (:func:`refuse_failed_batch`), after the tally counted it."""
    finished = [i for i, s in enumerate(samples) if not truncated(s)]
    rewards = [float(truncated_reward)] * len(samples)
    texts = response_texts([samples[i] for i in finished], tokenizer)
    if isinstance(reward_fn, RecordReward):
        records = [record_of(problems[i]) for i in finished]
        outcomes = reward_fn.score_records(records, texts)
        if tally is not None:
            tally.add(outcomes, records)
        if max_failed_frac is not None:
            refuse_failed_batch(reward_fn.spec, records, outcomes, max_failed_frac)
        verified = [outcome.score for outcome in outcomes]
    else:
        verified = reward_fn(texts, [problems[i].answer for i in finished])
    for i, value in zip(finished, verified):
        rewards[i] = value
    return torch.tensor(rewards, dtype=torch.float32)
