"""The local spec's MoE token dispatch by sorting: no host sync per layer at EP=1, one at EP>1.

Without transformer-engine's fused permutation (``moe_permute_fusion``), Megatron's dispatchers
wait on the host in every MoE layer: the all-to-all dispatcher copies ``tokens_per_expert`` and its
split sizes to the host and waits for them (at EP=1 as well, where nothing is exchanged), the
all-gather dispatcher calls ``.cpu()`` on its counts, and megatron-core 0.16's ``permute`` and
``unpermute`` select the routed rows with ``masked_select`` (an output sized by the data, so the
GPU's result must reach the host before the next op is issued). 0.19's ``permute`` sorts the
whole ``[experts, tokens]`` routing map instead: no sync, but ``experts / k`` times the entries
sorted here.

Dropless routing makes every token name exactly top-k distinct experts, so the permuted buffer has
a static ``tokens × k`` rows. A stable ``argsort`` of the flattened ``[tokens, k]`` expert ids
orders them by expert, then by token: the rows Megatron's ``permute`` yields from the transposed
routing map, in the same order, so the experts see the same inputs. The counts per expert are an
``index_add_`` of ones on the device (not ``bincount``, which reads its input's minimum and
maximum on the host under CUDA to size its output), handed to the experts as a device tensor
(:class:`~bpo_megatron.models.grouped_experts.GroupedSequentialMLP` needs no host count; Megatron's
``SequentialMLP``, ``model.expert_gemm=sequential``, still reads them with ``tolist``). The experts
have already weighted their rows by the routing probabilities, so combining is Megatron's
``unpermute`` without probabilities: a scatter-add of the rows onto their tokens, sync-free.

Where it applies (:data:`SORTED_DISPATCHERS`, by Megatron's dispatcher type and whether experts are
split over ranks):

* EP=1, either dispatcher type (:class:`SortedTokenDispatcher`): every expert is local. With expert
  tensor parallelism (``etp = tp`` at EP=1, sequence parallel) the tokens, their top-k ids and
  probabilities are all-gathered over the expert-TP group and the combined output reduce-scattered,
  as Megatron's all-gather dispatcher does; sequence parallelism gives every rank an equal shard, so
  all sizes are static. No host sync at all. Megatron's all-to-all dispatcher computes the same at
  EP=1, but all-gathers the k times larger permuted rows with split sizes read on the host and
  re-sorts them by expert with host counts; it reduce-scatters the k rows of a token and then sums
  them, where this sums them first (k times less data to reduce): the same up to summation order.
* EP>1 with the all-to-all dispatcher (:class:`SortedAlltoAllTokenDispatcher`): the all-to-all
  itself takes its split sizes as host integers (``torch.distributed.all_to_all_single``), so one
  device-to-host copy of the counts per layer is inherent; it is Megatron's, overlapped as Megatron
  overlaps it. Only the permutation before the all-to-all is replaced (0.16: its two
  ``masked_select`` calls go; 0.19: ``tokens × k`` ids sorted instead of ``experts × tokens`` map
  entries); the re-sort by local expert after it uses the host counts that copy already brought.
* EP>1 with the all-gather dispatcher: none. Each rank's share of the gathered tokens is sized by
  the routing, so a sync-free permutation would need buffers EP times larger; it is refused, not
  replaced silently (``model.moe_dispatch=megatron`` keeps Megatron's).

Token dropping and padding (capacity factor, padding to capacity or for quantization) make the
row count data-dependent again, shared-expert overlap hooks into Megatron's dispatch internals, and
TE's fused permutation uses its own index format: all are refused by name when the layer is built.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.utils import get_pg_size

MOE_DISPATCH_SETTING = "model.moe_dispatch"


def top_k_routing(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``topk`` expert ids and their probabilities (``[tokens, topk]`` each) from the
    router's ``[tokens, experts]`` map and probabilities; which of a token's experts comes first
    does not matter (:func:`permute_by_expert` orders by expert). Exact for dropless routing,
    where every row of the map holds exactly ``topk`` experts."""
    expert_ids = routing_map.to(torch.uint8).topk(topk, dim=1, sorted=False).indices
    return expert_ids, probs.gather(1, expert_ids)


def permute_by_expert(tokens: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` ``[N, h]`` routed to ``expert_ids`` ``[N, k]`` with ``probs`` ``[N, k]``, as
    ``(rows, row probabilities, token of each row, tokens per expert)``: ``N·k`` rows grouped by
    expert, tokens in order within an expert (Megatron's order), and the counts on the device."""
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_row = order.div(expert_ids.shape[1], rounding_mode="floor")
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))
    return tokens.index_select(0, token_of_row), probs.reshape(-1).index_select(0, order), token_of_row, \
        tokens_per_expert


def _check_supported(config) -> None:
    refused = {
        "moe_expert_capacity_factor (token dropping)": getattr(config, "moe_expert_capacity_factor", None) is not None,
        "moe_pad_expert_input_to_capacity": bool(getattr(config, "moe_pad_expert_input_to_capacity", False)),
        "moe_router_padding_for_quantization": bool(getattr(config, "moe_router_padding_for_quantization", False)),
        "moe_shared_expert_overlap": bool(getattr(config, "moe_shared_expert_overlap", False)),
        "moe_permute_fusion (transformer-engine's fused permutation)": bool(config.moe_permute_fusion),
    }
    unsupported = [name for name, on in refused.items() if on]
    if unsupported:
        raise ValueError(f"the sorted MoE token dispatch ({MOE_DISPATCH_SETTING}=sorted) does not support "
                         + "; ".join(unsupported) + f" — set {MOE_DISPATCH_SETTING}=megatron for these")


class SortedTokenDispatcher(MoEAllGatherTokenDispatcher):
    """EP=1: all experts are local. Megatron's all-gather dispatcher (the all-gather and
    reduce-scatter over the expert-TP group, the combine) with the top-k ids and probabilities
    gathered instead of the ``[tokens, experts]`` map, and the permutation by sorting: no host
    sync (module docstring)."""

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """The tokens as rows, and each token's top-k probabilities (its ids are kept)."""
        self.hidden_shape = hidden_states.shape
        self.expert_ids, topk_probs = top_k_routing(routing_map, probs, self.router_topk)
        return hidden_states.view(-1, self.hidden_shape[-1]), topk_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """All-gathers tokens, top-k probabilities and ids over the expert-TP group: equal shards
        under sequence parallelism, so no split sizes."""
        if self.tp_size > 1 or self.ep_size > 1:
            with torch.no_grad():
                self.expert_ids = gather_from_sequence_parallel_region(self.expert_ids, group=self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_ep_group,
                                                                 use_global_buffer=True)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The rows grouped by expert, the tokens per expert (a device tensor) and the rows'
        probabilities; the combine (Megatron's) scatters the experts' rows back by token."""
        self.hidden_shape_before_permute = hidden_states.shape
        permuted, self.local_probs, self.reversed_local_input_permutation_mapping, tokens_per_expert = \
            permute_by_expert(hidden_states, self.expert_ids, probs, self.num_local_experts)
        self.local_map = None  # the combine's unpermute takes no probabilities, so no map
        self.expert_ids = None
        return permuted, tokens_per_expert, self.local_probs


class SortedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """EP>1: Megatron's all-to-all dispatcher with the permutation before the all-to-all by
    sorting; the split sizes the all-to-all needs on the host (one copy per layer) stay as
    Megatron computes and overlaps them (module docstring)."""

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Megatron's metadata (counts, split sizes, their device-to-host copy), then the rows
        grouped by expert and their probabilities, as the all-to-all sends them."""
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        expert_ids, topk_probs = top_k_routing(routing_map, probs, self.config.moe_router_topk)
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping, _ = permute_by_expert(
            hidden_states, expert_ids, topk_probs, self.num_experts)
        return permuted, permuted_probs


# Megatron's dispatcher type and whether experts are split over ranks (EP > 1) -> the sorted dispatcher
SORTED_DISPATCHERS: dict[tuple[str, bool], type] = {
    ("alltoall", False): SortedTokenDispatcher,
    ("allgather", False): SortedTokenDispatcher,
    ("alltoall", True): SortedAlltoAllTokenDispatcher,
}


class SortedDispatchMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with its token dispatcher from :data:`SORTED_DISPATCHERS` (same
    router, experts, parameters and checkpoints); layouts and settings it does not cover are
    refused when the layer is built."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        _check_supported(config)
        ep = get_pg_size(pg_collection.ep)
        dispatcher = SORTED_DISPATCHERS.get((config.moe_token_dispatcher_type, ep > 1))
        if dispatcher is None:
            covered = ", ".join(f"{kind} at {'EP>1' if split else 'EP=1'}" for kind, split in SORTED_DISPATCHERS)
            raise ValueError(
                f"the sorted MoE token dispatch ({MOE_DISPATCH_SETTING}=sorted) has no "
                f"{config.moe_token_dispatcher_type!r} dispatcher at expert parallelism {ep} (covered: {covered}) "
                f"— set {MOE_DISPATCH_SETTING}=megatron, or model.moe_token_dispatcher=alltoall")
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        self.token_dispatcher = dispatcher(self.num_local_experts, self.local_expert_indices,
                                           config=self.config, pg_collection=pg_collection)
