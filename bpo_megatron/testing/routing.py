"""Independent views of routing for tests and the GPU kit: which experts a router sent each
token to, read from Megatron's routers themselves (not from the replay machinery)."""

from __future__ import annotations

import torch


def same_expert_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per (token, layer): do two top-k expert lists name the same experts?"""
    return (a.long().sort(dim=-1).values == b.long().sort(dim=-1).values).all(dim=-1)


class DispatchRecorder:
    """Forward hooks on every Megatron router: the experts each token was actually sent to.

    Independent of the replay machinery: it reads the router's output ``routing_map``
    (``[tokens, experts]`` bool, sequence-major ``[s_local · b]``), whatever produced it (free
    routing or replay). Pipeline parallelism is not supported (routers in layer order).
    """

    def __init__(self, model: torch.nn.Module, topk: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.topk = topk
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]  # in layer order (PP=1)
        self.maps: list[list[torch.Tensor]] = [[] for _ in routers]
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def record(module, args, output) -> None:
            self.maps[layer].append(output[1].detach().clone())
        return record

    def per_sample(self, actor, samples) -> list[torch.Tensor]:
        """``[len(tokens) − 1, MoE layers, K]`` expert sets per sample (host tensors), in sample
        order, on every rank of ``actor``'s world, which ran padded micro-batches of ``samples``."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from bpo_megatron.trainer.samples import chunk, split

        for handle in self._handles:
            handle.remove()
        mine = split(samples, actor.ranks.dp_size)[actor.ranks.dp]
        out = []
        for k, group in enumerate(chunk(mine, actor.trainer_cfg.micro_batch_size)):
            layers = []
            for maps in self.maps:
                routing_map = maps[k]
                assert bool((routing_map.sum(-1) == self.topk).all()), "a token went to != top-k experts"
                experts = routing_map.float().topk(self.topk, dim=-1).indices.sort(dim=-1).values
                experts = experts.reshape(-1, len(group), self.topk)  # [s_local, b, K]
                if actor.parallel.sequence_parallel:  # each TP rank routed its slice of the sequence
                    parts = [torch.empty_like(experts) for _ in range(actor.ranks.tp_size)]
                    dist.all_gather(parts, experts.contiguous(), group=ps.get_tensor_model_parallel_group())
                    experts = torch.cat(parts, dim=0)
                layers.append(experts)
            routed = torch.stack(layers, dim=2).cpu()  # [s, b, L, K]
            out += [routed[: s.tokens.numel() - 1, row] for row, s in enumerate(group)]
        gathered: list = [None] * actor.ranks.dp_size
        dist.all_gather_object(gathered, out, group=ps.get_data_parallel_group())
        return [t for part in gathered for t in part]
