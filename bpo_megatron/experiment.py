"""One experiment = one config: every component's section, loaded, overridden and validated.

    cfg = load_experiment("configs/tiny_moe_cpu.yaml", ["loss.name=grpo", "parallel.tp=2"])

Each section is the typed config of the component that uses it; this module only composes them
and checks what no single component can see (layouts against the model and the world, batch
sizes against each other, R3 against the rollout engine): the named rules of
:mod:`bpo_megatron.experiment_rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from bpo_megatron import platform
from bpo_megatron.config import ConfigError, apply_overrides, build, load_yaml, refuse_moved, refuse_removed
from bpo_megatron.data.config import DataConfig
from bpo_megatron.eval.config import EvalConfig, background_engines
from bpo_megatron.experiment_rules import RULES
from bpo_megatron.losses import PolicyLossConfig
from bpo_megatron.loop.config import CheckpointConfig, LoopConfig
from bpo_megatron.models.config import ModelConfig
from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.observability.config import LoggingConfig
from bpo_megatron.orchestration.config import ClusterConfig
from bpo_megatron.orchestration.engine_group_spec import EngineGroupSpec
from bpo_megatron.orchestration.placement import EVALUATION
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
        (:meth:`weight_transport`), ``weight_sync``'s bucket size, check and delta, the precision the
        engine's spec takes them in and the form it holds quantized layers in."""
        from bpo_megatron.models.options import TORCH_DTYPES

        dtype = self.rollout.sync_dtype
        delta = (self.rollout.sync_delta(self.cluster.colocate and not evaluation, self.cluster.gpus_per_engine > 0)
                 if self.weight_sync.delta else None)
        return SyncPlan(transport=self.weight_transport(evaluation=evaluation),
                        bucket_bytes=self.weight_sync.bucket_bytes, dtype=TORCH_DTYPES[dtype] if dtype else None,
                        quantization=self.rollout.sync_quantization(self.hf_config()), verify=self.weight_sync.verify,
                        delta=delta, full_every=self.weight_sync.full_every)

    def trainer_spec(self) -> TrainerSpec:
        """What each trainer rank is built from: the trainer's sections of this experiment (its
        log π at the engines' sampling temperature, the distribution log μ comes from)."""
        return TrainerSpec(hf=self.hf_config(), parallel=self.parallel, model=self.model.options, loss=self.loss,
                           optimizer=self.optimizer,
                           trainer=replace(self.trainer, temperature=self.rollout.temperature, seed=self.seed))

    def engine_group_spec(self, *, evaluation: bool = False) -> EngineGroupSpec:
        """What the rollout engines are built from (``evaluation``: the background evaluation
        engines, ``evaluation_engines`` of them, indexed after the rollout engines): the engines'
        sections of this experiment."""
        spec = EngineGroupSpec(hf=self.hf_config(), rollout=self.rollout, cluster=self.cluster,
                               max_staleness=self.train.asynchronous.max_staleness,
                               max_prompt_tokens=self.data.max_prompt_tokens,
                               weight_bucket_bytes=self.weight_sync.bucket_bytes)
        if not evaluation:
            return spec
        return replace(spec, role=EVALUATION, num_engines=self.evaluation_engines, first_index=self.rollout.num_engines)


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


class RuleBroken(ConfigError):
    """An experiment breaks the cross-section rule ``rule`` (:data:`~bpo_megatron.experiment_rules.RULES`)."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


def validate(cfg: ExperimentConfig, *, check_model: bool = True) -> None:
    """Cross-section checks (:mod:`bpo_megatron.experiment_rules`, in their order; with
    ``check_model``, those that read the model's config.json too); the first broken rule is raised,
    naming the fields to change."""
    hf = None
    for rule in RULES:
        if rule.model and not check_model:
            continue
        if rule.model and hf is None:
            try:
                hf = cfg.hf_config()
            except (OSError, ValueError) as exc:
                raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from exc
        error = rule.check(cfg, hf) if rule.model else rule.check(cfg)
        if error is not None:
            raise RuleBroken(rule.name, error)
