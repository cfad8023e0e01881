"""Triton kernels for :func:`bpo_megatron.ops.vocab_parallel_logprobs` on a GPU (``kernel="fused"``).

The chunked PyTorch op makes several passes over each chunk (upcast, subtract, exp, sum, and in
backward the same again plus a copy back for bf16): at bf16 it moved about 1.3x the bytes of
Megatron's cross entropy. Here each direction touches the logits once:

* forward: one kernel reads this rank's shard in its own dtype and keeps, per row, the running
  max m, Σ exp(z − m) and (for the entropy) Σ exp(z − m)(z − m) in fp32, rescaling them as the max
  grows. With few rows a row's columns are split over several programs, whose partial sums are
  combined exactly like tensor-parallel ranks; ranks are then combined by the chunked op's own
  :func:`~bpo_megatron.ops.shards.combine_shards`.
* backward: one kernel recomputes π(v) = exp(z_v − lse) in fp32 from the saved logits (the
  logits are saved, never the probabilities) and writes (1[v = y] − π(v)) · g / T in the logits'
  dtype: into the logits buffer itself when the caller gave it up (``inplace``), otherwise into a
  new tensor. Rows whose incoming gradient is zero (prompt and padding positions) read nothing.

Forward never modifies the logits, in place or not.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from bpo_megatron.ops.shards import combine_shards, group_rank_size, valid_columns

# Columns per block. A bf16 block of 4096 is 8 KiB: 16 values per thread at 8 warps, enough loads
# in flight per program to keep HBM busy. Fixed rather than autotuned: autotuning re-runs a
# kernel, and the backward may be overwriting its own input.
BLOCK = 4096
NUM_WARPS = 8
# Forward programs to aim for: with fewer rows than this, a row's columns are split over several
# programs so that every SM has work (an H100 has 132).
FORWARD_PROGRAMS = 1024


@triton.jit
def _row_stats_kernel(x_ptr, x_stride, max_ptr, sum_ptr, dot_ptr, valid, span, splits, inv_t,
                      BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    # one program: columns [split·span, min((split + 1)·span, valid)) of one row; span is a
    # multiple of BLOCK and every split starts below `valid`, so the first block is never empty
    row = tl.program_id(0).to(tl.int64)  # row · stride passes 2^31 at 16k rows x 152k columns
    split = tl.program_id(1)
    lo = split * span
    hi = tl.minimum(lo + span, valid)
    base = x_ptr + row * x_stride
    cols = lo + tl.arange(0, BLOCK)
    mask = cols < hi
    z = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
    m = tl.max(z, axis=0)
    e = tl.exp(z - m)  # masked lanes: exp(−inf) = 0
    s = tl.sum(e, axis=0)
    if WITH_ENTROPY:
        d = tl.sum(e * tl.where(mask, z - m, 0.0), axis=0)  # where: 0 · −inf would be NaN
    for start in range(lo + BLOCK, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hi
        z = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        if WITH_ENTROPY:
            # Σ e^(z−m)(z−m) measured against the new max: α(d + (m − m_new)·s)
            d = alpha * (d + (m - m_new) * s) + tl.sum(e * tl.where(mask, z - m_new, 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    out = row * splits + split
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, s)
    if WITH_ENTROPY:
        tl.store(dot_ptr + out, d)


@triton.jit
def _grad_kernel(x_ptr, x_stride, grad_ptr, grad_stride, lse_ptr, g_ptr, target_ptr, valid, shard,
                 inv_t, BLOCK: tl.constexpr):
    # one program: BLOCK columns of one row; x and grad may be the same buffer, each element is
    # read before it is written by the same program
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_shard = cols < shard
    g = tl.load(g_ptr + row)  # incoming gradient / T
    out = grad_ptr + row * grad_stride + cols
    if g == 0.0:
        tl.store(out, tl.zeros([BLOCK], dtype=tl.float32).to(grad_ptr.dtype.element_ty), mask=in_shard)
    else:
        real = cols < valid  # padding columns are not tokens: zero gradient
        x = tl.load(x_ptr + row * x_stride + cols, mask=real, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        target = tl.load(target_ptr + row)  # local column of the target, −1 on other ranks
        p = tl.exp(x * inv_t - lse)
        grad = g * (tl.where(cols == target, 1.0, 0.0) - p)
        grad = tl.where(real, grad, 0.0)
        tl.store(out, grad.to(grad_ptr.dtype.element_ty), mask=in_shard)


def _row_stats(flat: torch.Tensor, valid: int, inv_t: float, with_entropy: bool, block: int,
               programs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of ``flat[:, :valid]``: max m, Σ exp(z − m), Σ exp(z − m)(z − m) (fp32)."""
    rows = flat.shape[0]
    blocks = triton.cdiv(valid, block)
    per_split = triton.cdiv(blocks, max(1, min(blocks, triton.cdiv(programs, rows))))
    splits = triton.cdiv(blocks, per_split)  # recomputed: no split is left without columns
    f32 = dict(dtype=torch.float32, device=flat.device)
    part_max, part_sum = torch.empty(rows, splits, **f32), torch.empty(rows, splits, **f32)
    part_dot = torch.empty(rows, splits, **f32) if with_entropy else part_sum
    _row_stats_kernel[(rows, splits)](
        flat, flat.stride(0), part_max, part_sum, part_dot, valid, per_split * block, splits, inv_t,
        BLOCK=block, WITH_ENTROPY=with_entropy, num_warps=NUM_WARPS)
    if splits == 1:
        return part_max[:, 0], part_sum[:, 0], part_dot[:, 0] if with_entropy else None
    # the splits of a row combine like tensor-parallel ranks: measured against the row's max
    local_max = part_max.amax(dim=-1, keepdim=True)
    shift = part_max - local_max
    weight = torch.exp(shift)
    exp_dot = (weight * (part_dot + shift * part_sum)).sum(-1) if with_entropy else None
    return local_max.squeeze(-1), (weight * part_sum).sum(-1), exp_dot


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, with_entropy, inplace, vocab_size, block, programs):
        shard = logits.shape[-1]
        rows = targets.numel()
        rank, _ = group_rank_size(group)
        valid = valid_columns(vocab_size, rank, shard)
        flat = logits.view(rows, shard) if inplace else logits.reshape(rows, shard)
        if flat.stride(-1) != 1:  # the kernels walk a row with unit stride
            flat = flat.contiguous()
        local_target = targets.reshape(rows) - rank * shard
        owned = (local_target >= 0) & (local_target < valid)
        inv_t = 1.0 / temperature

        f32 = dict(dtype=torch.float32, device=logits.device)
        if valid and rows:
            local_max, sum_exp, exp_dot = _row_stats(flat, valid, inv_t, with_entropy, block, programs)
        else:  # a shard of padding only: no mass, and a max no other rank is below
            local_max = torch.full((rows,), -math.inf, **f32)
            sum_exp = torch.zeros(rows, **f32)
            exp_dot = torch.zeros(rows, **f32) if with_entropy else None
        # the target logit is one value per row: a gather, no kernel needed
        target_logit = flat.gather(-1, torch.where(owned, local_target, 0).unsqueeze(-1)).squeeze(-1).float() * inv_t
        combined = combine_shards(local_max, sum_exp, target_logit, owned, exp_dot, group)
        logprobs = combined.logprobs.view(targets.shape)

        if ctx.needs_input_grad[0]:
            # the input itself, not a view made here: autograd forbids in-place writes to views
            # created in forward
            ctx.save_for_backward(logits, torch.where(owned, local_target, -1), combined.lse)
            ctx.meta = (inv_t, inplace, valid, block)
        if not with_entropy:
            return logprobs
        entropy = combined.entropy.view(targets.shape)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, target, lse = ctx.saved_tensors
        inv_t, inplace, valid, block = ctx.meta
        shard = logits.shape[-1]
        rows = target.shape[0]
        flat = logits.view(rows, shard) if inplace else logits.reshape(rows, shard)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        grad = flat if inplace else torch.empty((rows, shard), dtype=logits.dtype, device=logits.device)
        g = (grad_logprobs.reshape(rows).to(torch.float32) * inv_t).contiguous()
        if rows:
            _grad_kernel[(rows, triton.cdiv(shard, block))](
                flat, flat.stride(0), grad, grad.stride(0), lse, g, target, valid, shard, inv_t,
                BLOCK=block, num_warps=NUM_WARPS)
        return grad.view(logits.shape), None, None, None, None, None, None, None, None


def fused_vocab_parallel_logprobs(logits, targets, group, temperature, with_entropy, inplace, vocab_size,
                                  *, block: int = BLOCK, programs: int = FORWARD_PROGRAMS):
    """:func:`~bpo_megatron.ops.vocab_parallel_logprobs` with ``kernel="fused"``, its arguments
    already checked. ``block`` (a power of two) and ``programs`` size the launch; tests make them
    small so that a tiny vocabulary still spans several blocks and splits."""
    return _FusedLogProbs.apply(logits, targets, group, temperature, with_entropy, inplace, vocab_size,
                                block, programs)
