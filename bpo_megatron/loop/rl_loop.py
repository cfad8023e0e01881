"""The RL loop (paper §4 and App. B): sample, verify, normalise, update, sync, evaluate, save.

Every step: ``prompts_per_step`` prompts × G responses from the rollout engines; a verifier
scores each response; advantages are normalised within each prompt's group; the responses are
shuffled into ``minibatches_per_step`` equal minibatches with one optimizer step each; the new
weights go to the engines. With ``train.async.max_staleness`` k > 0 the batches of the next k
steps generate while a step trains (:mod:`bpo_megatron.loop.rollout_pipeline`). Evaluation and
checkpoints every few steps, evaluation inline or beside training (:mod:`bpo_megatron.eval.scheduler`);
a killed run resumes from its newest checkpoint exactly (same data, same seeds), and its metrics
record each step once. A batch a user's reward failed on is never trained on
(``data.on_reward_failure``: the run stops, or the step is skipped).
Everything the run reads is checked first (:mod:`bpo_megatron.loop.preflight`).
"""

from __future__ import annotations

import random

from bpo_megatron.data.reward_values import RewardFailed
from bpo_megatron.loop import diagnostics
from bpo_megatron.loop.batch_shaping import dynamic_batch, punish_overlong
from bpo_megatron.loop.draw import StepDraw
from bpo_megatron.loop.preflight import RunPlan, prepare
from bpo_megatron.loop.rollout_pipeline import RolloutPipeline
from bpo_megatron.loop.samples import training_samples, with_old_logprobs
from bpo_megatron.loop.session import RunSession
from bpo_megatron.observability.timer import PhaseTimer
from bpo_megatron.trainer.samples import split

PHASES = ("rollout", "sync", "train")  # a step's timed phases (time/<phase>_s); the rest is the driver's


def run(cfg, *, echo=print, override_resume: tuple[str, ...] = ()) -> dict:
    """Check everything the run reads, then run it (see :func:`execute`)."""
    return execute(prepare(cfg, override_resume=override_resume), echo=echo)


def execute(plan: RunPlan, *, echo=print) -> dict:
    with RunSession(plan, echo) as run:
        run.start()  # the weights, the warm start, the initial policy's evaluation
        cfg = run.cfg
        if cfg.train.steps == 0:  # a supervised run: its warm start is what it makes
            run.evaluations.wait(why="the run ends")
            run.save(step=0)
            return run.finish()
        ahead = cfg.train.asynchronous
        pipeline = RolloutPipeline(run.rollouts, run.prompts, run.requests, per_step=cfg.train.prompts_per_step,
                                   group_size=cfg.rollout.group_size, last_step=cfg.train.steps,
                                   max_staleness=ahead.max_staleness, stale=ahead.stale,
                                   partial=run.engines.partial_rollouts)
        for step in range(run.state.step + 1, cfg.train.steps + 1):
            rl_step(run, pipeline, step)
        return run.finish()


def rl_step(run: RunSession, pipeline: RolloutPipeline, step: int) -> None:
    """One RL step: settle, sync, rollout, draw and score, shape, advantages, old log-probs,
    train, evaluate, record, save."""
    cfg = run.cfg
    run.evaluations.poll()  # a background evaluation that finished meanwhile is recorded
    timer = PhaseTimer(PHASES)
    with timer.phase("rollout"):
        pipeline.settle()  # the batches under way finish (or pause) before new weights
    with timer.phase("sync"):
        run.phases.rollout()  # the engines get the weights of the last update
    pipeline.plan(step)  # this step's batch and, asynchronously, those of the next max_staleness steps
    draw = StepDraw(run, pipeline, step, timer)  # prompts × G responses and their rewards
    shaping: dict[str, float] = {}
    try:
        if cfg.train.dynamic_sampling:  # only groups whose rewards vary, drawing more prompts
            samples, rewards, shaping = dynamic_batch(draw, cfg.train.prompts_per_step, cfg.rollout.group_size,
                                                      cfg.train.dynamic_sampling_max_rounds)
        else:
            samples, rewards = draw(cfg.train.prompts_per_step, 0)
    except RewardFailed as failure:  # a user's reward failed on too much of the batch to train on it
        if cfg.data.on_reward_failure == "stop":
            raise
        run.skip_step(step, pipeline.resume_cursor(), {**draw.metrics(), **timer.metrics()}, failure)
        return
    if cfg.train.overlong_buffer:
        rewards, overlong = punish_overlong(samples, rewards, cfg.rollout.max_new_tokens, cfg.train.overlong_buffer,
                                            cfg.train.overlong_penalty)
        shaping.update(overlong)
    train_samples, metrics = training_samples(samples, rewards, cfg.rollout.group_size,
                                              keep_routing=cfg.model.options.routing_replay,
                                              asynchronous=bool(cfg.train.asynchronous.max_staleness))
    metrics.update(shaping)
    metrics.update(draw.metrics())
    random.Random(cfg.seed + step).shuffle(train_samples)
    with timer.phase("train"):
        run.phases.train()
        metrics.update(diagnostics.routing_agreement(run.trainer, train_samples, cfg))
        # log π_old, what the loss anchors to and corrects by: the weights of this step's start
        # (under train.async newer than the sampling ones: decoupled, ρ = π_old/μ has staleness)
        if cfg.train.recompute_old_logprobs:
            train_samples = with_old_logprobs(run.trainer, train_samples)
        updates = [run.trainer.train_step(mb) for mb in split(train_samples, cfg.train.minibatches_per_step)]
        run.phases.weights_changed(version=step)
    metrics.update(diagnostics.mean_over_minibatches(updates))
    metrics["driver/to_trainer_mb"] = run.trainer.take_sent_bytes() / 2**20  # this step's object-store writes
    metrics.update(timer.metrics())
    run.state.step, run.state.data_cursor = step, pipeline.resume_cursor()
    metrics.update(run.evaluate(step, pipeline))
    run.record(step, metrics)  # with what the device phases moved (push, offload, onload, resume)
    run.checkpoint(step)
