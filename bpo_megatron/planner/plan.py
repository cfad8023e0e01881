"""One plan: the layout's checks and the memory of every trainer stage and rollout engine GPU."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.models.hf_config import HFModelConfig
from bpo_megatron.weights.names import parameter_counts
from bpo_megatron.models.megatron_model import model_vocab_size
from bpo_megatron.planner.activations import (context_gather_bytes, forward_only_activation_bytes, logits_bytes,
                                              micro_batch_positions, micro_batches_in_flight, stage_activation_bytes,
                                              stage_replay_bytes)
from bpo_megatron.planner.batches import BatchEstimate, estimate_batches, lockstep_groups
from bpo_megatron.trainer.balance import CostModel
from bpo_megatron.trainer.packing import rank_positions
from bpo_megatron.planner.host import NodeHost, trainer_node_host
from bpo_megatron.planner.layout import Allocation, Check, layout_checks
from bpo_megatron.planner.offload import OffloadPlan, offload_plan
from bpo_megatron.planner.params import StageParams, rank_parameters
from bpo_megatron.planner.precision import Precision, StaticMemory, static_memory
from bpo_megatron.planner.rollout import RolloutMemory, TrainerResidual, rollout_memory, trainer_residual

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig

# A fixed allowance per GPU, beyond what is counted: CUDA context, NCCL communicators, allocator
# fragmentation (trainer); CUDA graphs, sampling buffers and decode activations (engine).
RESERVED_BYTES = 4e9


def largest_pool_fraction(residual: float, gpu_bytes: float) -> float:
    """The largest ``mem_fraction_static`` whose rest of a GPU of ``gpu_bytes`` holds the engine's
    runtime (``RESERVED_BYTES``) and ``residual``, what a colocated trainer keeps on the GPU while
    offloaded (SGLang sizes its pool as if the GPU were empty): ``(gpu − reserved − residual) / gpu``."""
    if gpu_bytes <= 0:
        raise ValueError(f"a GPU of {gpu_bytes} bytes has no pool to size")
    return max(0.0, (gpu_bytes - RESERVED_BYTES - residual) / gpu_bytes)


@dataclass(frozen=True)
class StagePlan:
    params: StageParams
    static: StaticMemory
    activations: float
    logits: float
    in_flight: int
    reserved: float  # RESERVED_BYTES on GPUs, nothing on a CPU allocation
    routing: float = 0.0  # R3 ids and routed experts held at the training pass's peak
    # the log-prob pass's peak beyond the static memory (forward only: one layer's activations,
    # logits and, with R3, the router ids of every micro-batch of the step's share); 0 when
    # train.recompute_old_logprobs is off
    logprob_pass: float = 0.0

    @property
    def training_pass(self) -> float:
        return self.activations + self.logits + self.routing

    @property
    def total(self) -> float:
        return self.static.total + max(self.training_pass, self.logprob_pass) + self.reserved


@dataclass(frozen=True)
class Plan:
    cfg: ExperimentConfig
    hf: HFModelConfig
    allocation: Allocation
    checks: list[Check]
    precision: Precision
    distributed_optimizer: bool
    dp: int
    expert_dp: int
    tokens_per_micro_batch: int  # input positions of the largest micro-batch (memory is sized for it)
    micro_batches: int  # per DP rank and optimizer step; packed: at most (one sample each)
    stages: list[StagePlan]
    rollout: RolloutMemory | None  # None on a CPU allocation
    host: NodeHost | None = None  # the busiest trainer node's host memory; None on a CPU allocation
    batches: BatchEstimate | None = None  # micro-batch counts for a length distribution (make_plan's lengths)
    offload: OffloadPlan | None = None  # what a colocated trainer offloads (cluster.offload); None apart

    @property
    def layout_ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def train_peak(self) -> float:
        return max((s.total for s in self.stages), default=0.0)

    @property
    def trainer_residual(self) -> TrainerResidual | None:
        """What the colocated trainer keeps on each GPU while the engines roll out (None apart)."""
        if self.rollout is None or not self.cfg.cluster.colocate:
            return None
        p = self.cfg.parallel
        return trainer_residual(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp or 1, dp=self.dp, expert_dp=self.expert_dp,
                                cp=p.cp)

    @property
    def rollout_outside_pool(self) -> float:
        """The engine's runtime beyond its weights and KV cache, plus a colocated trainer's residual."""
        residual = self.trainer_residual
        return RESERVED_BYTES + (residual.total if residual is not None else 0.0)

    @property
    def rollout_peak(self) -> float:
        return self.rollout.total + self.rollout_outside_pool if self.rollout else 0.0

    @property
    def rollout_pool(self) -> float | None:
        """Bytes the engine may use for weights and KV cache, when its config caps them."""
        if self.rollout is None or self.rollout.profile.pool_fraction is None:
            return None
        return self.rollout.profile.pool_fraction * self.allocation.gpu_bytes

    @property
    def engine_kept(self) -> float:
        """What an engine keeps on a GPU it shares with the trainer while the trainer computes
        (the parts of its memory its release does not hand back: ``EngineProfile.released``)."""
        r = self.rollout
        if r is None:
            return 0.0
        return ((r.weights if "weights" not in r.profile.released else 0.0)
                + (r.kv_cache + RESERVED_BYTES if "kv_cache" not in r.profile.released else 0.0))

    @property
    def memory_ok(self) -> bool:
        if not self.allocation.gpus_per_node:
            return True  # a CPU allocation has no per-GPU budget
        cap = self.allocation.gpu_bytes
        pool = self.rollout_pool
        in_pool = pool is None or (self.rollout.total <= pool + 1.0 and self.rollout.resident_sequences != 0
                                   and self.rollout_outside_pool <= cap - pool)
        if self.offload is not None and self.offload.options:  # colocated: the phases of the offload chosen
            return self.offload.fits and in_pool
        return self.train_peak <= cap and self.rollout_peak <= cap and in_pool

    @property
    def inflight_ok(self) -> bool:
        """The requests an engine keeps in flight stay within what its KV pool holds at full
        length (:mod:`bpo_megatron.planner.rollout`'s rule)."""
        return self.rollout is None or self.rollout.inflight_ok

    def inflight_refusal(self) -> str | None:
        """Why the config's requests in flight are refused (None: they are within the rule)."""
        if self.inflight_ok:
            return None
        r, engine = self.rollout, self.cfg.rollout.engine
        return (f"rollout.{engine}.max_inflight={r.profile.requested_inflight} requests in flight per engine, more than "
                f"the {r.inflight_cap} sequences of {r.tokens_per_sequence} tokens its KV pool holds "
                f"({r.profile.pool_fraction:g} × {self.allocation.gpu_memory_gb:g} GB less the weights, by "
                f"bpo-megatron plan): the server would retract responses for space, and those leave the loss; set it "
                f"≤ {r.inflight_cap} or null (the pool's capacity, as the server measures it), or give the pool more "
                "(mem_fraction_static, engine TP)")

    @property
    def host_ok(self) -> bool:
        return self.host is None or self.host.fits

    @property
    def fits(self) -> bool:
        return self.layout_ok and self.memory_ok and self.host_ok and self.inflight_ok

    @property
    def model_size(self) -> tuple[int, int]:
        return parameter_counts(self.hf)

    @property
    def optimizer_dp(self) -> int:
        """The ranks the distributed optimizer shards dense parameters' states over: the
        data-parallel ranks and, as Megatron's, their context-parallel ranks (dp × cp)."""
        return self.dp * self.cfg.parallel.cp

    @property
    def context_gather(self) -> float:
        """Keys and values a rank receives from its CP group in one micro-batch's forward, over the
        busiest stage's layers (0 without context parallelism)."""
        layers = max((len(s.params.layers) for s in self.stages), default=0)
        return context_gather_bytes(self.hf, self.cfg.parallel, self.precision.param_bytes,
                                    tokens=self.tokens_per_micro_batch, layers=layers)


def longest_sample(cfg: ExperimentConfig) -> int:
    """Input positions of the longest sample a rollout can produce (``tokens[:-1]``)."""
    return cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1


def longest_share(cfg: ExperimentConfig) -> int:
    """What the longest sample takes of a pack on each rank: all of it, or its share on each of
    ``parallel.cp`` context-parallel ranks."""
    return rank_positions(longest_sample(cfg), cfg.parallel.cp)


def _splits(cfg: ExperimentConfig, hf: HFModelConfig) -> bool:
    try:
        cfg.parallel.validate_world(cfg.cluster.trainer_ranks)
        cfg.parallel.validate_model(num_layers=hf.num_hidden_layers,
                                    num_experts=hf.num_experts if hf.is_moe else 0,
                                    num_attention_heads=hf.num_attention_heads,
                                    num_query_groups=hf.num_key_value_heads)
    except ValueError:
        return False
    return True


def _replay_and_logprob_pass(cfg: ExperimentConfig, hf: HFModelConfig, params: StageParams, *, tokens: int,
                             in_flight: int, logits: float, dp: int, act_bytes: int, gpu: bool) -> tuple[float, float]:
    """R3 memory at the training pass's peak, and the log-prob pass's peak beyond the static
    memory (0 when ``train.recompute_old_logprobs`` is off)."""
    p = cfg.parallel

    def replay(micro_batches_held: int) -> float:
        """R3 bytes: the routed experts of the micro-batch being loaded and the router ids of
        ``micro_batches_held`` micro-batches."""
        if not cfg.model.options.routing_replay:
            return 0.0
        return stage_replay_bytes(hf, p, params.layers, tokens=tokens, held_tokens=micro_batches_held * tokens)

    # The router ids of a micro-batch stay queued until recomputation replays them in backward;
    # without recomputation (and in a forward-only pass) the trainer drops them once its forward
    # has them (trainer/replay.py), so only the running micro-batch's are held.
    training = replay(in_flight if cfg.model.options.recompute != "none" else 1)
    if not cfg.train.recompute_old_logprobs:
        return training, 0.0
    forward = forward_only_activation_bytes(hf, p, params.layers, tokens=tokens, act_bytes=act_bytes,
                                            expert_gemm=cfg.model.options.expert_gemm, gpu=gpu)
    return training, forward + logits + replay(1)


def make_plan(cfg: ExperimentConfig, hf: HFModelConfig, allocation: Allocation | None = None, *,
              distributed_optimizer: bool | None = None, lengths: str | None = None) -> Plan:
    """Plan ``cfg`` on ``allocation`` (default: the cluster section's). The distributed optimizer
    is what the trainer uses (default: ``optimizer.distributed``, unset on for a GPU allocation and
    off for a CPU one).
    ``lengths`` names a length distribution (:data:`~bpo_megatron.planner.batches.LENGTH_DISTRIBUTIONS`)
    to estimate micro-batches per rank, imbalance and useful tokens for; None skips it.

    Memory is sized for the largest micro-batch (every sample at the caps): activations, logits
    and R3 per micro-batch scale with its input positions, ``micro_batch_size ×`` the longest
    sample padded, the token budget packed."""
    allocation = allocation or Allocation.of(cfg)
    if distributed_optimizer is None:
        chosen = cfg.optimizer.distributed
        distributed_optimizer = allocation.gpus_per_node > 0 if chosen is None else chosen
    checks = layout_checks(cfg, hf, allocation)
    # what the trainer ranks of this allocation build (an unset dtype: bf16 with GPUs, fp32 without)
    # and run (torch's fused RMSNorm on GPUs keeps less than its composite on CPUs)
    gpu = allocation.gpus_per_node > 0
    precision = Precision.of(cfg.model.options.params_dtype_on(gpu=gpu))
    p, ranks = cfg.parallel, cfg.cluster.trainer_ranks
    world_ok = _splits(cfg, hf)  # the memory model needs a layout the model can be cut into
    dp = ranks // (p.tp * p.pp * p.cp) if world_ok else 1
    expert_dp = ranks // p.pp // (p.ep * p.expert_tp) if world_ok else 1
    budget = cfg.trainer.max_tokens_per_micro_batch
    tokens = micro_batch_positions(p, longest=longest_sample(cfg), micro_batch_size=cfg.trainer.micro_batch_size,
                                   budget=budget)
    share = max(1, cfg.minibatch_size // max(dp, 1))  # samples per DP rank and optimizer step
    # packed, a rank may run as many micro-batches as it has samples (one each, at the caps)
    micro_batches = share if budget else max(1, share // cfg.trainer.micro_batch_size)
    stages = []
    if world_ok:
        vocab_rows = model_vocab_size(hf, p, cfg.model.options) // p.tp
        for params in rank_parameters(hf, p, cfg.model.options):
            in_flight = micro_batches_in_flight(p.pp, params.stage, micro_batches)
            logits = logits_bytes(vocab_rows, tokens, precision.param_bytes) if params.stage == p.pp - 1 else 0.0
            routing, logprob_pass = _replay_and_logprob_pass(cfg, hf, params, tokens=tokens, in_flight=in_flight,
                                                            logits=logits, dp=dp, act_bytes=precision.param_bytes,
                                                            gpu=gpu)
            stages.append(StagePlan(
                params=params,
                static=static_memory(params, precision, dp=dp * p.cp, expert_dp=expert_dp,
                                     distributed_optimizer=distributed_optimizer),
                activations=stage_activation_bytes(hf, p, params.layers, tokens=tokens,
                                                   recompute=cfg.model.options.recompute,
                                                   act_bytes=precision.param_bytes, in_flight=in_flight,
                                                   first=params.stage == 0, last=params.stage == p.pp - 1,
                                                   expert_gemm=cfg.model.options.expert_gemm, gpu=gpu),
                logits=logits,
                in_flight=in_flight,
                reserved=RESERVED_BYTES if allocation.gpus_per_node else 0.0,
                routing=routing,
                logprob_pass=logprob_pass,
            ))
    rollout = (rollout_memory(cfg, hf, parameter_counts(hf)[0], allocation.gpu_bytes)
               if allocation.gpus_per_node else None)
    batches = None
    if lengths is not None and world_ok:
        groups = lockstep_groups(p, cfg.cluster.trainer_ranks, moe=hf.is_moe)
        batches = estimate_batches(cfg, dp=dp, groups=groups, lengths=lengths, cost=CostModel.of(hf))
    plan = Plan(cfg=cfg, hf=hf, allocation=allocation, checks=checks, precision=precision,
                distributed_optimizer=distributed_optimizer, dp=dp, expert_dp=expert_dp,
                tokens_per_micro_batch=tokens, micro_batches=micro_batches, stages=stages, rollout=rollout,
                batches=batches)
    if cfg.cluster.colocate:
        residual = plan.trainer_residual
        plan = dataclasses.replace(plan, offload=offload_plan(
            cfg.cluster.offload, stages, engine=rollout.total + RESERVED_BYTES if rollout else None,
            engine_kept=plan.engine_kept, residual=residual.total if residual else 0.0,
            cap=allocation.gpu_bytes if allocation.gpus_per_node else None))
    return dataclasses.replace(plan, host=trainer_node_host(plan, allocation.host_memory_gb))


def largest_budget(plan: Plan) -> int | None:
    """The largest ``trainer.max_tokens_per_micro_batch`` (a multiple of TP under sequence
    parallelism) whose training memory still fits ``plan``'s GPUs, everything else as planned;
    None on a CPU allocation, or when not even the longest sample's fits. Activations, logits and
    R3 per micro-batch grow with the budget, so a bisection over the budget finds it."""
    cfg, allocation = plan.cfg, plan.allocation
    if not allocation.gpus_per_node or not plan.stages:
        return None
    pad = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1

    def fits(units: int) -> bool:
        trainer = dataclasses.replace(cfg.trainer, max_tokens_per_micro_batch=units * pad)
        trial = make_plan(dataclasses.replace(cfg, trainer=trainer), plan.hf, allocation,
                          distributed_optimizer=plan.distributed_optimizer)
        return trial.train_peak <= allocation.gpu_bytes

    low = -(-longest_share(cfg) // pad)  # the longest sample (its share of it on each CP rank)
    if not fits(low):
        return None
    high = 2 * low
    while fits(high):
        low, high = high, 2 * high
        if high * pad > 2**30:  # memory that never runs out would be a bug elsewhere; stop anyway
            return low * pad
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * pad


def suggested_context_parallelism(plan: Plan) -> int | None:
    """When not even the longest sample's share fits one rank's memory (:func:`largest_budget` is
    None): the smallest ``parallel.cp`` (a power of two dividing the trainer ranks left by TP and
    PP) whose plan, with a budget of one share of the longest sample, fits; None when none does or
    on a CPU allocation."""
    cfg, allocation = plan.cfg, plan.allocation
    if not allocation.gpus_per_node or not plan.stages:
        return None
    p, ranks = cfg.parallel, cfg.cluster.trainer_ranks
    cp = p.cp * 2
    while ranks % (p.tp * p.pp * cp) == 0:
        parallel = dataclasses.replace(p, cp=cp)
        pad = p.tp if p.sequence_parallel else 1
        budget = -(-rank_positions(longest_sample(cfg), cp) // pad) * pad
        trial_cfg = dataclasses.replace(cfg, parallel=parallel,
                                        trainer=dataclasses.replace(cfg.trainer, max_tokens_per_micro_batch=budget))
        if _splits(trial_cfg, plan.hf):
            trial = make_plan(trial_cfg, plan.hf, allocation, distributed_optimizer=plan.distributed_optimizer)
            if trial.train_peak <= allocation.gpu_bytes:
                return cp
        cp *= 2
    return None


def node_memory_gib(cfg: ExperimentConfig) -> int | None:
    """What a trainer node (a KubeRay worker pod) should have: the host memory of the busiest
    trainer node at a checkpoint save or load, in GiB rounded up; None on a CPU allocation.
    Raises ``OSError``/``ValueError`` when the model's config cannot be read."""
    host = make_plan(cfg, cfg.hf_config()).host
    return None if host is None else math.ceil(host.peak / 2**30)
