"""R3 — rollout routing replay through Megatron-Core's upstream ``RouterReplay``.

The rollout engine records, for every token it processed, the top-k experts of every MoE layer
(``[n − 1, num_moe_layers, topk]`` per sample). The trainer makes each of its routers use exactly
those experts while the router's probabilities (and their gradients) stay live:
``REPLAY_FORWARD`` while a micro-batch goes forward, ``REPLAY_BACKWARD`` while activation
recomputation re-runs it during backward.

Each rank replays only what its routers see: the MoE layers of its pipeline stage, and with
sequence parallelism its own slice of the sequence (routers see hidden states ``[s/TP, b, h]``,
flattened sequence-major). This module talks to this model's ``RouterReplay`` instances directly,
not to the class-wide registry, so several models in one process do not interfere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bpo_megatron.models.routing import RoutingError, check_expert_ids
from bpo_megatron.trainer.samples import MicroBatch, TrainSample

CAPTURE_SETTING = "rollout.capture_routed_experts"
REPLAY_SETTING = "model.routing_replay"


class RoutingReplayError(RuntimeError):
    """Replay data and the model disagree (a bug upstream, never silently ignored)."""


def check_routed_experts(samples: list[TrainSample], *, num_moe_layers: int, topk: int, num_experts: int,
                         contents: bool = True) -> None:
    """Refuse samples whose routing cannot be replayed, before any compute.

    The shape and dtype are checked always (constant time per sample). The expert ids themselves
    (range, no expert twice within a token's top-k) are read only with ``contents``: where
    routing enters the trainer from outside, once. Routing from a rollout engine was checked as it
    arrived (:meth:`bpo_megatron.models.routing.RoutingLayout.select`), so the driver and the
    ranks, which see every sample again for π_old and for each minibatch, check its shape only
    (reading the ids again costs a pass over ``tokens × MoE layers × top-k`` per rank and call)."""
    for i, s in enumerate(samples):
        experts = s.routed_experts
        if experts is None:
            raise ValueError(
                f"sample {i} carries no routed experts but {REPLAY_SETTING}=true: start the rollout "
                f"engine with {CAPTURE_SETTING}=true, or set {REPLAY_SETTING}=false"
            )
        want = (s.tokens.numel() - 1, num_moe_layers, topk)
        if tuple(experts.shape) != want:
            raise ValueError(
                f"sample {i}: routed experts have shape {tuple(experts.shape)}, expected {want} "
                f"([len(tokens) - 1, MoE layers, top-k]); the rollout engine ({CAPTURE_SETTING}) and "
                f"the trained model ({REPLAY_SETTING}) disagree on the model or the tokens"
            )
        if experts.dtype.is_floating_point or experts.dtype == torch.bool:
            raise ValueError(f"sample {i}: routed experts must be integer ids, got {experts.dtype}")
    if not contents:
        return
    hint = f"was {CAPTURE_SETTING} recorded with another model than the one trained with {REPLAY_SETTING}?"
    try:  # every sample's ids at once (three host reads for the batch) ...
        check_expert_ids(torch.cat([s.routed_experts for s in samples]), num_experts=num_experts, where="",
                         hint=hint)
    except RoutingError:  # ... and sample by sample only to name the sample holding a bad one
        for i, s in enumerate(samples):
            check_expert_ids(s.routed_experts, num_experts=num_experts, where=f"sample {i}", hint=hint)


@dataclass
class _Router:
    moe_index: int  # position of this layer among the model's MoE layers (engine capture order)
    replay: object  # megatron RouterReplay
    loaded: int = 0  # micro-batches whose indices were handed to this router
    forward_calls: int = 0


class RoutingReplay:
    """Drives the ``RouterReplay`` instances of one model chunk (one pipeline stage)."""

    def __init__(self, model: torch.nn.Module, *, moe_layers: list[int], tp_rank: int, tp_size: int,
                 sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self._tp_rank, self._tp_size, self._sp = tp_rank, tp_size, sequence_parallel
        self._routers: list[_Router] = []
        layer_of = {id(m): layer for layer in _decoder_layers(model) for m in layer.modules()}
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise RoutingReplayError(
                        f"{REPLAY_SETTING}=true but the model was built without routing replay"
                    )
                global_layer = layer_of[id(module)].layer_number - 1  # Megatron counts from 1
                self._routers.append(_Router(moe_layers.index(global_layer), module.router_replay))
                module.register_forward_pre_hook(self._check_router_input(len(self._routers) - 1))

    @property
    def num_local_routers(self) -> int:
        return len(self._routers)

    def _local_indices(self, routed: torch.Tensor, moe_index: int) -> torch.Tensor:
        """[b, s, L, K] → this rank's router view: [s_local · b, K], sequence-major."""
        per_layer = routed[:, :, moe_index].transpose(0, 1)  # [s, b, K]
        if self._sp:
            shard = per_layer.shape[0] // self._tp_size
            per_layer = per_layer[self._tp_rank * shard : (self._tp_rank + 1) * shard]
        return per_layer.reshape(-1, per_layer.shape[-1]).long()  # routers index with int64

    def load(self, micro: MicroBatch, *, recompute: bool) -> None:
        """Hand ``micro``'s routing to every router (call right before its forward).

        ``recompute``: activation recomputation will re-run the routers in backward. Megatron's
        ``RouterReplay`` also queues every micro-batch's ids (int64) for that; without
        recomputation nothing takes them off the queue until :meth:`finish`, so a forward-only
        pass would hold the int64 ids of its whole share (gigabytes at paper lengths): they are
        taken off at once instead."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if micro.routed_experts is None:
            raise RoutingReplayError(f"micro-batch without routed experts while {REPLAY_SETTING}=true")
        for router in self._routers:
            router.replay.set_target_indices(self._local_indices(micro.routed_experts, router.moe_index))
            if not recompute:
                router.replay.replay_backward_list.pop()
            router.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.loaded += 1

    def start_recording(self) -> None:
        """Let the routers choose freely and keep their choices (the trainer's own routing)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self._routers:
            router.replay.clear_indices()
            router.replay.set_router_replay_action(RouterReplayAction.RECORD)

    def take_recorded(self, batch_size: int) -> torch.Tensor:
        """The choices of the forward that just ran, ``[s_local, b, local MoE layers, K]``
        (the layers are :attr:`local_moe_layers`)."""
        recorded = []
        for router in self._routers:
            indices = router.replay.get_recorded_indices()
            if indices is None:
                raise RoutingReplayError(f"MoE layer {router.moe_index} recorded nothing")
            recorded.append(indices.reshape(-1, batch_size, indices.shape[-1]))
            router.replay.record_indices(None)
        return torch.stack(recorded, dim=2)

    @property
    def local_moe_layers(self) -> list[int]:
        """Positions among the model's MoE layers of the routers on this rank, in order."""
        return [router.moe_index for router in self._routers]

    def forward_done(self) -> None:
        """Any router call from now on is activation recomputation inside backward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for router in self._routers:
            router.replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def finish(self, *, recompute: bool) -> None:
        """Assert every loaded entry was used exactly as planned, then reset for the next step."""
        try:
            for router in self._routers:
                if router.forward_calls != router.loaded:
                    raise RoutingReplayError(
                        f"MoE layer {router.moe_index}: {router.loaded} micro-batches of routing were "
                        f"loaded but the router ran forward {router.forward_calls} times"
                    )
                left = len(router.replay.replay_backward_list)
                if recompute and left:
                    raise RoutingReplayError(
                        f"MoE layer {router.moe_index}: {left} recorded routings were never replayed "
                        "by activation recomputation"
                    )
        finally:
            for router in self._routers:
                router.replay.clear_indices()
                router.replay.clear_router_replay_action()
                router.loaded = router.forward_calls = 0

    def _check_router_input(self, position: int):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def pre_hook(module: torch.nn.Module, args: tuple) -> None:
            router = self._routers[position]
            action = router.replay.router_replay_action
            if action == RouterReplayAction.REPLAY_FORWARD:
                router.forward_calls += 1
                pending = router.replay.target_topk_idx
            elif action == RouterReplayAction.REPLAY_BACKWARD:
                queue = router.replay.replay_backward_list
                pending = queue[0] if queue else None
            else:  # routing freely (no replay, or recording)
                return
            tokens = args[0].shape[0] * args[0].shape[1]  # router input is [s, b, h]
            if pending is None or pending.shape[0] != tokens:
                have = None if pending is None else pending.shape[0]
                raise RoutingReplayError(
                    f"MoE layer {router.moe_index} sees {tokens} tokens but has replay data for {have}"
                )

        return pre_hook


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The TransformerLayers of a GPTModel chunk, unwrapping DDP / Float16Module."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return list(model.decoder.layers)
