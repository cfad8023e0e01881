"""Load groups in weight-sync buckets: tensors an engine fuses across names and writes only when all of
them arrive in one load call never straddle a bucket boundary, whatever the bucket size.

SGLang 0.5.23's DeepSeek loader concatenates a layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` into
``fused_qkv_a_proj_with_mqa`` only when both come in the same ``load_weights`` call (each bucket is
one call); a part that arrives alone is dropped when the call ends and the layer keeps its old
weights. Its other fused parameters (``gate_up_proj``, ``qkv_proj`` of Qwen3-MoE and GLM-4.5, the
experts' ``w13``) are written shard by shard by their own loaders, so only the latent down
projections form a group. ``tests/sglang_contract/test_deepseek_weight_buckets.py`` pushes these
buckets through SGLang's own DeepSeek model.
"""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.models import HFModelConfig
from bpo_megatron.testing import MODEL_CONFIGS
from bpo_megatron.weights import export, host_staging
from bpo_megatron.weights.buckets import buckets, tensor_bytes
from bpo_megatron.weights.gather import StreamedTensor
from bpo_megatron.weights.host_staging import HostStaging
from bpo_megatron.weights.names import hf_tensor_shapes, load_group

DEEPSEEK = MODEL_CONFIGS / "tiny_deepseek_v3" / "config.json"


def _stream(hf: HFModelConfig, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """The export's tensors in its order (the order of the name map), as real CPU tensors."""
    return [(name, torch.zeros(shape, dtype=dtype)) for name, shape in hf_tensor_shapes(hf).items()]


def _boundary_sizes(stream: list[tuple[str, torch.Tensor]], align: int = 1) -> list[int]:
    """For each position i ≥ 1, the bucket size whose first bucket a greedy cut would end right
    before item i (the bytes of items 0 … i−1, each rounded up to ``align`` as host staging places
    them): every boundary of the stream, once."""
    sizes, total = [], 0
    for _, tensor in stream[:-1]:
        total += -(-tensor_bytes(tensor) // align) * align
        sizes.append(total)
    return sizes


def _check_buckets(stream, planned: list[list[str]], max_bytes: int, first_cut: int) -> None:
    nbytes = {name: tensor_bytes(tensor) for name, tensor in stream}
    order = [name for name, _ in stream]
    assert [name for bucket in planned for name in bucket] == order  # nothing dropped, moved or repeated
    where = {name: index for index, bucket in enumerate(planned) for name in bucket}
    groups: dict[tuple, set[int]] = {}
    for name in order:
        if load_group(name) is not None:
            groups.setdefault(load_group(name), set()).add(where[name])
    assert all(len(buckets_of_group) == 1 for buckets_of_group in groups.values()), groups
    for bucket in planned:
        # a bucket exceeds the size only by the later members of a load group it ends with, or is
        # a single tensor larger than the size
        joined = sum(nbytes[b] for a, b in zip(bucket, bucket[1:]) if load_group(b) is not None
                     and load_group(b) == load_group(a))
        assert sum(nbytes[n] for n in bucket) - joined <= max_bytes or len(bucket) == 1
    # the first cut lands where the greedy one would, unless that splits a group: then after it
    cut = first_cut
    while cut < len(order) and load_group(order[cut]) is not None \
            and load_group(order[cut]) == load_group(order[cut - 1]):
        cut += 1
    assert len(planned[0]) == cut


def test_the_latent_down_projections_of_a_layer_are_neighbours_in_the_export() -> None:
    hf = HFModelConfig.load(DEEPSEEK)
    names = list(hf_tensor_shapes(hf))
    for layer in range(hf.num_hidden_layers):
        q_a = names.index(f"model.layers.{layer}.self_attn.q_a_proj.weight")
        assert names[q_a + 1] == f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"
        assert load_group(names[q_a]) == load_group(names[q_a + 1]) == ("latent_down", layer, -1)
    # the rest of the model forms no group
    grouped = [name for name in names if load_group(name) is not None]
    assert len(grouped) == 2 * hf.num_hidden_layers
    # a module's FP8 scales belong to its group, other modules of the layer do not
    assert load_group("model.layers.2.self_attn.kv_a_proj_with_mqa.weight_scale_inv") == ("latent_down", 2, -1)
    assert load_group("model.layers.2.self_attn.q_b_proj.weight") is None
    assert load_group("model.layers.2.self_attn.kv_a_layernorm.weight") is None


@pytest.mark.parametrize("staging", [False, True], ids=["buckets", "host_staging"])
def test_no_bucket_size_splits_a_layers_latent_down_projections(staging: bool) -> None:
    """Every boundary position of the tiny DeepSeek-V3's export (with ``q_lora_rank``), bf16: the
    pair of each layer shares a bucket, every other cut is the greedy one, and the size is kept
    but for the group's second member. Host staging (CPU tensors pass through it; it places each
    tensor at a multiple of 256 bytes) cuts alike."""
    stream = _stream(HFModelConfig.load(DEEPSEEK))
    kv_a = {i for i, (name, _) in enumerate(stream) if "kv_a_proj_with_mqa" in name}
    sizes = _boundary_sizes(stream, align=host_staging._ALIGN if staging else 1)
    assert len(sizes) == len(stream) - 1 and kv_a <= set(range(1, len(stream)))  # the sweep cuts inside each pair
    for first_cut, max_bytes in enumerate(sizes, start=1):
        made = HostStaging().buckets(stream, max_bytes) if staging else buckets(stream, max_bytes)
        planned = [[name for name, _ in bucket] for bucket in made]
        _check_buckets(stream, planned, max_bytes, first_cut)


def test_the_trainers_export_keeps_the_pairs_together(monkeypatch) -> None:
    """``export_weights`` (rank 0's buckets, in place or staged in host memory) over the tiny
    DeepSeek-V3's stream: a bucket that would end between ``q_a_proj`` and ``kv_a_proj_with_mqa``
    takes the second too."""
    stream = _stream(HFModelConfig.load(DEEPSEEK))
    monkeypatch.setattr(export, "weight_stream", lambda model, hf, **_: iter(
        [StreamedTensor(name, tuple(t.shape), t.dtype, t) for name, t in stream]))
    kv_a = next(i for i, (name, _) in enumerate(stream) if "kv_a_proj_with_mqa" in name)
    for host in (False, True):
        # a greedy cut would fall inside the pair
        max_bytes = _boundary_sizes(stream, align=host_staging._ALIGN if host else 1)[kv_a - 1]
        planned = [[name for name, _ in bucket] for bucket in export.export_weights(None, None, max_bytes, host=host)]
        assert planned[0][-2:] == [stream[kv_a - 1][0], stream[kv_a][0]]
        _check_buckets(stream, planned, max_bytes, kv_a)


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_glm4_moe", "tiny_qwen3"])
def test_families_whose_engines_load_shard_by_shard_are_cut_greedily(family: str) -> None:
    """Qwen3(-MoE) and GLM-4.5 form no load group: their buckets are the plain greedy ones."""
    stream = _stream(HFModelConfig.load(MODEL_CONFIGS / family / "config.json"))
    assert all(load_group(name) is None for name, _ in stream)
    for first_cut, max_bytes in enumerate(_boundary_sizes(stream), start=1):
        planned = [[name for name, _ in bucket] for bucket in buckets(stream, max_bytes)]
        assert len(planned[0]) == first_cut


def test_a_deepseek_model_without_a_query_latent_is_cut_greedily() -> None:
    """Moonlight's layout (no ``q_lora_rank``): ``kv_a_proj_with_mqa`` is alone in its group, and
    the query projection before it is no member, so every boundary stays where a greedy cut puts it."""
    import json

    raw = json.loads(DEEPSEEK.read_text())
    raw["q_lora_rank"] = None
    stream = _stream(HFModelConfig.load(raw))
    for first_cut, max_bytes in enumerate(_boundary_sizes(stream), start=1):
        planned = [[name for name, _ in bucket] for bucket in buckets(stream, max_bytes)]
        assert len(planned[0]) == first_cut
