"""What a step draws: its generation requests, then its responses and their rewards.

:class:`StepRequests` makes the requests of a batch of prompts for a step (tags and seeds by step
and round, so a resumed run asks again exactly what it asked). :class:`StepDraw` is one step's
``draw(count, round)``: round 0 takes the step's planned batch from the rollout pipeline, a later
round (dynamic sampling) draws fresh prompts; either way the responses are scored, and what the
reward and the rollouts report besides the scores is kept for the step's metrics. A batch a user's
reward failed on beyond ``data.reward_max_failed_frac`` raises
:class:`~bpo_megatron.data.reward_values.RewardFailed` instead.
"""

from __future__ import annotations

from bpo_megatron.tasks.prompts import requests, stop_tokens
from bpo_megatron.tasks.scoring import RewardTally, score

ROUND_SEED_STRIDE = 7_919_111  # a dynamic-sampling round's seeds lie far from every step's first round


class StepRequests:
    """``(prompts, step, round) -> requests``: G responses each, by the ``rollout`` settings."""

    def __init__(self, cfg, tokenizer) -> None:
        self.rollout = cfg.rollout
        self.stops = stop_tokens(tokenizer, cfg.rollout.stop_token_ids)
        # score centering is built from the sampler's top-k of every generated token
        self.top_logprobs = cfg.loss.score_centering_top_k if cfg.loss.score_centering else 0

    def __call__(self, batch: list, step: int, round_: int) -> list:
        r = self.rollout
        return requests(batch, tag=f"s{step}" if round_ == 0 else f"s{step}r{round_}", n=r.group_size,
                        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                        stop_token_ids=self.stops, seed=r.seed + step + round_ * ROUND_SEED_STRIDE,
                        top_logprobs=self.top_logprobs)


class StepDraw:
    """``draw(count, round)`` of step ``step`` (see the module docstring); ``timer`` counts the
    waits for the engines as the step's rollout phase."""

    def __init__(self, run, pipeline, step: int, timer) -> None:
        self.run, self.pipeline, self.step, self.timer = run, pipeline, step, timer
        self.tally = RewardTally()  # what a user's reward reports besides its scores (reward/* metrics)
        self.lagging: dict[str, float] = {}  # the pipeline's staleness metrics of the step's batch

    def __call__(self, count: int, round_: int):
        run = self.run
        with self.timer.phase("rollout"):
            if round_ == 0:
                samples, batch, self.lagging = self.pipeline.take(self.step)
            else:
                batch = run.prompts.take(count)
                samples = run.rollouts.generate(run.requests(batch, self.step, round_))
        problems = [e.problem for e in batch for _ in range(run.cfg.rollout.group_size)]
        return samples, score(samples, problems, run.tokenizer, run.verify,
                              truncated_reward=run.cfg.data.truncated_reward, tally=self.tally,
                              max_failed_frac=run.cfg.data.reward_max_failed_frac)

    def metrics(self) -> dict[str, float]:
        """The reward's extras and counts, the batch's staleness, and the agent's errors."""
        out = {**self.tally.metrics(), **self.lagging}
        if self.run.plan.agent is not None:
            out["agent/errors"] = self.run.rollouts.take_errors()
        return out
