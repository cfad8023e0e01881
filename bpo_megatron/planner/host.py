"""Host memory of the driver: it holds one step's samples twice (as the engines return them, and as
training samples with advantages) besides Python, Ray's client and the datasets; and of the
busiest trainer node at a checkpoint save and at a load (below)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bpo_megatron.planner.offload import RULES

GiB = 2**30
DRIVER_BASE_GIB = 16  # interpreter, Ray client, tokenizer, prompt datasets, metrics


def sampler_head_bytes(cfg) -> int:
    """Bytes per response token of score centering's sampler top-k (``loss.score_centering``):
    k ids (int32) and k log-probs (float32), as the samples hold them (SGLang sends them as base64
    of the same arrays; 0 without score centering)."""
    return 8 * cfg.loss.score_centering_top_k if cfg.loss.score_centering else 0


def step_sample_bytes(cfg) -> int:
    """Bytes of one step's samples at their longest: per token its id (int64), log μ (fp32) and,
    with routing replay, its routed experts (uint8 per MoE layer and top-k slot; counted when the
    model's config is readable here: a launch may name a checkpoint only the cluster has); per
    response token score centering's sampler top-k (:func:`sampler_head_bytes`)."""
    routing = 0
    if cfg.model.options.routing_replay:
        try:
            hf = cfg.hf_config()
        except (OSError, ValueError):
            hf = None
        routing = len(hf.moe_layers) * hf.num_experts_per_tok if hf is not None else 0
    per_token = 8 + 4 + routing
    responses = cfg.train.prompts_per_step * cfg.rollout.group_size
    tokens = responses * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    return tokens * per_token + responses * cfg.rollout.max_new_tokens * sampler_head_bytes(cfg)


def driver_memory_gib(cfg) -> int:
    """What the driver's host (a Slurm head node step, a KubeRay head pod) should have."""
    return math.ceil(2 * step_sample_bytes(cfg) / GiB) + DRIVER_BASE_GIB


# ------------------------------------------------------------------------------- trainer nodes
# Host memory of a trainer node at a checkpoint save, with the distributed optimizer saved as
# bpo_megatron.trainer.optimizer_state does it (each data-parallel rank writes its own shard,
# Megatron's DP-reshardable format; nothing is gathered). Per trainer rank:
#   * fp32 state: its own shard of the master weights and two Adam moments, 12 bytes a parameter
#     it owns (its 1/dp of the dense parameters, 1/expert-dp of the expert ones), which the writer
#     stages from the GPU;
#   * model weights: the DP rank 0 of each inner optimizer (dense parameters over DP, expert
#     parameters over expert DP) writes its whole model shard of that kind, staged from the GPU
#     (dtype bytes a parameter); the other ranks hold replicas that are not written.
# A background save (checkpoint.background) holds the same staged copy while the next steps train
# beside it. Colocated ranks also hold their offload buffers (what cluster.offload moves: weights
# and optimizer shard, or the optimizer shard alone, or nothing; gradients are not moved),
# allocated before the first step. They are counted at a save: the trainer keeps them across saves
# when the node holds both (NodeHost.fits), and drops them before each save otherwise (then the
# figure is what the node would need to keep them).
# At load (a resume, before any offload) every rank reads its own shard's fp32 state. (A resume
# from a checkpoint of the older, gathered format allocates the fp32 state of its whole model shard
# on every rank instead, 12 bytes a parameter: not counted.)
# The busiest node is taken to hold the ranks with the largest figures, a bound whatever the
# placement (Megatron's rank order puts a stage's DP-rank-0 ranks first: on one node, that one).
FP32_STATE_BYTES = 12  # master weight, exp_avg, exp_avg_sq
HOST_MARGIN_FRACTION = 0.10  # allocator fragmentation, Ray's object store, what is not counted
HOST_PROCESS_BYTES_PER_GPU = 8e9  # each GPU's processes: Python, CUDA/NCCL host state, SGLang's
DEFAULT_NODE_HOST_MEMORY_GB = 1000.0  # a node's host memory unless `plan --host-memory-gb` says


@dataclass(frozen=True)
class RankHost:
    """Host bytes of one trainer rank of pipeline stage ``stage``."""

    stage: int
    dense_writer: bool  # DP rank 0 of the dense optimizer: writes the dense weights (and, unsharded, their state)
    expert_writer: bool  # DP rank 0 of the expert optimizer (expert DP)
    pinned: int  # offload buffers (colocated runs)
    fp32_state: int  # optimizer state it writes, staged from the GPU
    weights: int  # model weights it writes, staged from the GPU
    load: int

    @property
    def staging(self) -> int:
        """What a save holds staged until its write is done (in the background too)."""
        return self.fp32_state + self.weights

    @property
    def at_save(self) -> int:
        return self.pinned + self.staging


@dataclass(frozen=True)
class NodeHost:
    """The trainer node with the most host memory at a checkpoint save, and at a load."""

    ranks: tuple[RankHost, ...]  # every trainer rank
    per_node: int  # trainer ranks on a node
    gpus_per_node: int
    node_bytes: float

    def _busiest(self, key) -> tuple[RankHost, ...]:
        return tuple(sorted(self.ranks, key=key, reverse=True)[:self.per_node])

    @property
    def save_ranks(self) -> tuple[RankHost, ...]:
        return self._busiest(lambda r: r.at_save)

    @property
    def counted_at_save(self) -> int:
        return sum(r.at_save for r in self.save_ranks)

    @property
    def counted_at_load(self) -> int:
        return sum(r.load for r in self._busiest(lambda r: r.load))

    def with_margin(self, counted: float) -> float:
        return counted * (1 + HOST_MARGIN_FRACTION) + HOST_PROCESS_BYTES_PER_GPU * self.gpus_per_node

    @property
    def at_save(self) -> float:
        return self.with_margin(self.counted_at_save)

    @property
    def at_load(self) -> float:
        return self.with_margin(self.counted_at_load)

    @property
    def peak(self) -> float:
        return max(self.at_save, self.at_load)

    @property
    def fits(self) -> bool:
        return self.peak <= self.node_bytes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rank_host(dense: int, expert: int, *, stage: int, param_bytes: int, offload_bytes: int, dp: int,
              expert_dp: int, dense_writer: bool, expert_writer: bool, distributed: bool) -> RankHost:
    """Host bytes of a rank holding ``dense`` and ``expert`` parameters (see the notes above);
    ``offload_bytes``: what offloading keeps on the host (0 when not colocated)."""
    written = sum(params for params, writer in ((dense, dense_writer), (expert, expert_writer)) if writer)
    weights = param_bytes * written
    if not distributed:
        # Megatron's other optimizers keep the whole state on every DP rank, on the GPU; DP rank 0
        # of each writes it, staged from there, and a load reads into it
        return RankHost(stage, dense_writer, expert_writer, offload_bytes, fp32_state=FP32_STATE_BYTES * written,
                        weights=weights, load=0)
    shard = FP32_STATE_BYTES * (_ceil_div(dense, dp) + _ceil_div(expert, expert_dp))
    return RankHost(stage, dense_writer, expert_writer, offload_bytes, fp32_state=shard, weights=weights, load=shard)


def trainer_node_host(plan, node_memory_gb: float) -> NodeHost | None:
    """The busiest trainer node of ``plan`` (a :class:`bpo_megatron.planner.plan.Plan` on GPUs);
    None on a CPU allocation."""
    a, cfg = plan.allocation, plan.cfg
    if not a.gpus_per_node or not plan.stages:
        return None
    p, c = cfg.parallel, cfg.cluster
    per_stage = c.trainer_ranks // p.pp
    # DP rank 0 of the dense optimizer: a stage's first tp ranks; of the expert optimizer: its
    # first ep × etp ranks (Megatron's rank order), so the two overlap as far as they can
    dense_writers = per_stage // plan.optimizer_dp
    expert_writers = per_stage // plan.expert_dp if plan.hf.is_moe else 0
    ranks = []
    parts = plan.offload.parts if plan.offload is not None else None
    for s in plan.stages:
        offload = RULES[parts].moved(s.static) if parts is not None else 0
        ranks += [rank_host(s.params.dense, s.params.expert, stage=s.params.stage,
                            param_bytes=plan.precision.param_bytes, offload_bytes=offload, dp=plan.optimizer_dp,
                            expert_dp=plan.expert_dp, dense_writer=local < dense_writers,
                            expert_writer=local < expert_writers, distributed=plan.distributed_optimizer)
                  for local in range(per_stage)]
    gpus_per_rank = c.gpus_per_trainer_rank or 1
    per_node = max(1, min(c.trainer_ranks, int(a.gpus_per_node // gpus_per_rank)))
    return NodeHost(tuple(ranks), per_node, a.gpus_per_node, node_memory_gb * 1e9)

