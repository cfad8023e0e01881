"""RoPE over packed rows without host reads (``megatron.compat.packed_rotary_embedding``, applied to
Megatron's ``_apply_rotary_pos_emb_thd`` on every platform) against Megatron's own function: the
same values and gradients bit for bit, for segments restarting at position 0 and for frequencies
of the whole row, with no host read and an op count that does not grow with the segments."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.megatron.compat import ensure_megatron_fixes, packed_rotary_embedding


class _OneRank:
    """A context-parallel group of one rank, as Megatron's attention passes it."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _inputs(lengths: list[int], heads: int = 3, dim: int = 8, whole_row: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    t = torch.randn(total, heads, dim, generator=gen, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = total if whole_row else max(lengths)
    freqs = torch.randn(positions, 1, 1, dim, generator=gen) * 3
    return t, cu_seqlens, freqs


@pytest.mark.parametrize("lengths, whole_row", [([5, 1, 7, 3], False), ([4, 4], False), ([9], False),
                                                 ([6, 2, 5], True)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_rope_equals_megatrons_bit_for_bit(lengths, whole_row, interleaved):
    from megatron.core.models.common.embeddings import rope_utils

    ensure_megatron_fixes()
    ours = rope_utils._apply_rotary_pos_emb_thd
    megatron = ours.megatron
    t, cu_seqlens, freqs = _inputs(lengths, whole_row=whole_row)
    upstream = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (megatron, ours):
        t.grad = None
        out = fn(t, cu_seqlens, freqs, rotary_interleaved=interleaved, mscale=1.0, cp_group=_OneRank())
        (out * upstream).sum().backward()
        results.append((out.detach(), t.grad.clone()))
    (ref_out, ref_grad), (out, grad) = results
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    # segments restart at 0: the second segment's first position is rotated as position 0
    if not whole_row and len(lengths) > 1:
        start = lengths[0]
        alone = megatron(t[start:start + lengths[1]].detach(), torch.tensor([0, lengths[1]], dtype=torch.int32),
                         freqs, rotary_interleaved=interleaved, cp_group=_OneRank())
        assert torch.equal(out[start:start + lengths[1]], alone)


def test_packed_rope_reads_nothing_on_the_host_and_its_ops_do_not_grow_with_the_segments():
    from bpo_megatron.bench.ops import _count

    rotate = packed_rotary_embedding(lambda *a, **k: pytest.fail("context parallelism is not asked for"))

    def counts(lengths):
        t, cu_seqlens, freqs = _inputs(lengths)
        return _count(lambda: rotate(t, cu_seqlens, freqs, cp_group=_OneRank()).sum().backward())

    few, many = counts([8, 8]), counts([2] * 8)
    assert few["scalar_reads"] == few["data_shaped"] == few["tolist_cpu"] == 0
    assert few["ops"] == many["ops"]
    ensure_megatron_fixes()
    from megatron.core.models.common.embeddings import rope_utils

    megatron = rope_utils._apply_rotary_pos_emb_thd.megatron

    def megatron_counts(lengths):
        t, cu_seqlens, freqs = _inputs(lengths)
        return _count(lambda: megatron(t, cu_seqlens, freqs, cp_group=_OneRank()).sum().backward())

    assert megatron_counts([2] * 8)["tolist_cpu"] >= 1 and megatron_counts([2] * 8)["ops"] > many["ops"]
