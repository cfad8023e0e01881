"""A delta weight sync's bytes (the encoding rule), the planner's delta estimate, ``bpo-megatron
bench sync``'s numbers from their formulas, and the 235B-A22B recipe they are simulated for."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bpo_megatron.experiment import load_experiment
from bpo_megatron.weight_sync.delta_estimate import (bucket_delta, bucket_wire_bytes, delta_wire_bytes, index_bytes,
                                                     tensor_kind)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MAIN, DISAGGREGATED = CONFIGS / "qwen3_30b_a3b_bpo.yaml", CONFIGS / "qwen3_30b_a3b_bpo_disaggregated.yaml"
Q235 = CONFIGS / "qwen3_235b_a22b_bpo.yaml"
MiB = 2**20


def test_a_bucket_goes_sparse_below_a_third_changed_and_dense_above():
    # bf16 values (2 bytes) with int32 indices (4 bytes): 6 bytes a changed element against 2 an element
    assert bucket_delta(1000, 0).encoding == "skip" and bucket_wire_bytes(1000, 0) == 0
    assert bucket_delta(1000, 100) == bucket_delta(1000, 100, itemsize=2)
    assert (bucket_delta(1000, 100).encoding, bucket_wire_bytes(1000, 100)) == ("sparse", 600)
    assert bucket_wire_bytes(1000, 333) == 333 * 6 == 1998  # < 2000: still sparse
    assert (bucket_delta(1000, 334).encoding, bucket_wire_bytes(1000, 334)) == ("dense", 2000)
    assert bucket_wire_bytes(1000, 1000) == 2000
    # one-byte values (FP8): sparse below a fifth
    assert bucket_wire_bytes(1000, 199, itemsize=1) == 199 * 5 and bucket_wire_bytes(1000, 200, itemsize=1) == 1000
    # past 2^31 elements an index takes 8 bytes
    assert index_bytes(2**31) == 4 and index_bytes(2**31 + 1) == 8
    assert bucket_wire_bytes(2**31 + 1, 10) == 10 * (8 + 2)
    with pytest.raises(ValueError, match="0 <= changed <= elements"):
        bucket_delta(10, 11)


def test_a_models_delta_bytes_bucket_by_bucket():
    # buckets of 1000, 1000 and 500 elements, 1% changed each (rounded up): 10 + 10 + 5 sparse elements
    assert delta_wire_bytes(2500, 1000, 0.01) == 6 * 25
    assert delta_wire_bytes(2500, 1000, 0.5) == 2 * 2500  # every bucket dense
    assert delta_wire_bytes(2500, 1000, 0.0) == 0
    # the 30B-A3B model in 512 MiB buckets at verl's 1%: ≈ 3% of its bytes (verl: 61 GB → 1.8 GB)
    total, bucket = 30_532_122_624, 256 * MiB
    full, rest = divmod(total, bucket)
    assert delta_wire_bytes(total, bucket, 0.01) == 6 * (full * math.ceil(bucket / 100) + math.ceil(rest / 100))
    with pytest.raises(ValueError, match="changed_share must be within"):
        delta_wire_bytes(10, 5, 1.5)


@pytest.mark.parametrize("name, kind", [
    ("model.layers.3.mlp.experts.7.down_proj.weight", "experts"),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", "shared experts"),
    ("model.layers.3.mlp.shared_expert.up_proj.weight", "shared experts"),
    ("model.layers.3.mlp.gate.weight", "router"),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "router"),
    ("model.layers.0.mlp.gate_proj.weight", "dense MLP"),
    ("model.layers.3.self_attn.q_proj.weight", "attention"),
    ("model.layers.3.self_attn.k_norm.weight", "attention"),
    ("model.embed_tokens.weight", "embeddings"),
    ("lm_head.weight", "embeddings"),
    ("model.layers.3.post_attention_layernorm.weight", "norms"),
    ("model.norm.weight", "norms"),
])
def test_tensor_kinds(name, kind):
    assert tensor_kind(name) == kind


def test_diffed_params_are_the_busiest_ranks_optimizer_shard():
    from bpo_megatron.planner.sync import diffed_params

    stage = lambda dense, expert: SimpleNamespace(params=SimpleNamespace(dense=dense, expert=expert))  # noqa: E731
    plan = SimpleNamespace(stages=[stage(1000, 3000), stage(1001, 2000)], dp=4, expert_dp=2)
    assert diffed_params(plan) == max(250 + 1500, 251 + 1000)


@pytest.fixture(scope="module")
def plans():
    from bpo_megatron.planner import make_plan

    out = {}
    for path in (MAIN, DISAGGREGATED, Q235):
        cfg = load_experiment(path)
        out[path.name] = make_plan(cfg, cfg.hf_config())
    return out


def _independent_delta_seconds(cfg, hf, total, diffed, share, diff_rate):
    """The delta sync's seconds written out from planner/sync.py's stated assumptions."""
    from bpo_megatron.weights.names import hf_tensor_count

    payload = delta_wire_bytes(total, cfg.weight_sync.bucket_bytes // 2, share)
    buckets = math.ceil(payload / cfg.weight_sync.bucket_bytes)
    tensors, expert_tensors = hf_tensor_count(hf), 3 * hf.num_experts * len(set(hf.moe_layers))
    gathers = tensors - expert_tensors + math.ceil(expert_tensors / cfg.parallel.ep)
    nodes = cfg.cluster.trainer_ranks // cfg.cluster.gpus_per_node
    remote = (nodes - 1) / nodes
    gather = payload * remote / 40e9 + payload * (1 - remote) / 150e9 + gathers * 30e-6
    spread = payload / 40e9 + buckets * 30e-6
    return payload, buckets, 2 * diffed / diff_rate + gather + spread + buckets * 15e-3


def test_plan_prints_the_delta_estimate(plans):
    from bpo_megatron.planner import format_plan
    from bpo_megatron.planner.sync import diffed_params, expected_delta_sync

    plan = plans[MAIN.name]
    total = plan.model_size[0]
    delta = expected_delta_sync(plan.cfg, plan.hf, total, diffed_params(plan))
    payload, _, seconds = _independent_delta_seconds(plan.cfg, plan.hf, total, diffed_params(plan), 0.01, 500e9)
    assert delta.wire_bytes == payload and delta.seconds == pytest.approx(seconds)
    assert sum(delta.parts.values()) == pytest.approx(delta.seconds)
    text = format_plan(plan)
    assert (f"delta weight sync (cuda_ipc with sparse pieces through a custom loader; not built: weight_sync.delta sends SGLang the changed tensors whole, and colocated engines drop their weights, so it is refused there): ≈ {seconds:.1f} s per step, {payload / 1e9:.2f} of 61.1 GB "
            "at 1.0% of the bf16 weights changed") in text
    # the same rank's copy in host memory: its shard leaves the GPU at 32 GB/s, compared at the host's rate
    host = expected_delta_sync(plan.cfg, plan.hf, total, diffed_params(plan), host_diff_gbps=2.0)
    assert host.parts["to host memory"] == pytest.approx(2 * diffed_params(plan) / 32e9)
    assert host.parts["diff in host memory"] == pytest.approx(2 * diffed_params(plan) / 2e9)
    # NCCL broadcast: SGLang's update_weights_from_distributed loads whole tensors only
    apart = plans[DISAGGREGATED.name]
    assert expected_delta_sync(apart.cfg, apart.hf, apart.model_size[0], diffed_params(apart)).seconds is None
    assert "delta weight sync (nccl_broadcast): none; SGLang's update_weights_from_distributed loads whole tensors " \
           "only" in format_plan(apart)


def test_the_235b_recipe_fits_its_cluster(plans):
    from bpo_megatron.planner import format_plan
    from bpo_megatron.weights.names import hf_tensor_count

    plan = plans[Q235.name]
    text = format_plan(plan)
    assert "Qwen3MoeForCausalLM, 235.09 B parameters (22.19 B active per token)" in text
    assert "verdict: FITS" in text and "FAIL" not in text
    # 94 layers × (128 experts × 3 + router + 4 attention + 2 QK norms + 2 layer norms) + 3
    assert hf_tensor_count(plan.hf) == 94 * (128 * 3 + 1 + 8) + 3


def test_bench_sync_numbers_from_their_formulas(plans, capsys):
    from bpo_megatron.bench.sync import HostRates, format_recipe, recipe_rows
    from bpo_megatron.planner.sync import diffed_params, expected_sync

    plan = plans[MAIN.name]
    cfg, hf, total = plan.cfg, plan.hf, plan.model_size[0]
    rates = HostRates(copy_gbps=5.0, diff_gbps=1.0, measured=False)
    _, _, _, full, rows = recipe_rows(MAIN, [0.01], rates, 30e-6)
    assert [row.sync for row in rows] == ["full", "delta, copy on the GPU", "delta, copy on the host"]
    # full: one post per 512 MiB bucket; each engine rank (tp 4, ep 4) loads every non-expert tensor
    # and 3 tensors for each of its 32 experts in each of the 48 layers
    buckets = math.ceil(2 * total / (512 * MiB))
    assert (rows[0].wire_bytes, rows[0].calls.posts) == (2 * total, buckets) == (61_064_245_248, 114)
    assert rows[0].calls.loader_calls == (18_867 - 18_432) + 48 * 3 * 32 == 5_043
    assert rows[0].transfer_s == pytest.approx(expected_sync(cfg, hf, total).seconds) == full.seconds
    assert rows[0].apply_s == pytest.approx(2 * total / 4 / 20e9 + 5_043 * 30e-6)
    for row, rate in zip(rows[1:], (500e9, None)):
        diff_rate = rate or 1 / (1 / 32e9 + 1 / 1e9)  # host: to host memory, then the diff
        payload, wire_buckets, seconds = _independent_delta_seconds(cfg, hf, total, diffed_params(plan), 0.01,
                                                                    diff_rate)
        assert (row.wire_bytes, row.calls.posts, row.calls.loader_calls) == (payload, wire_buckets, wire_buckets)
        assert wire_buckets == 4 and payload / (2 * total) == pytest.approx(0.03, rel=1e-3)
        assert row.transfer_s == pytest.approx(seconds)
        assert row.apply_s == pytest.approx(payload / 4 / 20e9 + wire_buckets * 30e-6)
    text = format_recipe(MAIN, [0.01], rates, 30e-6)
    assert (f"| full | — | 61.06 GB | 114 | 5,043 | {full.seconds:.1f} | {rows[0].apply_s:.1f} | "
            f"{rows[0].total_s:.1f} |") in text
    assert f"| delta, copy on the GPU | 1.00% | {payload / 1e9:.2f} GB | 4 | 4 |" in text


def test_bench_sync_command(capsys):
    from bpo_megatron.cli import main

    args = ["bench", "sync", "--recipes", str(DISAGGREGATED), "--host-copy-gbps", "5", "--host-diff-gbps", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "host rates (given): copy 5.00 GB/s, diff 1.00 GB/s" in out and "40 GB/s between nodes" in out
    assert "| delta: whole changed tensors, all of them | — | 61.06 GB | 114 | 5,043 |" in out
    assert "verl delta_sharded: Qwen3-30B-A3B ≈ 32 s full → 5.8-7.9 s delta" in out
    with pytest.raises(SystemExit) as refused:
        main(["bench", "sync", "--changed-share", "1.5"])
    assert refused.value.code == 2 and "--changed-share must be within [0, 1], got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "sync", "--host-copy-gbps", "5"])
    assert "go together" in capsys.readouterr().err


def test_host_rates_are_measured():
    from bpo_megatron.bench.sync import measure_host_rates

    rates = measure_host_rates(mib=4, repeats=1)
    assert rates.measured and rates.copy_gbps > 0 and rates.diff_gbps > 0


def test_the_changed_share_table_from_its_csv():
    """experiments/changed_share/table.py: shares per sync and per kind, and delta over full bytes."""
    import sys

    sys.path.insert(0, str(CONFIGS.parent / "experiments" / "changed_share"))
    from table import table

    def row(step, kind, elements, changed):
        return {"run": "r", "config": "c.yaml", "lr": "1e-05", "step": str(step), "updates_per_step": "8",
                "kind": kind, "elements": str(elements), "changed": str(changed), "dense_bytes": str(2 * elements),
                "delta_bytes": str(bucket_wire_bytes(elements, changed))}

    rows = [row(1, "experts", 900, 9), row(1, "attention", 100, 50), row(2, "experts", 900, 0), row(2, "attention", 100, 0)]
    lines = table(rows).splitlines()
    assert lines[0] == ("| run | recipe | lr | updates a sync | syncs | changed, all weights: mean [min-max] | experts | "
                        "attention | delta / full bytes |")
    # syncs: 59/1000 and 0/1000 changed; experts 9/1800, attention 50/200; bytes (54 + 200) / 4000
    assert lines[2] == "| r | c.yaml | 1e-05 | 8 | 2 | 2.95% [0.00%-5.90%] | 0.50% | 25.00% | 0.06 |"
