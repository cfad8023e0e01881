"""Routed experts cross the engine boundary in one layout: the MoE layers of the model's layer
axis, in the smallest integer type that holds the expert ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bpo_megatron.models import HFModelConfig
from bpo_megatron.models.routing import RoutingError, RoutingLayout, expert_id_dtype
from bpo_megatron.testing import MODEL_CONFIGS

FIXTURE = MODEL_CONFIGS / "tiny_qwen3_moe" / "config.json"


@pytest.fixture
def tiny_moe_config() -> dict:
    return json.loads(FIXTURE.read_text())


def test_expert_ids_take_the_smallest_integer_type():
    assert expert_id_dtype(128) == torch.uint8  # Qwen3-30B-A3B
    assert expert_id_dtype(256) == torch.uint8 and expert_id_dtype(257) == torch.int16
    assert expert_id_dtype(2**15) == torch.int16 and expert_id_dtype(2**15 + 1) == torch.int32


def test_layout_of_a_model_with_dense_layers(tiny_moe_config):
    hf = HFModelConfig.load({**tiny_moe_config, "num_hidden_layers": 4, "mlp_only_layers": [0, 2]})
    layout = RoutingLayout.of(hf)
    assert layout.moe_layers == (1, 3) and layout.num_hidden_layers == 4 and layout.dtype == torch.uint8
    # a router's top-k: distinct experts per position and layer
    full = np.argsort(np.random.default_rng(0).random((5, 4, hf.num_experts)), axis=-1)[..., :hf.num_experts_per_tok]
    full = full.astype(np.int32)
    picked = layout.select(full)
    assert picked.dtype == torch.uint8 and picked.shape == (5, 2, hf.num_experts_per_tok)
    assert torch.equal(picked.long(), torch.from_numpy(full[:, [1, 3]]).long())
    # routing already over the MoE layers passes through (converted)
    assert torch.equal(layout.select(picked.long()), picked)
    # the wire format: int32 over every layer
    assert torch.equal(layout.decode_int32(full.astype("<i4").tobytes()), picked)


def test_glm_dense_first_layers_are_cut_from_sglangs_rows():
    """GLM-4.5 (first_k_dense_replace): SGLang's int32 rows cover every layer; the dense first one
    routes nothing and is dropped, so MoE layer i of the engine is MoE layer i of the trainer."""
    hf = HFModelConfig.load({**json.loads((MODEL_CONFIGS / "tiny_glm4_moe" / "config.json").read_text()),
                             "num_hidden_layers": 4, "first_k_dense_replace": 2})
    layout = RoutingLayout.of(hf)
    assert (layout.moe_layers, layout.num_hidden_layers, layout.topk, layout.num_experts) == ((2, 3), 4, 2, 8)
    full = np.argsort(np.random.default_rng(1).random((6, 4, 8)), axis=-1)[..., :2].astype("<i4")
    assert torch.equal(layout.decode_int32(full.tobytes()).long(), torch.from_numpy(full[:, 2:]).long())


@pytest.mark.parametrize("shape, match", [((5, 3, 2), r"expected \[positions, 4 layers \(or its 2 MoE layers\), top-2\]"),
                                          ((5, 4, 3), "top-2"), ((5, 8), "shape")])
def test_routing_of_another_shape_is_refused_naming_both(tiny_moe_config, shape, match):
    layout = RoutingLayout.of(HFModelConfig.load({**tiny_moe_config, "num_hidden_layers": 4, "mlp_only_layers": [0, 2]}))
    with pytest.raises(RoutingError, match=match):
        layout.select(torch.zeros(shape, dtype=torch.int32))


def test_expert_ids_outside_the_model_are_refused():
    layout = RoutingLayout(num_hidden_layers=2, moe_layers=(0, 1), topk=2, num_experts=4)
    with pytest.raises(RoutingError, match=r"ids must lie in \[0, 4\), got \[0, 4\]; the model has 4 experts"):
        layout.select(torch.tensor([[[0, 4], [1, 2]]]))
    with pytest.raises(RoutingError, match="not a multiple of 4 x 2 layers x top-2"):
        layout.decode_int32(b"\0" * 12)


def test_a_position_naming_an_expert_twice_is_refused_on_arrival():
    """A router's top-k never repeats an expert: routing that does is refused where it enters,
    once (the trainer reads only its shape afterwards). Dense layers, which SGLang reports as
    zeros, are dropped before the check."""
    layout = RoutingLayout(num_hidden_layers=3, moe_layers=(0, 2), topk=2, num_experts=4)
    good = torch.tensor([[[0, 3], [0, 0], [2, 1]]], dtype=torch.int32)
    assert layout.select(good).tolist() == [[[0, 3], [2, 1]]]
    with pytest.raises(RoutingError, match="position 7: routed experts repeat an expert"):
        layout.select(torch.tensor([[[0, 3], [0, 0], [1, 1]]]), where="position 7")
