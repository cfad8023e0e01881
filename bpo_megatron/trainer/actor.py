"""The train actor: one per rank, a slice of the policy model under TP × EP × PP × CP × DP.

Plain Python (the orchestration layer wraps it in a Ray actor). Every rank of the trainer world
calls the same methods: with the whole batch (each rank takes its data-parallel share itself), or,
as a driver that sends each share once does, with this rank's share alone (``*_share``). Both
check and choose the shares with :func:`~bpo_megatron.trainer.shares.prepare_shares`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.losses import BatchTotals, DeferredChecks, LossStatistics, PolicyLossConfig, policy_loss
from bpo_megatron.models import HFModelConfig, ModelOptions, build_gpt_model
from bpo_megatron.models.routing import expert_id_dtype
from bpo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_logprobs_at
from bpo_megatron.parallel import ParallelConfig, initialize_parallel, layout_record
from bpo_megatron.trainer import checkpoint
from bpo_megatron.trainer.config import TrainerConfig
from bpo_megatron.trainer.offload import release_host_cache, trainer_offload
from bpo_megatron.trainer.optimizer import (
    OptimizerSettings,
    build_optimizer,
    wrap_ddp,
    zero_grad,
)
from bpo_megatron.trainer.balance import CostModel, in_sample_order, packs_in_lockstep
from bpo_megatron.trainer.packing import PackedMicroBatch, pack
from bpo_megatron.trainer.replay import RoutingReplay
from bpo_megatron.trainer.samples import MicroBatch, TrainSample, chunk, collate
from bpo_megatron.trainer.shares import Shares, check_batch, prepare_shares
from bpo_megatron.weights import mtp
from bpo_megatron.weights.export import export_weights
from bpo_megatron.weights.flat_bucket import FlatBucket
from bpo_megatron.weights.gather import ExportPlan
from bpo_megatron.weights.host_staging import HostStaging

# What the schedule runs: right-padded rows, or samples packed end to end (trainer.max_tokens_per_micro_batch).
Batch = MicroBatch | PackedMicroBatch


@dataclass
class ScoredSamples:
    """Per-sample results of :meth:`TrainActor.compute_logprobs`, one entry per response token
    (routing: one per input position, ``[len(tokens) − 1, MoE layers, top-k]``)."""

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor]
    routed_experts: list[torch.Tensor] | None = None
    # [responses, k] log π of the sampler's top-k ids at each response token, for samples that
    # carry them (score centering's anchor π_old when these are the recomputed log-probs); else None
    head_logprobs: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class _Ranks:
    """This rank's place in the layout (read once from Megatron's parallel state)."""

    tp: int
    tp_size: int
    dp: int
    dp_size: int
    cp: int
    cp_size: int
    is_first_stage: bool
    is_last_stage: bool


class TrainActor:
    """Builds the model, DDP and optimizer, and runs forward-only scoring and training steps."""

    def __init__(self, hf: HFModelConfig, *, parallel: ParallelConfig, model: ModelOptions,
                 loss: PolicyLossConfig, optimizer: OptimizerSettings, trainer: TrainerConfig) -> None:
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            raise RuntimeError("TrainActor needs an initialised torch.distributed world (one process per rank)")
        if model.routing_replay and not hf.num_experts:
            raise ValueError("model.routing_replay=true needs a Mixture-of-Experts model; this one is dense")
        parallel.validate_world(dist.get_world_size())
        if parallel.cp > 1 and not trainer.max_tokens_per_micro_batch:
            raise ValueError(f"parallel.cp={parallel.cp} splits packed samples: set trainer.max_tokens_per_micro_batch "
                             "(packed micro-batches; under CP it counts one rank's positions)")
        parallel.validate_model(num_layers=hf.num_hidden_layers, num_experts=hf.num_experts,
                                num_attention_heads=hf.num_attention_heads,
                                num_query_groups=hf.num_key_value_heads)
        if trainer.logprob_kernel == "fused" and not platform.runs_triton(platform.device()):
            raise ValueError("trainer.logprob_kernel=fused needs a GPU with triton on every trainer rank; this rank has "
                             "none (trainer.logprob_kernel=auto takes the fused kernels where they can run)")
        # the checkpoint being written in the background, if any (save(background=True)); refuses a
        # torch whose distributed checkpointing lacks what Megatron's writer imports, before any model
        self.saves = checkpoint.BackgroundSaves()
        initialize_parallel(parallel, seed=trainer.seed)
        # An unset params_dtype is this rank's platform default (bf16 with a GPU), decided here
        # where the model lives, not by a driver that may have no GPU.
        model = model.resolved()

        self.hf, self.parallel, self.model_options = hf, parallel, model
        self.loss_cfg, self.trainer_cfg = loss, trainer
        self.ranks = _Ranks(
            tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
            dp=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
            cp=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
            is_first_stage=ps.is_pipeline_first_stage(), is_last_stage=ps.is_pipeline_last_stage(),
        )
        self.model = build_gpt_model(hf, parallel, model)
        self.config = self.model.config
        # Micro-batches differ in length; pipeline stages exchange shapes before activations.
        self.config.variable_seq_lengths = parallel.pp > 1
        self.ddp = wrap_ddp([self.model], self.config, distributed=optimizer.distributed)
        self.optimizer = build_optimizer(optimizer, self.ddp)
        self.replay = (
            RoutingReplay(self.model, moe_layers=list(hf.moe_layers), tp_rank=self.ranks.tp,
                          tp_size=self.ranks.tp_size, sequence_parallel=parallel.sequence_parallel)
            if model.routing_replay else None
        )
        # what a sample costs to run, for balancing packed work over ranks and micro-batches
        self.cost = CostModel.of(hf)
        self.step = 0
        self._offload = trainer_offload("everything", self.ddp, self.optimizer)  # until plan_offload
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        # how the weights travel to rank 0 (one collective to build): at the first export, then reused
        self._export_plan: ExportPlan | None = None
        # the pinned host buffer exported weights pass through on their way to host memory
        self._staging: HostStaging | None = None
        # the multi-token-prediction layers the weights came with (never trained: each save carries
        # them on from where they are, bpo_megatron.weights.mtp), set where the weights are loaded
        self._mtp: mtp.MtpLayers | None = None

    # ------------------------------------------------------------------------------------ API
    @property
    def is_output_rank(self) -> bool:
        """Ranks that hold the results of :meth:`compute_logprobs` (the last pipeline stage)."""
        return self.ranks.is_last_stage

    @property
    def returns_share_results(self) -> bool:
        """The one rank per data-parallel share whose :meth:`logprobs_of_share` results a driver
        needs (last pipeline stage, TP and CP rank 0; the other TP and CP ranks hold the same)."""
        return self.ranks.is_last_stage and self.ranks.tp == 0 and self.ranks.cp == 0

    def compute_logprobs(self, samples: list[TrainSample], *, record_routing: bool = False
                         ) -> ScoredSamples | None:
        """log π and the entropy of π at every response token of every sample (forward only).

        With ``model.routing_replay`` the samples' routed experts are replayed (R3). With
        ``record_routing`` the routers instead choose freely and their choices are returned,
        e.g. to measure how often trainer and rollout engine route alike. Results are in sample
        order on the ranks of the last pipeline stage; None elsewhere.
        """
        shares = self._prepare(samples, replaying=not record_routing).indices
        mine = self.logprobs_of_share([samples[i] for i in shares[self.ranks.dp]], record_routing=record_routing)
        if mine is None:
            return None
        return ScoredSamples(
            logprobs=self._gather_over_dp(mine.logprobs, shares),
            entropies=self._gather_over_dp(mine.entropies, shares),
            routed_experts=None if mine.routed_experts is None else self._gather_over_dp(mine.routed_experts, shares),
            head_logprobs=None if mine.head_logprobs is None else self._gather_over_dp(mine.head_logprobs, shares),
        )

    def logprobs_of_share(self, share: list[TrainSample], *, record_routing: bool = False
                          ) -> ScoredSamples | None:
        """:meth:`compute_logprobs` of this rank's data-parallel share only (every rank calls it
        with its own share at once); results of the share on the last pipeline stage."""
        if record_routing and self.replay is None:
            raise ValueError("record_routing needs a model built with model.routing_replay=true")
        self._check_share(share, replaying=not record_routing)
        micro_batches, groups = self._micro_batches(share, with_routing=not record_routing)
        recorded: list[torch.Tensor] = []

        def loss_func(micro: Batch, logits: torch.Tensor):
            scored = {}
            if micro.head_ids is not None:  # first, from the logits as they are (the next call overwrites them)
                scored["head"] = micro.as_padded(vocab_parallel_logprobs_at(
                    logits, micro.head_ids, self._tp_group, temperature=self.trainer_cfg.temperature,
                    vocab_size=self.hf.vocab_size))
            logp, entropy = vocab_parallel_logprobs(
                logits, micro.targets, self._tp_group, temperature=self.trainer_cfg.temperature,
                with_entropy=True, inplace=True, vocab_size=self.hf.vocab_size, kernel=self.trainer_cfg.logprob_kernel,
                targets_checked=True)  # the share's token ids were checked on the host (_check_share)
            return logp.sum() * 0.0, {"logp": micro.as_padded(logp), "entropy": micro.as_padded(entropy), **scored}

        for module in self.ddp:
            module.eval()
        with torch.no_grad():
            outputs = self._run(micro_batches, loss_func, forward_only=True,
                                record_into=recorded if record_routing else None)
        for module in self.ddp:
            module.train()
        routing = self._assemble_routing(micro_batches, groups, recorded) if record_routing else None
        if not self.ranks.is_last_stage:
            return None
        logps: list[torch.Tensor] = [torch.empty(0)] * len(share)
        entropies: list[torch.Tensor] = [torch.empty(0)] * len(share)
        carries_heads = share[0].sampler_head_ids is not None
        heads: list[torch.Tensor] | None = [torch.empty(0)] * len(share) if carries_heads else None
        for out, group in zip(outputs, groups, strict=True):
            # results leave the trainer as host tensors (a driver may have no GPU at all): one copy
            # of each micro-batch, cut on the host where each sample's responses lie
            logp, entropy = out["logp"].to("cpu"), out["entropy"].to("cpu")
            head = out["head"].to("cpu") if heads is not None else None
            for row, index in enumerate(group):
                sample = share[index]
                responses = slice(sample.response_start - 1, sample.tokens.numel() - 1)
                logps[index] = logp[row, responses].clone()
                entropies[index] = entropy[row, responses].clone()
                if heads is not None:
                    heads[index] = head[row, responses].clone()
        return ScoredSamples(logprobs=logps, entropies=entropies, routed_experts=routing, head_logprobs=heads)

    def train_step(self, minibatch: list[TrainSample]) -> dict[str, float]:
        """One optimizer step on ``minibatch`` (every rank passes the whole minibatch).

        The loss is the policy loss of the whole minibatch, aggregated as ``loss.agg`` says, no
        matter how it is split over data-parallel ranks and micro-batches. Returns the loss, the
        loss statistics, the grad norm (pre-clip) and timings, identical on every rank.
        """
        shares = self._prepare(minibatch, training=True)
        return self.train_share([minibatch[i] for i in shares.indices[self.ranks.dp]], shares.totals)

    def train_share(self, share: list[TrainSample], totals: BatchTotals) -> dict[str, float]:
        """:meth:`train_step` given this rank's data-parallel share of the minibatch and the
        minibatch's ``totals`` (every rank calls it with its own share at once)."""
        self._check_share(share, training=True)
        self.poll_saves()  # every rank trains this step: the point where a finished save is published
        start = time.perf_counter()
        micro_batches, _ = self._micro_batches(share)
        # Megatron's schedule divides each micro-batch loss by their number and DDP divides the
        # gradients by the DP size; the losses here are already shares of the whole minibatch.
        # Under context parallelism the schedule multiplies each loss by CP and DDP divides by
        # DP × CP: every CP rank computes the whole loss from the gathered log-probs, and its
        # backward reaches only this rank's positions (ContextSplit.gather), so the two cancel.
        scale = len(micro_batches) * self.ranks.dp_size

        centring = self.loss_cfg.score_centering

        def loss_func(micro: Batch, logits: torch.Tensor):
            head = None
            if centring:  # first, from the logits as they are (its backward reads them again)
                head = micro.as_padded(vocab_parallel_logprobs_at(
                    logits, micro.head_ids, self._tp_group, temperature=self.trainer_cfg.temperature,
                    vocab_size=self.hf.vocab_size))
            logp = vocab_parallel_logprobs(
                logits, micro.targets, self._tp_group, temperature=self.trainer_cfg.temperature,
                inplace=not centring, vocab_size=self.hf.vocab_size, kernel=self.trainer_cfg.logprob_kernel,
                targets_checked=True)  # the share's token ids were checked on the host (_check_share)
            # the padded layout whatever the model read: one loss, aggregation and statistics
            logp, view = micro.as_padded(logp), micro.padded
            loss, stats = policy_loss(logp, view.rollout_logprobs, view.advantages, view.train_mask,
                                      self.loss_cfg, totals=totals, old_logprobs=view.old_logprobs,
                                      head_logprobs=head, sampler_head_logprobs=view.sampler_head_logprobs,
                                      old_head_logprobs=view.old_head_logprobs if centring else None,
                                      deferred=checks)
            return loss * scale, {"loss": loss.detach().clone(), "stats": stats}

        # the loss inputs' values are checked once for the whole step, before the update
        checks = DeferredChecks()
        zero_grad(self.ddp, self.optimizer)
        outputs = self._run(micro_batches, loss_func, forward_only=False)
        checks.raise_first(group=dist.group.WORLD, device=platform.device())  # every rank refuses together
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise FloatingPointError(f"optimizer step {self.step} skipped: non-finite gradients")
        self.step += 1
        metrics = self._step_metrics(outputs)
        metrics.update(grad_norm=float(grad_norm), train_time_s=time.perf_counter() - start,
                       num_micro_batches=float(len(micro_batches)), step=float(self.step))
        return metrics

    def save(self, root: str, *, trainer_state: dict[str, Any] | None = None,
             keep_last: int | None = None, step: int | None = None, background: bool = False) -> str:
        """Atomically write model, optimizer, RNG and ``trainer_state`` (e.g. the data cursor).

        The checkpoint is named after ``step`` (e.g. the RL step), by default the optimizer step.
        With ``background`` the save returns once the state is staged and a background process
        writes it; it is published (the directory returned appears) at the first
        :meth:`poll_saves` (each training step) after the write, or at :meth:`finish_saves`. A save
        still in flight is finished first: ``saves.waited_s`` and ``saves.staged_s`` say how long
        this call waited for it and then took itself.

        The host buffers offloading keeps for its next round are dropped first, so the optimizer
        state the save stages in host memory (``bpo_megatron.planner.host``) does not come on
        top of them (the next offload pins fresh ones), unless :meth:`plan_offload` said the
        node holds both. Refused while offloaded.
        """
        if self._offload.offloaded:
            raise RuntimeError("the trainer's memory is offloaded (engines hold the device): call onload() "
                               "before save()")
        # the HF config travels with the weights, so the checkpoint can be exported to HF alone; it
        # counts the multi-token-prediction layers the checkpoint carries
        hf_config = mtp.config_with_layers(self.hf.to_hf_dict(), self.hf, self._mtp,
                                           where="the weights this trainer loaded")
        state = {"actor_step": self.step, "hf_config": hf_config, **(trainer_state or {})}
        self._offload.before_save()
        if not background:
            self.saves.waited_s = self._timed_finish("a blocking save starts")
        try:
            saved = checkpoint.save(root, self.step if step is None else step, self.model, self.optimizer,
                                    state, layout=self._layout(), keep_last=keep_last,
                                    background=self.saves if background else None,
                                    beside=self._mtp.write if self._mtp is not None else None)
            if self._mtp is not None:  # the next save links them from this one (published before it starts)
                self._mtp = mtp.MtpLayers(saved / mtp.CARRIED_DIR, self._mtp.names, self._mtp.layers)
            return str(saved)
        finally:
            if not self.saves.in_flight:
                release_host_cache()  # the pinned copies the writer staged the weights in

    def poll_saves(self) -> int | None:
        """Publish the background save if every rank's writer is done (collective); its step."""
        published = self.saves.poll()
        if published is not None:
            release_host_cache()
        return published

    def finish_saves(self, why: str = "the caller needs the checkpoint written") -> int | None:
        """Wait for the background save in flight, if any, and publish it (collective); its step."""
        published = self.saves.finish(why)
        if published is not None:
            release_host_cache()
        return published

    def _timed_finish(self, why: str) -> float:
        start = time.perf_counter()
        self.finish_saves(why)
        return time.perf_counter() - start

    def load(self, path: str, *, load_optimizer: bool = True, verify: bool = True) -> dict[str, Any]:
        """Load a checkpoint saved under any layout (the distributed optimizer's state: under any
        data-parallel size, TP, PP, EP and expert TP as saved); returns its trainer state. ``verify``
        checks its files against the checksums written at save (split over the ranks) first.
        A background save in flight is published first (it may be the newest checkpoint)."""
        self.finish_saves("a checkpoint is loaded")
        meta = checkpoint.load(path, self.model, self.optimizer if load_optimizer else None,
                               layout=self._layout(), verify=verify)
        self.step = int(meta.get("actor_step", meta["step"]))
        self._mtp = mtp.carried_in(checkpoint.resolve(path))
        return meta

    def load_hf(self, directory: str) -> int:
        """Set the model's weights from a Hugging Face checkpoint directory (any layout; its
        multi-token-prediction layers, if any, are carried into this trainer's checkpoints);
        returns how many tensors were read."""
        from bpo_megatron.weights.load import load_hf_weights

        count = load_hf_weights(self.model, self.hf, directory)
        self.reload_optimizer_params()
        self._mtp = mtp.find_in_hf_dir(directory, self.hf)
        return count

    def export_weights(self, bucket_bytes: int, *, dtype: torch.dtype | None = None, host: bool = False,
                       all_ranks: bool = False, views: bool = False
                       ) -> Iterator[list[tuple[str, torch.Tensor]] | FlatBucket]:
        """The model under Hugging Face names, in buckets of at most ``bucket_bytes``: what a
        weight sync sends (:func:`~bpo_megatron.weights.export.export_weights` says what
        ``dtype``, ``host``, ``all_ranks`` and ``views`` choose). Every rank must iterate to the
        end. The export plan is built at the first call and the host staging buffer kept, both
        reused by every later export of this model (parameters keep their place across
        offloads)."""
        if self._offload.offloaded:
            raise RuntimeError("the trainer's memory is offloaded (engines hold the device): call onload() "
                               "before export_weights()")
        self._export_plan = self._export_plan or ExportPlan.build(self.model, self.hf)
        self._staging = self._staging or HostStaging()
        return export_weights(self.model, self.hf, bucket_bytes, dtype=dtype, host=host, all_ranks=all_ranks,
                              views=views, plan=self._export_plan, staging=self._staging)

    def set_learning_rate(self, lr: float) -> None:
        """Constant learning rate from the next step on (e.g. a supervised warm start uses its own)."""
        if not lr > 0:
            raise ValueError(f"learning rate must be > 0, got {lr}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_loss(self, loss: PolicyLossConfig) -> None:
        """The policy loss of the next steps (a supervised warm start uses the same for every method)."""
        self.loss_cfg = loss

    def reload_optimizer_params(self) -> None:
        """After the model's weights were set directly (e.g. from a Hugging Face checkpoint):
        optimizers that keep their own fp32 master copies (mixed precision on GPU) refresh them."""
        reload = getattr(self.optimizer, "reload_model_params", None)
        if reload is not None:
            reload()

    @property
    def offloaded(self) -> bool:
        return self._offload.offloaded

    def plan_offload(self, parts: str, *, keep_across_saves: bool = False) -> int:
        """From now on :meth:`offload` moves ``parts`` (``cluster.offload``'s choice: a key of
        ``trainer.offload.OFFLOAD_PARTS``) into host buffers allocated here, before the first step
        (pinned with CUDA; the optimizer state its first step creates included), and kept across
        checkpoint saves with ``keep_across_saves``; returns the bytes allocated. Refused while
        offloaded."""
        self._check_onloaded()
        self._offload = trainer_offload(parts, self.ddp, self.optimizer, keep_across_saves=keep_across_saves)
        return self._offload.reserve()

    @property
    def host_buffers(self):
        """The offload's host buffers (``trainer.host_buffers.HostBuffers``: what is held, what was allocated)."""
        return self._offload.buffers

    def offload(self) -> int:
        """Move what :meth:`plan_offload` chose (until then everything: parameters and optimizer
        state) to host memory and free the device memory it and the gradient buffers held
        (colocated engines use it meanwhile; gradients are dead between steps and come back
        zeroed); returns the bytes moved."""
        return self._offload.offload()

    def onload(self) -> int:
        """Bring back what :meth:`offload` moved, bit for bit, and zeroed gradient buffers;
        returns the bytes moved."""
        return self._offload.onload()

    def close(self) -> None:
        """Release Megatron's process groups (the ``torch.distributed`` world stays: its owner
        created it). The actor is unusable afterwards; another may be built in this world. A
        background save in flight is published first."""
        from megatron.core import parallel_state

        self.finish_saves("the trainer closes")
        self.replay = None
        parallel_state.destroy_model_parallel()

    # ------------------------------------------------------------------------------ internals
    def _layout(self) -> dict[str, int]:
        return layout_record(self.parallel, dist.get_world_size())

    def _prepare(self, samples: list[TrainSample], *, replaying: bool = True, training: bool = False) -> Shares:
        """The whole batch checked and split as a driver does (:func:`prepare_shares`): every rank
        has the whole batch and refuses alike."""
        self._check_onloaded()
        return prepare_shares(samples, self.hf, dp_size=self.ranks.dp_size,
                              budget=self.trainer_cfg.max_tokens_per_micro_batch, cost=self.cost,
                              replaying=self.replay is not None and replaying,
                              loss=self.loss_cfg if training else None, cp=self.ranks.cp_size)

    def _check_share(self, share: list[TrainSample], *, replaying: bool = True, training: bool = False) -> None:
        """A share comes from a driver that checked the whole batch: its routing ids are not read
        again, and its samples are checked against the token budget collectively
        (balance.packs_in_lockstep), so no rank waits for another that refused."""
        self._check_onloaded()
        check_batch(share, self.hf, replaying=self.replay is not None and replaying, dp_size=1,
                    loss=self.loss_cfg if training else None, routing_ids=False)

    def _check_onloaded(self) -> None:
        if self._offload.offloaded:
            raise RuntimeError("the trainer's memory is offloaded (engines hold the device): call onload() first")

    def _micro_batches(self, samples: list[TrainSample], *, with_routing: bool = True
                       ) -> tuple[list[Batch], list[list[int]]]:
        """The micro-batches of ``samples`` and, for each, the indices of the samples it holds
        (their rows of its padded layout, in order)."""
        pad = self.ranks.tp_size if self.parallel.sequence_parallel else 1
        with_routing = with_routing and self.replay is not None
        if self.trainer_cfg.max_tokens_per_micro_batch:
            groups = packs_in_lockstep(samples, self.trainer_cfg.max_tokens_per_micro_batch, self.cost,
                                       group=self._dp_group if self.ranks.dp_size > 1 else None,
                                       cp=self.ranks.cp_size)
            return [pack([samples[i] for i in group], pad_to_multiple=pad, with_routing=with_routing,
                         cp_size=self.ranks.cp_size, cp_rank=self.ranks.cp)
                    for group in groups], groups
        groups = chunk(list(range(len(samples))), self.trainer_cfg.micro_batch_size)
        return [collate([samples[i] for i in group], pad_to_multiple=pad, with_routing=with_routing)
                for group in groups], groups

    def _run(self, micro_batches: list[Batch],
             loss_func: Callable[[Batch, torch.Tensor], tuple], *, forward_only: bool,
             record_into: list[torch.Tensor] | None = None) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = platform.device()
        replay = self.replay
        # activation recomputation re-runs the routers in backward, replaying what forward replayed
        recompute = self.model_options.recompute != "none" and not forward_only

        def forward_step(data: Iterator[Batch], model: torch.nn.Module):
            micro = next(data).to(device)
            if record_into is not None:
                replay.start_recording()
            elif replay is not None:
                replay.load(micro, recompute=recompute)
            output = model(micro.input_ids, micro.position_ids, attention_mask=None,
                           packed_seq_params=micro.packed_seq_params())
            if record_into is not None:
                record_into.append(replay.take_recorded(micro.shape[0]))
            elif replay is not None:
                replay.forward_done()
            return output, lambda logits: loss_func(micro, logits)

        seq = max(m.shape[1] for m in micro_batches)
        try:
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=self.ddp,
                num_microbatches=len(micro_batches),
                seq_length=seq,
                micro_batch_size=max(m.shape[0] for m in micro_batches),
                forward_only=forward_only,
            )
        finally:
            if replay is not None:
                replay.finish(recompute=recompute)
        return outputs

    def _step_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Loss and loss statistics summed over micro-batches and DP ranks, sent to every stage."""
        metrics: dict[str, float] = {}
        if self.ranks.is_last_stage:
            loss = torch.stack([o["loss"] for o in outputs]).sum().reshape(1).double()
            stats = outputs[0]["stats"]
            for out in outputs[1:]:
                stats = stats.merge(out["stats"])
            dist.all_reduce(loss, group=self._dp_group)
            stats = stats.all_reduce(self._dp_group)
            values = torch.cat([loss, stats.packed()]).tolist()  # the step's one read of its metrics
            metrics = {"loss": values[0], **LossStatistics.metrics_of(values[1:])}
        if self.parallel.pp > 1:
            box = [metrics]
            last = dist.get_global_rank(self._pp_group, self.parallel.pp - 1)
            dist.broadcast_object_list(box, src=last, group=self._pp_group)
            metrics = box[0]
        return metrics

    def _assemble_routing(self, micro_batches: list[Batch], groups: list[list[int]],
                          recorded: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-sample ``[n − 1, MoE layers, K]`` routing, in sample order, from every rank's
        sequence shard and pipeline stage's layers (recorded as ``[s_local, b, local layers, K]``
        per micro-batch; a packed one's single row is cut into its samples by their positions)."""
        if self.parallel.sequence_parallel:
            shards: list = [None] * self.ranks.tp_size
            dist.all_gather_object(shards, recorded, group=self._tp_group)
            recorded = [torch.cat(parts, dim=0) for parts in zip(*shards)]
        if self.parallel.pp > 1:
            stages: list = [None] * self.parallel.pp
            dist.all_gather_object(stages, (self.replay.local_moe_layers, recorded), group=self._pp_group)
            order = [index for layers, _ in stages for index in layers]
            merged = [torch.cat(parts, dim=2) for parts in zip(*(r for _, r in stages))]
            recorded = [m[:, :, sorted(range(len(order)), key=order.__getitem__)] for m in merged]
        per_sample: list[torch.Tensor] = [torch.empty(0)] * sum(map(len, groups))
        dtype = expert_id_dtype(self.hf.num_experts)
        for micro, group, routing in zip(micro_batches, groups, recorded, strict=True):
            rows = micro.as_padded(routing.transpose(0, 1))  # [b, s, layers, K] in the padded layout
            for row, (index, n) in enumerate(zip(group, micro.padded.lengths.tolist(), strict=True)):
                per_sample[index] = rows[row, :n].to("cpu", dtype, copy=True)
        return per_sample

    def _gather_over_dp(self, local: list[torch.Tensor], shares: list[list[int]]) -> list[torch.Tensor]:
        """Every rank's results of its share (``shares[dp]``), in sample order."""
        if self.ranks.dp_size == 1:
            return local
        parts: list[list[torch.Tensor] | None] = [None] * self.ranks.dp_size
        dist.all_gather_object(parts, local, group=self._dp_group)
        return in_sample_order(parts, shares)
