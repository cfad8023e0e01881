"""Log-probabilities of k given token ids per row from vocabulary-parallel logits (score centering's
``log π(v)``, ``v`` in the sampler's top-k: losses/score_centering.py).

With z = logits / T, ``log π(v) = z_v − lse`` over the whole vocabulary. Each tensor-parallel rank
holds a contiguous slice of it (Megatron-Core's layout): one pass in row chunks computes the local
max and Σ exp(z − m) per row and the logits of the ids this rank owns; a MAX all-reduce of the row
maxima and one SUM all-reduce of the rescaled sums and the owned logits give ``[rows, k]``
log-probs on every rank. The vocabulary is never gathered. Backward, per rank and with no
collective: ``∂/∂z_u = (Σ_j g_j·1[u = v_j] − π(u)·Σ_j g_j) / T``, the softmax recomputed chunk by
chunk from the saved logits and lse (so the logits must not be overwritten in between: the
caller's log-prob op then runs copy-safe, ``inplace=False``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from bpo_megatron.ops.shards import group_rank_size, valid_columns
from bpo_megatron.ops.vocab_parallel import default_chunk_rows


class _VocabParallelLogProbsAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, group, temperature, chunk_rows, vocab_size):
        vocab_shard = logits.shape[-1]
        k = ids.shape[-1]
        rows = ids.numel() // k
        rank, world = group_rank_size(group)
        valid = valid_columns(vocab_size, rank, vocab_shard)
        flat = logits.reshape(rows, vocab_shard)
        local = ids.reshape(rows, k).long() - rank * vocab_shard
        owned = (local >= 0) & (local < valid)
        index = torch.where(owned, local, 0)
        inv_t = 1.0 / temperature
        f32 = dict(dtype=torch.float32, device=logits.device)
        local_max = torch.full((rows,), -math.inf, **f32)
        sum_exp = torch.zeros(rows, **f32)
        picked = torch.zeros(rows, k, **f32)
        for start in range(0, rows if valid else 0, chunk_rows):
            stop = min(start + chunk_rows, rows)
            z = flat[start:stop, :valid].float() * inv_t
            m = z.amax(dim=-1)
            local_max[start:stop] = m
            sum_exp[start:stop] = (z - m[:, None]).exp().sum(dim=-1)
            picked[start:stop] = z.gather(-1, index[start:stop])
        global_max = local_max.clone()
        if world > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        reduced = torch.cat([(sum_exp * torch.exp(local_max - global_max))[:, None],
                             torch.where(owned, picked, 0.0)], dim=1)
        if world > 1:
            dist.all_reduce(reduced, group=group)
        lse = global_max + torch.log(reduced[:, 0])
        out = reduced[:, 1:] - lse[:, None]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, index, owned, lse)
            ctx.meta = (inv_t, chunk_rows, valid)
        return out.view(ids.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, index, owned, lse = ctx.saved_tensors
        inv_t, chunk_rows, valid = ctx.meta
        rows, k = index.shape
        flat = logits.reshape(rows, logits.shape[-1])
        g = grad_out.reshape(rows, k).float() * inv_t
        g_sum = g.sum(-1, keepdim=True)
        picked = torch.where(owned, g, 0.0)
        grad = torch.zeros(flat.shape, dtype=logits.dtype, device=logits.device)
        for start in range(0, rows if valid else 0, chunk_rows):
            stop = min(start + chunk_rows, rows)
            work = (flat[start:stop, :valid].float() * inv_t - lse[start:stop, None]).exp_()
            work.mul_(-g_sum[start:stop]).scatter_add_(-1, index[start:stop], picked[start:stop])
            grad[start:stop, :valid] = work.to(grad.dtype)
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_logprobs_at(logits: torch.Tensor, ids: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                               temperature: float = 1.0, vocab_size: int | None = None,
                               chunk_size: int | None = None) -> torch.Tensor:
    """``log softmax(logits / temperature)`` at ``ids`` over the whole vocabulary, fp32.

    Args:
        logits: ``[..., V/TP]`` this rank's vocabulary shard (any float dtype).
        ids: ``[..., k]`` global token ids (the same on every rank of ``group``).
        group: the tensor-parallel group (None: one rank holds the whole vocabulary).
        vocab_size: the real vocabulary (Megatron pads it; the padding columns are not tokens).
        chunk_size: rows per pass (default: about 4 MiB of fp32 on a CPU, 256 MiB on a GPU).

    Returns ``[..., k]`` with a gradient to ``logits`` (see the module)."""
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"ids {tuple(ids.shape)} must be logits' leading shape {tuple(logits.shape[:-1])} plus k")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_size or default_chunk_rows(logits.shape[-1], logits.device)
    return _VocabParallelLogProbsAt.apply(logits, ids, group, float(temperature), chunk, vocab_size)
