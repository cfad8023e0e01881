"""One projection for an attention's queries, keys and values in the embedded engine's decode step.

transformers' attention projects the queries, keys and values with three GEMMs and normalises the
query and key heads with two RMSNorms; the decode step (:mod:`decode`) instead multiplies by their
weights stacked into one ``[(Hq + 2·Hkv)·D, hidden]`` matrix, normalises the query and key heads
together (one RMSNorm weight per head: the query norm's for query heads, the key norm's for key
heads) and rotates them together. Every value is the one the three projections give, computed by
one GEMM (its summation order may differ in the last bits) and elementwise ops in the same order.

The stacked weights are a copy, refreshed in place (:meth:`FusedQKV.refresh`) whenever the
weights may have changed — at the end of every ``update_weights`` call and every weight update
(``end_weight_update``, which also covers weights written through shared memory) — as the FP8
copies of :mod:`fp8_compute` are: their storage never moves, so a captured decode graph stays
valid across updates. A :class:`FusedQKV` is a child module of the attention (``fused_qkv``) whose
buffers are not persistent: checkpoints, the weight names and weight sync do not see it. Attention
whose projections are not plain ``nn.Linear`` (an FP8 engine's) or that has no ``v_proj`` (latent
attention) keeps its three projections.
"""

from __future__ import annotations

import torch
from torch import nn

ATTRIBUTE = "fused_qkv"


class FusedQKV(nn.Module):
    """The stacked query, key and value projection (and query/key norm weights) of one attention."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        self._projections = projections  # a list: not registered, the attention owns them
        self._norms = [attn.q_norm, attn.k_norm] if _norms_fuse(attn) else []
        head_dim = attn.head_dim
        self.query_heads = attn.q_proj.out_features // head_dim
        self.rotated_heads = self.query_heads + attn.k_proj.out_features // head_dim  # queries and keys
        self.eps = self._norms[0].variance_epsilon if self._norms else 0.0
        weight = attn.q_proj.weight
        rows = sum(p.out_features for p in projections)
        self.register_buffer("weight", weight.new_empty(rows, weight.shape[1]), persistent=False)
        self.register_buffer("bias", weight.new_empty(rows) if attn.q_proj.bias is not None else None,
                             persistent=False)
        norm = (weight.new_empty(self.rotated_heads, head_dim, dtype=self._norms[0].weight.dtype)
                if self._norms else None)
        self.register_buffer("norm_weight", norm, persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the projections' (and norms') current weights into the stacked buffers, in place."""
        torch.cat([p.weight for p in self._projections], out=self.weight)
        if self.bias is not None:
            torch.cat([p.bias for p in self._projections], out=self.bias)
        if self.norm_weight is not None:
            self.norm_weight[:self.query_heads].copy_(self._norms[0].weight)
            self.norm_weight[self.query_heads:].copy_(self._norms[1].weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Qwen3, Qwen3-MoE, GLM-4.5: the same operations in the same order) with
    ``weight`` broadcast against ``x``."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def _norms_fuse(attn: nn.Module) -> bool:
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is None and k_norm is None:
        return False
    if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in (q_norm, k_norm)) \
            or q_norm.variance_epsilon != k_norm.variance_epsilon:
        raise ValueError(f"{type(attn).__name__}: query/key norms {type(q_norm).__name__}/{type(k_norm).__name__} "
                         "are not the RMSNorm pair the decode step fuses")
    return True


def _fuses(attn: nn.Module) -> bool:
    projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(type(p) is nn.Linear for p in projections):  # FP8 layers, latent attention: as they are
        return False
    return (len({p.in_features for p in projections}) == 1
            and len({p.bias is None for p in projections}) == 1
            and all(p.out_features % attn.head_dim == 0 for p in projections))


def install(model: nn.Module) -> list[FusedQKV]:
    """A :class:`FusedQKV` on every attention of ``model`` that can take one (kept and refreshed
    when already there: an engine built again on the same model object); returns them all."""
    fused = []
    for layer in model.model.layers:
        attn = layer.self_attn
        existing = getattr(attn, ATTRIBUTE, None)
        if existing is not None and not _fuses(attn):  # the model was converted since (FP8 layers)
            delattr(attn, ATTRIBUTE)
        elif existing is not None:
            existing.refresh()
            fused.append(existing)
        elif _fuses(attn):
            holder = FusedQKV(attn)
            setattr(attn, ATTRIBUTE, holder)
            fused.append(holder)
    return fused
