"""Hugging Face ↔ Megatron-Core conversion, checked against transformers itself.

Random tiny transformers models (norm weights random too, so a dropped or misplaced norm shows) are
saved with ``save_pretrained``, converted with the CLI or its Python entry points, loaded into
Megatron models of several layouts in gloo worlds, and must give transformers' logits (fp32,
real-vocabulary columns). Exporting back must reproduce every original tensor bit for bit, and
transformers must load the export. The name table, layouts, safetensors I/O and config checks are
also tested directly; the transformer-engine names (GPU only) are tested as data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_gpt as tg
from bpo_megatron import testing as th

from bpo_megatron.convert import (
    ConfigMismatchError,
    check_same_architecture,
    convert_hf_to_mcore,
    convert_mcore_to_hf,
)
from bpo_megatron.convert.output_dir import staged_output
from bpo_megatron.convert.world import world_size_for
from bpo_megatron.models import HFModelConfig
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.weights import HFWeightsReader, ShardedSafetensorsWriter, expected_keys, hf_tensor_shapes
from bpo_megatron.weights.layouts import LAYOUTS, LayoutContext
from bpo_megatron.weights.names import RULES, match_megatron_name
from bpo_megatron.weights.safetensors_io import parse_size
from bpo_megatron.testing import MODEL_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = MODEL_CONFIGS
TIMEOUT = 120.0
BATCH, SEQ = 2, 12
REL_TOL = 1e-5


# ------------------------------------------------------------------------- HF models and refs
def _batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _save_random_hf_model(fixture: str, out: Path, seed: int, **overrides: Any) -> torch.Tensor:
    """A random transformers model saved to ``out``; returns its logits on the fixed batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(FIXTURES / fixture)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text('{"version": "1.0"}')  # stands in for a tokenizer
    with torch.no_grad():
        return model(_batch(config.vocab_size)).logits


def _hf_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(_batch(model.config.vocab_size)).logits


def _hf_model(directory: Path):
    """transformers' own model of a checkpoint directory, in fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _save(raw: dict[str, Any], out: Path, seed: int) -> tuple[Path, torch.Tensor]:
    """A random checkpoint of the config.json dict ``raw`` in ``out`` (the test kit's initialisation)
    and transformers' fp32 logits on the fixed batch."""
    from bpo_megatron.testing.models import random_checkpoint, write_config

    random_checkpoint(write_config(raw, out) / "config.json", out, seed=seed)
    (out / "tokenizer.json").write_text('{"version": "1.0"}')  # stands in for a tokenizer
    with torch.no_grad():
        return out, _hf_model(out)(_batch(raw["vocab_size"])).logits


def _assert_logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape
    relative = ((got - ref).abs().max() / ref.abs().max()).item()
    assert relative <= REL_TOL, f"max |Δ| / max |ref| = {relative:.2e}"


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_bit_exact(exported: Path, original: Path) -> None:
    got, want = _safetensors(exported), _safetensors(original)
    assert sorted(got) == sorted(want)
    different = [name for name in want if got[name].dtype != want[name].dtype
                 or not torch.equal(got[name], want[name])]
    assert not different, different


# name -> (fixture, seed, config overrides); every family's round trips at TP, EP and PP, from its tiny
# checkpoints, are the family contract's (tests/test_model_families.py)
MODELS = {"moe": ("tiny_qwen3_moe", 11, {})}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    models = {}
    for name, (fixture, seed, overrides) in MODELS.items():
        out = tmp_path_factory.mktemp(f"hf_{name}")
        models[name] = (out, _save_random_hf_model(fixture, out, seed, **overrides))
    return models


# ------------------------------------------------------------------------------ rank functions
def _pipeline_logits(model: torch.nn.Module, vocab_size: int) -> torch.Tensor | None:
    """One forward through Megatron's schedule; the last stage returns its logits shard."""
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return tg.schedule_logits(model, _batch(vocab_size), positions)


def _checkpoint_logits(checkpoint_root: str, layout: dict) -> dict | None:
    """Load a trainer checkpoint into ``layout``; the last stage's TP ranks return logits shards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from bpo_megatron.convert.world import build_model, tear_down
    from bpo_megatron.parallel import layout_record
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.trainer import checkpoint

    state = json.loads((checkpoint.resolve(checkpoint_root) / checkpoint.STATE_FILE).read_text())
    hf = HFModelConfig.load(state["hf_config"])
    parallel = ParallelConfig(**layout)
    model = build_model(hf, parallel, ModelOptions())
    checkpoint.load(checkpoint_root, model, None, layout=layout_record(parallel, dist.get_world_size()))
    model.eval()
    with torch.no_grad():
        logits = _pipeline_logits(model, hf.vocab_size)
    tp_rank = ps.get_tensor_model_parallel_rank()
    tear_down()
    return None if logits is None else {"tp_rank": tp_rank, "logits": logits}


def _full_logits(results: list[dict | None], vocab_size: int) -> torch.Tensor:
    """Concatenate the vocabulary shards of one TP group; only the real vocabulary columns."""
    shards: dict[int, torch.Tensor] = {}
    for result in results:
        if result is not None:
            shards.setdefault(result["tp_rank"], result["logits"])
    return torch.cat([shards[t] for t in sorted(shards)], dim=-1)[..., :vocab_size]


def _actor_logprobs(checkpoint_root: str, raw: dict, layout: dict,
                    resave_to: str) -> list[torch.Tensor] | None:
    """``TrainActor.load`` of the converted checkpoint; log π of the batch's next tokens. Saves
    the actor again (at its layout) to ``resave_to``."""
    from bpo_megatron.trainer.samples import TrainSample

    hf = HFModelConfig.load(raw)
    actor = th.build_actor(hf, lr=1e-6, micro_batch_size=BATCH, **layout)
    meta = actor.load(checkpoint_root)
    assert meta["actor_step"] == 0 and meta["hf_config"] == raw
    samples = [TrainSample(tokens=row, response_start=1, rollout_logprobs=-torch.ones(SEQ - 1),
                           advantage=1.0) for row in _batch(hf.vocab_size)]
    scored = actor.compute_logprobs(samples)
    actor.save(resave_to)
    actor.close()
    return None if scored is None else scored.logprobs


def _live_export(hf_dir: str, layout: dict, all_ranks: bool) -> dict:
    """Load HF weights straight into a sharded model, then stream them back out, recording every
    collective the export makes; point-to-point sends fail (the export uses collectives only)."""
    import torch.distributed as dist

    from bpo_megatron.convert.world import build_model, tear_down
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.weights import ExportPlan, iter_hf_weights, load_hf_weights
    from bpo_megatron.weights.export import export_weights

    hf = HFModelConfig.load(hf_dir)
    model = build_model(hf, ParallelConfig(**layout), ModelOptions())
    load_hf_weights(model, hf, hf_dir)
    plan = ExportPlan.build(model, hf)
    from megatron.core import parallel_state as ps

    collectives: list[tuple[str, int]] = []  # (collective, group size); "expert_gather" over the EP group
    expert_group = ps.get_expert_model_parallel_group()
    # Groups with the same ranks are interchangeable: count EP gathers only where EP's are its own.
    distinct = {tuple(dist.get_process_group_ranks(g)) for g in
                (ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group())}
    experts_distinct = tuple(dist.get_process_group_ranks(expert_group)) not in distinct

    def recorded(name):
        original = getattr(dist, name)

        def call(*args, group=None, **kwargs):
            over_experts = (name == "gather" and dist.get_world_size(group) > 1 and experts_distinct
                            and dist.get_process_group_ranks(group) == dist.get_process_group_ranks(expert_group))
            collectives.append(("expert_gather" if over_experts else name, dist.get_world_size(group)))
            return original(*args, group=group, **kwargs)
        return call

    def forbidden(*_args, **_kwargs):
        raise AssertionError("point-to-point transfer during export")

    for name in ("gather", "broadcast"):
        setattr(dist, name, recorded(name))
    for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv"):
        setattr(dist, name, forbidden)
    if all_ranks:
        stream = ((n, t) for bucket in export_weights(model, hf, 1 << 16, all_ranks=True, plan=plan) for n, t in bucket)
    else:
        stream = iter_hf_weights(model, hf, plan=plan)
    names, tensors = [], {}
    for name, tensor in stream:
        names.append(name)
        if dist.get_rank() == 0 or all_ranks:
            tensors[name] = tensor.clone()
    tear_down()
    return {"names": names, "tensors": tensors, "collectives": collectives, "experts_distinct": experts_distinct}


# ----------------------------------------------------------------------------------- helpers
def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "bpo_megatron.cli", "convert", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)


def _check_megatron_logits(checkpoint: Path, layout: dict, world: int, ref: torch.Tensor) -> None:
    results = run_gloo_world(_checkpoint_logits, world, str(checkpoint), layout, timeout=TIMEOUT)
    _assert_logits_close(_full_logits(results, ref.shape[-1]), ref)


def _check_export(checkpoint: Path, out: Path, hf_dir: Path, ref: torch.Tensor, **kwargs) -> None:
    convert_mcore_to_hf(checkpoint, out, progress=False, timeout=TIMEOUT, **kwargs)
    _assert_bit_exact(out, hf_dir)
    _assert_logits_close(_hf_logits(out), ref)


# ------------------------------------------------------------------------- end-to-end (worlds)
@pytest.fixture(scope="module")
def moe_checkpoint(hf_models, tmp_path_factory) -> Path:
    """hf-to-mcore of the MoE model at TP=2 EP=2, through the command line."""
    hf_dir, _ = hf_models["moe"]
    out = tmp_path_factory.mktemp("ckpt") / "moe_tp2_ep2"
    done = _run_cli("hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(out),
                    "--tp", "2", "--ep", "2", "--no-progress")
    assert done.returncode == 0, done.stderr
    return out


def test_moe_tp2_ep2_cli_round_trip(moe_checkpoint, hf_models, tmp_path):
    hf_dir, ref = hf_models["moe"]
    state = json.loads((moe_checkpoint / "step-00000000" / "trainer_state.json").read_text())
    assert state["layout"] == {"tp": 2, "pp": 1, "ep": 2, "etp": 1, "dp": 1}
    assert state["optimizer_state"] is False and (moe_checkpoint / "latest").is_file()
    _check_megatron_logits(moe_checkpoint, {"tp": 2, "ep": 2}, 2, ref)

    out = tmp_path / "hf"
    done = _run_cli("mcore-to-hf", "--ckpt", str(moe_checkpoint), "--out", str(out),
                    "--hf-config", str(hf_dir), "--max-shard-size", "60KB", "--no-progress")
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in out.glob("*.safetensors"))
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    _assert_bit_exact(out, hf_dir)
    _assert_logits_close(_hf_logits(out), ref)


def test_moe_checkpoint_loads_into_train_actor_at_another_layout(moe_checkpoint, hf_models, tmp_path):
    hf_dir, ref = hf_models["moe"]
    raw = json.loads((moe_checkpoint / "step-00000000" / "trainer_state.json").read_text())["hf_config"]
    resaved = tmp_path / "actor"
    results = run_gloo_world(_actor_logprobs, 2, str(moe_checkpoint), raw, {"pp": 2}, str(resaved),
                             timeout=TIMEOUT)
    logprobs = next(r for r in results if r is not None)
    tokens = _batch(ref.shape[-1])
    want = torch.log_softmax(ref, dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    for got, expected in zip(logprobs, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # TrainActor.save records the HF config, so its checkpoints export without --hf-config
    convert_mcore_to_hf(resaved, tmp_path / "hf", progress=False, timeout=TIMEOUT)
    _assert_bit_exact(tmp_path / "hf", hf_dir)


def test_bf16_checkpoint_round_trips_in_bf16(tmp_path):
    """fp32 Megatron weights hold bf16 values exactly; the export is bf16 again, bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURES / "tiny_qwen3"))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    checkpoint = convert_hf_to_mcore(tmp_path / "hf", tmp_path / "ckpt", progress=False, timeout=TIMEOUT)
    convert_mcore_to_hf(checkpoint, tmp_path / "out", progress=False, timeout=TIMEOUT)
    _assert_bit_exact(tmp_path / "out", tmp_path / "hf")


LIVE_LAYOUTS = {"tp2_ep2": ({"tp": 2, "ep": 2}, 2), "ep2": ({"ep": 2}, 2), "pp2": ({"pp": 2}, 2), "tp2_expert_tp2": ({"tp": 2}, 2),
                "tp2_pp2_ep2": ({"tp": 2, "pp": 2, "ep": 2}, 4), "pp2_dp2": ({"pp": 2}, 4),
                "tp2_ep2_etp2_dp2": ({"tp": 2, "ep": 2, "etp": 2}, 4)}


@pytest.mark.parametrize("layout", LIVE_LAYOUTS, ids=list(LIVE_LAYOUTS))
def test_iter_hf_weights_from_a_live_sharded_model(hf_models, layout):
    """Every HF tensor reaches rank 0 bit-exact, once, gathered over Megatron's own groups with
    collectives only (never the whole world, never point to point); replicas send nothing."""
    hf_dir, _ = hf_models["moe"]
    hf = HFModelConfig.load(hf_dir)
    parallel, world = LIVE_LAYOUTS[layout]
    ranks = run_gloo_world(_live_export, world, str(hf_dir), parallel, False, timeout=TIMEOUT)
    assert all(rank["names"] == [] for rank in ranks[1:])  # yielded on rank 0 only
    shapes = hf_tensor_shapes(hf)
    assert sorted(ranks[0]["names"]) == sorted(shapes)  # each name once
    layers = [int(name.split(".")[2]) for name in ranks[0]["names"] if name.startswith("model.layers.")]
    assert layers == sorted(layers)  # layer by layer
    original = _safetensors(hf_dir)
    for name, tensor in ranks[0]["tensors"].items():
        assert tuple(tensor.shape) == shapes[name]
        assert torch.equal(tensor, original[name]), name
    for rank in ranks:
        assert all(1 < size < world or world == 2 for _, size in rank["collectives"]), rank["collectives"]
    if ranks[0]["experts_distinct"] and parallel.get("ep", 1) > 1:  # one gather: an expert from every EP rank
        experts = sum(".experts." in name for name in shapes)
        assert sum(kind == "expert_gather" for kind, _ in ranks[0]["collectives"]) == experts // parallel["ep"]


def test_export_buckets_on_every_rank(hf_models):
    """``all_ranks``: each bucket is broadcast from rank 0 as one buffer; every rank gets the same
    tensors, bit-exact."""
    hf_dir, _ = hf_models["moe"]
    ranks = run_gloo_world(_live_export, 2, str(hf_dir), {"tp": 2, "ep": 2}, True, timeout=TIMEOUT)
    assert ranks[0]["names"] == ranks[1]["names"]
    assert sorted(ranks[0]["names"]) == sorted(hf_tensor_shapes(HFModelConfig.load(hf_dir)))
    original = _safetensors(hf_dir)
    for rank in ranks:
        assert all(torch.equal(tensor, original[name]) for name, tensor in rank["tensors"].items())
    world_broadcasts = sum(kind == "broadcast" and size == 2 for kind, size in ranks[1]["collectives"])
    assert world_broadcasts < len(ranks[0]["names"]) / 4  # one per bucket, not one per tensor


# -------------------------------------------------------------------------------- bad input
def test_mismatched_hf_config_is_refused_naming_each_field(moe_checkpoint, tmp_path):
    raw = json.loads((FIXTURES / "tiny_qwen3_moe" / "config.json").read_text())
    raw.update(num_hidden_layers=4, hidden_size=128, num_experts_per_tok=3, rope_theta=1e4,
               rms_norm_eps=1e-5)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    with pytest.raises(ConfigMismatchError) as caught:
        convert_mcore_to_hf(moe_checkpoint, tmp_path / "out", hf_config=config)
    assert caught.value.fields == ["num_hidden_layers", "hidden_size", "num_experts_per_tok",
                                   "rms_norm_eps", "rope_theta"]
    done = _run_cli("mcore-to-hf", "--ckpt", str(moe_checkpoint), "--out", str(tmp_path / "out"),
                    "--hf-config", str(config))
    assert done.returncode == 2
    for text in ("num_hidden_layers: checkpoint has 2, --hf-config has 4", "hidden_size",
                 "num_experts_per_tok", "rms_norm_eps", "rope_theta"):
        assert text in done.stderr
    assert not (tmp_path / "out").exists()


def _broken_copy(hf_dir: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_or_misshaped_tensor_is_refused_before_any_work(hf_models, tmp_path):
    hf_dir, _ = hf_models["moe"]
    missing = _broken_copy(hf_dir, tmp_path / "missing",
                           lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight' is "
                                         r"missing from the checkpoint in .*missing"):
        convert_hf_to_mcore(missing, tmp_path / "out")

    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)

    wrong = _broken_copy(hf_dir, tmp_path / "wrong", shrink)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in "
                                         r".*wrong/model\.safetensors has shape \[32, 64\]; the "
                                         r"config implies \[64, 64\]"):
        convert_hf_to_mcore(wrong, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_hf_to_mcore(tmp_path / "nowhere", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["missing", "wrong"]  # nothing written


def test_output_appears_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="midway"):
        with staged_output(out) as staging:
            (staging / "half.safetensors").write_text("x")
            raise RuntimeError("midway")
    assert list(tmp_path.iterdir()) == []
    with staged_output(out) as staging:
        (staging / "done").write_text("x")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "done").is_file()
    with pytest.raises(FileExistsError, match="--overwrite"):
        with staged_output(out):
            pass
    with staged_output(out, overwrite=True) as staging:
        (staging / "again").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == ["again"]


def test_cli_exit_codes(tmp_path):
    from bpo_megatron.cli import COMMANDS, main

    assert "convert" in COMMANDS
    assert main(["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "none"),
                 "--out", str(tmp_path / "out")]) == 2
    assert main(["convert", "hf-to-mcore", "--hf-dir", str(FIXTURES / "tiny_qwen3_moe"),
                 "--out", str(tmp_path / "out"), "--tp", "4"]) == 2  # tp must divide the heads


# --------------------------------------------------------------------------- the table as data
def test_local_and_transformer_engine_names_map_to_the_same_rules():
    cases = {
        "decoder.layers.3.input_layernorm.weight": ("input_norm", 3, -1),
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": ("input_norm", 3, -1),
        "decoder.layers.3.pre_mlp_layernorm.weight": ("post_attention_norm", 3, -1),
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": ("post_attention_norm", 3, -1),
        "decoder.layers.3.mlp.linear_fc1.weight": ("mlp_in", 3, -1),
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight": ("expert_in", 3, 5),
        "decoder.layers.3.mlp.experts.linear_fc1.weight5": ("expert_in", 3, 5),
        "decoder.layers.3.mlp.experts.linear_fc2.weight12": ("expert_out", 3, 12),
        "decoder.layers.3.mlp.router.weight": ("router", 3, -1),
        "output_layer.weight": ("output", -1, -1),
    }
    for name, (rule, layer, expert) in cases.items():
        found = match_megatron_name(name)
        assert found is not None and (found[0].name, found[1], found[2]) == (rule, layer, expert), name
    for unknown in ("decoder.layers.3.mlp.linear_fc1.bias", "decoder.layers.3.mlp.experts.weight1"):
        assert match_megatron_name(unknown) is None
    assert len({rule.name for rule in RULES}) == len(RULES)


def test_expected_keys_follow_the_moe_layer_rule():
    raw = json.loads((FIXTURES / "tiny_qwen3_moe" / "config.json").read_text())
    hf = HFModelConfig.load({**raw, "mlp_only_layers": [0]})
    keys = expected_keys(hf)
    assert ("mlp_in", 0, -1) in keys and ("router", 0, -1) not in keys
    assert [k for k in keys if k[0] == "expert_out" and k[1] == 1] == [("expert_out", 1, e) for e in range(4)]
    assert keys[0] == ("embedding", -1, -1) and keys[-2:] == [("final_norm", -1, -1), ("output", -1, -1)]


class _Source:
    """In-memory stand-in for the safetensors reader (slices are plain tensor views)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def slice(self, name, expected_shape):
        assert tuple(self.tensors[name].shape) == tuple(expected_shape)
        return self.tensors[name]


def test_qkv_layout_interleaves_per_query_group():
    # 4 query heads in 2 groups, head_dim 2: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1]
    hd, hidden = 2, 3
    q = torch.arange(4 * hd * hidden, dtype=torch.float32).reshape(4 * hd, hidden)
    k = -torch.arange(2 * hd * hidden, dtype=torch.float32).reshape(2 * hd, hidden) - 1
    v = k - 100
    source = _Source({"q": q, "k": k, "v": v})
    shapes = [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    ctx = LayoutContext(num_query_groups=2, vocab_size=0)
    layout = LAYOUTS["qkv"]
    full = layout.read(source, ["q", "k", "v"], shapes, 0, 1, (), ctx)
    expected = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    assert torch.equal(full, expected)
    shards = [layout.read(source, ["q", "k", "v"], shapes, t, 2, (), ctx) for t in range(2)]
    assert torch.equal(torch.cat(shards), full)  # TP gives each rank whole groups
    for got, want in zip(layout.merge(shards, shapes, ctx), (q, k, v)):
        assert torch.equal(got, want)


def test_glu_layout_splits_gate_and_up_per_tp_rank():
    gate = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2)
    up = gate + 100
    source = _Source({"gate": gate, "up": up})
    shapes = [(8, 2), (8, 2)]
    ctx = LayoutContext(num_query_groups=1, vocab_size=0)
    layout = LAYOUTS["glu"]
    assert torch.equal(layout.read(source, ["gate", "up"], shapes, 0, 1, (), ctx), torch.cat([gate, up]))
    shards = [layout.read(source, ["gate", "up"], shapes, t, 2, (), ctx) for t in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))  # rank 1: [gate_1; up_1]
    merged = layout.merge(shards, shapes, ctx)
    assert torch.equal(merged[0], gate) and torch.equal(merged[1], up)


def test_vocab_rows_pad_with_zeros_and_drop_padding():
    embed = torch.randn(5, 3)
    source = _Source({"e": embed})
    ctx = LayoutContext(num_query_groups=1, vocab_size=5)
    layout = LAYOUTS["vocab_rows"]
    shards = [layout.read(source, ["e"], [(5, 3)], t, 2, (4, 3), ctx) for t in range(2)]
    assert torch.equal(shards[0], embed[:4]) and torch.equal(shards[1][0], embed[4])
    assert not shards[1][1:].any()
    assert torch.equal(layout.merge(shards, [(5, 3)], ctx)[0], embed)


def test_sharded_writer_bounds_shards_and_writes_an_index(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1000)
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    with pytest.raises(ValueError, match="written twice"):
        writer.add("t0", tensors["t0"])
    index = writer.close()
    assert index["metadata"]["total_size"] == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    with HFWeightsReader(tmp_path) as reader:
        assert reader.file_of("t4") == "model-00003-of-00003.safetensors"
        assert torch.equal(reader.slice("t3", (100,))[:], tensors["t3"])


def test_config_checks():
    moe = HFModelConfig.load(FIXTURES / "tiny_qwen3_moe")
    raw = json.loads((FIXTURES / "tiny_qwen3_moe" / "config.json").read_text())
    other = HFModelConfig.load({**raw, "vocab_size": 300, "tie_word_embeddings": True,
                                "head_dim": 16, "bos_token_id": 1})
    with pytest.raises(ConfigMismatchError, match=r"vocab_size: checkpoint has 200, --hf-config has 300"):
        check_same_architecture(moe, other)
    try:
        check_same_architecture(moe, other)
    except ConfigMismatchError as error:
        assert error.fields == ["head_dim", "vocab_size", "tie_word_embeddings"]
    check_same_architecture(moe, HFModelConfig.load({**raw, "bos_token_id": 1}))  # metadata only


def test_hf_config_keeps_its_source_and_reads_transformers_5_names():
    raw = json.loads((FIXTURES / "tiny_qwen3_moe" / "config.json").read_text())
    as_written = {**{k: v for k, v in raw.items() if k != "num_experts"}, "num_local_experts": 4}
    cfg = HFModelConfig.load(as_written)  # transformers 5 writes num_experts as num_local_experts
    assert cfg == HFModelConfig.load(raw) and cfg.num_experts == 4
    assert cfg.to_hf_dict() == as_written and cfg.weights_dtype == "float32"
    with pytest.raises(ValueError, match="num_experts=4 disagrees with num_local_experts=8"):
        HFModelConfig.load({**raw, "num_local_experts": 8})
    bare = HFModelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "source"})
    assert HFModelConfig.load(bare.to_hf_dict()) == cfg


def test_sizes_and_world_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("60KB") == 60_000
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("123") == 123
    with pytest.raises(ValueError, match="expected a number of bytes"):
        parse_size("lots")
    assert world_size_for(ParallelConfig(tp=2, ep=2)) == 2
    assert world_size_for(ParallelConfig(ep=2)) == 2
    assert world_size_for(ParallelConfig(tp=2, pp=2)) == 4
    assert world_size_for(ParallelConfig(tp=2, ep=4)) == 4
