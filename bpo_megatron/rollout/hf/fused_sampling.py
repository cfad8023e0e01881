"""Triton kernels of the embedded engine's sampler (:mod:`sampling`) on 16-bit logits: the same
draw as :func:`~bpo_megatron.rollout.hf.sampling.draw` — fp32 logits / temperature, log μ the
log-softmax of the sampled token, top-k then top-p on the renormalised top-k distribution, the
inverse CDF of one uniform per row (in vocabulary order unfiltered, in descending-probability order,
ties by index, when the batch is filtered) — reading the bf16 logits in place of an fp32 copy, a
log-softmax, a cumulative sum and (filtered) a sort of the whole vocabulary.

One program per row, no host read, static shapes (a CUDA graph captures them):

* unfiltered: one pass keeps each block's max and Σ exp(z − max); the blocks' sums, rescaled to the
  row's max, locate the uniform's block, which is read once more to find the token;
* filtered: a first pass gives the row's max, Σ exp(z − max) and the range of its logits' bit
  patterns; a second counts every token into a histogram over the 16-bit patterns (a row's
  ``scratch`` row, integer atomics: the same counts whatever the order). Equal bit patterns have
  equal probabilities, so the histogram *is* the sorted distribution: walking it from the largest
  logit down gives every prefix's count and mass, hence the top-k cut, the top-p cut and the
  uniform's place without sorting anything. The token itself is the r-th (by index) of the tie
  group the uniform falls in, found by a third pass that stops there; the histogram is zeroed again
  on the way out (the scratch is all zeros between calls).

"Same draw" up to floating-point order: each token's probability is the fp32 ``exp`` of its fp32
log-probability, as in torch, but the kernels sum them in another order (blocks, a parallel
cumulative sum) and in fp64 — a cumulative fp32 sum of thousands of similar terms drifts by ~1e-5 of
the total, wider than a rare token's share — so a prefix's mass differs from torch's in its last
bits; a token differs from the torch sampler's only where the uniform's target lies that close to a
boundary between two tokens (or a top-p threshold that close to a prefix's mass), and is then one
of the two tokens that boundary separates. Ties are broken by index in both (the torch sampler sorts
stably).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # logits per load: 4 KiB of bf16
CHUNK = 1024  # histogram bins walked at a time
NUM_WARPS = 8
CODES = 1 << 16  # 16-bit logits: bit patterns per row of the filtered draw's scratch
BIG = tl.constexpr(1 << 30)  # beyond any token id or bit pattern


@triton.jit
def _key(bits):
    """Ordered key of a 16-bit float's bit pattern (int32 in [0, 65535]): keys sort as the values do."""
    return tl.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)


@triton.jit
def _bits(key):
    return tl.where(key >= 0x8000, key - 0x8000, 0xFFFF - key)


@triton.jit
def _load_z(base, cols, mask, temperature):
    """z = fp32 logit / temperature (torch's division, rounded to nearest); −inf past the row."""
    raw = tl.load(base + cols, mask=mask, other=0.0)
    return tl.where(mask, tl.math.div_rn(raw.to(tl.float32), temperature), -float("inf"))


@triton.jit
def _load_row(base, cols, mask, temperature):
    """:func:`_load_z` and the 16-bit logit's ordered key (−1 past the row)."""
    raw = tl.load(base + cols, mask=mask, other=0.0)
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    z = tl.math.div_rn(raw.to(tl.float32), temperature)
    return tl.where(mask, z, -float("inf")), tl.where(mask, _key(bits), -1)


@triton.jit
def _logprob_of_key(key, temperature, row_max, log_sum, DTYPE: tl.constexpr):
    """log-softmax of the logit whose ordered key is ``key``: the same operations, in the same
    order, as for a loaded logit, so equal keys give equal log-probabilities bit for bit."""
    value = _bits(key).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    return (tl.math.div_rn(value, temperature) - row_max) - log_sum


@triton.jit
def _just_below(total):
    """The largest fp64 below a positive ``total`` (torch.nextafter(total, 0))."""
    return (total.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True)


@triton.jit
def _pick(vector, lanes, index):
    return tl.sum(tl.where(lanes == index, vector, 0), axis=0)


@triton.jit
def _plain_kernel(logits_ptr, stride, vocab, temperature_ptr, uniform_ptr, token_ptr, logprob_ptr,
                  BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    temperature = tl.load(temperature_ptr + row)
    uniform = tl.load(uniform_ptr + row)
    lanes = tl.arange(0, BLOCK)
    blocks = tl.arange(0, BLOCKS)
    block_max = tl.full([BLOCKS], -float("inf"), tl.float32)
    block_sum = tl.zeros([BLOCKS], tl.float64)
    for b in range(0, tl.cdiv(vocab, BLOCK)):  # the one pass over the row
        cols = b * BLOCK + lanes
        z = _load_z(base, cols, cols < vocab, temperature)
        high = tl.max(z, axis=0)
        block_max = tl.where(blocks == b, high, block_max)
        block_sum = tl.where(blocks == b, tl.sum(tl.exp(z - high).to(tl.float64), axis=0), block_sum)
    row_max = tl.max(block_max, axis=0)
    # Σ exp(z − row_max) of each block (a block's terms rescaled by one factor: their fp32 values
    # would be rescaled one by one, so the sums differ in the last bits)
    weight = tl.where(block_sum > 0, block_sum * tl.exp(block_max - row_max).to(tl.float64), 0.0)
    total = tl.sum(weight, axis=0)
    target = tl.minimum(uniform.to(tl.float64) * total, _just_below(total))  # strictly below the total, as torch's
    through = tl.cumsum(weight, axis=0)
    chosen = tl.min(tl.where((through > target) & (weight > 0), blocks, BLOCKS), axis=0)
    last = tl.max(tl.where(weight > 0, blocks, -1), axis=0)
    chosen = tl.where(chosen < BLOCKS, chosen, last)  # a target past the blocks' sum by rounding
    before = tl.sum(tl.where(blocks == chosen - 1, through, 0.0), axis=0)
    cols = chosen * BLOCK + lanes
    mask = cols < vocab
    z = _load_z(base, cols, mask, temperature)
    mass = tl.where(mask, tl.exp(z - row_max), 0.0)
    cdf = before + tl.cumsum(mass.to(tl.float64), axis=0)
    hit = tl.min(tl.where((cdf > target) & (mass > 0), lanes, BLOCK), axis=0)
    hit = tl.where(hit < BLOCK, hit, tl.max(tl.where(mass > 0, lanes, -1), axis=0))
    tl.store(token_ptr + row, (chosen * BLOCK + hit).to(tl.int64))
    tl.store(logprob_ptr + row, (_pick(z, lanes, hit) - row_max) - tl.log(total).to(tl.float32))


@triton.jit
def _filtered_kernel(logits_ptr, stride, vocab, temperature_ptr, top_k_ptr, top_p_ptr, uniform_ptr,
                     counts_ptr, counts_stride, token_ptr, logprob_ptr,
                     BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    DTYPE = logits_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    counts = counts_ptr + row * counts_stride
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_k = tl.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    top_p = tl.load(top_p_ptr + row)
    uniform = tl.load(uniform_ptr + row)
    lanes = tl.arange(0, BLOCK)
    bins = tl.arange(0, CHUNK)

    # pass 1: the row's max, Σ exp(z − max) (rescaled as the max grows) and the range of its keys
    row_max = tl.full([], -float("inf"), tl.float32)
    row_sum = tl.zeros([], tl.float64)
    key_max = tl.full([], -1, tl.int32)
    key_min = tl.full([], BIG, tl.int32)
    for offset in range(0, vocab, BLOCK):
        cols = offset + lanes
        mask = cols < vocab
        z, key = _load_row(base, cols, mask, temperature)
        high = tl.maximum(row_max, tl.max(z, axis=0))
        row_sum = row_sum * tl.exp(row_max - high).to(tl.float64) + tl.sum(tl.exp(z - high).to(tl.float64), axis=0)
        row_max = high
        key_max = tl.maximum(key_max, tl.max(key, axis=0))
        key_min = tl.minimum(key_min, tl.min(tl.where(mask, key, BIG), axis=0))
    log_sum = tl.log(row_sum).to(tl.float32)  # torch's log of the sum, rounded once to fp32
    span = key_max - key_min + 1  # ordinals in use: ordinal = key_max − key, 0 the most likely

    # pass 2: how many tokens have each ordinal, and the row's total probability
    total = tl.zeros([], tl.float64)
    for offset in range(0, vocab, BLOCK):
        cols = offset + lanes
        mask = cols < vocab
        z, key = _load_row(base, cols, mask, temperature)
        # no ordering with other memory needed (the barrier below orders them before the reads): no fence an add
        tl.atomic_add(counts + (key_max - key), 1, mask=mask, sem="relaxed")
        total += tl.sum(tl.where(mask, tl.exp((z - row_max) - log_sum), 0.0).to(tl.float64), axis=0)
    tl.debug_barrier()  # the counts complete before any thread reads them

    # the top-k cut: where the count of tokens in descending order reaches k; c_k the mass of those k
    kept_mass = total
    cut = span  # the first ordinal not wholly kept (span: none)
    cut_kept = tl.zeros([], tl.int32)  # of its tokens, how many are kept
    if top_k < vocab:
        start = tl.zeros([], tl.int32)
        seen = tl.zeros([], tl.int32)
        mass_seen = tl.zeros([], tl.float64)
        while start < span:
            ordinal = start + bins
            valid = ordinal < span
            count = tl.load(counts + ordinal, mask=valid, other=0, cache_modifier=".cg")
            prob = tl.where(valid, tl.exp(_logprob_of_key(key_max - ordinal, temperature, row_max, log_sum, DTYPE)), 0.0)
            mass = count.to(tl.float64) * prob.to(tl.float64)
            count_through = seen + tl.cumsum(count, axis=0)
            mass_through = mass_seen + tl.cumsum(mass, axis=0)
            at = tl.min(tl.where(count_through >= top_k, bins, CHUNK), axis=0)
            if at < CHUNK:
                before = _pick(count_through - count, bins, at)
                kept_mass = _pick(mass_through - mass, bins, at) + (top_k - before).to(tl.float64) * _pick(prob, bins, at)
                cut = start + at
                cut_kept = top_k - before
                start = span
            else:
                seen = _pick(count_through, bins, CHUNK - 1)
                mass_seen = _pick(mass_through, bins, CHUNK - 1)
                start += CHUNK

    # the top-p cut: a token stays while the mass before it is below top_p · c_k (and it is in the top k)
    if top_p < 1.0:
        threshold = top_p.to(tl.float64) * kept_mass
        start = tl.zeros([], tl.int32)
        seen = tl.zeros([], tl.int32)
        mass_seen = tl.zeros([], tl.float64)
        k_cut = cut
        k_cut_kept = cut_kept
        cut = span
        cut_kept = tl.zeros([], tl.int32)
        kept_mass = tl.zeros([], tl.float64)
        while start < span:
            ordinal = start + bins
            valid = ordinal < span
            count = tl.load(counts + ordinal, mask=valid, other=0, cache_modifier=".cg")
            prob = tl.where(valid, tl.exp(_logprob_of_key(key_max - ordinal, temperature, row_max, log_sum, DTYPE)), 0.0)
            in_top_k = tl.where(ordinal < k_cut, count, tl.where(ordinal == k_cut, k_cut_kept, 0))
            mass = in_top_k.to(tl.float64) * prob.to(tl.float64)
            mass_through = mass_seen + tl.cumsum(mass, axis=0)
            mass_before = mass_through - mass
            # tokens j = 0, 1, … of an ordinal have mass_before + j · prob before them
            room = tl.where(prob > 0, tl.ceil((threshold - mass_before) / tl.where(prob > 0, prob, 1.0).to(tl.float64)),
                            tl.where(mass_before < threshold, in_top_k.to(tl.float64), 0.0))
            kept = tl.minimum(tl.maximum(room, 0.0), in_top_k.to(tl.float64)).to(tl.int32)
            at = tl.min(tl.where(valid & (kept < count), bins, CHUNK), axis=0)
            if at < CHUNK:
                cut = start + at
                cut_kept = _pick(kept, bins, at)
                kept_mass = _pick(mass_before, bins, at) + cut_kept.to(tl.float64) * _pick(prob, bins, at)
                start = span
            else:
                mass_seen = _pick(mass_through, bins, CHUNK - 1)
                kept_mass = mass_seen
                start += CHUNK

    # the uniform's place in the kept tokens, in descending order: an ordinal and a rank within it
    target = tl.minimum(uniform.to(tl.float64) * kept_mass, _just_below(kept_mass))
    start = tl.zeros([], tl.int32)
    mass_seen = tl.zeros([], tl.float64)
    chosen = tl.full([], -1, tl.int32)
    rank = tl.zeros([], tl.int32)
    last = tl.zeros([], tl.int32)  # the last ordinal holding kept mass, and how many of it are kept
    last_kept = tl.full([], 1, tl.int32)
    while start < span:
        ordinal = start + bins
        valid = ordinal < span
        count = tl.load(counts + ordinal, mask=valid, other=0, cache_modifier=".cg")
        prob = tl.where(valid, tl.exp(_logprob_of_key(key_max - ordinal, temperature, row_max, log_sum, DTYPE)), 0.0)
        kept = tl.where(ordinal < cut, count, tl.where(ordinal == cut, cut_kept, 0))
        mass = kept.to(tl.float64) * prob.to(tl.float64)
        mass_through = mass_seen + tl.cumsum(mass, axis=0)
        holds = (kept > 0) & (prob > 0)
        at = tl.min(tl.where(holds & (mass_through > target), bins, CHUNK), axis=0)
        latest = tl.max(tl.where(holds, bins, -1), axis=0)
        if latest >= 0:
            last = start + latest
            last_kept = _pick(kept, bins, latest)
        if at < CHUNK:
            chosen = start + at
            step = _pick(prob, bins, at)
            inside = tl.floor((target - _pick(mass_through - mass, bins, at)) / step.to(tl.float64))
            rank = tl.minimum(tl.maximum(inside, 0.0), (_pick(kept, bins, at) - 1).to(tl.float64)).to(tl.int32)
            start = span
        else:
            mass_seen = _pick(mass_through, bins, CHUNK - 1)
            start = tl.where(start + CHUNK > cut, span, start + CHUNK)
    if chosen < 0:  # the target past the kept mass by rounding: the last kept token
        chosen = last
        rank = last_kept - 1

    # its tie group: the ordinals of the same log-probability (they are contiguous), found by bisection
    log_prob = _logprob_of_key(key_max - chosen, temperature, row_max, log_sum, DTYPE)
    low = tl.zeros([], tl.int32)
    high = chosen
    while low < high:
        middle = (low + high) // 2
        if _logprob_of_key(key_max - middle, temperature, row_max, log_sum, DTYPE) == log_prob:
            high = middle
        else:
            low = middle + 1
    group_low = low
    low = chosen
    high = span - 1
    while low < high:
        middle = (low + high + 1) // 2
        if _logprob_of_key(key_max - middle, temperature, row_max, log_sum, DTYPE) == log_prob:
            low = middle
        else:
            high = middle - 1
    group_high = low
    # the rank within the group: its tokens of the ordinals before the chosen one, then the rank
    start = group_low
    while start < chosen:
        ordinal = start + bins
        count = tl.load(counts + ordinal, mask=ordinal < chosen, other=0, cache_modifier=".cg")
        rank += tl.sum(count, axis=0)
        start += CHUNK

    # pass 3 (stops at the token): the group's rank-th token in index order
    token = tl.full([], -1, tl.int32)
    seen = tl.zeros([], tl.int32)
    start = tl.zeros([], tl.int32)
    while (start < vocab) & (token < 0):
        cols = start + lanes
        mask = cols < vocab
        _, key = _load_row(base, cols, mask, temperature)
        ordinal = key_max - key
        member = (mask & (ordinal >= group_low) & (ordinal <= group_high)).to(tl.int32)
        through = seen + tl.cumsum(member, axis=0)
        token = tl.min(tl.where((member > 0) & (through == rank + 1), cols, BIG), axis=0)
        token = tl.where(token < BIG, token, -1)
        seen = _pick(through, lanes, BLOCK - 1)
        start += BLOCK
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, log_prob)

    tl.debug_barrier()  # every read of the counts is done: leave them zero for the next call
    for offset in range(0, span, CHUNK):
        ordinal = offset + bins
        tl.store(counts + ordinal, tl.zeros([CHUNK], tl.int32), mask=ordinal < span)


def plain_draw(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
               tokens: torch.Tensor, logprobs: torch.Tensor, *, block: int = BLOCK) -> None:
    rows, vocab = logits.shape
    blocks = triton.next_power_of_2(triton.cdiv(vocab, block))
    _plain_kernel[(rows,)](logits, logits.stride(0), vocab, temperature, uniforms, tokens, logprobs,
                           BLOCK=block, BLOCKS=blocks, num_warps=NUM_WARPS)


def filtered_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  uniforms: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
                  *, block: int = BLOCK, chunk: int = CHUNK) -> None:
    rows, vocab = logits.shape
    _filtered_kernel[(rows,)](logits, logits.stride(0), vocab, temperature, top_k, top_p, uniforms,
                              counts, counts.stride(0), tokens, logprobs, BLOCK=block, CHUNK=chunk,
                              num_warps=NUM_WARPS)
