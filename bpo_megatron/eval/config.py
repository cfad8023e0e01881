"""The ``eval`` section: Avg@k on held-out benchmarks every few steps (paper: Avg@32, AIME24–26)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalConfig:
    every: int = 10  # steps; 0 disables evaluation
    datasets: tuple[str, ...] = ("aime24", "aime25", "aime26")
    k: int = 32  # samples per question
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None  # None: the rollout limit
    # Questions per dataset (None: all). A procedural:<task> set is generated with exactly this
    # many (its first questions are the same whatever the count: one seeded sequence); a dataset
    # file holding fewer is refused, so an evaluation never asks fewer questions than it says.
    limit: int | None = None
    procedural_count: int = 200  # questions of a procedural:<task> dataset when eval.limit is unset
    at_start: bool = True  # also evaluate the initial policy (step 0)
    # The evaluation prompts' template; None: data.template. Its own setting because training
    # prompts may carry their answer instruction themselves (DAPO-Math-17k with data.template=
    # plain) while the benchmarks do not: AIME with plain would lose its answer instruction.
    template: str | None = None

    def __post_init__(self) -> None:
        if self.every < 0 or self.k < 1:
            raise ValueError("eval.every must be >= 0 and eval.k >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"eval.limit={self.limit} asks for no question; set it >= 1 (or null: every question)")
        if self.procedural_count < 1:
            raise ValueError(f"eval.procedural_count={self.procedural_count} must be >= 1")
        if not self.datasets and self.every:
            raise ValueError("eval.datasets is empty while eval.every > 0")
        from bpo_megatron.data.config import check_procedural
        from bpo_megatron.data.tokenizer import TEMPLATES

        for index, spec in enumerate(self.datasets):
            check_procedural(spec, f"eval.datasets[{index}]")
        if self.template is not None and self.template not in TEMPLATES:
            raise ValueError(f"eval.template={self.template!r} is unknown; choose one of {sorted(TEMPLATES)} "
                             "(or null: data.template)")
