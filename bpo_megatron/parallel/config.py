"""How the trainer's world is split: tensor, pipeline, context, expert and data parallelism."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of the train actors.

    ``tp × pp × cp × dp = world size``; experts are split ``ep`` ways (with ``etp``-way tensor
    parallelism inside each expert) over the ``tp × cp × dp`` ranks of a pipeline stage, as in
    Megatron-Core. Sequence parallelism is on whenever ``tp > 1`` (Megatron-Core requires it for
    MoE with tensor parallelism, and it saves activation memory for dense models too). Context
    parallelism (``cp > 1``) splits every packed sample's positions over ``cp`` ranks
    (:mod:`bpo_megatron.parallel.context`); it needs packed micro-batches
    (``trainer.max_tokens_per_micro_batch``).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    # Expert tensor parallelism. None: 1 with expert parallelism (small experts are not worth
    # splitting), tp without it (Megatron-Core's default; see validate_world).
    etp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"parallel.etp must be a positive integer or None, got {self.etp!r}")

    @property
    def expert_tp(self) -> int:
        if self.etp is not None:
            return self.etp
        return 1 if self.ep > 1 else self.tp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    @property
    def device_max_connections(self) -> str | None:
        """``CUDA_DEVICE_MAX_CONNECTIONS`` a GPU rank of this layout needs (None: the driver's
        default). With tensor parallelism Megatron-Core's linear layers start the sequence-parallel
        all-gather, reduce-scatter or the input-gradient all-reduce asynchronously and rely on one
        hardware queue per device to run them before the weight-gradient GEMM they overlap
        (``tensor_parallel/layers.py``); with more queues the GEMM may run first and the overlap
        is lost."""
        return "1" if self.tp > 1 else None

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for ``world_size`` ranks; raises ValueError naming the sizes if they do not fit."""
        self.validate_world(world_size)
        return world_size // (self.model_parallel_size * self.cp)

    def validate_world(self, world_size: int) -> None:
        if self.ep == 1 and self.expert_tp != self.tp:
            # Megatron-Core all-reduces expert gradients over the expert-data-parallel group only
            # when ep > 1; with ep = 1 experts count as dense parameters, so experts replicated
            # over TP ranks that see different tokens would keep partial gradients.
            raise ValueError(
                f"parallel.etp={self.expert_tp} with parallel.ep=1 must equal parallel.tp={self.tp} "
                "(use expert parallelism, ep > 1, to keep experts unsplit)"
            )
        if world_size % (self.model_parallel_size * self.cp) != 0:
            names, sizes = "parallel.tp × parallel.pp", f"{self.tp} × {self.pp}"
            if self.cp > 1:
                names, sizes = f"{names} × parallel.cp", f"{sizes} × {self.cp}"
            raise ValueError(f"world size {world_size} is not divisible by {names} = {sizes}; choose sizes whose "
                             "product divides the number of ranks")
        per_stage = world_size // self.pp
        expert_ranks = self.ep * self.expert_tp
        if per_stage % expert_ranks != 0:
            raise ValueError(
                f"parallel.ep × parallel.etp = {self.ep} × {self.expert_tp} must divide the "
                f"{per_stage} ranks of a pipeline stage (world {world_size} / pp {self.pp})"
            )

    def validate_model(self, *, num_layers: int, num_experts: int, num_attention_heads: int,
                       num_query_groups: int) -> None:
        """Refuse layouts the model cannot be split into, naming the field and the limit."""
        if num_layers % self.pp != 0:
            raise ValueError(
                f"parallel.pp={self.pp} must divide the model's {num_layers} layers"
            )
        if num_attention_heads % self.tp != 0 or num_query_groups % self.tp != 0:
            raise ValueError(
                f"parallel.tp={self.tp} must divide the attention heads ({num_attention_heads}) "
                f"and key/value heads ({num_query_groups})"
            )
        if num_experts == 0 and (self.ep > 1 or self.etp not in (None, 1)):
            raise ValueError("parallel.ep/etp > 1 needs a Mixture-of-Experts model; this one is dense")
        if num_experts and num_experts % self.ep != 0:
            raise ValueError(
                f"parallel.ep={self.ep} must divide the model's {num_experts} experts "
                f"(and cannot exceed it)"
            )
