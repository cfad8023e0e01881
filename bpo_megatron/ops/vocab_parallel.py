"""Log-probabilities (and entropy) of target tokens from vocabulary-parallel logits.

Each tensor-parallel rank holds a contiguous slice ``[rank·V/TP, (rank+1)·V/TP)`` of the
vocabulary (Megatron-Core's layout). With z = logits / T:

    log π(y) = z_y − lse,   lse = M + log Σ_v exp(z_v − M)
    H        = lse − Σ_v π(v) z_v

One pass over the logits, in row chunks that stay in cache, computes per rank the local max m,
Σ exp(z − m), the target logit (on the owning rank) and Σ exp(z − m)(z − m) for the entropy.
Two small collectives of [N] vectors combine them (a MAX for M, one SUM for everything else,
rescaled by exp(m − M)). The full vocabulary is never gathered.

Backward is ``∂ log π(y)/∂z_v = (1[v = y] − π(v)) / T`` times the incoming gradient, computed
chunk by chunk. Memory: with ``inplace=False`` the logits are left untouched and the only large
allocation is the gradient itself; with ``inplace=True`` the caller gives up the logits buffer
(fp32 logits then hold exp(z − m) after forward, and every dtype receives the gradient in place),
so nothing of logits size is allocated at all.

On CUDA with triton installed the same quantities come from the fused kernels of
``fused_logprobs.py`` (one read of the logits forward, one read and one write backward);
``kernel=`` forces either path. Both combine ranks through ``shards.combine_shards``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.ops.shards import combine_shards, group_rank_size, valid_columns

# Rows per pass are chosen so one fp32 temporary is about this large. On a CPU: big enough to
# amortise per-op overhead, small enough to stay in cache. On a GPU no pass fits in cache anyway,
# and each pass launches a few kernels: small passes leave it waiting on launches (4 MiB passes
# ran 10-16x slower than Megatron's unchunked cross entropy on an H100), so a pass is made large
# enough that launches cost nothing next to the memory traffic, still far below the logits' size.
_CHUNK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def default_chunk_rows(vocab_shard: int, device: torch.device) -> int:
    chunk_bytes = _CHUNK_BYTES.get(device.type, _CHUNK_BYTES["cuda"])
    return max(1, chunk_bytes // (4 * max(vocab_shard, 1)))


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, chunk_rows, with_entropy, inplace, vocab_size):
        vocab_shard = logits.shape[-1]
        rows = targets.numel()
        rank, _ = group_rank_size(group)
        # Columns past the real vocabulary (Megatron pads it to a multiple of 128·TP) are not
        # tokens: they are left out of the softmax and get no gradient.
        valid = valid_columns(vocab_size, rank, vocab_shard)
        flat = logits.view(rows, vocab_shard) if inplace else logits.reshape(rows, vocab_shard)
        local_target = targets.reshape(rows) - rank * vocab_shard
        owned = (local_target >= 0) & (local_target < vocab_shard)
        target_index = torch.where(owned, local_target, 0).unsqueeze(-1)
        inv_t = 1.0 / temperature
        # exp(z − m) is kept in the caller's fp32 buffer only when the caller gave it up and a
        # backward will read it; otherwise every chunk works on a scratch copy.
        store_exp = inplace and logits.dtype == torch.float32 and ctx.needs_input_grad[0]

        f32 = dict(dtype=torch.float32, device=logits.device)
        local_max = torch.empty(rows, **f32)
        sum_exp = torch.empty(rows, **f32)
        target_logit = torch.empty(rows, **f32)
        exp_dot = torch.zeros(rows, **f32) if with_entropy else None
        # chunk-sized fp32 scratch, allocated once: fresh large buffers cost page faults per chunk
        scratch_shape = (min(chunk_rows, rows), valid)
        z_scratch = None if store_exp else torch.empty(scratch_shape, **f32)
        exp_scratch = torch.empty(scratch_shape, **f32) if with_entropy else None
        if valid == 0:  # a shard of padding only: no mass, and a max no other rank is below
            local_max.fill_(-math.inf)
            sum_exp.zero_()
            target_logit.zero_()
        for start in range(0, rows if valid else 0, chunk_rows):
            stop = min(start + chunk_rows, rows)
            chunk = flat[start:stop, :valid]
            if store_exp:
                z = chunk.mul_(inv_t) if temperature != 1.0 else chunk
                m = z.amax(dim=-1)
                target_logit[start:stop] = z.gather(-1, target_index[start:stop]).squeeze(-1)
                z.sub_(m.unsqueeze(-1))
            else:
                # max and target come from the caller's logits (max and 1/T commute as T > 0);
                # fp32 logits are read once into the scratch z − m, lower precisions are upcast
                # first, which is faster than a mixed-dtype subtraction
                raw_max = chunk.amax(dim=-1).float()
                m = raw_max * inv_t
                target = chunk.gather(-1, target_index[start:stop]).squeeze(-1)
                target_logit[start:stop] = target.float() * inv_t
                z = z_scratch[: stop - start]
                if chunk.dtype == torch.float32:
                    torch.sub(chunk, raw_max.unsqueeze(-1), out=z)
                else:
                    z.copy_(chunk).sub_(raw_max.unsqueeze(-1))
                if temperature != 1.0:
                    z.mul_(inv_t)
            local_max[start:stop] = m
            if with_entropy:
                e = torch.exp(z, out=exp_scratch[: stop - start])
                exp_dot[start:stop] = torch.linalg.vecdot(e, z)
                z.copy_(e) if store_exp else None
                sum_exp[start:stop] = e.sum(dim=-1)
            else:
                sum_exp[start:stop] = z.exp_().sum(dim=-1)

        combined = combine_shards(local_max, sum_exp, target_logit, owned, exp_dot, group)
        logprobs = combined.logprobs.view(targets.shape)

        if ctx.needs_input_grad[0]:
            # store_exp: π(v) = buffer · exp(m − M) / S;  otherwise π(v) = exp(z/T − lse).
            row_term = combined.scale / combined.total_exp if store_exp else combined.lse
            # Save the input itself, not a view made here: autograd forbids in-place writes to
            # views created in forward.
            ctx.save_for_backward(logits, target_index, owned, row_term)
            ctx.meta = (logits.shape, inv_t, chunk_rows, store_exp, inplace, valid)
        if not with_entropy:
            return logprobs
        entropy = combined.entropy.view(targets.shape)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, target_index, owned, row_term = ctx.saved_tensors
        shape, inv_t, chunk_rows, store_exp, inplace, valid = ctx.meta
        rows = target_index.shape[0]
        flat = logits.view(rows, shape[-1]) if inplace else logits.reshape(rows, shape[-1])
        g = grad_logprobs.reshape(rows).to(torch.float32) * inv_t
        grad = flat if inplace else torch.empty_like(flat)
        fp32_grad = grad.dtype == torch.float32
        scratch_shape = (min(chunk_rows, rows), valid)
        scratch = None if fp32_grad else torch.empty(scratch_shape, dtype=torch.float32, device=grad.device)
        target_grad = torch.where(owned, g, 0.0).unsqueeze(-1)
        for start in range(0, rows if valid else 0, chunk_rows):
            stop = min(start + chunk_rows, rows)
            g_rows = g[start:stop].unsqueeze(-1)
            if store_exp:
                # the buffer holds exp(z − m): the gradient is computed where it lies
                work = grad[start:stop, :valid]
                work.mul_(-g_rows * row_term[start:stop].unsqueeze(-1))
            else:
                # π(v) = exp(z/T − lse): an fp32 gradient is computed where it will lie, other
                # dtypes in an fp32 scratch chunk copied back below
                logits_rows = flat[start:stop, :valid]
                lse_rows = row_term[start:stop].unsqueeze(-1)
                if fp32_grad:
                    work = grad[start:stop, :valid]
                    if inv_t != 1.0:
                        torch.mul(logits_rows, inv_t, out=work).sub_(lse_rows)
                    else:
                        torch.sub(logits_rows, lse_rows, out=work)
                else:
                    work = scratch[: stop - start].copy_(logits_rows)
                    if inv_t != 1.0:
                        work.mul_(inv_t)
                    work.sub_(lse_rows)
                work.exp_().mul_(-g_rows)
            work.scatter_add_(-1, target_index[start:stop], target_grad[start:stop])
            if work.data_ptr() != grad[start:stop].data_ptr():
                grad[start:stop, :valid].copy_(work)
        if valid < grad.shape[-1]:
            grad[:, valid:] = 0
        return grad.view(shape), None, None, None, None, None, None, None


Kernel = Literal["auto", "fused", "chunked"]
KERNELS: tuple[Kernel, ...] = ("auto", "fused", "chunked")


def _use_fused(kernel: Kernel, device: torch.device) -> bool:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    runs = platform.runs_triton(device)
    if kernel == "fused" and not runs:
        raise ValueError(
            f"kernel='fused' needs logits on a CUDA device and triton installed; the logits are on "
            f"{device.type} and triton is {'' if platform.has_triton() else 'not '}installed "
            f"(kernel='chunked' or 'auto' runs anywhere)")
    return kernel == "fused" or (kernel == "auto" and runs)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    inplace: bool = False,
    vocab_size: int | None = None,
    kernel: Kernel = "auto",
    targets_checked: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log π(targets) from this rank's vocabulary shard of the logits.

    Args:
        logits: ``[..., V/TP]`` this rank's contiguous vocabulary slice (any float dtype).
        targets: ``[...]`` token ids in the full vocabulary ``[0, V)``.
        tp_group: the tensor-parallel group the vocabulary is split over; None when ``logits``
            hold the whole vocabulary.
        temperature: logits are divided by it first (use the sampling temperature, so π and the
            rollout engine's μ are the same distribution).
        chunk_size: rows (tokens) per pass; None sizes a pass at about 4 MiB of fp32 scratch on
            a CPU and 256 MiB on a GPU.
        with_entropy: also return the entropy of π per position (not differentiable; logging).
        inplace: the caller gives up ``logits``: fp32 logits are overwritten in forward, and the
            gradient is written into the logits buffer in backward. Saves a logits-sized buffer.
        vocab_size: the real vocabulary size when the logits carry padding columns (Megatron pads
            the vocabulary to a multiple of 128·TP); padding never enters the softmax. None: every
            column is a token.
        kernel: ``"fused"``: triton kernels that read the logits once forward and once backward
            (CUDA logits and triton needed; ``chunk_size`` does not apply); ``"chunked"``: the
            PyTorch passes above, on any device; ``"auto"``: fused where it can run, else chunked.
        targets_checked: the caller checked that the ids lie in ``[0, vocab_size)`` where it built
            them (the trainer: ``trainer.samples.check_samples``, on the host), so they are not read
            again here (reading device targets waits for the device, twice a call).

    Returns:
        fp32 log-probs shaped like ``targets`` (and the entropy when ``with_entropy``).
    """
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if inplace and not logits.is_contiguous():
        raise ValueError("inplace=True needs contiguous logits (a copy would defeat its purpose)")
    _, world = group_rank_size(tp_group)
    padded_vocab = logits.shape[-1] * world
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded_vocab}] (shard x TP)")
    vocab = vocab_size or padded_vocab
    if not targets_checked and targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(
            f"targets must lie in [0, {vocab}) (vocab shard {logits.shape[-1]} x TP {world}"
            f"{'' if vocab_size is None else f', real vocabulary {vocab_size}'}), "
            f"got range [{int(targets.min())}, {int(targets.max())}]"
        )
    if _use_fused(kernel, logits.device):
        from bpo_megatron.ops.fused_logprobs import fused_vocab_parallel_logprobs

        return fused_vocab_parallel_logprobs(
            logits, targets, tp_group, float(temperature), with_entropy, inplace, vocab_size)
    chunk_rows = chunk_size or default_chunk_rows(logits.shape[-1], logits.device)
    return _VocabParallelLogProbs.apply(
        logits, targets, tp_group, float(temperature), chunk_rows, with_entropy, inplace, vocab_size
    )
