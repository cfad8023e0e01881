"""The model-family contract's test data and the rank functions it runs.

``tests/test_model_families.py`` runs one contract over every entry of
:data:`bpo_megatron.models.families.FAMILIES`; what a family must hold there is its entry in
:data:`CASES` below, beside its tiny config (``bpo_megatron/testing/configs/tiny_<model_type>``):
the tiny checkpoints it converts (each a variant of the tiny config, a seed and the layout it
converts at), what its description and its Megatron ``TransformerConfig`` hold, its recipe and the
parameter count of the recipe's model. The families' own tests (``tests/test_glm4_moe.py``,
``tests/test_deepseek_v3.py``) take the same checkpoints from the session's ``family_models``
fixture (``tests/conftest.py``), made once per session.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bpo_megatron.models import HFModelConfig
from bpo_megatron.testing import MODEL_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120.0

# DeepSeek-V3's YaRN at the tiny model's scale; mscale ≠ mscale_all_dim so that both the factor on cos
# and sin and the softmax scale's mscale² differ from 1
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}
# the layouts R3 training must equal one rank at (beside a family's own)
R3_LAYOUTS = {"tp2": {"tp": 2}, "ep2": {"ep": 2}, "tp2_ep2": {"tp": 2, "ep": 2}}


def tiny_config_path(model_type: str) -> Path:
    return MODEL_CONFIGS / f"tiny_{model_type}" / "config.json"


def tiny_dict(model_type: str, **overrides: Any) -> dict[str, Any]:
    """The family's tiny ``config.json`` as a dict, with ``overrides``."""
    return {**json.loads(tiny_config_path(model_type).read_text()), **overrides}


@dataclass(frozen=True)
class TinyCheckpoint:
    """A random checkpoint of the family's tiny config with ``overrides``; converted at ``layout``, its
    Megatron checkpoint must give transformers' logits there and in every layout of ``reloads``, and
    export (from ``export_layout``, the conversion's when None) bit for bit."""

    seed: int
    layout: dict[str, int]
    overrides: dict[str, Any] = field(default_factory=dict)
    reloads: tuple[dict[str, int], ...] = ()
    export_layout: dict[str, int] | None = None


@dataclass(frozen=True)
class FamilyCase:
    """What one family's contract checks. ``checkpoints``: the first is the tiny config itself (the
    engine, R3, weight-sync and planner checks run on it); ``description``: fields of its
    :class:`HFModelConfig`; ``megatron``: fields of its ``TransformerConfig`` (one rank, fp32);
    ``recipe``: ``configs/<recipe>.yaml``, the main setting on the family's released model, whose
    ``config.json`` is ``configs/models/<model>``, with ``parameters`` in transformers' count and
    ``plan`` the model line ``bpo-megatron plan`` prints; ``r3_layouts``: layouts besides
    :data:`R3_LAYOUTS`; ``sync_adjacent``: pairs of a layer's tensors a weight sync sends one after the
    other (a load group an engine fuses)."""

    checkpoints: dict[str, TinyCheckpoint]
    description: dict[str, Any]
    megatron: dict[str, Any]
    recipe: str
    model: str
    parameters: int
    plan: str
    r3_layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    sync_adjacent: tuple[tuple[str, str], ...] = ()


TP2, PP2, TP2_EP2 = {"tp": 2}, {"pp": 2}, {"tp": 2, "ep": 2}
SIGMOID_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate=0.0,  # the engine's bias never drifts in training
                      moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32", moe_layer_freq=[0, 1, 1],
                      moe_shared_expert_intermediate_size=32, moe_ffn_hidden_size=32, num_moe_experts=8)

CASES: dict[str, FamilyCase] = {
    "qwen3": FamilyCase(
        checkpoints={
            # exported at TP=1: padded to 256 rows at TP=2 as at TP=1; the tied output layer is not written
            "tied": TinyCheckpoint(12, TP2, reloads=(PP2,), export_layout={}),
            "untied": TinyCheckpoint(13, PP2, {"tie_word_embeddings": False}, export_layout={}),
            # padded to 512 rows at TP=2 but 384 at TP=1, where the export loads it
            "vocab_300": TinyCheckpoint(14, TP2, {"vocab_size": 300}, export_layout={}),
        },
        description=dict(architecture="Qwen3ForCausalLM", is_moe=False, moe_layers=(), tie_word_embeddings=True,
                         vocab_size=256, hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                         qk_norm=True, attention_bias=False, rotary_percent=1.0, multi_latent_attention=False),
        megatron=dict(qk_layernorm=True, add_qkv_bias=False, add_bias_linear=False, num_query_groups=2,
                      kv_channels=16, ffn_hidden_size=128, num_moe_experts=None, multi_latent_attention=False),
        recipe="qwen3_4b_ablation", model="qwen3_4b", parameters=4_022_468_096,
        plan="Qwen3ForCausalLM, 4.02 B parameters"),
    "qwen3_moe": FamilyCase(
        checkpoints={"tiny": TinyCheckpoint(11, PP2)},
        description=dict(architecture="Qwen3MoeForCausalLM", moe_layers=(0, 1), vocab_size=200, hidden_size=64,
                         head_dim=32, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(),
                         router_score="softmax", router_expert_bias=False, shared_expert_intermediate_size=0,
                         qk_norm=True, multi_latent_attention=False),
        megatron=dict(qk_layernorm=True, add_qkv_bias=False, num_query_groups=2, kv_channels=32,
                      ffn_hidden_size=128, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                      moe_layer_freq=[1, 1], moe_router_score_function="softmax", moe_router_pre_softmax=False,
                      moe_router_enable_expert_bias=False, moe_shared_expert_intermediate_size=None),
        recipe="qwen3_30b_a3b_bpo", model="qwen3_30b_a3b", parameters=30_532_122_624,
        plan="Qwen3MoeForCausalLM, 30.53 B parameters"),
    "glm4_moe": FamilyCase(
        checkpoints={"qk_norm": TinyCheckpoint(21, TP2_EP2, reloads=({},)),  # resharded on load (the bias too)
                     "no_qk_norm": TinyCheckpoint(22, PP2, {"use_qk_norm": False, "num_hidden_layers": 4})},
        description=dict(architecture="Glm4MoeForCausalLM", moe_layers=(1, 2), num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=32, first_k_dense_replace=1,
                         router_score="sigmoid", router_expert_bias=True, routed_scaling_factor=2.5,
                         n_group=1, topk_group=1, qk_norm=True, attention_bias=True, rotary_percent=0.5,
                         rope_theta=10000.0, multi_latent_attention=False),
        megatron=dict(SIGMOID_ROUTER, qk_layernorm=True, add_qkv_bias=True, add_bias_linear=False, kv_channels=32,
                      ffn_hidden_size=96, moe_router_topk=2, moe_router_num_groups=None, moe_router_group_topk=None,
                      multi_latent_attention=False),
        recipe="glm4_5_air_bpo", model="glm4_5_air", parameters=106_852_245_504,
        plan="Glm4MoeForCausalLM, 106.85 B parameters"),
    "deepseek_v3": FamilyCase(
        checkpoints={"q_lora": TinyCheckpoint(31, TP2_EP2, reloads=({},)),
                     # a plain query projection, as Moonlight's
                     "plain_q": TinyCheckpoint(32, PP2, {"q_lora_rank": None, "num_hidden_layers": 4},
                                               reloads=(TP2,)),
                     "yarn": TinyCheckpoint(33, TP2, {"rope_scaling": YARN})},
        description=dict(architecture="DeepseekV3ForCausalLM", moe_layers=(1, 2), num_experts=8, num_experts_per_tok=4,
                         n_group=4, topk_group=2, shared_expert_intermediate_size=32, first_k_dense_replace=1,
                         router_score="sigmoid", router_expert_bias=True, routed_scaling_factor=2.5,
                         multi_latent_attention=True, qk_norm=False, rotary_percent=1.0, q_lora_rank=32,
                         kv_lora_rank=32, qk_nope_head_dim=32, head_dim=16, v_head_dim=24, query_key_head_dim=48,
                         value_head_dim=24),
        megatron=dict(SIGMOID_ROUTER, multi_latent_attention=True, qk_layernorm=True,  # the latent norms
                      q_lora_rank=32, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=24,
                      rope_type="rope", rotary_base=10000.0, moe_router_topk=4, moe_router_num_groups=4,
                      moe_router_group_topk=2),
        recipe="moonlight_16b_a3b_bpo", model="moonlight_16b_a3b", parameters=15_960_108_544,
        plan="DeepseekV3ForCausalLM, 15.96 B parameters",
        # also under full recompute (the recipe's), where the replayed routing is used again in backward
        r3_layouts={"tp2_ep2_recompute": {"tp": 2, "ep": 2, "recompute": "full"}},
        # SGLang fuses a layer's latent down projections only when one load call brings both
        # (tests/test_weight_load_groups.py)
        sync_adjacent=(("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),)),
}

WHAT_A_FAMILY_NEEDS = (
    "the tiny config: every kind of layer the family has, at the smallest size; the FamilyCase: its tiny "
    "checkpoints with their conversion layouts, the description and TransformerConfig fields the tiny config "
    "gives, its recipe (configs/<recipe>.yaml on configs/models/<model>/config.json) and transformers' parameter "
    "count of that model")


def missing_test_data(model_type: str) -> str | None:
    """What family ``model_type`` lacks for the contract, or None."""
    lacks = [what for what, present in (("a FamilyCase entry in tests/family_kit.py CASES", model_type in CASES),
                                        (f"{tiny_config_path(model_type).relative_to(ROOT)}",
                                         tiny_config_path(model_type).is_file())) if not present]
    if not lacks:
        return None
    return (f"model family {model_type!r} is registered in bpo_megatron/models/families.py FAMILIES but its "
            f"contract has no test data: add {' and '.join(lacks)} ({WHAT_A_FAMILY_NEEDS})")


def checkpoint_config(model_type: str, name: str) -> dict[str, Any]:
    return tiny_dict(model_type, **CASES[model_type].checkpoints[name].overrides)


def main_checkpoint(model_type: str) -> str:
    return next(iter(CASES[model_type].checkpoints))


class FamilyModels:
    """Each family's tiny checkpoints and R3 reference, made on first use (held by the session fixture
    ``family_models``)."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._checkpoints: dict[tuple[str, str], tuple[Path, torch.Tensor]] = {}
        self._r3: dict[str, tuple[Path, list, dict]] = {}

    def checkpoint(self, model_type: str, name: str | None = None) -> tuple[Path, torch.Tensor]:
        """``(directory, transformers' fp32 logits on test_convert's fixed batch)``."""
        from test_convert import _save

        name = name or main_checkpoint(model_type)
        key = (model_type, name)
        if key not in self._checkpoints:
            seed = CASES[model_type].checkpoints[name].seed
            self._checkpoints[key] = _save(checkpoint_config(model_type, name),
                                           self._tmp.mktemp(f"{model_type}_{name}"), seed=seed)
        return self._checkpoints[key]

    def r3_reference(self, model_type: str, name: str | None = None) -> tuple[Path, list, dict]:
        """The embedded engine's samples of the checkpoint and the trainer on them at one rank
        (:func:`r3_rank`)."""
        from bpo_megatron.parallel.local_world import run_gloo_world

        name = name or main_checkpoint(model_type)
        if (model_type, name) not in self._r3:
            hf_dir = self.checkpoint(model_type, name)[0]
            samples = engine_samples(hf_dir)
            (result,) = run_gloo_world(r3_rank, 1, str(hf_dir), samples, {}, timeout=TIMEOUT)
            self._r3[(model_type, name)] = (hf_dir, samples, result)
        return self._r3[(model_type, name)]


# ---------------------------------------------------------------------------- engine and ranks
def engine_samples(hf_dir: Path) -> list:
    """Responses the embedded engine samples (temperature 1) with the routing it captured, as train
    samples with advantages of both signs."""
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine
    from bpo_megatron.trainer.samples import TrainSample

    engine = HFEngine(hf_dir, capture_routing=True)
    generator = torch.Generator().manual_seed(3)
    requests = [GenerationRequest(f"q{i}", tuple(torch.randint(0, 200, (length,), generator=generator).tolist()),
                                  SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=40 + i))
                for i, length in enumerate((3, 8, 5))]
    samples = engine.generate(requests)
    engine.shutdown()
    return [TrainSample(tokens=s.tokens, response_start=s.prompt_tokens.numel(), rollout_logprobs=s.rollout_logprobs,
                        advantage=(1.0 if i % 2 == 0 else -0.5) * (1 + i / 10), routed_experts=s.routed_experts)
            for i, s in enumerate(samples)]


def r3_rank(hf_dir: str, samples: list, layout: dict) -> dict | None:
    """The trainer on the engine's samples: its own free routing (teacher-forced, recorded), then
    log π with the engine's routing replayed, one R3 train step and log π after it."""
    from bpo_megatron import testing as th

    hf = HFModelConfig.load(hf_dir)
    actor = th.build_actor(hf, replay=True, weights=hf_dir, params_dtype="fp32", micro_batch_size=2, lr=1e-3,
                           **layout)
    free = actor.compute_logprobs([replace(s, routed_experts=None) for s in samples], record_routing=True)
    replayed = actor.compute_logprobs(samples)
    metrics = actor.train_step(samples)
    after = actor.compute_logprobs(samples)
    bias = [m.expert_bias.clone() for m in actor.model.modules() if getattr(m, "expert_bias", None) is not None]
    actor.close()
    if replayed is None:
        return None
    return {"free_routing": free.routed_experts, "replayed": replayed.logprobs, "metrics": metrics,
            "after": after.logprobs, "bias": bias}


def rank_parameter_counts(configs: list[dict], layout: dict) -> list[int]:
    """This rank's parameters in the Megatron model of each config.json dict of ``configs``."""
    from bpo_megatron.convert.world import build_model, tear_down
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.parallel import ParallelConfig

    counts = []
    for raw in configs:
        model = build_model(HFModelConfig.load(raw), ParallelConfig(**layout), ModelOptions(params_dtype="fp32"))
        counts.append(sum(p.numel() for p in model.parameters()))
        del model
        tear_down()
    return counts


def assert_same_step(got: dict, ref: dict) -> None:
    """A train step equal to the reference's: loss and grad norm within 1e-5 relative, log π with the
    replayed routing before and after the step within 1e-5."""
    for name in ("loss", "grad_norm"):
        assert abs(got["metrics"][name] - ref["metrics"][name]) <= 1e-5 * abs(ref["metrics"][name]), name
    for key in ("replayed", "after"):
        for a, b in zip(got[key], ref[key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def sorted_experts(routing: torch.Tensor) -> torch.Tensor:
    return routing.long().sort(dim=-1).values
