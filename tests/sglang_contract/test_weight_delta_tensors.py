"""A whole-tensor delta (``weight_sync.delta`` over SGLang's paths) through SGLang 0.5.23's own
DeepSeek-V3 model: loading only the changed tensors after the old weights gives every parameter
the full sync of the new weights gives.

SGLang's paths take whole Hugging Face-named tensors through ``model.load_weights`` (one call per
bucket), so a delta to an SGLang engine sends the tensors whose bytes changed, each bucket's
changed tensors in one call (:func:`bpo_megatron.weight_sync.delta.encode`, ``mode="tensors"``).
DeepSeek's loader fuses a layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` only when both arrive in
one call: a delta where one of them changed sends both. The model is built as
``test_deepseek_weight_buckets.py`` builds it (its script is reused: old weights A in one call, then
the planned calls of B, every parameter and the derived ``w_kc``/``w_vc`` compared with B in one
call). As a control, the changed tensors alone, without their load group, leave exactly the layer
whose ``q_a_proj`` alone changed on its old fused projection.

Needs SGLang's environment (``bash tools/setup.sh --sglang``); skips without it.
"""

from __future__ import annotations

import json

import pytest
import torch

from bpo_megatron.models import HFModelConfig
from bpo_megatron.weight_sync.delta import HeldWeights, encode
from bpo_megatron.weights.buckets import buckets, tensor_bytes
from bpo_megatron.weights.names import hf_tensor_shapes
from test_deepseek_weight_buckets import DEEPSEEK, SGLANG_PYTHON, load_in_sglang

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="SGLang's environment is missing: bash tools/setup.sh --sglang")


def test_a_whole_tensor_delta_leaves_sglangs_deepseek_model_as_a_full_sync_does(tmp_path):
    raw = json.loads(DEEPSEEK.read_text())
    hf = HFModelConfig.load(raw)
    raw.update(moe_layer_freq=1, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})
    (tmp_path / "config.json").write_text(json.dumps(raw))

    shapes = hf_tensor_shapes(hf)
    old = {name: torch.randn(shape, generator=torch.Generator().manual_seed(3000 + i)).bfloat16()
           for i, (name, shape) in enumerate(shapes.items())}
    new = {name: tensor.clone() for name, tensor in old.items()}
    gen = torch.Generator().manual_seed(4000)
    lone = "model.layers.0.self_attn.q_a_proj.weight"  # changed without its partner kv_a_proj_with_mqa
    changed = [name for i, name in enumerate(new) if i % 3 == 0 and "kv_a_proj_with_mqa" not in name] + [lone]
    for name in changed:
        flat = new[name].view(-1)
        where = torch.randperm(flat.numel(), generator=gen)[:max(1, flat.numel() // 100)]
        flat[where] = (flat[where].float() + 0.5).bfloat16()
    weights = {"A": {n: t.float() for n, t in old.items()}, "B": {n: t.float() for n, t in new.items()}}
    torch.save(weights, tmp_path / "weights.pt")

    stream = list(new.items())
    total = sum(tensor_bytes(t) for _, t in stream)
    plans: dict[str, list] = {"delta": [], "changed alone": []}
    for size in (total // 7, total // 3, total):
        record = HeldWeights()
        record.keep(list(old.items()))
        delta = [[name for name, _ in encode(bucket, record, "tensors").tensors] for bucket in buckets(stream, size)]
        plans["delta"].append([bucket for bucket in delta if bucket])
        plans["changed alone"].append([[n for n in bucket if n in changed] for bucket in plans["delta"][-1]])
    sent = {name for plan in plans["delta"] for bucket in plan for name in bucket}
    assert sent == set(changed) | {lone.replace("q_a_proj", "kv_a_proj_with_mqa")}, "the changed tensors and the pair"
    out = load_in_sglang(tmp_path, plans)
    assert len(out["unchanged_by_a"]) < out["parameters"], "B differs from A in SGLang's parameters"
    assert out["stale"]["delta"] == [[], [], []], "every bucket size: the delta leaves nothing on A"
    assert out["stale"]["changed alone"] == [["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"]] * 3
