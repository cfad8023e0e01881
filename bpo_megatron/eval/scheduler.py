"""Evaluation at its steps (``eval.mode``): inline on the rollout engines, or in the background.

**Inline**: at an evaluation step the rollout engines, holding that step's weights, generate the
evaluation while training waits; its metrics join the step's record.

**Background**: evaluation engines of their own (``eval.engines``). At an evaluation step s the
trainer's weights of version s go to them (their own
:class:`~bpo_megatron.weight_sync.session.WeightSync`, over the transport the engine's spec
chooses for engines apart from the trainer), the requests are submitted and the
loop goes on training. At every later step boundary :meth:`Evaluations.poll` looks, without
waiting, whether the evaluation finished; when it has, it is scored, the best-checkpoint rule
sees it and its metrics are written as a record of step s of their own (``MetricsWriter``: a
step's record, then its evaluation's). One evaluation runs at a time: the next one, a checkpoint
and the run's end wait for it first (:meth:`Evaluations.wait`, bounded by the engines'
``rollout.stall_timeout_s`` and ``rollout.generate_timeout_s``), so the evaluation engines never
receive newer weights while they evaluate and results land in step order. The evaluation engines
start while the run warms up (after the trainer, beside its warm start); the evaluation of the
initial policy (step 0, ``eval.at_start``) runs inline on the rollout engines in either mode, so
nothing waits for the evaluation engines' start before the first evaluation step.

Checkpoints: before the checkpoint of step c is saved the evaluations of earlier steps finish; the
checkpoint's trainer state lists an evaluation of step c still running (``eval_pending``) and how
many records ``metrics.jsonl`` held. A resume from c keeps those records and runs that evaluation
again (its weights are the checkpoint's), so a killed run neither loses nor repeats one.

An evaluation engine that dies, hangs or stalls is replaced like a rollout engine and its share
sent again once it holds the evaluated weights. When training has already moved past them (the
trainer holds newer weights), that evaluation cannot be finished: it is reported lost (a warning
and an echo line naming the step) and the next evaluation goes on with the new engine.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from bpo_megatron.eval.avg_at_k import BestCheckpoint, EvalResult, eval_requests, evaluate, score_evaluation
from bpo_megatron.rollout.agents import with_agent
from bpo_megatron.weight_sync.plan import SyncPlan
from bpo_megatron.weight_sync.session import WeightSync

log = logging.getLogger(__name__)


class StaleEvaluation(RuntimeError):
    """An evaluation engine was replaced after the trainer's weights moved past the version it
    evaluates: the replacement cannot be given those weights."""


@dataclass
class _Running:
    step: int
    generation: Any  # PendingGeneration (or PendingConversations with rollout.agent)
    started: float  # time.perf_counter() at submission


class Evaluations:
    """The run's evaluations: scored, recorded (``metrics_out``), told to the best-checkpoint rule
    (``best``) in step order, and echoed.

    ``engines``: the background evaluation engines (an ``EngineGroup`` of role evaluation, or a
    future of one still starting, waited for at the first background evaluation), None for inline
    evaluation. They are given the weights of ``trainer`` (whose devices ``phases``, the rollout
    engines' device phases, hand out; ``phases.version``: the update the trainer holds) by a
    :class:`~bpo_megatron.weight_sync.session.WeightSync` of their own, as ``sync_plan`` says.
    The scheduler is their custodian (``orchestration.engine_group.Custodian``): a replacement
    starts at once (their devices are their own) and is given the evaluated weights.
    """

    def __init__(self, plan, reward_fn, best: BestCheckpoint, metrics_out, echo: Callable[[str], None], *,
                 engines=None, trainer=None, phases=None, sync_plan: SyncPlan | None = None) -> None:
        if engines is not None and (trainer is None or phases is None or sync_plan is None):
            raise ValueError("background evaluation engines need the trainer, its device phases and a sync plan")
        self.cfg, self._plan, self._reward_fn = plan.cfg, plan, reward_fn
        self.best, self._metrics_out, self._echo = best, metrics_out, echo
        self._engines, self._trainer, self._phases, self._sync_plan = engines, trainer, phases, sync_plan
        self._weights: WeightSync | None = None
        self._running: _Running | None = None
        if engines is not None and not isinstance(engines, Future):
            self._take_charge(engines)

    @property
    def background(self) -> bool:
        return self._engines is not None

    @property
    def engines(self):
        """The evaluation engines (waits for them to start, the first time)."""
        if isinstance(self._engines, Future):
            self._take_charge(self._engines.result())
        return self._engines

    def _take_charge(self, engines) -> None:
        """The started evaluation engines: their weight sync, and this scheduler their custodian."""
        self._engines, self._weights = engines, WeightSync(self._trainer, engines, self._sync_plan)
        engines.entrust(self)

    def pending_steps(self) -> list[int]:
        """The steps whose background evaluation has not been recorded yet."""
        return [self._running.step] if self._running is not None else []

    # ------------------------------------------------------------------------------- inline
    def inline(self, step: int, generate, *, record: bool = False) -> dict[str, float]:
        """Evaluate step ``step`` now with ``generate`` (the rollout engines, holding its
        weights); its metrics, also written as a record of their own with ``record``."""
        result = evaluate(generate, self._plan.eval_sets, self._plan.tokenizer, self._reward_fn, self.cfg, step)
        return self._record(result, write=record, how="")

    # --------------------------------------------------------------------------- background
    def start(self, step: int) -> dict[str, float]:
        """Evaluate the trainer's current weights (version ``step``) on the evaluation engines,
        without waiting for the result: the evaluation under way finishes first. Returns the
        seconds this took (``time/eval_wait_s``, ``time/eval_sync_s``)."""
        if self._phases.version != step:
            raise RuntimeError(f"an evaluation of step {step} was asked for while the trainer holds the weights of "
                               f"step {self._phases.version}")
        t0 = time.perf_counter()
        self.wait(why=f"before the weights of step {step} go to the evaluation engines")
        engines = self.engines  # started beside the trainer: at the first evaluation, waited for
        t1 = time.perf_counter()
        self._sync(step)
        requests = eval_requests(self._plan.eval_sets, self._plan.tokenizer, self.cfg, step)
        # with rollout.agent, conversations of the evaluation engines (moved on by poll()'s done())
        rollouts = with_agent(engines, self._plan.agent, self._plan.tokenizer)
        self._running = _Running(step, rollouts.submit(requests), time.perf_counter())
        return {"time/eval_wait_s": t1 - t0, "time/eval_sync_s": time.perf_counter() - t1}

    def poll(self) -> None:
        """Record the evaluation under way if it has finished (never waits for generation; an
        engine found dead is replaced here and its share sent again)."""
        running = self._running
        if running is None:
            return
        try:
            finished = running.generation.done()
        except StaleEvaluation as exc:
            self._lost(running, exc)
            return
        if finished:
            self._finish(running)

    def wait(self, *, before: int | None = None, why: str = "") -> None:
        """Record the evaluation under way (only one of a step before ``before``; None: any),
        waiting for it: bounded by the evaluation engines' stall and generation timeouts, after
        which an engine is replaced (see the module docstring)."""
        running = self._running
        if running is None or (before is not None and running.step >= before):
            return
        log.info("waiting for the background evaluation of step %d%s", running.step, f" ({why})" if why else "")
        self._finish(running)

    def _finish(self, running: _Running) -> None:
        try:
            samples = running.generation.result()
        except StaleEvaluation as exc:
            self._lost(running, exc)
            return
        self._running = None
        versions = sorted({sample.weight_version for sample in samples})
        if versions != [running.step]:
            raise RuntimeError(f"the background evaluation of step {running.step} was generated with weight versions "
                               f"{versions}, not {running.step}: an evaluation engine was given other weights")
        result = score_evaluation(samples, self._plan.eval_sets, self._plan.tokenizer, self._reward_fn, self.cfg,
                                  running.step)
        self._record(result, write=True, how=f" (background, weights version {running.step}, "
                                              f"{time.perf_counter() - running.started:.1f}s)")

    def _lost(self, running: _Running, exc: Exception) -> None:
        self._running = None
        message = (f"eval step {running.step} (background) lost: {exc}; the run goes on and the next evaluation "
                   "uses the replaced engines")
        log.warning(message)
        self._echo(message)

    # ------------------------------------------------------------- the evaluation engines' custodian
    def starting_engines(self, indices: list[int], start: Callable[[], None]) -> None:
        """Replacements start at once: the evaluation engines' devices are their own."""
        start()

    def resync(self, indices: list[int]) -> None:
        """Engines replaced while an evaluation waits for them: given its weights if the trainer
        still holds them; otherwise that evaluation cannot finish (:class:`StaleEvaluation`)."""
        running = self._running
        version = self._phases.version
        if running is not None and running.step != version:
            raise StaleEvaluation(f"evaluation engines {indices} were replaced while evaluating the weights of step "
                                  f"{running.step}, and the trainer holds those of step {version} now")
        self._sync(version, only=indices)

    def _sync(self, version: int, only: list[int] | None = None) -> None:
        """The trainer's weights, the ``version``-th update, to the evaluation engines (``only``:
        those), read where the trainer computes (colocated: it takes the devices back first)."""
        self._phases.train()
        self._weights.sync(version, only)

    # ---------------------------------------------------------------------------- recording
    def _record(self, result: EvalResult, *, write: bool, how: str) -> dict[str, float]:
        """Tell the best-checkpoint rule, write and echo an evaluation. One on which a user reward
        failed beyond ``data.reward_max_failed_frac`` measured nothing (its failures score as wrong
        answers): it is left out of the rule, its accuracies are not written (its reward-failure
        counts are), and a warning and the echo say why."""
        data = self.cfg.data
        unscored = result.unscored(data.reward, data.reward_max_failed_frac)
        improved = unscored is None and self.best.update(result)
        metrics = result.metrics(self.cfg.eval.k, measured=unscored is None)
        if write:
            self._metrics_out.write(result.step, metrics)
        if unscored is not None:
            failed = ", ".join(f"eval/{name}_reward_failed" for name in result.reward_failed)
            message = (f"eval step {result.step}{how} measured nothing and is left out of the best checkpoint: "
                       f"{unscored}; its accuracies are not recorded (metrics {failed})")
            log.warning(message)
            self._echo(message)
            return metrics
        self._echo(f"eval step {result.step}{how}: " + ", ".join(f"{k}={v:.3f}" for k, v in result.scores.items())
                   + f" | mean {result.mean:.3f}{' (best)' if improved else ''}")
        return metrics


def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """``fn(*args, **kwargs)`` started in a thread of its own (evaluation engines that load their
    model while the trainer starts); the future holds its result or its error."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the result
            future.set_exception(exc)

    threading.Thread(target=work, name=getattr(fn, "__name__", "start"), daemon=True).start()
    return future
