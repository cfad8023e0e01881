"""Weight fingerprints: any bit flip, a missing tensor or a stale extra one is named."""

import pytest
import torch

from bpo_megatron.weights.checksums import WeightMismatch, compare, fingerprint, fingerprints


def test_fingerprints_see_one_bit_and_the_dtype():
    t = torch.randn(4, 4)
    flipped = t.clone()
    flipped.view(torch.int32)[1, 2] ^= 1
    assert fingerprint(t) == fingerprint(t.clone())
    assert fingerprint(t) != fingerprint(flipped)
    assert fingerprint(t) != fingerprint(t.double())
    assert fingerprint(t[:, :2]) == fingerprint(t[:, :2].contiguous())


def test_compare_names_wrong_missing_and_extra_tensors():
    sent = fingerprints([("a", torch.ones(2)), ("b", torch.zeros(2))])
    compare(sent, dict(sent), engine="e0")
    with pytest.raises(WeightMismatch, match="1 tensors differ \\(e.g. a\\)"):
        compare(sent, {**sent, "a": fingerprint(torch.full((2,), 2.0))}, engine="e0")
    with pytest.raises(WeightMismatch, match="not received \\(e.g. b\\)"):
        compare(sent, {"a": sent["a"]}, engine="e0")
    with pytest.raises(WeightMismatch, match="never sent \\(e.g. c\\)"):
        compare(sent, {**sent, "c": sent["a"]}, engine="e0")
