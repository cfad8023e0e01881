"""The RL loop (paper §4 and App. B): sample, verify, normalise, update, sync, evaluate, save.

Every step: ``prompts_per_step`` prompts × G responses from the rollout engines; a verifier
scores each response; advantages are normalised within each prompt's group; the responses are
shuffled into ``minibatches_per_step`` equal minibatches with one optimizer step each; the new
weights go to the engines. With ``train.async.max_staleness`` k > 0 the batches of the next k
steps generate while a step trains (:mod:`bpo_megatron.loop.rollout_pipeline`). Evaluation and
checkpoints every few steps, evaluation inline or beside training (:mod:`bpo_megatron.loop.evaluation`);
a killed run resumes from its newest checkpoint exactly (same data, same seeds), and its metrics
record each step once.
Everything the run reads is checked first (:mod:`bpo_megatron.loop.preflight`).
"""

from __future__ import annotations

import random
import time

from bpo_megatron.data.rewards import reward_fn
from bpo_megatron.eval.avg_at_k import BestCheckpoint
from bpo_megatron.eval.config import background_engines
from bpo_megatron.loop import diagnostics
from bpo_megatron.loop.batch_shaping import dynamic_batch, punish_overlong
from bpo_megatron.loop.evaluation import Evaluations, in_thread
from bpo_megatron.loop.preflight import RunPlan, prepare
from bpo_megatron.loop.rollout_pipeline import RolloutPipeline
from bpo_megatron.loop.run_dir import RunLock, checkpoint_root, initial_hf_dir, read_recorded_config, record_config
from bpo_megatron.loop.samples import training_samples, with_old_logprobs
from bpo_megatron.loop.sft import sft_warmup
from bpo_megatron.observability.metrics import MetricsWriter, summary_line
from bpo_megatron.observability.plot import plot_runs
from bpo_megatron.orchestration.cluster import start_ray, stop_ray
from bpo_megatron.orchestration.groups import EngineGroup, TrainerGroup, run_placement
from bpo_megatron.orchestration.placement import EVALUATION
from bpo_megatron.orchestration.phases import DevicePhases
from bpo_megatron.orchestration.weight_sync import sync_weights
from bpo_megatron.rollout.agents import with_agent
from bpo_megatron.tasks.prompts import requests, stop_tokens
from bpo_megatron.tasks.scoring import RewardTally, score
from bpo_megatron.trainer.samples import split


ROUND_SEED_STRIDE = 7_919_111  # a dynamic-sampling round's seeds lie far from every step's first round


def run(cfg, *, echo=print, override_resume: tuple[str, ...] = ()) -> dict:
    """Check everything the run reads, then run it (see :func:`execute`)."""
    return execute(prepare(cfg, override_resume=override_resume), echo=echo)


def execute(plan: RunPlan, *, echo=print) -> dict:
    cfg, tokenizer, prompts, state = plan.cfg, plan.tokenizer, plan.prompts, plan.state
    run_dir = cfg.run_dir
    with RunLock(run_dir):
        for note in plan.notes:
            echo(f"note: {note}")
        record_config(cfg, run_dir, changed_at_step=state.step if plan.changes else None)
        verify = reward_fn(cfg.data.reward, cfg.data)
        hf_dir = initial_hf_dir(cfg)
        metrics_out = MetricsWriter(run_dir, trackers=cfg.logging.tracker_names, config=read_recorded_config(run_dir),
                                    settings=cfg.logging, resume_after=state.step if plan.checkpoint else None,
                                    keep_records=state.metrics_records if plan.checkpoint else None)
        best = BestCheckpoint(state.best_step, state.best_mean, list(state.eval_history))
        stops = stop_tokens(tokenizer, cfg.rollout.stop_token_ids)
        trainer = engines = starting = placement = None
        started_ray = False
        try:
            evaluating = background_engines(cfg.eval, cfg.rollout.num_engines)  # 0: inline evaluation
            started_ray = start_ray(cfg.cluster,
                                    cpus_needed=cfg.cluster.trainer_ranks + cfg.rollout.num_engines + evaluating)
            placement = run_placement(cfg, eval_engines=evaluating)  # engines on the trainer's devices, or apart
            engines = EngineGroup(cfg, hf_dir, placement=placement)
            # what generates: the engines, or conversations of theirs with rollout.agent's tool
            rollouts = with_agent(engines, plan.agent, tokenizer, max_turns=cfg.rollout.agent.max_turns)
            bucket = cfg.rollout.weight_bucket_mb * 1024 * 1024
            transport = cfg.rollout.spec.transport(cfg.rollout.options, cfg.cluster.colocate)
            push = lambda only, version: sync_weights(  # noqa: E731
                trainer, engines, transport=transport, version=version, bucket_bytes=bucket,
                verify=cfg.train.verify_weight_sync, only=only, dtype=cfg.rollout.sync_dtype)
            phases = DevicePhases(engines, push, shared=cfg.cluster.colocate)
            trainer = TrainerGroup(cfg, placement=placement)
            phases.attach_trainer(trainer)
            engines.on_restart = phases.resync
            if evaluating:  # the evaluation engines start while the run warms up; the first to use them waits
                starting = in_thread(EngineGroup, cfg, hf_dir, placement=placement, role=EVALUATION,
                                     num_engines=evaluating)
            evaluations = Evaluations.of(plan, verify, best, metrics_out, echo, evaluators=starting, trainer=trainer,
                                         phases=phases)
            if plan.checkpoint:
                trainer.load(plan.checkpoint, verify=False)  # verified by the preflight moments ago
                echo(f"resumed from step {state.step} ({plan.checkpoint})")
            else:
                trainer.load_hf(hf_dir)
            if not state.sft_done and cfg.train.sft_warmup_steps:
                sft_warmup(cfg, trainer, prompts, tokenizer, metrics_out, echo, agent=plan.agent)
            state.sft_done = True
            phases.weights_changed(version=state.step)  # version n: the weights after RL step n
            # the initial policy's evaluation (inline in either mode: the evaluation engines are still
            # starting), or the one the checkpoint's save did not see finish
            first = [0] if state.step == 0 and cfg.eval.every and cfg.eval.at_start else []
            for step in first + [s for s in state.eval_pending if cfg.eval.every]:
                if evaluations.background and step:
                    evaluations.start(step)
                else:
                    phases.rollout()
                    evaluations.inline(step, rollouts.generate, record=True)
            if cfg.train.steps == 0:  # a supervised run: its warm start is what it makes
                evaluations.wait(why="the run ends")
                _save(cfg, trainer, phases, state, best, evaluations, metrics_out, step=0)
                return {"step": 0, "best_step": best.step, "best_mean": best.mean, "run_dir": str(run_dir)}

            def request_batch(batch: list, step: int, round_: int) -> list:
                """The requests of ``batch`` (G responses each) for ``step``: tags and seeds by step and round."""
                return requests(batch, tag=f"s{step}" if round_ == 0 else f"s{step}r{round_}", n=cfg.rollout.group_size,
                                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=stops,
                                seed=cfg.rollout.seed + step + round_ * ROUND_SEED_STRIDE)

            ahead = cfg.train.asynchronous
            pipeline = RolloutPipeline(rollouts, prompts, request_batch, per_step=cfg.train.prompts_per_step,
                                       group_size=cfg.rollout.group_size, last_step=cfg.train.steps,
                                       max_staleness=ahead.max_staleness, stale=ahead.stale,
                                       partial=engines.partial_rollouts)

            for step in range(state.step + 1, cfg.train.steps + 1):
                evaluations.poll()  # a background evaluation that finished meanwhile is recorded
                timer = time.perf_counter()
                generating = [0.0]  # seconds spent waiting for the engines to generate
                waited(generating, pipeline.settle)  # the batches under way finish (or pause) before new weights
                t_settled = time.perf_counter()
                sync = phases.rollout()  # the engines get the weights of the last update
                t_sync = time.perf_counter()
                pipeline.plan(step)  # this step's batch and, asynchronously, those of the next max_staleness steps
                tally = RewardTally()  # what a user's reward reports besides its scores (reward/* metrics)

                def draw(count: int, round_: int):
                    """``count`` prompts × G responses (round 0: this step's planned batch) and their
                    verified rewards."""
                    nonlocal lagging
                    if round_ == 0:
                        samples, batch, lagging = waited(generating, pipeline.take, step)
                    else:
                        batch = prompts.take(count)
                        samples = waited(generating, rollouts.generate, request_batch(batch, step, round_))
                    problems = [e.problem for e in batch for _ in range(cfg.rollout.group_size)]
                    return samples, score(samples, problems, tokenizer, verify,
                                          truncated_reward=cfg.data.truncated_reward, tally=tally)

                lagging: dict[str, float] = {}
                shaping: dict[str, float] = {}
                if cfg.train.dynamic_sampling:  # only groups whose rewards vary, drawing more prompts
                    samples, rewards, shaping = dynamic_batch(draw, cfg.train.prompts_per_step, cfg.rollout.group_size,
                                                              cfg.train.dynamic_sampling_max_rounds)
                else:
                    samples, rewards = draw(cfg.train.prompts_per_step, 0)
                if cfg.train.overlong_buffer:
                    rewards, overlong = punish_overlong(samples, rewards, cfg.rollout.max_new_tokens,
                                                        cfg.train.overlong_buffer, cfg.train.overlong_penalty)
                    shaping.update(overlong)
                train_samples, metrics = training_samples(samples, rewards, cfg.rollout.group_size,
                                                          keep_routing=cfg.model.routing_replay,
                                                          asynchronous=bool(ahead.max_staleness))
                metrics.update(shaping)
                metrics.update(tally.metrics())
                metrics.update(lagging)
                if plan.agent is not None:
                    metrics["agent/errors"] = rollouts.take_errors()
                random.Random(cfg.train.seed + step).shuffle(train_samples)
                t_prepared = time.perf_counter()
                phases.train()
                metrics.update(diagnostics.routing_agreement(trainer, train_samples, cfg))
                # log π_old, what the loss anchors to and corrects by: the weights of this step's start
                # (under train.async newer than the sampling ones: decoupled, ρ = π_old/μ has staleness)
                if cfg.train.recompute_old_logprobs:
                    train_samples = with_old_logprobs(trainer, train_samples)
                updates = [trainer.train_step(mb) for mb in split(train_samples, cfg.train.minibatches_per_step)]
                phases.weights_changed(version=step)
                t_train = time.perf_counter()
                metrics.update(diagnostics.mean_over_minibatches(updates))
                metrics["driver/to_trainer_mb"] = trainer.take_sent_bytes() / 2**20  # this step's object-store writes
                step_s = time.perf_counter() - timer
                rollout_s, sync_s, train_s = generating[0], t_sync - t_settled, t_train - t_prepared
                metrics.update({"time/rollout_s": rollout_s, "time/train_s": train_s, "time/sync_s": sync_s,
                                "time/step_s": step_s,
                                # scoring, advantages, batching and bookkeeping: the driver's own work
                                "time/driver_s": step_s - train_s - sync_s - rollout_s})
                state.step, state.data_cursor = step, pipeline.resume_cursor()
                if cfg.eval.every and step % cfg.eval.every == 0:
                    if evaluations.background:  # weights version `step` to the evaluation engines; on we go
                        metrics.update(evaluations.start(step))
                    else:
                        pipeline.settle()
                        sync = diagnostics.add_sync(sync, phases.rollout())
                        metrics.update(evaluations.inline(step, rollouts.generate))
                metrics.update(diagnostics.add_sync(sync, {}))
                metrics_out.write(step, metrics)
                echo(summary_line(step, cfg.train.steps, metrics, bar=cfg.logging.progress))
                evaluations.poll()
                last = step == cfg.train.steps
                if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    # a checkpoint follows every evaluation of an earlier step; the last one, every evaluation
                    evaluations.wait(before=None if last else step, why=f"the checkpoint of step {step}")
                    _save(cfg, trainer, phases, state, best, evaluations, metrics_out, step=step)
            evaluations.wait(why="the run ends")
            return {"step": state.step, "best_step": best.step, "best_mean": best.mean, "run_dir": str(run_dir)}
        except BaseException:
            metrics_out.close(failed=True)  # trackers that keep a status mark the run failed
            raise
        finally:
            metrics_out.close()  # done already when the run failed
            evaluators = starting.result() if starting is not None and starting.exception() is None else None
            for group in (evaluators, engines, trainer):
                if group is not None:
                    group.shutdown()
            if placement is not None:
                placement.remove()
            if started_ray:
                stop_ray()


def _save(cfg, trainer, phases, state, best, evaluations, metrics_out, *, step: int) -> None:
    phases.train()  # the trainer's state is saved from where it computes
    state.best_step, state.best_mean, state.eval_history = best.step, best.mean, best.history
    # an evaluation of this step still running is run again by a resume from here, whose metrics
    # keep the records written so far (not that evaluation's, which may come later)
    state.eval_pending, state.metrics_records = evaluations.pending_steps(), metrics_out.records
    trainer.save(str(checkpoint_root(cfg)), step, state.to_dict(), cfg.checkpoint.keep_last)
    plot_runs([cfg.run_dir], cfg.run_dir / "curves.png", labels=[cfg.name])


def waited(seconds: list[float], fn, *args):
    """``fn(*args)``, its duration added to ``seconds[0]``."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        seconds[0] += time.perf_counter() - start
