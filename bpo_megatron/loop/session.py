"""A run's set-up and tear-down, in order, around the loop (:class:`RunSession`).

Set up: the run directory's lock, the recorded config, the reward, the metrics writer and its
trackers, the best-checkpoint rule; then Ray, the placement, the rollout engines (and, with
``rollout.agent``, conversations over them), the trainer, the device phases between them, and the
evaluation engines of ``eval.mode=background``. :meth:`RunSession.start` loads the weights (a
checkpoint to resume, or the initial ones), runs the warm start and evaluates the initial policy.
Torn down whatever happened, in reverse: trackers told whether the run failed, every group shut
down, the placement removed, a user reward's scoring workers ended, Ray stopped if this run started
it, the lock released.
"""

from __future__ import annotations

import errno
import sys
import time

from bpo_megatron.data.reward_values import RecordReward
from bpo_megatron.data.rewards import reward_fn
from bpo_megatron.eval.avg_at_k import BestCheckpoint
from bpo_megatron.eval.config import background_engines
from bpo_megatron.eval.scheduler import Evaluations, in_thread
from bpo_megatron.loop.draw import StepRequests
from bpo_megatron.loop.preflight import RunPlan
from bpo_megatron.loop.run_dir import RunLock, checkpoint_root, initial_hf_dir, read_recorded_config, record_config
from bpo_megatron.loop.sft import sft_warmup
from bpo_megatron.observability.metrics import MetricsWriter, summary_line
from bpo_megatron.observability.plot import plot_runs
from bpo_megatron.orchestration.cluster import start_ray, stop_ray
from bpo_megatron.orchestration.groups import EngineGroup, TrainerFailed, TrainerGroup, run_placement
from bpo_megatron.orchestration.phases import DevicePhases, hand_devices_to_trainer
from bpo_megatron.rollout.agents import with_agent
from bpo_megatron.trainer.checkpoint import checkpoint_bytes, space_shortfall, step_dir_name
from bpo_megatron.weight_sync.session import WeightSync


class RunSession:
    """Everything a run holds while it runs (see the module docstring); ``with RunSession(plan) as
    run:``. Its attributes are the loop's vocabulary: ``cfg``, ``state``, ``prompts``,
    ``tokenizer``, ``verify`` (the reward), ``requests`` (a step's requests), ``rollouts`` (what
    generates), ``trainer``, ``phases``, ``evaluations``, ``metrics_out``, ``best``."""

    def __init__(self, plan: RunPlan, echo=print) -> None:
        self.plan, self.cfg, self.state, self.echo = plan, plan.cfg, plan.state, echo
        self.prompts, self.tokenizer = plan.prompts, plan.tokenizer
        self.metrics_out = self.trainer = self.engines = self.placement = self._evaluators = self.verify = None
        self._started_ray = False
        self._lock = RunLock(self.cfg.run_dir)
        self._writing: tuple[int, float] | None = None  # a background save: its step and start time

    # ------------------------------------------------------------------------------ set up
    def __enter__(self) -> RunSession:
        cfg, state, plan = self.cfg, self.state, self.plan
        self._lock.__enter__()
        try:
            for note in plan.notes:
                self.echo(f"note: {note}")
            record_config(cfg, cfg.run_dir, changed_at_step=state.step if plan.changes else None)
            self.verify = reward_fn(cfg.data.reward, cfg.data)
            self.hf_dir = initial_hf_dir(cfg)
            self.metrics_out = MetricsWriter(
                cfg.run_dir, trackers=cfg.logging.tracker_names, config=read_recorded_config(cfg.run_dir),
                settings=cfg.logging, resume_after=state.step if plan.checkpoint else None,
                keep_records=state.metrics_records if plan.checkpoint else None)
            self.best = BestCheckpoint(state.best_step, state.best_mean, list(state.eval_history))
            self.requests = StepRequests(cfg, self.tokenizer)
            self._start_actors()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _start_actors(self) -> None:
        cfg = self.cfg
        evaluating = background_engines(cfg.eval, cfg.rollout.num_engines)  # 0: inline evaluation
        self._started_ray = start_ray(cfg.cluster,
                                      cpus_needed=cfg.cluster.trainer_ranks + cfg.rollout.num_engines + evaluating)
        # engines on the trainer's devices, or apart
        self.placement = run_placement(cfg.cluster, cfg.rollout.num_engines, eval_engines=evaluating)
        self.engines = EngineGroup(cfg.engine_group_spec(), self.hf_dir, placement=self.placement)
        # what generates: the engines, or conversations of theirs with rollout.agent's tool
        self.rollouts = with_agent(self.engines, self.plan.agent, self.tokenizer)
        offload = self.plan.offload  # colocated: what the trainer hands the engines (the planner's choice)
        shared, parts = offload is not None, offload.parts if offload else "nothing"
        hand_devices_to_trainer(self.engines, shared=shared, offload=parts)
        self.trainer = TrainerGroup(cfg.trainer_spec(), cfg.cluster, placement=self.placement)
        self.phases = DevicePhases(self.engines, self.trainer, WeightSync(self.trainer, self.engines, cfg.sync_plan()),
                                   shared=shared, offload=parts,
                                   keep_spares_across_saves=offload.keep_across_saves if offload else False)
        if evaluating:  # the evaluation engines start while the run warms up; the first to use them waits
            self._evaluators = in_thread(EngineGroup, cfg.engine_group_spec(evaluation=True), self.hf_dir,
                                         placement=self.placement)
            self.evaluations = Evaluations(self.plan, self.verify, self.best, self.metrics_out, self.echo,
                                           engines=self._evaluators, trainer=self.trainer, phases=self.phases,
                                           sync_plan=cfg.sync_plan(evaluation=True))
        else:
            self.evaluations = Evaluations(self.plan, self.verify, self.best, self.metrics_out, self.echo)

    def start(self) -> None:
        """The weights (the checkpoint resumed from, or the initial ones), the warm start, and the
        initial policy's evaluation (inline in either mode: the evaluation engines are still
        starting), or the one the checkpoint's save did not see finish."""
        cfg, state, plan = self.cfg, self.state, self.plan
        if plan.checkpoint:
            self.trainer.load(plan.checkpoint, verify=False)  # verified by the preflight moments ago
            self.echo(f"resumed from step {state.step} ({plan.checkpoint})")
        else:
            self.trainer.load_hf(self.hf_dir)
        warm_started = not state.sft_done and cfg.train.sft_warmup_steps
        if warm_started:
            sft_warmup(cfg, self.trainer, self.prompts, self.tokenizer, self.metrics_out, self.echo, agent=plan.agent)
        state.sft_done = True
        self.phases.weights_changed(version=state.step)  # version n: the weights after RL step n
        first = [0] if state.step == 0 and cfg.eval.every and cfg.eval.at_start else []
        if warm_started and first:
            # the warm start's weights, about to be evaluated (the best so far, then), exist nowhere
            # else: saved while the trainer holds the devices; pruned like any other once beaten
            state.data_cursor = self.prompts.cursor  # past the warm start's prompts, where RL goes on
            self.save(0)
        for step in first + [s for s in state.eval_pending if cfg.eval.every]:
            if self.evaluations.background and step:
                self.evaluations.start(step)
            else:
                self.phases.rollout()
                self.evaluations.inline(step, self.rollouts.generate, record=True)
        # what the start moved (the weights and the trainer's memory for an evaluation before
        # step 1) is the run's start-up, as Ray's and the engines' is: no step's
        self.phases.take_moves()

    # -------------------------------------------------------------------- at a step's end
    def evaluate(self, step: int, pipeline) -> dict[str, float]:
        """Step ``step``'s evaluation, when it has one: started in the background, or inline on the
        rollout engines (the batches under way settled, the engines given the step's weights). Its
        metrics."""
        cfg = self.cfg
        if not (cfg.eval.every and step % cfg.eval.every == 0):
            return {}
        if self.evaluations.background:  # weights version `step` to the evaluation engines; on we go
            return self.evaluations.start(step)
        pipeline.settle()
        self.phases.rollout()
        return self.evaluations.inline(step, self.rollouts.generate)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """The step's record, with what the device phases moved since the last one (every key of
        ``orchestration.phases.MOVE_KEYS``: push, offload, onload and resume seconds, zero when not
        run), written and echoed; a background evaluation that finished is recorded too."""
        self.metrics_out.write(step, {**metrics, **self.phases.take_moves()})
        self.echo(summary_line(step, self.cfg.train.steps, metrics, bar=self.cfg.logging.progress))
        self.evaluations.poll()

    def skip_step(self, step: int, data_cursor, metrics: dict[str, float], failure: Exception) -> None:
        """A step that trains nothing (``data.on_reward_failure=skip_step``): recorded as skipped
        (``reward/skipped_step``, and in the run's state, which the run's result reports), saying
        why, and saved on the usual schedule."""
        self.echo(f"step {step}/{self.cfg.train.steps} skipped, nothing trained: {failure}")
        self.state.step, self.state.data_cursor = step, data_cursor
        self.state.skipped_steps.append(step)
        self.record(step, {**metrics, "reward/skipped_step": 1.0})
        self.checkpoint(step)

    def checkpoint(self, step: int) -> None:
        """Save at ``checkpoint.every`` steps, at the last and at a step an evaluation found the
        best so far, once the evaluations before it are recorded (the last: every evaluation)."""
        cfg = self.cfg
        last = step == cfg.train.steps
        best = self.best.step == step  # an evaluation of this step is the best so far: its weights are kept
        if last or best or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            self.evaluations.wait(before=None if last else step, why=f"the checkpoint of step {step}")
            self.save(step)

    def save(self, step: int) -> None:
        self.phases.train()  # the trainer's state is saved from where it computes
        state, best = self.state, self.best
        state.best_step, state.best_mean, state.eval_history = best.step, best.mean, best.history
        # an evaluation of this step still running is run again by a resume from here, whose metrics
        # keep the records written so far (not that evaluation's, which may come later)
        state.eval_pending, state.metrics_records = self.evaluations.pending_steps(), self.metrics_out.records
        root, background = checkpoint_root(self.cfg), self.cfg.checkpoint.background
        self.echo(f"saving the checkpoint of step {step} under {root}{' in the background' if background else ''} ...")
        start = time.perf_counter()
        try:
            timing = self.trainer.save(str(root), step, state.to_dict(), self.cfg.checkpoint.keep_last, background)
        except TrainerFailed as exc:
            _refuse_full_disk(root, exc)
            raise
        self._report_published()  # the save before this one, finished by now
        waited = f"{timing['waited_s']:.1f} s for the save before it, " if timing["waited_s"] >= 0.05 else ""
        if background:
            self._writing = (step, start)
            self.echo(f"the checkpoint of step {step} is being written in the background: training waited "
                      f"{waited}{timing['staged_s']:.1f} s to stage it")
        else:
            written = checkpoint_bytes(root / step_dir_name(step))
            self.echo(f"saved the checkpoint of step {step}: {written / 1e9:.3f} GB in {time.perf_counter() - start:.1f} s")
        plot_runs([self.cfg.run_dir], self.cfg.run_dir / "curves.png", labels=[self.cfg.name])

    def finish_saves(self) -> None:
        """The checkpoint being written in the background, if any, written and published."""
        try:
            self.trainer.finish_saves()
        except TrainerFailed as exc:
            _refuse_full_disk(checkpoint_root(self.cfg), exc)
            raise
        self._report_published()

    def _report_published(self) -> None:
        """Say that the background save started last is published, once it is (the trainer
        publishes it at a training step after its write, or when asked to finish it)."""
        if self._writing is None:
            return
        step, start = self._writing
        saved = checkpoint_root(self.cfg) / step_dir_name(step)
        if saved.is_dir():
            self._writing = None
            self.echo(f"saved the checkpoint of step {step}: {checkpoint_bytes(saved) / 1e9:.3f} GB in the background "
                      f"(published within {time.perf_counter() - start:.1f} s of its start)")

    def finish(self) -> dict:
        """Every evaluation recorded, the last checkpoint written; what the run achieved (with the
        RL steps that trained nothing, ``skipped_steps``)."""
        self.evaluations.wait(why="the run ends")
        self.finish_saves()
        return {"step": self.state.step, "best_step": self.best.step, "best_mean": self.best.mean,
                "best_weights": self.best_weights(), "run_dir": str(self.cfg.run_dir),
                "skipped_steps": list(self.state.skipped_steps)}

    def best_weights(self) -> str | None:
        """Where the best evaluation's weights are: its checkpoint (kept whatever
        ``checkpoint.keep_last`` says), or, for step 0 without a warm start, the initial weights;
        None when they were not saved (a background evaluation finished after its step had passed)."""
        step = self.best.step
        if step is None:
            return None
        saved = checkpoint_root(self.cfg) / step_dir_name(step)
        if saved.is_dir():
            return str(saved)
        return self.hf_dir if step == 0 and not self.cfg.train.sft_warmup_steps else None

    # ---------------------------------------------------------------------------- tear down
    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.metrics_out is not None:
                self.metrics_out.close(failed=exc_type is not None)  # trackers that keep a status mark the run
            evaluators = self._evaluators
            if evaluators is not None:
                evaluators = evaluators.result() if evaluators.exception() is None else None
            for group in (evaluators, self.engines, self.trainer):
                if group is not None:
                    group.shutdown()
            if self.placement is not None:
                self.placement.remove()
            if isinstance(self.verify, RecordReward):  # a user reward's scoring workers end with the run
                self.verify.close()
            if self._started_ray:
                stop_ray()
        finally:
            self._lock.__exit__(exc_type, exc, tb)


def _refuse_full_disk(root, failure: Exception) -> None:
    """A save that failed on a disk with less room than a checkpoint takes failed for want of
    space, whatever error the writer's rank reported (``checkpoint.space_shortfall``): say so, as
    ``OSError(ENOSPC)`` naming the checkpoint directory."""
    if (shortfall := space_shortfall(root)) is not None:
        raise OSError(errno.ENOSPC, f"{shortfall} ({failure})", str(root)) from failure
