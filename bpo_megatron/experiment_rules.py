"""The experiment's cross-section rules: what no single section can check on its own (layouts
against the world and the model, batch sizes against each other, losses against the engine that
samples for them).

Each rule is a named check over the config keys it reads, registered in :data:`RULES` in the order
:func:`~bpo_megatron.experiment.validate` applies them: it returns ``None`` when the experiment
keeps it, else the error, which names the keys to change and how. A model rule reads the model's
``config.json`` too (``hf``), or the trainer's environment, and runs only where the model is
checked (for a launch: on the cluster, not on the submitting machine). A new cross-section check is
one function here with its ``@rule`` line and a failing input in tests/test_experiment_rules.py;
docs/config-reference.md lists the rules (``python tools/config_reference.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron import platform
from bpo_megatron.models.options import layer_spec_device_refusal, layer_spec_install_refusal
from bpo_megatron.models.megatron_model import check_megatron_builds

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig
    from bpo_megatron.models.hf_config import HFModelConfig


# a rule's check: (cfg) or, for a model rule, (cfg, hf) -> its error, or None
Check = Callable[..., str | None]


@dataclass(frozen=True)
class Rule:
    """``check(cfg)`` (a model rule: ``check(cfg, hf)``) returns the error, or None."""

    name: str
    reads: tuple[str, ...]  # the dotted config keys the check reads
    check: Check
    # checked where the model is (with the model check; on the cluster for a launch): it reads the
    # model's config.json, or the environment the trainer runs in
    model: bool

    @property
    def summary(self) -> str:
        """What the rule asks, in one sentence: the first line of its check's docstring."""
        return " ".join((self.check.__doc__ or "").strip().split("\n\n")[0].split())


RULES: list[Rule] = []


def rule(name: str, *reads: str, model: bool = False) -> Callable[[Check], Check]:
    """Register the decorated check as the rule ``name`` over the keys ``reads``."""

    def register(check: Check) -> Check:
        if any(existing.name == name for existing in RULES):
            raise ValueError(f"experiment rule {name!r} is registered twice")
        RULES.append(Rule(name=name, reads=reads, check=check, model=model))
        return check

    return register


def _value_error(call: Callable[..., object], *args: object, **kwargs: object) -> str | None:
    """The message of the ValueError ``call`` raises (a component's own check), or None."""
    try:
        call(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


# ---- rules over the config alone ----

@rule("parallel_layout_fits_world", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.etp",
      "cluster.trainer_ranks")
def _parallel_layout_fits_world(cfg: ExperimentConfig) -> str | None:
    """The parallel sizes divide the trainer's world."""
    problem = _value_error(cfg.parallel.validate_world, cfg.cluster.trainer_ranks)
    return problem and f"{problem} (cluster.trainer_ranks={cfg.cluster.trainer_ranks})"


@rule("responses_split_into_minibatches", "train.prompts_per_step", "rollout.group_size", "train.minibatches_per_step")
def _responses_split_into_minibatches(cfg: ExperimentConfig) -> str | None:
    """A step's responses split into equal minibatches."""
    if cfg.responses_per_step % cfg.train.minibatches_per_step:
        return (f"train.prompts_per_step × rollout.group_size = {cfg.responses_per_step} responses cannot be split "
                f"into train.minibatches_per_step={cfg.train.minibatches_per_step} equal minibatches")
    return None


@rule("minibatch_splits_over_data_parallel", "train.prompts_per_step", "rollout.group_size",
      "train.minibatches_per_step", "cluster.trainer_ranks", "parallel.tp", "parallel.pp", "parallel.cp")
def _minibatch_splits_over_data_parallel(cfg: ExperimentConfig) -> str | None:
    """A minibatch splits evenly over the data-parallel ranks (every rank runs as many micro-batches)."""
    if cfg.minibatch_size % cfg.data_parallel_size:
        return (f"minibatches of {cfg.minibatch_size} responses cannot be split over {cfg.data_parallel_size} "
                "data-parallel ranks (cluster.trainer_ranks / (parallel.tp × parallel.pp))")
    return None


@rule("routing_replay_needs_capture", "model.routing_replay", "rollout.capture_routed_experts")
def _routing_replay_needs_capture(cfg: ExperimentConfig) -> str | None:
    """R3 replays the experts the engine records, so the engine must record them."""
    if cfg.model.options.routing_replay and not cfg.rollout.capture_routed_experts:
        return ("model.routing_replay=true (R3) needs rollout.capture_routed_experts=true: the trainer "
                "replays the experts the engine records")
    return None


@rule("routing_replay_engine_captures_here", "model.routing_replay", "rollout.engine")
def _routing_replay_engine_captures_here(cfg: ExperimentConfig) -> str | None:
    """R3's engine records routed experts on this machine (some engines only on GPUs)."""
    spec = cfg.rollout.spec
    if cfg.model.options.routing_replay and not spec.captures_routing_without_gpu and not platform.has_cuda():
        return (f"model.routing_replay=true with rollout.engine={spec.name}: it records routed experts only "
                "on GPUs; use rollout.engine=hf on CPU")
    return None


@rule("asynchronous_needs_own_devices", "train.async.max_staleness", "cluster.colocate")
def _asynchronous_needs_own_devices(cfg: ExperimentConfig) -> str | None:
    """Generating while the trainer trains needs the engines on devices of their own."""
    if cfg.train.asynchronous.max_staleness and cfg.cluster.colocate:
        return (f"train.async.max_staleness={cfg.train.asynchronous.max_staleness} generates while the trainer "
                "trains, which needs the engines on their own devices: set cluster.colocate=false (or "
                "train.async.max_staleness=0)")
    return None


@rule("delta_sync_needs_engines_that_keep_weights", "weight_sync.delta", "cluster.colocate", "rollout.engine")
def _delta_sync_needs_engines_that_keep_weights(cfg: ExperimentConfig) -> str | None:
    """A delta weight sync needs engines that keep their weights between syncs."""
    if cfg.weight_sync.delta and cfg.cluster.colocate and cfg.rollout.spec.drops_weights_when_released:
        return (f"weight_sync.delta=true with colocated {cfg.rollout.engine} engines: they drop their weights "
                "when they hand the devices to the trainer, so every sync after a train phase is full and "
                "the trainer's host copy for deltas is paid for nothing: set weight_sync.delta=false (or "
                "cluster.colocate=false)")
    return None


@rule("overlong_buffer_below_limit", "train.overlong_buffer", "rollout.max_new_tokens")
def _overlong_buffer_below_limit(cfg: ExperimentConfig) -> str | None:
    """The overlong penalty starts before the response length limit."""
    if cfg.train.overlong_buffer >= cfg.rollout.max_new_tokens:
        return (f"train.overlong_buffer={cfg.train.overlong_buffer} must be below rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens}: the penalty starts that many tokens before the limit")
    return None


@rule("token_sum_norm_needs_length", "loss.agg", "loss.norm_length", "rollout.max_new_tokens")
def _token_sum_norm_needs_length(cfg: ExperimentConfig) -> str | None:
    """``seq-mean-token-sum-norm`` divides by a constant, so the loss does not depend on how samples are grouped."""
    if cfg.loss.agg == "seq-mean-token-sum-norm" and cfg.loss.norm_length is None:
        return ("loss.agg=seq-mean-token-sum-norm divides each response's token sum by loss.norm_length, which "
                "is unset: the divisor would be each micro-batch's padded width, so the loss would depend on "
                f"how samples are grouped; set loss.norm_length (Dr. GRPO's constant: rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens})")
    return None


@rule("correction_needs_recomputed_logprobs", "loss.correction.name", "train.recompute_old_logprobs")
def _correction_needs_recomputed_logprobs(cfg: ExperimentConfig) -> str | None:
    """An off-policy correction weighs by the trainer's own log-probs at the step's start."""
    if cfg.loss.correction.active and not cfg.train.recompute_old_logprobs:
        return (f"loss.correction={cfg.loss.correction.name} corrects by the trainer's own log-probs under the weights "
                "at the step's start (those that sampled each response when train.async.max_staleness=0): set "
                "train.recompute_old_logprobs=true (or loss.correction=none)")
    return None


@rule("score_centering_engine_returns_top_logprobs", "loss.score_centering", "rollout.engine")
def _score_centering_engine_returns_top_logprobs(cfg: ExperimentConfig) -> str | None:
    """Score centering needs the sampler's top-k log-probs of every generated token from the engine."""
    spec = cfg.rollout.spec
    if cfg.loss.score_centering and spec.top_logprobs == "none":
        return (f"loss.score_centering builds its term from the sampler's top-k log-probs of every generated "
                f"token, which rollout.engine={spec.name} does not return here (rollout.engine=hf and sglang do); "
                f"use another engine or loss.score_centering=false")
    return None


@rule("score_centering_engine_top_logprobs_filtered", "loss.score_centering", "rollout.engine", "rollout.top_p",
      "rollout.top_k")
def _score_centering_engine_top_logprobs_filtered(cfg: ExperimentConfig) -> str | None:
    """An engine that reports the top-k before its filters samples without top-p/top-k under score centering."""
    spec = cfg.rollout.spec
    if cfg.loss.score_centering and spec.top_logprobs == "unfiltered" and _filters(cfg):
        return (f"loss.score_centering with rollout.engine={spec.name}: it reports the top-k of the distribution "
                f"before its top-k/top-p filters, not the one it draws from with rollout.top_p="
                f"{cfg.rollout.top_p}, rollout.top_k={cfg.rollout.top_k}; set rollout.top_p=1.0 and "
                "rollout.top_k=0 (or use rollout.engine=hf, which reports the filtered one)")
    return None


@rule("score_centering_filters_anchor_to_old_policy", "loss.score_centering", "rollout.top_p", "rollout.top_k",
      "train.recompute_old_logprobs", "loss.correction.name")
def _score_centering_filters_anchor_to_old_policy(cfg: ExperimentConfig) -> str | None:
    """Score centering under top-p/top-k takes no ratio against μ (taken before the filters)."""
    if (cfg.loss.score_centering and _filters(cfg)
            and (not cfg.train.recompute_old_logprobs or cfg.loss.correction.active)):
        return (f"loss.score_centering with rollout.top_p={cfg.rollout.top_p}, rollout.top_k={cfg.rollout.top_k}"
                ": the engine's log μ of each sampled token is taken before these filters and its top-k log "
                "q after them, so a ratio against μ (the loss's without train.recompute_old_logprobs, or "
                f"loss.correction={cfg.loss.correction.name}'s) would weigh the candidates against another "
                "distribution than the sampled token (losses/score_centering.py); set rollout.top_p=1.0 and "
                "rollout.top_k=0, or anchor the loss to π_old without a correction "
                "(train.recompute_old_logprobs=true, loss.correction=none)")
    return None


@rule("score_centering_single_turn", "loss.score_centering", "rollout.agent.name")
def _score_centering_single_turn(cfg: ExperimentConfig) -> str | None:
    """Score centering takes single-turn responses (a multi-turn one carries no top-k of its turns)."""
    if cfg.loss.score_centering and cfg.rollout.agent.name is not None:
        return (f"loss.score_centering with rollout.agent.name={cfg.rollout.agent.name}: a multi-turn response "
                "does not carry the sampler's top-k of its turns yet; set rollout.agent.name=null or "
                "loss.score_centering=false")
    return None


@rule("groups_of_two_or_more", "rollout.group_size", "train.steps")
def _groups_of_two_or_more(cfg: ExperimentConfig) -> str | None:
    """An RL step needs groups of two or more responses (a group of one is its own baseline)."""
    # advantages are group-relative (algo/advantages.py): a group of one response is its own
    # baseline, so every advantage, and with it every policy-gradient and score-centering term, is 0
    if cfg.rollout.group_size == 1 and cfg.train.steps > 0:
        return ("rollout.group_size=1: each response's advantage is its reward minus its group's mean, so in a "
                "group of one it is 0 and no RL step trains anything (score centering's term is scaled by "
                "the advantage too); set rollout.group_size >= 2 (the paper: 16)")
    return None


@rule("verify_needs_readable_engine", "weight_sync.verify", "rollout.engine")
def _verify_needs_readable_engine(cfg: ExperimentConfig) -> str | None:
    """Verifying the weight sync reads the engine's weights back, which the engine must allow."""
    if cfg.weight_sync.verify and not cfg.rollout.spec.exposes_weights:
        return (f"weight_sync.verify=true reads the engine's weights back, which rollout.engine="
                f"{cfg.rollout.spec.name} does not allow (rollout.engine=hf does)")
    return None


@rule("context_parallel_needs_packing", "parallel.cp", "trainer.max_tokens_per_micro_batch")
def _context_parallel_needs_packing(cfg: ExperimentConfig) -> str | None:
    """Context parallelism splits packed samples, so micro-batches are packed."""
    if cfg.parallel.cp > 1 and not cfg.trainer.max_tokens_per_micro_batch:
        return (f"parallel.cp={cfg.parallel.cp} splits packed samples over its ranks: set "
                "trainer.max_tokens_per_micro_batch (packed micro-batches; under CP it counts one rank's "
                "positions)")
    return None


@rule("token_budget_holds_longest_sample", "trainer.max_tokens_per_micro_batch", "data.max_prompt_tokens",
      "rollout.max_new_tokens", "parallel.cp")
def _token_budget_holds_longest_sample(cfg: ExperimentConfig) -> str | None:
    """The longest sample a rollout can produce fits one packed micro-batch (one rank's share under CP)."""
    from bpo_megatron.trainer.packing import rank_positions

    budget, cp = cfg.trainer.max_tokens_per_micro_batch, cfg.parallel.cp
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1  # input positions: tokens[:-1]
    per_rank = rank_positions(longest, cp)
    if budget and per_rank > budget:
        share = "" if cp == 1 else f", {per_rank} on each of parallel.cp={cp} ranks"
        return (f"trainer.max_tokens_per_micro_batch={budget} cannot hold the longest sample: data.max_prompt_tokens="
                f"{cfg.data.max_prompt_tokens} + rollout.max_new_tokens={cfg.rollout.max_new_tokens} − 1 = {longest} "
                f"input positions{share}; raise the budget or parallel.cp (each of its ranks holds 1/cp of a sample), "
                "or lower those limits")
    return None


@rule("engine_options", "rollout.engine", "rollout.<engine>")
def _engine_options(cfg: ExperimentConfig) -> str | None:
    """The engine's own section (``rollout.<engine>``) is one its spec accepts."""
    return _value_error(cfg.rollout.spec.check, cfg.rollout.options)


@rule("layer_spec_needs_gpu_ranks", "model.layer_spec", "cluster.gpus_per_trainer_rank")
def _layer_spec_needs_gpu_ranks(cfg: ExperimentConfig) -> str | None:
    """transformer-engine's layer spec runs on trainer ranks with GPUs only."""
    return layer_spec_device_refusal(cfg.model.options.layer_spec, gpu=cfg.cluster.gpus_per_trainer_rank > 0)


# ---- rules over the config and the model's config.json ----

@rule("layer_spec_installed", "model.layer_spec", model=True)
def _layer_spec_installed(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """transformer-engine's layer spec needs transformer-engine in the trainer's environment (checked where
    the model is: the cluster's driver shares its nodes' environment; each rank checks again)."""
    return layer_spec_install_refusal(cfg.model.options.layer_spec)


@rule("parallel_layout_fits_model", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.etp", "model.path",
      model=True)
def _parallel_layout_fits_model(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """The parallel sizes divide the model's layers, experts and attention heads."""
    return _value_error(cfg.parallel.validate_model, num_layers=hf.num_hidden_layers, num_experts=hf.num_experts,
                        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads)


@rule("score_centering_top_k_within_vocabulary", "loss.score_centering", "loss.score_centering_top_k", "model.path",
      model=True)
def _score_centering_top_k_within_vocabulary(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """Score centering asks the sampler for at most the vocabulary's tokens."""
    if cfg.loss.score_centering and cfg.loss.score_centering_top_k > hf.vocab_size:
        return (f"loss.score_centering_top_k={cfg.loss.score_centering_top_k} asks the sampler for more of its "
                f"most likely tokens than the model's vocabulary holds (vocab_size={hf.vocab_size} in "
                f"{cfg.model.path}); set loss.score_centering_top_k <= {hf.vocab_size} (default 32)")
    return None


@rule("routing_replay_needs_experts", "model.routing_replay", "model.path", model=True)
def _routing_replay_needs_experts(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """R3 replays expert choices, so the model has experts."""
    if cfg.model.options.routing_replay and not hf.num_experts:
        return "model.routing_replay=true needs a Mixture-of-Experts model; model.path is dense"
    return None


@rule("fp8_serving_without_latent_attention", "rollout.<engine>.quantization", "model.path", model=True)
def _fp8_serving_without_latent_attention(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """FP8 serving quantizes grouped-query attention only: a latent-attention model is served unquantized."""
    # the FP8 weight rules (weights/fp8.py) name grouped-query attention's projections only: the
    # latent projections would reach an FP8 server unquantized
    if hf.multi_latent_attention and cfg.rollout.spec.weight_quantization(cfg.rollout.options) is not None:
        return (f"rollout.{cfg.rollout.engine}.quantization=fp8 is not supported for {hf.architecture} "
                "(multi-head latent attention): serve it unquantized")
    return None


@rule("quantized_layout_builds", "rollout.<engine>", "model.path", model=True)
def _quantized_layout_builds(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """The engine builds its quantized layers at its layout (e.g. SGLang's 128-blocks per partition)."""
    layout = cfg.rollout.quantized_layout(hf)
    if layout is not None and not layout.ok:
        return f"rollout.{cfg.rollout.engine}.quantization: " + layout.describe()
    return None


@rule("megatron_builds_model", "model.path", model=True)
def _megatron_builds_model(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """The installed megatron-core builds the model's architecture."""
    problem = _value_error(check_megatron_builds, hf)
    return problem and f"model.path={cfg.model.path!r}: {problem}"


@rule("context_parallel_without_latent_attention", "parallel.cp", "model.path", model=True)
def _context_parallel_without_latent_attention(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """Context parallelism takes grouped-query attention only."""
    # the context-parallel attention (models/context_attention.py) gathers grouped-query keys and
    # values; latent attention's query/key and value widths differ and have no CP path yet
    if hf.multi_latent_attention and cfg.parallel.cp > 1:
        return (f"parallel.cp={cfg.parallel.cp} is not supported for {hf.architecture} (multi-head latent "
                "attention): set parallel.cp=1")
    return None


@rule("sample_fits_model_context", "data.max_prompt_tokens", "rollout.max_new_tokens", "eval.every",
      "eval.max_new_tokens", "model.path", model=True)
def _sample_fits_model_context(cfg: ExperimentConfig, hf: HFModelConfig) -> str | None:
    """A prompt and its response fit the model's positions (training and evaluation)."""
    budgets = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens}
    if cfg.eval.every and cfg.eval.max_new_tokens:
        budgets["eval.max_new_tokens"] = cfg.eval.max_new_tokens
    for setting, new_tokens in budgets.items():
        if cfg.data.max_prompt_tokens + new_tokens > hf.max_position_embeddings:
            return (f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + {setting}={new_tokens} = "
                    f"{cfg.data.max_prompt_tokens + new_tokens} tokens exceed the model's max_position_embeddings="
                    f"{hf.max_position_embeddings} (model.path={cfg.model.path}); lower them")
    return None


def _filters(cfg: ExperimentConfig) -> bool:
    """Whether the engines sample under top-p or top-k."""
    return cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0
