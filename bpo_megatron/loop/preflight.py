"""Everything a run will read, checked before anything starts (no Ray, no model, nothing written).

:func:`prepare` resolves a validated experiment into a :class:`RunPlan`: the tokenizer, the
screened training prompts and evaluation sets, the checkpoint to resume from (intact, with an
unchanged model) and what the run directory allows. Refused input raises
:class:`~bpo_megatron.loop.run_dir.RunRefused` naming the file, line or setting and the fix;
``bpo-megatron train|eval|compare --check`` runs it alone.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpo_megatron.data.problems import Problem
from bpo_megatron.data.reward_service import ServiceError
from bpo_megatron.data.reward_values import record_of
from bpo_megatron.data.rewards import REWARDS, reward_fn
from bpo_megatron.data.tokenizer import load_tokenizer
from bpo_megatron.eval.avg_at_k import EvalSet, load_eval_sets
from bpo_megatron.models.options import describe_layer_spec
from bpo_megatron.loop.run_dir import (RunRefused, RunState, check_config_unchanged, check_model_unchanged,
                                       check_unlocked, checkpoint_root, holds_a_run)
from bpo_megatron.rollout.agents import Agent, Turn, load_agent
from bpo_megatron.rollout.agents.sandbox import SandboxUnavailable, check_confinement
from bpo_megatron.tasks.prompts import PromptFormat
from bpo_megatron.tasks.stream import PromptStream
from bpo_megatron.trainer import checkpoint


@dataclass(frozen=True)
class ColocatedOffload:
    """What a colocated trainer hands its engines for each rollout phase (``cluster.offload``,
    ``auto`` resolved by the planner on the recipe's GPUs: a key of
    ``trainer.offload.OFFLOAD_PARTS``) and whether its host buffers stay across checkpoint saves
    (the node's host memory holds them beside a save's staging)."""

    parts: str
    keep_across_saves: bool


@dataclass
class RunPlan:
    cfg: Any
    tokenizer: Any
    prompts: PromptStream
    eval_sets: list[EvalSet]
    state: RunState
    checkpoint: str | None  # the checkpoint root to resume from; None starts fresh
    changes: dict[str, tuple[Any, Any]]  # settings changed on resume (named by --override-resume)
    notes: list[str] = field(default_factory=list)  # what the user should know before it runs
    agent: Agent | None = None  # rollout.agent, loaded and checked (None: single-turn rollouts)
    offload: ColocatedOffload | None = None  # engines on the trainer's devices: what it hands them


def prompt_format(cfg, tokenizer) -> PromptFormat:
    warm_start = cfg.train.sft_warmup_steps > 0
    return PromptFormat(tokenizer, cfg.data.template, cfg.data.max_prompt_tokens, with_answers=warm_start,
                        max_answer_tokens=cfg.rollout.max_new_tokens if warm_start else None)


def load_run_tokenizer(cfg, hf):
    """The run's tokenizer, whose every id must be a row of the model's embedding."""
    spec = cfg.model.tokenizer or cfg.model.path
    try:
        tokenizer = load_tokenizer(spec)
    except (OSError, ValueError) as exc:
        raise RunRefused(f"model.tokenizer={spec!r} cannot be loaded: {exc}") from exc
    if tokenizer.vocab_size > hf.vocab_size:
        raise RunRefused(f"the tokenizer ({spec}) has {tokenizer.vocab_size} tokens but the model's vocabulary "
                         f"(vocab_size in {cfg.model.path}) has {hf.vocab_size}: token ids past it have no "
                         "embedding; use the model's own tokenizer (model.tokenizer)")
    return tokenizer


def load_data(cfg, tokenizer, *, cursor: int = 0) -> tuple[PromptStream, list[EvalSet]]:
    fmt = prompt_format(cfg, tokenizer)
    skip_bad = cfg.data.on_bad_record == "skip"
    try:
        prompts = PromptStream(cfg.data.train, cfg.data.root, fmt, seed=cfg.data.seed, cursor=cursor,
                               fields=cfg.data.fields, skip_bad=skip_bad)
        prompts.check_first_epoch()
    except (OSError, ValueError, RuntimeError) as exc:
        message = str(exc)
        raise RunRefused(message if message.startswith("data.") else f"data.train={cfg.data.train!r}: {message}") from exc
    eval_sets = []
    if cfg.eval.every:
        try:
            eval_sets = load_eval_sets(cfg.eval, cfg.data.root, fmt, skip_bad=skip_bad)
        except (OSError, ValueError) as exc:
            raise RunRefused(str(exc)) from exc
    return prompts, eval_sets


def check_trackers(cfg) -> str | None:
    """Every tracker ``logging.trackers`` asks for can start: its package is installed and
    imports. The implicit TensorBoard of ``logging.trackers: null`` is not refused (a run may go
    without it, as after a tracker that fails mid-run); a note says when it cannot start."""
    from bpo_megatron.observability.trackers import missing_package, tracker_class, unavailable

    if cfg.logging.trackers is None:
        if not cfg.logging.tensorboard or (why := unavailable("tensorboard")) is None:
            return None
        package = tracker_class("tensorboard").package
        return (f"logging.trackers is null, so the run mirrors its metrics to TensorBoard, whose package {package!r} "
                f"{why}: the run writes metrics.jsonl alone (pip install {package}; or set logging.tensorboard=false, "
                "or list the trackers in logging.trackers, where a missing one is refused)")
    for name in cfg.logging.trackers:
        if (why := missing_package(name)) is not None:
            raise RunRefused(why)
    return None


def check_reward(cfg, problem: Problem, what: str = "the first training record") -> str | None:
    """A user's ``data.reward`` (a function or a service) loaded and called once, on ``problem``
    with its reference answer as the response: a module or function that is missing, a service
    that does not answer, a call that raises and a value a reward may not return (NaN, outside
    [-1, 1], a string, a dict without ``score``) are refused here, before Ray or a model starts;
    mid-run they would only be counted. The note says what the dry call scored."""
    spec = cfg.data.reward
    if spec in REWARDS:
        return None
    try:
        reward = reward_fn(spec, cfg.data, workers=1)  # one call: one worker process
    except ValueError as exc:
        raise RunRefused(str(exc)) from exc
    try:
        outcome = reward.outcomes([record_of(problem)], [problem.answer])[0]
    except ServiceError as exc:
        raise RunRefused(f"{exc} (the dry call on {what}, before the run starts)") from exc
    finally:
        reward.close()
    where = f"{what} (id {problem.id!r}{f', {problem.origin}' if problem.origin else ''})"
    if outcome.failure is not None:
        raise RunRefused(f"data.reward={spec}: the dry call on {where}, its reference answer as the response, "
                         f"{outcome.detail}")
    extras = "".join(f", {name}={value:g}" for name, value in outcome.extras.items())
    return (f"data.reward={spec}: the dry call on {where}, its reference answer as the response, scored "
            f"{outcome.score:g}{extras}")


def check_agent(cfg, tokenizer, problem: Problem, what: str = "the first training record"
                ) -> tuple[Agent | None, str | None]:
    """``rollout.agent`` loaded and checked before Ray or a model starts: importable, its call
    token one token of the run's tokenizer, and, where it gives a demonstration (which a warm start
    imitates), the demonstration of ``problem`` well formed and answered by the agent itself as it
    says. The agent, and a note for the user."""
    settings = cfg.rollout.agent
    if not settings.enabled:
        return None, None
    try:
        agent = load_agent(settings, run_dir=cfg.run_dir)
    except ValueError as exc:
        raise RunRefused(str(exc)) from exc
    confinement = None
    if agent.executes_model_output:  # the code must be confinable here, or the run says it will not be
        try:
            confinement = check_confinement(settings.sandbox, run_dir=cfg.run_dir)
        except SandboxUnavailable as exc:
            raise RunRefused(f"rollout.agent.name={settings.name}: {exc}") from exc
    try:
        ids = tokenizer.encode(agent.call_token)
    except ValueError as exc:
        ids = exc
    if not isinstance(ids, list) or len(ids) != 1:
        count = f"{len(ids)} tokens" if isinstance(ids, list) else f"not encodable ({ids})"
        raise RunRefused(f"rollout.agent.call_token={agent.call_token!r} (rollout.agent.name={settings.name}) is "
                         f"{count} of the run's tokenizer ({cfg.model.tokenizer or cfg.model.path}); a model turn "
                         "stops on one token: set rollout.agent.call_token to the text of one")
    where = f"rollout.agent.name={settings.name}: the demonstration of {what} (id {problem.id!r})"
    try:
        demonstration = agent.demonstration(problem.problem, problem.answer)
    except Exception as exc:  # noqa: BLE001 - a user's agent: its error, named
        raise RunRefused(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if demonstration is None:
        plain = ("rollout.agent: the agent gives no demonstration, so a warm start (train.sft_warmup_steps) trains on "
                 "plain reference answers" if cfg.train.sft_warmup_steps else None)
        return agent, "; ".join(note for note in (confinement, plain) if note) or None
    # respond() reads the prompt as the model saw it: rendered, encoded, decoded
    prompt = tokenizer.decode(tokenizer.encode(tokenizer.render_prompt(problem.problem, cfg.data.template)))
    _check_demonstration(agent, tokenizer, demonstration, prompt, where)
    return agent, confinement


def _check_demonstration(agent: Agent, tokenizer, turns: list[Turn], prompt: str, where: str) -> None:
    """Model and environment turns alternate, from the model's to the model's; every model turn
    but the last ends with the call token; every text encodes; the agent answers each call as the
    demonstration says (a warm start would otherwise teach what the environment never does)."""
    if not turns or any(not isinstance(t, Turn) for t in turns):
        raise RunRefused(f"{where} must be a non-empty list of Turn, got {turns!r}")
    for i, turn in enumerate(turns):
        if turn.from_environment != (i % 2 == 1) or (i == len(turns) - 1 and turn.from_environment):
            raise RunRefused(f"{where}: turn {i} ({turn.text!r}) is out of order: model and environment turns "
                             "alternate, starting and ending with the model's")
        try:
            tokenizer.encode(turn.text)
        except ValueError as exc:
            raise RunRefused(f"{where}: turn {i} ({turn.text!r}) cannot be encoded: {exc}") from exc
        if not turn.from_environment and i < len(turns) - 1 and not turn.text.endswith(agent.call_token):
            raise RunRefused(f"{where}: model turn {i} ({turn.text!r}) is followed by the environment's but does not "
                             f"end with the call token {agent.call_token!r}")
    for i in range(1, len(turns), 2):
        try:
            said = agent.respond(prompt, list(turns[:i]))
        except Exception as exc:  # noqa: BLE001 - a user's agent: its error, named
            raise RunRefused(f"{where}: respond() on its turns before turn {i} raised "
                             f"{type(exc).__name__}: {exc}") from exc
        if said != turns[i].text:
            raise RunRefused(f"{where}: turn {i} says the environment answers {turns[i].text!r}, but respond() "
                             f"answers {said!r}")


def resume_point(cfg, hf) -> tuple[RunState, str | None, list[str]]:
    """The state and checkpoint a resumed run starts from (intact, same model), with notes."""
    root = checkpoint_root(cfg)
    try:
        chosen = checkpoint.select(root)
    except checkpoint.DamagedCheckpoint as exc:
        raise RunRefused(str(exc)) from exc
    if chosen.path is None:
        return RunState(), None, list(chosen.notes)
    meta = json.loads((chosen.path / checkpoint.STATE_FILE).read_text())
    if "hf_config" in meta:
        from bpo_megatron.models import HFModelConfig

        check_model_unchanged(hf, HFModelConfig.load(meta["hf_config"]), what=f"the one {chosen.path} was trained with",
                              model_path=cfg.model.path)
    check_optimizer_layout(cfg, chosen.path, meta)
    state, notes = RunState.from_checkpoint(meta), list(chosen.notes)
    if any(len(entry) < 3 for entry in state.eval_history):
        notes.append(f"{chosen.path} records its evaluations as means without their counts (saved before counts "
                     "were kept): while the best checkpoint is one of them, a new evaluation must beat its float mean")
    return state, str(root), notes


def check_optimizer_layout(cfg, directory: Path, meta: dict[str, Any]) -> None:
    """A checkpoint whose optimizer state reshards across data parallelism only (the distributed
    optimizer's shards) resumes with the model-parallel layout it was saved with."""
    from bpo_megatron.parallel import layout_record
    from bpo_megatron.trainer import optimizer_state

    if not meta.get("optimizer_state", False):
        return
    saved = meta.get("optimizer_format", optimizer_state.GATHERED)
    layout = layout_record(cfg.parallel, cfg.cluster.trainer_ranks)
    refusal = optimizer_state.model_parallel_change(directory, saved, meta.get("layout", {}), layout)
    if refusal:
        raise RunRefused(refusal)


def check_initial_weights(cfg, hf) -> None:
    """A ``model.init: random`` run's engines start from ``initial_hf``: it must be this model."""
    initial = cfg.run_dir / "initial_hf" / "config.json"
    if cfg.model.init == "random" and initial.is_file():
        from bpo_megatron.models import HFModelConfig

        check_model_unchanged(hf, HFModelConfig.load(initial), what=f"the run's initial weights ({initial.parent})",
                              model_path=cfg.model.path)


def check_pretrained_weights(cfg, hf) -> None:
    """A run that starts from ``model.path``'s weights: every file readable (not cut short) and
    every tensor there with the shape its config.json implies, no expert it does not count, and its
    multi-token-prediction layers (carried into the run's checkpoints) whole and counted."""
    from bpo_megatron.weights.mtp import find_in_checkpoint
    from bpo_megatron.weights.names import check_hf_checkpoint
    from bpo_megatron.weights.safetensors_io import HFWeightsReader

    try:
        with HFWeightsReader(cfg.model.path) as reader:
            check_hf_checkpoint(reader, hf)
            find_in_checkpoint(reader, hf)
    except (OSError, ValueError) as exc:
        raise RunRefused(f"model.path={cfg.model.path}: {exc}") from exc


def resource_plan(cfg, hf):
    """The planner's plan of the recipe's allocation (:func:`bpo_megatron.planner.plan.make_plan`)
    when a check reads it: engines sharing the trainer's devices, or any on GPUs; else None."""
    if not (cfg.cluster.colocate or cfg.cluster.gpus_per_node):
        return None
    from bpo_megatron.planner.plan import make_plan

    return make_plan(cfg, hf)


def check_inflight(plan) -> None:
    """Refuse requests in flight beyond what an engine's KV pool holds at full length
    (``rollout.<engine>.max_inflight``; :mod:`bpo_megatron.planner.rollout` states the rule)."""
    if plan is not None and (why := plan.inflight_refusal()) is not None:
        raise RunRefused(why)


def colocated_offload(cfg, hf, plan=None) -> tuple[ColocatedOffload | None, list[str]]:
    """What a colocated trainer offloads, by the plan of the recipe's allocation
    (:mod:`bpo_megatron.planner.offload`; ``plan``: made here when not given), and whether the
    busiest trainer node's host memory keeps the offload's buffers across checkpoint saves
    (:mod:`bpo_megatron.planner.host`); notes saying so on GPUs. A setting that does not fit the
    GPUs is refused, naming cluster.offload."""
    if not cfg.cluster.colocate:
        return None, []
    plan = plan or resource_plan(cfg, hf)
    if (why := plan.offload.refusal()) is not None:
        raise RunRefused(why)
    keep = plan.host is None or plan.host.fits
    notes = [plan.offload.describe()] if plan.offload.options else []
    if not keep:
        host = plan.host
        notes.append(f"the offload's host buffers are dropped before each checkpoint save and allocated again after "
                     f"it (slowly, pinned): with them a save needs {host.at_save / 1e9:.1f} GB of host memory on the "
                     f"busiest trainer node, more than its {host.node_bytes / 1e9:.0f} GB (bpo-megatron plan, "
                     "--host-memory-gb)")
    return ColocatedOffload(plan.offload.parts, keep), notes


def decoupled_anchor_note(cfg) -> str | None:
    """What π_old is under train.async: the weights at each step's start, not the sampling weights."""
    lag = cfg.train.asynchronous.max_staleness
    if not (lag and cfg.train.recompute_old_logprobs):
        return None
    return (f"train.async.max_staleness={lag} with train.recompute_old_logprobs=true: log π_old is recomputed with "
            "the weights at each step's start, not the (up to "
            f"{lag} updates older) weights that sampled the responses (decoupled PPO): the loss's ratios are taken "
            f"against them and ρ = π_old/μ (loss.correction={cfg.loss.correction.name}; metrics mismatch_abs_logp_diff_mean, "
            "mismatch_kl_k3) includes the responses' staleness besides the engine/trainer mismatch")


def unused_engine_note(cfg) -> str | None:
    """The settings of engine sections the run does not use (``rollout.engine`` picks one): they
    do nothing, which a user who set, say, FP8 serving there should hear before the run."""
    unused = cfg.rollout.unused_settings()
    if not unused:
        return None
    chosen = {option.name for option in dataclasses.fields(cfg.rollout.options)}
    listed = "; ".join(f"rollout.{engine}.{name}={value!r}"
                       + (f" (this engine's own is rollout.{cfg.rollout.engine}.{name})" if name in chosen else "")
                       for engine, name, value in unused)
    return (f"rollout.engine={cfg.rollout.engine}: the sections of the other engines are not used, so these settings "
            f"do nothing: {listed}; move them to rollout.{cfg.rollout.engine} or drop them")


def prepare(cfg, *, override_resume: tuple[str, ...] = ()) -> RunPlan:
    """Check everything the run will read; refuse with :class:`RunRefused` (nothing written)."""
    run_dir = Path(cfg.run_dir)
    hf = cfg.hf_config()
    check_unlocked(run_dir)
    occupied = holds_a_run(run_dir)
    if occupied and not cfg.checkpoint.resume:
        raise RunRefused(
            f"{run_dir} already holds a run and checkpoint.resume=false would mix a new run into it; choose "
            "another name (name=... or logging.run_dir=...), delete the directory, or resume it")
    changes = check_config_unchanged(cfg, run_dir, tuple(override_resume)) if occupied else {}
    if occupied:
        check_initial_weights(cfg, hf)
    state, resume_from, notes = resume_point(cfg, hf) if occupied else (RunState(), None, [])
    if (anchor := decoupled_anchor_note(cfg)) is not None:
        notes.append(anchor)
    if (unused := unused_engine_note(cfg)) is not None:
        notes.append(unused)
    notes += cfg.rollout.spec.notes(cfg.rollout.options)
    if resume_from is None and cfg.model.init == "pretrained":
        check_pretrained_weights(cfg, hf)
    plan = resource_plan(cfg, hf)
    check_inflight(plan)
    offload, offload_notes = colocated_offload(cfg, hf, plan)
    notes += offload_notes
    if (layout := cfg.rollout.quantized_layout(hf)) is not None:  # refused ones stopped the config check
        notes.append(layout.describe())
    tokenizer = load_run_tokenizer(cfg, hf)
    prompts, eval_sets = load_data(cfg, tokenizer, cursor=state.data_cursor)
    if (tracking := check_trackers(cfg)) is not None:
        notes.append(tracking)
    if (scored := check_reward(cfg, prompts.peek().problem)) is not None:
        notes.append(scored)
    agent, agent_note = check_agent(cfg, tokenizer, prompts.peek().problem)
    if agent_note is not None:
        notes.append(agent_note)
    if prompts.rejected:
        notes.append(f"data.on_bad_record=skip: {len(prompts.rejected)} training records left out "
                     f"(first: {prompts.rejected[0]})")
    for eval_set in eval_sets:
        if eval_set.rejected:
            notes.append(f"data.on_bad_record=skip: {len(eval_set.rejected)} questions of {eval_set.name} left out "
                         f"(first: {eval_set.rejected[0]})")
    return RunPlan(cfg, tokenizer, prompts, eval_sets, state, resume_from, changes, notes, agent, offload)


def summary(plan: RunPlan) -> str:
    """What ``--check`` prints: what the run would do."""
    cfg = plan.cfg
    lines = [f"config ok: {cfg.name} -> {cfg.run_dir}"]
    if plan.checkpoint:
        lines.append(f"resumes from step {plan.state.step} ({plan.checkpoint})")
    else:
        lines.append("starts a new run")
    lines.append(f"training prompts: {plan.prompts.describe()}")
    lines.append(f"trainer: {describe_layer_spec(cfg.model.options, gpu=cfg.cluster.gpus_per_trainer_rank > 0)}")
    for eval_set in plan.eval_sets:
        lines.append(f"eval set {eval_set.name}: {len(eval_set.prompts)} questions")
    for key, (old, new) in plan.changes.items():
        lines.append(f"changed on resume: {key}: {old!r} -> {new!r}")
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
