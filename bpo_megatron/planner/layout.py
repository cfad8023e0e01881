"""Checks of a layout against the model, the batch and the GPU allocation.

Each check is one function in :data:`CHECKS`; it returns a :class:`Check` saying what holds or
what to change, naming the config fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.planner.host import DEFAULT_NODE_HOST_MEMORY_GB
from bpo_megatron.planner.rollout import engine_profile

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig


@dataclass(frozen=True)
class Allocation:
    """The GPUs an experiment runs on, and the host memory of each node (GB, 10^9 bytes)."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    host_memory_gb: float = DEFAULT_NODE_HOST_MEMORY_GB

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_bytes(self) -> float:
        return self.gpu_memory_gb * 1e9

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> Allocation:
        c = cfg.cluster
        return cls(nodes=c.nodes, gpus_per_node=c.gpus_per_node, gpu_memory_gb=c.gpu_memory_gb)


@dataclass(frozen=True)
class Check:
    ok: bool
    message: str


CheckFn = Callable[["ExperimentConfig", HFModelConfig, Allocation], "Check | None"]


def _world(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check:
    p, ranks = cfg.parallel, cfg.cluster.trainer_ranks
    try:
        p.validate_world(ranks)
    except ValueError as exc:
        return Check(False, f"{exc} (cluster.trainer_ranks={ranks})")
    return Check(True, f"tp × pp × cp = {p.tp} × {p.pp} × {p.cp} divides the {ranks} trainer ranks (dp "
                       f"{p.data_parallel_size(ranks)}); ep × etp = {p.ep} × {p.expert_tp} divides the "
                       f"{ranks // p.pp} ranks of a stage")


def _model_split(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check:
    p = cfg.parallel
    try:
        p.validate_model(num_layers=hf.num_hidden_layers, num_experts=hf.num_experts if hf.is_moe else 0,
                         num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads)
    except ValueError as exc:
        return Check(False, str(exc))
    experts = f"; ep {p.ep} ≤ {hf.num_experts} experts and divides them" if hf.is_moe else ""
    return Check(True, f"pp {p.pp} ≤ {hf.num_hidden_layers} layers and divides them; tp {p.tp} divides "
                       f"{hf.num_attention_heads} heads and {hf.num_key_value_heads} KV heads{experts}")


def _ffn_split(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check:
    p = cfg.parallel
    dense_layers = hf.num_hidden_layers - len(hf.moe_layers)
    if dense_layers and hf.intermediate_size % p.tp:
        return Check(False, f"parallel.tp={p.tp} must divide the MLP width {hf.intermediate_size}")
    if hf.is_moe and hf.moe_intermediate_size % p.expert_tp:
        return Check(False, f"parallel.etp={p.expert_tp} must divide the expert width {hf.moe_intermediate_size}")
    return Check(True, "tp and etp divide the MLP widths")


def _batch(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check:
    try:
        dp = cfg.parallel.data_parallel_size(cfg.cluster.trainer_ranks)
    except ValueError:
        return Check(False, "no data-parallel size: the layout does not divide the trainer ranks")
    if cfg.minibatch_size % dp:
        return Check(False, f"minibatches of {cfg.minibatch_size} responses cannot be split over dp {dp}")
    per_rank = cfg.minibatch_size // dp
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget:
        return _budget(cfg, per_rank, dp, budget)
    if cfg.parallel.cp > 1:
        return Check(False, f"parallel.cp={cfg.parallel.cp} splits packed samples: set "
                            "trainer.max_tokens_per_micro_batch")
    if per_rank % cfg.trainer.micro_batch_size:
        return Check(False, f"{per_rank} responses per DP rank are not a multiple of "
                            f"trainer.micro_batch_size={cfg.trainer.micro_batch_size}")
    return Check(True, f"minibatch {cfg.minibatch_size} = dp {dp} × {per_rank // cfg.trainer.micro_batch_size} "
                       f"micro-batches × {cfg.trainer.micro_batch_size}")


def _budget(cfg: ExperimentConfig, per_rank: int, dp: int, budget: int) -> Check:
    """Packed micro-batches: the longest sample (its share on each CP rank) must fit the budget
    (micro_batch_size is unused)."""
    from bpo_megatron.trainer.packing import rank_positions

    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    cp = cfg.parallel.cp
    share = rank_positions(longest, cp)
    if share > budget:
        of = "" if cp == 1 else (f", {share} on each of parallel.cp={cp} ranks (raise the budget or parallel.cp, "
                                 "which splits the sample over more ranks)")
        return Check(False, f"trainer.max_tokens_per_micro_batch={budget} cannot hold the longest sample, "
                            f"data.max_prompt_tokens + rollout.max_new_tokens − 1 = {longest} positions{of}")
    tp = cfg.parallel.tp
    # packs are padded to a multiple of TP under sequence parallelism: a budget that is one keeps them within it
    padding = "" if not cfg.parallel.sequence_parallel or budget % tp == 0 else \
        f"; not a multiple of tp {tp}: packs may be padded to {-(-budget // tp) * tp}"
    held = f"the longest sample ({longest})" if cp == 1 else \
        f"a share of the longest sample ({longest} over cp {cp}: {share} a rank)"
    return Check(True, f"minibatch {cfg.minibatch_size} = dp {dp} × {per_rank} responses, packed into micro-batches "
                       f"of ≤ {budget} positions that hold {held}{padding}")


def _gpu_split(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check | None:
    if not alloc.gpus_per_node:
        return None  # a CPU allocation: nothing to place
    c = cfg.cluster
    trainer = c.trainer_ranks * c.gpus_per_trainer_rank
    engines = cfg.rollout.num_engines * c.gpus_per_engine
    evaluation = cfg.evaluation_engines * c.gpus_per_engine  # background evaluation: GPUs of its own
    if not c.gpus_per_trainer_rank:
        return Check(False, "cluster.gpus_per_trainer_rank=0 on a GPU allocation: set it to 1")
    if c.colocate:
        ok = max(trainer, engines) + evaluation <= alloc.gpus
        how = f"colocated: trainer {trainer:g} and engines {engines:g} GPUs each"
    else:
        ok = trainer + engines + evaluation <= alloc.gpus
        how = f"trainer {trainer:g} + engines {engines:g} GPUs"
    how += f" + evaluation engines {evaluation:g} GPUs" if evaluation else ""
    how += f" ≤ {alloc.gpus}"
    fix = "" if ok else " (cluster.trainer_ranks, rollout.num_engines, cluster.gpus_per_engine" + (
        ", eval.mode, eval.engines)" if evaluation else ")")
    return Check(ok, how + fix)


def _tp_in_node(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check | None:
    if not alloc.gpus_per_node:
        return None
    tp, g = cfg.parallel.tp, alloc.gpus_per_node
    if g % tp:
        return Check(False, f"parallel.tp={tp} must divide the {g} GPUs of a node (TP stays on NVLink)")
    return Check(True, f"tp {tp} fits in a node of {g} GPUs")


def _engine_gpus(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check | None:
    if not alloc.gpus_per_node:
        return None
    tp, gpus = engine_profile(cfg).tp, cfg.cluster.gpus_per_engine
    if gpus < tp or tp > alloc.gpus_per_node:
        return Check(False, f"a {cfg.rollout.engine} engine of tp {tp} needs {tp} GPUs of one node; "
                            f"cluster.gpus_per_engine={gpus:g}")
    return Check(True, f"each {cfg.rollout.engine} engine: tp {tp} on {gpus:g} GPUs")


def _engine_quantization(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> Check | None:
    """The engine's quantized layers at its layout (``EngineSpec.quantized_layout``): those it
    builds, those it serves unquantized, and those it cannot serve (the run is refused)."""
    layout = cfg.rollout.quantized_layout(hf)
    if layout is None:
        return None
    verdict = "" if layout.ok else f"\n  `bpo-megatron train` refuses this (exit 2); change rollout.{cfg.rollout.engine}"
    return Check(layout.ok, (layout.describe() + verdict).replace("\n", "\n      "))


CHECKS: tuple[CheckFn, ...] = (_world, _model_split, _ffn_split, _batch, _gpu_split, _tp_in_node, _engine_gpus,
                               _engine_quantization)


def layout_checks(cfg: ExperimentConfig, hf: HFModelConfig, alloc: Allocation) -> list[Check]:
    results = [check(cfg, hf, alloc) for check in CHECKS]
    return [r for r in results if r is not None]
