"""The ``data`` section: where training prompts come from and how answers are scored."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from bpo_megatron.data import reward_service

PROCEDURAL = "procedural:"


def check_procedural(spec: str, setting: str) -> None:
    """``procedural:<task>`` must name a registered task, or several joined by ``+`` (a mixture)."""
    if spec.startswith(PROCEDURAL):
        from bpo_megatron.data.procedural import MIXTURE, TASKS, unknown_tasks

        if unknown := unknown_tasks(spec[len(PROCEDURAL):]):
            raise ValueError(f"{setting}={spec!r}: procedural task {unknown[0]!r} is unknown; choose one of "
                             f"{', '.join(PROCEDURAL + t for t in sorted(TASKS))} (or several joined by "
                             f"{MIXTURE!r}, e.g. {PROCEDURAL}add2{MIXTURE}max)")


@dataclass(frozen=True)
class DataConfig:
    """``train`` is a dataset name, a ``.jsonl``/``.parquet`` path, ``hf:<name>``, or
    ``procedural:<task>`` (an endless generated task, see ``bpo_megatron.data.procedural``). The
    names (``gsm8k_train``, ``gsm8k_test``, ``math500``, ``aime24``, ``aime25``, ``aime26``) are the
    sets that ship with the package (``bpo_megatron/data/sets``: sources, licences, checksums);
    ``root``, when set, is a directory of your own holding files of the same names instead.
    ``fields`` reads ``train`` records of another schema: problem field -> dotted path, e.g.
    ``{problem: prompt.0.content, answer: reward_model.ground_truth, id: extra_info.index}``.

    ``on_bad_record`` says what happens to a record the run cannot use (malformed, a field
    missing, a prompt longer than ``max_prompt_tokens`` or not encodable by the tokenizer):
    ``error`` refuses the run before it starts, naming the record; ``skip`` leaves it out of
    training and evaluation and reports how many were left out.

    ``reward`` scores a response: ``math`` or ``exact`` by its final answer only (see
    ``bpo_megatron.data.rewards``), or a reward of the user's, a function as
    ``package.module:function`` or a service as ``http://host:port/path`` (see
    ``bpo_megatron.data.user_reward`` and ``bpo_megatron.data.reward_service``), checked with a dry
    call before a run starts. A service is given ``reward_timeout_s`` to answer a batch, and
    ``reward_retries`` more attempts when it does not (or fails with a 5xx).
    A user function's calls run within ``reward_batch_timeout_s`` for a whole batch (besides
    each call's own scoring timeout), so a function that hangs on every response costs a step that
    much, not a timeout per response. A batch in which more than ``reward_max_failed_frac`` of the
    scored responses failed (the reward raised, timed out or returned an invalid value) is not
    trained on: ``on_reward_failure`` ``stop`` ends the run (exit 1, resumable from its newest
    checkpoint once the reward is fixed), ``skip_step`` records the step as skipped
    (``reward/skipped_step``) and goes on (``train`` then says on its last line how many steps
    trained nothing, and exits 3 when that is most of them). A service that fails a whole batch always stops the run.
    ``truncated_reward`` is the training reward of a response cut off by the length limit
    (``rollout.max_new_tokens``), whatever its text ends with. Evaluation counts such a response
    as wrong whatever this says: Avg@k counts correct answers."""

    train: str = "gsm8k_train"
    root: str = ""
    # the prompt template: a name of data.tokenizer.TEMPLATES (math-boxed, math-answer-line, plain)
    template: str = "math-boxed"
    reward: str = "math"
    max_prompt_tokens: int = 2048
    seed: int = 1234  # the training prompts' order: each epoch shuffled (a procedural task generated) from seed + epoch
    fields: dict[str, str] = field(default_factory=dict)
    on_bad_record: Literal["error", "skip"] = "error"
    truncated_reward: float = 0.0
    reward_timeout_s: float = reward_service.TIMEOUT_S
    reward_retries: int = reward_service.RETRIES
    reward_batch_timeout_s: float = 600.0
    reward_max_failed_frac: float = 0.1
    on_reward_failure: Literal["stop", "skip_step"] = "stop"

    def __post_init__(self) -> None:
        from bpo_megatron.data.problems import check_field_map
        from bpo_megatron.data.rewards import unknown_reward
        from bpo_megatron.data.tokenizer import TEMPLATES

        if (why := unknown_reward(self.reward)) is not None:
            raise ValueError(why)
        if not (self.reward_timeout_s > 0 and math.isfinite(self.reward_timeout_s)):
            raise ValueError(f"data.reward_timeout_s must be a positive number of seconds, got {self.reward_timeout_s}")
        if self.reward_retries < 0:
            raise ValueError(f"data.reward_retries must be >= 0 (0: one attempt only), got {self.reward_retries}")
        if not (self.reward_batch_timeout_s > 0 and math.isfinite(self.reward_batch_timeout_s)):
            raise ValueError(f"data.reward_batch_timeout_s must be a positive number of seconds, got "
                             f"{self.reward_batch_timeout_s}")
        if not 0.0 <= self.reward_max_failed_frac <= 1.0:
            raise ValueError(f"data.reward_max_failed_frac must be a share in [0, 1] (0: stop at the first failed "
                             f"response, 1: never), got {self.reward_max_failed_frac}")
        if self.template not in TEMPLATES:
            raise ValueError(f"data.template={self.template!r} is unknown; choose one of {sorted(TEMPLATES)}")
        if self.max_prompt_tokens < 1:
            raise ValueError("data.max_prompt_tokens must be >= 1")
        if not math.isfinite(self.truncated_reward):
            raise ValueError(f"data.truncated_reward must be a finite number (0 scores a truncated response as "
                             f"wrong), got {self.truncated_reward}")
        check_field_map(self.fields)
        check_procedural(self.train, "data.train")
