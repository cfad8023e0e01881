"""The multi-token-prediction layer this project carries and exports is what SGLang 0.5.23's speculative
decoding reads, and a weight sync leaves it alone.

A tiny random DeepSeek-V3 with its MTP layer (:func:`~bpo_megatron.testing.models.random_checkpoint_with_mtp`,
laid out as a checkpoint this project exports: ``tests/test_mtp_layers.py`` shows the export equal to it
bit for bit) is loaded by SGLang's own models on CPU, over a one-rank gloo group: its NEXTN/EAGLE draft model
``DeepseekV3ForCausalLMNextN`` (``models/deepseek_nextn.py``) takes every parameter from the MTP layer's
tensors (the decoder layer's fused as SGLang fuses them: ``fused_qkv_a_proj_with_mqa``, the experts'
``w13``/``w2``, the shared expert's ``gate_up_proj``); the target model ``DeepseekV3ForCausalLM`` ends the
same with or without the MTP tensors in the call; and the draft, given what a weight sync sends (the main
model's tensors, new values), keeps every parameter, while new values of the MTP layer's own tensors change
every one (the control). The stub of ``vllm._custom_ops`` is the one
``sglang_cpu.py`` explains. Needs SGLang's environment (``bash tools/setup.sh --sglang``);
skips without it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bpo_megatron.platform import free_port
from bpo_megatron.testing.models import deepseek_v3_config, random_checkpoint_with_mtp
from sglang_cpu import ONE_RANK_CPU

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="SGLang's environment is missing: bash tools/setup.sh --sglang")

LOAD_DRAFT_AND_TARGET = ONE_RANK_CPU + r"""
from pathlib import Path
from safetensors.torch import load_file

config_dir, weights_dir, out_file = model_dir, sys.argv[2], sys.argv[3]
from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

config = AutoConfig.from_pretrained(config_dir)
weights = {}
for file in sorted(Path(weights_dir).glob("*.safetensors")):
    weights.update(load_file(str(file)))
first = config.num_hidden_layers
mtp = f"model.layers.{first}."
main = [name for name in weights if not name.startswith(mtp)]


def state(model):
    # bytes, so that never-written padding (vocabulary rows) compares equal even when it holds NaN
    return {name: p.detach().contiguous().view(torch.uint8).clone() for name, p in model.named_parameters()}


def load(model, names, values=None):
    model.load_weights([(name, (values or weights)[name].clone()) for name in names])


torch.manual_seed(0)
draft = DeepseekV3ForCausalLMNextN(config)
load(draft, list(weights))
params = dict(draft.named_parameters())


def w(name):
    return weights[mtp + name]


experts = range(config.n_routed_experts)
expected = {
    "model.enorm.weight": w("enorm.weight"), "model.hnorm.weight": w("hnorm.weight"),
    "model.eh_proj.weight": w("eh_proj.weight"), "model.shared_head.norm.weight": w("shared_head.norm.weight"),
    "model.decoder.input_layernorm.weight": w("input_layernorm.weight"),
    "model.decoder.post_attention_layernorm.weight": w("post_attention_layernorm.weight"),
    "model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight":
        torch.cat([w("self_attn.q_a_proj.weight"), w("self_attn.kv_a_proj_with_mqa.weight")]),
    "model.decoder.self_attn.q_a_layernorm.weight": w("self_attn.q_a_layernorm.weight"),
    "model.decoder.self_attn.q_b_proj.weight": w("self_attn.q_b_proj.weight"),
    "model.decoder.self_attn.kv_a_layernorm.weight": w("self_attn.kv_a_layernorm.weight"),
    "model.decoder.self_attn.kv_b_proj.weight": w("self_attn.kv_b_proj.weight"),
    "model.decoder.self_attn.o_proj.weight": w("self_attn.o_proj.weight"),
    "model.decoder.mlp.gate.weight": w("mlp.gate.weight"),
    "model.decoder.mlp.gate.e_score_correction_bias": w("mlp.gate.e_score_correction_bias"),
    "model.decoder.mlp.experts.w13_weight": torch.stack(
        [torch.cat([w(f"mlp.experts.{e}.gate_proj.weight"), w(f"mlp.experts.{e}.up_proj.weight")]) for e in experts]),
    "model.decoder.mlp.experts.w2_weight": torch.stack([w(f"mlp.experts.{e}.down_proj.weight") for e in experts]),
    "model.decoder.mlp.shared_experts.gate_up_proj.weight":
        torch.cat([w("mlp.shared_experts.gate_proj.weight"), w("mlp.shared_experts.up_proj.weight")]),
    "model.decoder.mlp.shared_experts.down_proj.weight": w("mlp.shared_experts.down_proj.weight"),
}
# the embedding and output head are the target model's in a served draft (set_embed_and_head)
draft_parameters = sorted(set(params) - {"model.embed_tokens.weight", "lm_head.weight"})
differing = sorted(name for name, value in expected.items()
                   if name not in params or not torch.equal(params[name].detach(), value.to(params[name].dtype)))

# a weight sync: the main model's tensors with new values reach the draft runner too
loaded = state(draft)
generator = torch.Generator().manual_seed(7)
synced = {name: torch.randn(weights[name].shape, generator=generator).to(weights[name].dtype) for name in main}
load(draft, main, synced)
changed_by_sync = sorted(name for name, value in state(draft).items() if not torch.equal(value, loaded[name]))
# the control: the MTP layer's tensors with new values change every parameter of the draft's own
redrawn = {name: torch.randn(t.shape, generator=generator).to(t.dtype) for name, t in weights.items()
           if name.startswith(mtp)}
load(draft, list(redrawn), redrawn)
changed_by_mtp_values = sorted(name for name, value in state(draft).items() if not torch.equal(value, loaded[name]))

torch.manual_seed(0)
target = DeepseekV3ForCausalLM(config)
load(target, main)
main_only = state(target)
load(target, list(weights))
changed_by_mtp = sorted(name for name, value in state(target).items() if not torch.equal(value, main_only[name]))

json.dump({"draft_parameters": draft_parameters, "checked": sorted(expected), "differing": differing,
           "changed_by_sync": changed_by_sync, "changed_by_mtp_values": changed_by_mtp_values,
           "changed_by_mtp": changed_by_mtp}, open(out_file, "w"))
"""


def test_sglang_draft_model_reads_the_carried_mtp_layer_and_a_weight_sync_leaves_it(tmp_path):
    config = deepseek_v3_config(num_nextn_predict_layers=1)
    hf_dir = random_checkpoint_with_mtp(config, tmp_path / "hf", seed=11, repeat_head=True)
    # what SGLang's DeepSeek model reads beyond the fixture (test_deepseek_weight_buckets.py): the MoE layer
    # frequency and YaRN (the rotary embedding SGLang builds on CPU); neither changes a weight
    served = {**config, "moe_layer_freq": 1,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}}
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "config.json").write_text(json.dumps(served))

    done = subprocess.run([str(SGLANG_PYTHON), "-c", LOAD_DRAFT_AND_TARGET, str(tmp_path / "served"), str(hf_dir),
                           str(tmp_path / "out.json"), str(free_port())],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["checked"] == out["draft_parameters"]  # every parameter of the draft's own is checked
    assert out["differing"] == []
    assert out["changed_by_sync"] == []
    assert out["changed_by_mtp_values"] == out["draft_parameters"]  # the control: a change would show
    assert out["changed_by_mtp"] == []
