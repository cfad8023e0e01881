"""One experiment = one config: every component's section, loaded, overridden and validated.

    cfg = load_experiment("configs/tiny_moe_cpu.yaml", ["loss.name=grpo", "parallel.tp=2"])

Each section is the typed config of the component that uses it; this module only composes them
and checks what no single component can see (layouts against the model and the world, batch
sizes against each other, R3 against the rollout engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from bpo_megatron import platform
from bpo_megatron.config import ConfigError, apply_overrides, build, load_yaml, refuse_moved, refuse_removed
from bpo_megatron.data.config import DataConfig
from bpo_megatron.eval.config import EvalConfig, background_engines
from bpo_megatron.losses import PolicyLossConfig
from bpo_megatron.loop.config import CheckpointConfig, LoopConfig
from bpo_megatron.models.config import ModelConfig
from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.models.qwen3 import check_megatron_builds
from bpo_megatron.observability.config import LoggingConfig
from bpo_megatron.orchestration.config import ClusterConfig
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.rollout.config import RolloutConfig
from bpo_megatron.trainer.config import TrainerConfig
from bpo_megatron.trainer.optimizer import OptimizerSettings
from bpo_megatron.trainer.spec import TrainerSpec
from bpo_megatron.weight_sync.config import WeightSyncConfig
from bpo_megatron.weight_sync.plan import SyncPlan


@dataclass(frozen=True)
class ExperimentConfig:
    """``seed`` is the run's: Megatron's initialisation and RNG, the order samples train in, the
    evaluation's sampling (each engine's own comes from ``rollout.seed``)."""

    # where each setting that left its section lives now (refused at the old key, naming the new)
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "train.micro_batch_size": "trainer.micro_batch_size",
        "train.max_tokens_per_micro_batch": "trainer.max_tokens_per_micro_batch",
        "train.seed": "seed",
        "train.verify_weight_sync": "weight_sync.verify",
        "rollout.weight_bucket_mb": "weight_sync.bucket_mb",
        "loss.tis_cap": "loss.correction.tis_cap",
        "loss.mis_cap": "loss.correction.mis_cap",
        "loss.icepop_low": "loss.correction.icepop_low",
        "loss.icepop_high": "loss.correction.icepop_high",
    }
    # settings that no longer exist, and what to write instead (refused naming it)
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        f"rollout.{engine}.weight_bucket_bytes": "the one weight bucket size, the trainer's buckets and each engine's "
                                                 "weight-update calls alike, is weight_sync.bucket_mb, in MiB (e.g. "
                                                 "weight_sync.bucket_mb=512 for 536870912 bytes)"
        for engine in ("sglang", "vllm")
    }

    name: str = "experiment"  # the run's name: {name} in logging.run_dir (default runs/{name})
    seed: int = 1234
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="."))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    train: LoopConfig = field(default_factory=LoopConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name))

    @property
    def responses_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.group_size

    @property
    def minibatch_size(self) -> int:
        return self.responses_per_step // self.train.minibatches_per_step

    @property
    def evaluation_engines(self) -> int:
        """Background evaluation engines beside the rollout engines (0: evaluation inline)."""
        return background_engines(self.eval, self.rollout.num_engines)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.data_parallel_size(self.cluster.trainer_ranks)

    def hf_config(self) -> HFModelConfig:
        return HFModelConfig.load(self.model.path)

    def weight_transport(self, *, evaluation: bool = False) -> str:
        """How the trainer's weights reach the rollout engines (``evaluation``: the background
        evaluation engines, always on devices of their own): the engine spec's transport for where
        they sit, on the trainer's devices or their own, on GPUs (``cluster.gpus_per_engine``) or
        not."""
        return self.rollout.spec.weight_transport(self.rollout.options, self.cluster.colocate and not evaluation,
                                                  self.cluster.gpus_per_engine > 0)

    def sync_plan(self, *, evaluation: bool = False) -> SyncPlan:
        """How the trainer's weights reach the rollout engines (``evaluation``: the background
        evaluation engines), the same at every sync: the transport for where they sit
        (:meth:`weight_transport`), ``weight_sync``'s bucket size and check, the precision the
        engine's spec takes them in and the form it holds quantized layers in."""
        from bpo_megatron.models.options import TORCH_DTYPES

        dtype = self.rollout.sync_dtype
        return SyncPlan(transport=self.weight_transport(evaluation=evaluation),
                        bucket_bytes=self.weight_sync.bucket_bytes, dtype=TORCH_DTYPES[dtype] if dtype else None,
                        quantization=self.rollout.sync_quantization(self.hf_config()), verify=self.weight_sync.verify)

    def trainer_spec(self) -> TrainerSpec:
        """What each trainer rank is built from: the trainer's sections of this experiment (its
        log π at the engines' sampling temperature, the distribution log μ comes from)."""
        return TrainerSpec(hf=self.hf_config(), parallel=self.parallel, model=self.model.options, loss=self.loss,
                           optimizer=self.optimizer,
                           trainer=replace(self.trainer, temperature=self.rollout.temperature, seed=self.seed))


# Settings given relative to the config file that sets them (e.g. ``model.path: models/tiny``).
RELATIVE_PATHS = ("model.path", "model.tokenizer")


def load_experiment(path: str | Path | None, overrides: list[str] = (), *, check_model: bool = True) -> ExperimentConfig:
    """Read a YAML experiment (or only defaults with ``path=None``), apply overrides, validate."""
    data = load_yaml(path, relative_paths=RELATIVE_PATHS) if path is not None else {}
    data = apply_overrides(data, list(overrides), ExperimentConfig)
    refuse_moved(data, ExperimentConfig.MOVED_KEYS)
    refuse_removed(data, ExperimentConfig.REMOVED_KEYS)
    cfg = build(ExperimentConfig, data)
    validate(cfg, check_model=check_model)
    return cfg


def validate(cfg: ExperimentConfig, *, check_model: bool = True) -> None:
    """Cross-section checks; each error names the fields to change."""
    try:
        cfg.parallel.validate_world(cfg.cluster.trainer_ranks)
    except ValueError as exc:
        raise ConfigError(f"{exc} (cluster.trainer_ranks={cfg.cluster.trainer_ranks})") from exc
    if cfg.responses_per_step % cfg.train.minibatches_per_step:
        raise ConfigError(
            f"train.prompts_per_step × rollout.group_size = {cfg.responses_per_step} responses cannot be split "
            f"into train.minibatches_per_step={cfg.train.minibatches_per_step} equal minibatches")
    if cfg.minibatch_size % cfg.data_parallel_size:
        raise ConfigError(
            f"minibatches of {cfg.minibatch_size} responses cannot be split over {cfg.data_parallel_size} "
            "data-parallel ranks (cluster.trainer_ranks / (parallel.tp × parallel.pp))")
    if cfg.model.options.routing_replay and not cfg.rollout.capture_routed_experts:
        raise ConfigError("model.routing_replay=true (R3) needs rollout.capture_routed_experts=true: the trainer "
                          "replays the experts the engine records")
    spec = cfg.rollout.spec
    if cfg.model.options.routing_replay and not spec.captures_routing_without_gpu and not platform.has_cuda():
        raise ConfigError(f"model.routing_replay=true with rollout.engine={spec.name}: it records routed experts only "
                          "on GPUs; use rollout.engine=hf on CPU")
    if cfg.train.asynchronous.max_staleness and cfg.cluster.colocate:
        raise ConfigError(f"train.async.max_staleness={cfg.train.asynchronous.max_staleness} generates while the trainer "
                          "trains, which needs the engines on their own devices: set cluster.colocate=false (or "
                          "train.async.max_staleness=0)")
    if cfg.train.overlong_buffer >= cfg.rollout.max_new_tokens:
        raise ConfigError(f"train.overlong_buffer={cfg.train.overlong_buffer} must be below rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}: the penalty starts that many tokens before the limit")
    if cfg.loss.agg == "seq-mean-token-sum-norm" and cfg.loss.norm_length is None:
        raise ConfigError("loss.agg=seq-mean-token-sum-norm divides each response's token sum by loss.norm_length, which "
                          "is unset: the divisor would be each micro-batch's padded width, so the loss would depend on "
                          f"how samples are grouped; set loss.norm_length (Dr. GRPO's constant: rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens})")
    if cfg.loss.correction.active and not cfg.train.recompute_old_logprobs:
        raise ConfigError(f"loss.correction={cfg.loss.correction.name} corrects by the trainer's own log-probs under the weights "
                          "at the step's start (those that sampled each response when train.async.max_staleness=0): set "
                          "train.recompute_old_logprobs=true (or loss.correction=none)")
    if cfg.loss.score_centering and spec.top_logprobs == "none":
        raise ConfigError(f"loss.score_centering builds its term from the sampler's top-k log-probs of every generated "
                          f"token, which rollout.engine={spec.name} does not return here (rollout.engine=hf and sglang do); "
                          f"use another engine or loss.score_centering=false")
    if cfg.loss.score_centering and spec.top_logprobs == "unfiltered" and (cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0):
        raise ConfigError(f"loss.score_centering with rollout.engine={spec.name}: it reports the top-k of the distribution "
                          f"before its top-k/top-p filters, not the one it draws from with rollout.top_p="
                          f"{cfg.rollout.top_p}, rollout.top_k={cfg.rollout.top_k}; set rollout.top_p=1.0 and "
                          "rollout.top_k=0 (or use rollout.engine=hf, which reports the filtered one)")
    filters = cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0
    if cfg.loss.score_centering and filters and (not cfg.train.recompute_old_logprobs or cfg.loss.correction.active):
        raise ConfigError(f"loss.score_centering with rollout.top_p={cfg.rollout.top_p}, rollout.top_k={cfg.rollout.top_k}"
                          ": the engine's log μ of each sampled token is taken before these filters and its top-k log "
                          "q after them, so a ratio against μ (the loss's without train.recompute_old_logprobs, or "
                          f"loss.correction={cfg.loss.correction.name}'s) would weigh the candidates against another "
                          "distribution than the sampled token (losses/score_centering.py); set rollout.top_p=1.0 and "
                          "rollout.top_k=0, or anchor the loss to π_old without a correction "
                          "(train.recompute_old_logprobs=true, loss.correction=none)")
    if cfg.loss.score_centering and cfg.rollout.agent.name is not None:
        raise ConfigError(f"loss.score_centering with rollout.agent.name={cfg.rollout.agent.name}: a multi-turn response "
                          "does not carry the sampler's top-k of its turns yet; set rollout.agent.name=null or "
                          "loss.score_centering=false")
    if cfg.rollout.group_size == 1 and cfg.train.steps > 0:
        # advantages are group-relative (algo/advantages.py): a group of one response is its own
        # baseline, so every advantage, and with it every policy-gradient and score-centering term, is 0
        raise ConfigError("rollout.group_size=1: each response's advantage is its reward minus its group's mean, so in a "
                          "group of one it is 0 and no RL step trains anything (score centering's term is scaled by "
                          "the advantage too); set rollout.group_size >= 2 (the paper: 16)")
    if cfg.weight_sync.verify and not spec.exposes_weights:
        raise ConfigError(f"weight_sync.verify=true reads the engine's weights back, which rollout.engine="
                          f"{spec.name} does not allow (rollout.engine=hf does)")
    _check_token_budget(cfg)
    try:
        spec.check(cfg.rollout.options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not check_model:
        return
    try:
        hf = cfg.hf_config()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from exc
    try:
        cfg.parallel.validate_model(num_layers=hf.num_hidden_layers, num_experts=hf.num_experts,
                                    num_attention_heads=hf.num_attention_heads,
                                    num_query_groups=hf.num_key_value_heads)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.loss.score_centering and cfg.loss.score_centering_top_k > hf.vocab_size:
        raise ConfigError(f"loss.score_centering_top_k={cfg.loss.score_centering_top_k} asks the sampler for more of its "
                          f"most likely tokens than the model's vocabulary holds (vocab_size={hf.vocab_size} in "
                          f"{cfg.model.path}); set loss.score_centering_top_k <= {hf.vocab_size} (default 32)")
    if cfg.model.options.routing_replay and not hf.num_experts:
        raise ConfigError("model.routing_replay=true needs a Mixture-of-Experts model; model.path is dense")
    if hf.multi_latent_attention and cfg.rollout.spec.weight_quantization(cfg.rollout.options) is not None:
        # the FP8 weight rules (weights/fp8.py) name grouped-query attention's projections only: the
        # latent projections would reach an FP8 server unquantized
        raise ConfigError(f"rollout.{cfg.rollout.engine}.quantization=fp8 is not supported for {hf.architecture} "
                          "(multi-head latent attention): serve it unquantized")
    layout = cfg.rollout.quantized_layout(hf)
    if layout is not None and not layout.ok:
        # the engine cannot build these quantized layers at its layout (e.g. SGLang's 128-blocks per partition)
        raise ConfigError(f"rollout.{cfg.rollout.engine}.quantization: " + layout.describe())
    try:
        check_megatron_builds(hf)
    except ValueError as exc:
        raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from exc
    if hf.multi_latent_attention and cfg.parallel.cp > 1:
        # the context-parallel attention (models/context_attention.py) gathers grouped-query keys and
        # values; latent attention's query/key and value widths differ and have no CP path yet
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} is not supported for {hf.architecture} (multi-head latent "
                          "attention): set parallel.cp=1")
    _check_context_budget(cfg, hf)


def _check_token_budget(cfg: ExperimentConfig) -> None:
    """The longest sample a rollout can produce must fit one packed micro-batch (its share of one
    under context parallelism, which needs packed micro-batches)."""
    from bpo_megatron.trainer.packing import rank_positions

    budget, cp = cfg.trainer.max_tokens_per_micro_batch, cfg.parallel.cp
    if cp > 1 and not budget:
        raise ConfigError(f"parallel.cp={cp} splits packed samples over its ranks: set "
                          "trainer.max_tokens_per_micro_batch (packed micro-batches; under CP it counts one rank's "
                          "positions)")
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1  # input positions: tokens[:-1]
    per_rank = rank_positions(longest, cp)
    if budget and per_rank > budget:
        share = "" if cp == 1 else f", {per_rank} on each of parallel.cp={cp} ranks"
        raise ConfigError(
            f"trainer.max_tokens_per_micro_batch={budget} cannot hold the longest sample: data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens} + rollout.max_new_tokens={cfg.rollout.max_new_tokens} − 1 = {longest} "
            f"input positions{share}; raise the budget or parallel.cp (each of its ranks holds 1/cp of a sample), "
            "or lower those limits")


def _check_context_budget(cfg: ExperimentConfig, hf: HFModelConfig) -> None:
    """A prompt and its response must fit the model's positions (training and evaluation)."""
    budgets = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens}
    if cfg.eval.every and cfg.eval.max_new_tokens:
        budgets["eval.max_new_tokens"] = cfg.eval.max_new_tokens
    for setting, new_tokens in budgets.items():
        if cfg.data.max_prompt_tokens + new_tokens > hf.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + {setting}={new_tokens} = "
                f"{cfg.data.max_prompt_tokens + new_tokens} tokens exceed the model's max_position_embeddings="
                f"{hf.max_position_embeddings} (model.path={cfg.model.path}); lower them")
