"""DeepSeek-V3 weight updates through SGLang 0.5.23's own model: every bucket size the weight sync
could pick leaves no layer on its old weights.

SGLang's DeepSeek loader (``models/deepseek_common/deepseek_weight_loader.py``) concatenates a
layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj_with_mqa`` only when both
arrive in one ``load_weights`` call, and one bucket is one call
(``update_weights_from_distributed`` / ``_from_tensor``); a part that arrives alone is cached for
the rest of the call and then dropped without a word. The test builds SGLang's real
``DeepseekV3ForCausalLM`` (the tiny DeepSeek-V3 with ``q_lora_rank``, on CPU, over a one-rank gloo
group), loads weights A in one call, then weights B in the buckets the project's planner
(:func:`~bpo_megatron.weights.buckets.buckets`) cuts at every boundary position of the export, and
compares every parameter, and the ``w_kc``/``w_vc`` SGLang derives from ``kv_b_proj`` after a
call, with B loaded in one call. As a control, the same sweep cut greedily by size alone leaves
exactly the layer whose pair it splits on its old ``fused_qkv_a_proj_with_mqa``.

One thing is stubbed: the module ``vllm._custom_ops`` (``sglang_cpu.py`` says why). Everything that loads weights is SGLang's. Needs SGLang's environment
(``bash tools/setup.sh --sglang``); skips without it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from bpo_megatron.models import HFModelConfig
from bpo_megatron.platform import free_port
from bpo_megatron.testing import MODEL_CONFIGS
from bpo_megatron.weights.buckets import buckets, tensor_bytes
from bpo_megatron.weights.names import hf_tensor_shapes
from sglang_cpu import ONE_RANK_CPU

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
DEEPSEEK = MODEL_CONFIGS / "tiny_deepseek_v3" / "config.json"

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="SGLang's environment is missing: bash tools/setup.sh --sglang")

LOAD_IN_BUCKETS = ONE_RANK_CPU + r"""
weights_file, plans_file, out_file = sys.argv[2:5]
from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

torch.manual_seed(0)
model = DeepseekV3ForCausalLM(AutoConfig.from_pretrained(model_dir))
weights = torch.load(weights_file)
plans = json.load(open(plans_file))


def state():
    # bytes, so that never-written padding (vocabulary rows) compares equal even when it holds NaN
    out = {name: p.detach().contiguous().view(torch.uint8).clone() for name, p in model.named_parameters()}
    for layer, decoder in enumerate(model.model.layers):
        for derived in ("w_kc", "w_vc"):
            out[f"model.layers.{layer}.self_attn.{derived}"] = \
                getattr(decoder.self_attn, derived).contiguous().view(torch.uint8).clone()
    return out


def load(names, which):
    model.load_weights([(name, weights[which][name].clone()) for name in names])


order = list(weights["B"])
load(order, "B")
new = state()
load(order, "A")
unchanged = sorted(name for name, value in state().items() if torch.equal(value, new[name]))
stale = {}
for kind, sweep in plans.items():
    stale[kind] = []
    for plan in sweep:
        load(order, "A")
        for bucket in plan:
            load(bucket, "B")
        stale[kind].append(sorted(name for name, value in state().items() if not torch.equal(value, new[name])))
json.dump({"unchanged_by_a": unchanged, "stale": stale, "parameters": len(new)}, open(out_file, "w"))
"""


def load_in_sglang(tmp_path: Path, plans: dict[str, list]) -> dict:
    """Run :data:`LOAD_IN_BUCKETS` in SGLang's environment on the checkpoint and weights written in
    ``tmp_path``, for each plan of buckets: what it reports (``out.json``)."""
    (tmp_path / "plans.json").write_text(json.dumps(plans))
    done = subprocess.run([str(SGLANG_PYTHON), "-c", LOAD_IN_BUCKETS, str(tmp_path), str(tmp_path / "weights.pt"),
                           str(tmp_path / "plans.json"), str(tmp_path / "out.json"), str(free_port())],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp_path / "out.json").read_text())


def _greedy(names: list[str], nbytes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """The control: buckets cut by size alone."""
    planned, bucket, total = [], [], 0
    for name in names:
        if bucket and total + nbytes[name] > max_bytes:
            planned.append(bucket)
            bucket, total = [], 0
        bucket.append(name)
        total += nbytes[name]
    return planned + [bucket]


def test_no_bucket_size_leaves_a_deepseek_layer_on_its_old_weights(tmp_path):
    raw = json.loads(DEEPSEEK.read_text())
    hf = HFModelConfig.load(raw)
    assert hf.q_lora_rank is not None
    # what SGLang's DeepSeek model reads beyond the fixture: DeepSeek-V3's MoE layer frequency (in its
    # config.json, not transformers' class) and YaRN (the rotary embedding SGLang builds on CPU)
    raw.update(moe_layer_freq=1, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})
    (tmp_path / "config.json").write_text(json.dumps(raw))

    shapes = hf_tensor_shapes(hf)
    weights = {which: {name: torch.randn(shape, generator=torch.Generator().manual_seed(seed + i))
                       for i, (name, shape) in enumerate(shapes.items())}
               for which, seed in (("A", 1000), ("B", 2000))}
    torch.save(weights, tmp_path / "weights.pt")
    stream = list(weights["B"].items())
    names = [name for name, _ in stream]
    nbytes = {name: tensor_bytes(tensor) for name, tensor in stream}
    sizes, total = [], 0
    for name in names[:-1]:  # every boundary position: the size whose first greedy cut falls right before the next
        total += nbytes[name]
        sizes.append(total)
    plans = {"project": [[[name for name, _ in bucket] for bucket in buckets(stream, size)] for size in sizes],
             "greedy": [_greedy(names, nbytes, size) for size in sizes]}
    out = load_in_sglang(tmp_path, plans)
    assert out["unchanged_by_a"] == []  # every parameter (and w_kc, w_vc) tells A from B
    assert out["parameters"] > len(shapes) // 2

    assert all(stale == [] for stale in out["stale"]["project"])  # every bucket size: nothing left behind
    # the control: a greedy cut between q_a_proj and kv_a_proj_with_mqa leaves exactly that layer's fused
    # projection old; every other cut is harmless
    for position, stale in enumerate(out["stale"]["greedy"], start=1):
        plan = plans["greedy"][position - 1]
        split = sorted({int(name.split(".")[2]) for bucket in plan for name in (bucket[0],)
                        if "kv_a_proj_with_mqa" in name})
        fused = [f"model.layers.{layer}.self_attn.fused_qkv_a_proj_with_mqa.weight" for layer in split]
        assert stale == fused, position
    assert sum(bool(stale) for stale in out["stale"]["greedy"]) >= hf.num_hidden_layers
