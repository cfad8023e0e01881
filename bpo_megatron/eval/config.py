"""The ``eval`` section: Avg@k on held-out benchmarks every few steps (paper: Avg@32, AIME24–26)."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("inline", "background")


@dataclass(frozen=True)
class EvalConfig:
    """Where an evaluation runs (``mode``):

    * ``inline`` (the default): on the rollout engines, at the evaluation step, while training
      waits; its metrics are part of that step's record in ``metrics.jsonl``.
    * ``background``: on evaluation engines of its own (``engines`` of them, apart from the
      training engines: their own actors and placement bundles, devices on a GPU cluster). At an
      evaluation step the trainer's weights of that step go to them and training goes on while they
      generate; the result is scored at a later step boundary and written as a record of its own
      for the step it evaluates (tagged with that weight version), in step order, once. The
      best-checkpoint rule sees every evaluation, in step order. ``engines`` null takes
      ``rollout.num_engines``: the requests are then split into the same shares and every engine
      decodes the same batches as inline evaluation does, which is what makes both modes' numbers
      identical for the same checkpoint.
    """

    every: int = 10  # steps; 0 disables evaluation
    datasets: tuple[str, ...] = ("aime24", "aime25", "aime26")  # evaluation sets: names, files or procedural:<task>
    k: int = 32  # samples per question
    temperature: float = 1.0  # the evaluation's sampling temperature
    top_p: float = 1.0  # the evaluation's nucleus sampling (1.0: off; no top-k)
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
    mode: str = "inline"  # "inline" | "background" (see the class docstring)
    engines: int | None = None  # background evaluation engines; None: rollout.num_engines

    def __post_init__(self) -> None:
        if self.every < 0 or self.k < 1:
            raise ValueError("eval.every must be >= 0 and eval.k >= 1")
        if self.mode not in MODES:
            raise ValueError(f"eval.mode={self.mode!r} is unknown; choose one of {list(MODES)}")
        if self.engines is not None and self.engines < 1:
            raise ValueError(f"eval.engines={self.engines} must be >= 1 (or null: rollout.num_engines)")
        if self.engines is not None and self.mode != "background":
            raise ValueError(f"eval.engines={self.engines} counts background evaluation engines, but eval.mode="
                             f"{self.mode} evaluates on the rollout engines: set eval.mode=background (or "
                             "eval.engines=null)")
        if self.mode == "background" and not self.every:
            raise ValueError("eval.mode=background starts evaluation engines, but eval.every=0 never evaluates: set "
                             "eval.every > 0 (or eval.mode=inline)")
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


def background_engines(ev: EvalConfig, rollout_engines: int) -> int:
    """How many evaluation engines a run starts beside its rollout engines (0: inline evaluation)."""
    if ev.mode != "background" or not ev.every:
        return 0
    return ev.engines if ev.engines is not None else rollout_engines
