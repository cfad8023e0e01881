"""The planner: per-rank counts equal the built Megatron model and optimizer; memory terms follow
their closed forms; layouts are checked and swept; the 30B recipe fits 4 × 8 × 80 GB."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from bpo_megatron import testing as th
from bpo_megatron.experiment import load_experiment
from bpo_megatron.models import HFModelConfig, ModelOptions
from bpo_megatron.weights.names import parameter_counts
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.planner import Allocation, Precision, make_plan, rank_parameters, static_memory, sweep
from bpo_megatron.planner.activations import stage_activation_bytes
from bpo_megatron.planner.rollout import kv_bytes_per_token
from bpo_megatron.parallel.local_world import run_gloo_world

ROOT = Path(__file__).resolve().parents[1]
RECIPE_30B = ROOT / "configs" / "qwen3_30b_a3b_bpo.yaml"
QWEN3_30B = ROOT / "configs" / "models" / "qwen3_30b_a3b" / "config.json"
WORLD_TIMEOUT_S = 120.0


# ------------------------------------------------------------------ against the built model
def _built_rank(tp: int, ep: int) -> dict:
    """Build the tiny MoE actor, take one optimizer step, and measure what each rank holds."""
    import torch.distributed as dist

    actor = th.build_actor(tp=tp, ep=ep, micro_batch_size=2)
    params = sum(p.numel() for p in actor.model.parameters())
    grad_bytes = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                     for chunk in actor.ddp for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers])
    actor.train_step(th.make_samples(4, seed=3))  # Adam creates its moments on the first step
    state_bytes, with_state = 0, 0
    for optimizer in actor.optimizer.chained_optimizers:
        for state in optimizer.optimizer.state.values():
            with_state += 1
            state_bytes += sum(state[key].numel() * state[key].element_size() for key in ("exp_avg", "exp_avg_sq"))
    out = {"rank": dist.get_rank(), "params": params, "grad_bytes": grad_bytes, "state_bytes": state_bytes,
           "params_with_state": with_state, "param_tensors": len(list(actor.model.parameters())),
           "dp": actor.ranks.dp_size}
    actor.close()
    return out


@pytest.mark.parametrize("tp,ep,world", [(2, 1, 2), (1, 2, 2), (2, 2, 4)], ids=["tp2", "ep2", "tp2-ep2"])
def test_rank_counts_equal_the_built_model_and_optimizer(tp, ep, world):
    ranks = run_gloo_world(_built_rank, world, tp, ep, timeout=WORLD_TIMEOUT_S)
    parallel = ParallelConfig(tp=tp, ep=ep)
    [stage] = rank_parameters(th.tiny_moe(), parallel, ModelOptions())  # fp32 on CPU, as built
    dp = parallel.data_parallel_size(world)
    expert_dp = world // (parallel.ep * parallel.expert_tp)
    planned = static_memory(stage, Precision.of("fp32"), dp=dp, expert_dp=expert_dp,
                            distributed_optimizer=False)  # the CPU path: FP32Optimizer, no sharding
    for out in ranks:
        assert out["dp"] == dp
        assert out["params"] == stage.total
        assert out["grad_bytes"] == planned.grads == 4 * stage.total
        assert out["params_with_state"] == out["param_tensors"]
        assert out["state_bytes"] == planned.optimizer == 8 * stage.total


def test_pipeline_stages_hold_their_layers_embedding_and_output():
    hf = th.tiny_moe()
    first, last = rank_parameters(hf, ParallelConfig(pp=2), ModelOptions())
    [whole] = rank_parameters(hf, ParallelConfig(), ModelOptions())
    # measured on the built model: 65,984 and 66,048 parameters per stage (final norm on the last)
    assert (first.total, last.total) == (65_984, 66_048)
    assert first.total + last.total == whole.total
    assert last.total - first.total == hf.hidden_size


# ------------------------------------------------------------------ the real model's size
def test_qwen3_30b_a3b_parameter_count_is_the_real_size():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = HFModelConfig.load(QWEN3_30B)
    total, active = parameter_counts(hf)
    with torch.device("meta"):  # transformers' own model, no memory
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(QWEN3_30B.read_text())))
    assert total == sum(p.numel() for p in reference.parameters())
    assert abs(total - 30.5e9) / 30.5e9 < 0.01
    # active: everything but the experts a token does not use
    per_expert = 3 * hf.hidden_size * hf.moe_intermediate_size
    assert active == total - len(hf.moe_layers) * (hf.num_experts - hf.num_experts_per_tok) * per_expert
    # The model card's figures (30.5 B total, 29.9 B non-embedding, 3.3 B activated) are the exact
    # counts cut to one decimal: 3.353 B active is 1.6 % above "3.3", a truncation, not a miscount.
    embeddings = 2 * hf.vocab_size * hf.hidden_size  # untied input embedding and output layer
    assert [int(n // 1e8) for n in (total, total - embeddings, active)] == [305, 299, 33]
    assert abs(active - 3.3e9) / 3.3e9 < 0.02
    # one rank holding the whole model holds exactly that (151,936 rows are a multiple of 128) ...
    [stage] = rank_parameters(hf, ParallelConfig(), ModelOptions(params_dtype="bf16"))
    assert stage.total == total
    # ... and at tp 4 ep 8: vocabulary padded to a multiple of 128 × 4 = 152,064 rows and split;
    # per layer QKV [(32 + 2·4)·128 / 4, 2048], output projection [2048, 32·128 / 4], q/k norms,
    # two layer norms and the router [128, 2048] (replicated); 16 local experts
    [shard] = rank_parameters(hf, ParallelConfig(tp=4, ep=8), ModelOptions(params_dtype="bf16"))
    layer = 40 * 128 // 4 * 2048 + 2048 * (32 * 128 // 4) + 2 * 128 + 2 * 2048 + 128 * 2048
    assert shard.dense == 2 * 152_064 // 4 * 2048 + 2048 + 48 * layer
    assert shard.expert == 48 * 16 * 3 * 2048 * 768


# ------------------------------------------------------------------ memory terms
def _recipe(*overrides: str):
    return load_experiment(RECIPE_30B, list(overrides), check_model=False)


def test_static_memory_closed_forms_for_the_30b_layout():
    plan = make_plan(_recipe(), HFModelConfig.load(QWEN3_30B))
    [stage] = plan.stages
    dense, expert = stage.params.dense, stage.params.expert
    assert (plan.dp, plan.expert_dp) == (8, 4)
    assert stage.static.weights == 2 * (dense + expert)  # bf16
    assert stage.static.grads == 4 * (dense + expert)  # fp32 main grads
    assert stage.static.optimizer == 12 * (math.ceil(dense / 8) + math.ceil(expert / 4))
    assert stage.static.optimizer_replicated == 12 * (dense + expert)
    assert plan.distributed_optimizer and stage.static.optimizer < stage.static.optimizer_replicated
    # 16 of 128 experts per rank, each 3·2048·768, in 48 layers
    assert expert == 48 * 16 * 3 * 2048 * 768


def test_activations_shrink_with_recompute_and_grow_with_pipeline_in_flight():
    hf = HFModelConfig.load(QWEN3_30B)
    p = ParallelConfig(tp=4, ep=8)
    layers = tuple(range(48))
    kw = dict(tokens=18_432, act_bytes=2)
    full = stage_activation_bytes(hf, p, layers, recompute="full", in_flight=1, **kw)
    none = stage_activation_bytes(hf, p, layers, recompute="none", in_flight=1, **kw)
    assert none > 10 * full
    # full recompute keeps b·h/tp per token and layer, plus one rebuilt layer and the dispatch buffers
    kept = 18_432 * 48 * 2 * 2048 / 4
    assert kept < full < kept + none / 48 * 1.5
    two = stage_activation_bytes(hf, p, layers, recompute="none", in_flight=2, **kw)
    assert two == pytest.approx(2 * none, rel=0.01)


def test_kv_cache_per_token_closed_form():
    hf = HFModelConfig.load(QWEN3_30B)
    # 2 (K, V) × 48 layers × KV heads per rank × 128 × 2 bytes; 4 KV heads split over TP, replicated beyond
    assert kv_bytes_per_token(hf, 1) == 2 * 48 * 4 * 128 * 2
    assert kv_bytes_per_token(hf, 4) == 2 * 48 * 1 * 128 * 2
    assert kv_bytes_per_token(hf, 8) == kv_bytes_per_token(hf, 4)
    plan = make_plan(_recipe(), hf)
    r = plan.rollout
    assert (r.profile.tp, r.profile.sequences) == (4, 512)  # sglang tp_size; an engine's share of the step
    assert r.weights == parameter_counts(hf)[0] * 2 / 4
    # SGLang admits by its own pool: mem_fraction_static 0.7 of the GPU less the weights, whatever is in flight
    assert r.kv_cache == pytest.approx(0.7 * plan.allocation.gpu_bytes - r.weights)
    assert r.resident_sequences == int(r.kv_cache // ((2048 + 16_384) * 2 * 48 * 128 * 2)) == 89
    # max_inflight unset: as many in flight as the pool holds at full length
    assert r.inflight == r.inflight_cap == 89 and r.profile.requested_inflight is None


def test_requests_in_flight_beyond_the_kv_pools_full_length_sequences_are_refused(capsys):
    """R1: 512 requests in flight per engine against a pool of 89 full-length sequences lets SGLang
    retract responses for space (and those leave the loss): plan marks it, --check refuses it."""
    from bpo_megatron.cli import main
    from bpo_megatron.loop.preflight import check_inflight
    from bpo_megatron.loop.run_dir import RunRefused

    hf = HFModelConfig.load(QWEN3_30B)
    asked = make_plan(_recipe("rollout.sglang.max_inflight=512"), hf)
    r = asked.rollout
    assert (r.inflight, r.inflight_cap, r.profile.requested_inflight) == (512, 89, 512)
    assert not asked.inflight_ok and not asked.fits and asked.memory_ok
    with pytest.raises(RunRefused, match=r"^rollout.sglang.max_inflight=512 requests in flight per engine, more than "
                                         r"the 89 sequences of 18432 tokens its KV pool holds .* set it ≤ 89 or null"):
        check_inflight(asked)
    assert main(["plan", str(RECIPE_30B), "rollout.sglang.max_inflight=512"]) == 1
    out = capsys.readouterr().out
    assert ("→ requests in flight per engine: rollout.sglang.max_inflight=512 EXCEEDS the rule: at most the 89 "
            "full-length sequences its KV pool holds") in out
    assert "verdict: DOES NOT FIT (requests in flight exceed the KV pool)" in out
    # at the cap, or below it, it is kept and fits; a larger pool holds more
    within = make_plan(_recipe("rollout.sglang.max_inflight=89"), hf)
    assert within.fits and within.rollout.inflight == 89 and check_inflight(within) is None
    larger = make_plan(_recipe("rollout.sglang.mem_fraction_static=0.8"), hf).rollout
    assert larger.inflight == larger.inflight_cap == int((0.8 * 80e9 - r.weights) // (18_432 * 2 * 48 * 128 * 2)) == 107
    assert main(["plan", str(RECIPE_30B)]) == 0
    assert ("→ requests in flight per engine: 89 (rollout.sglang.max_inflight unset: at most the 89 full-length "
            "sequences its KV pool holds, so none is retracted for space" in capsys.readouterr().out)


def test_the_colocated_trainers_residual_and_the_engine_runtime_fit_outside_the_pool(capsys):
    """SGLang sizes its static pool (mem_fraction_static of the GPU) as if the GPU were empty; what
    the pool leaves must hold the engine's runtime and what the offloaded trainer keeps: its CUDA
    context and one set of NCCL buffers per communicator it uses."""
    from bpo_megatron.cli import main
    from bpo_megatron.planner.plan import RESERVED_BYTES
    from bpo_megatron.planner.rollout import NCCL_COMMUNICATOR_BYTES, TRAINER_CONTEXT_BYTES

    hf = HFModelConfig.load(QWEN3_30B)
    plan = make_plan(_recipe(), hf)
    residual = plan.trainer_residual
    assert residual.groups == ("tp", "ep", "dp", "expert dp")  # tp 4, ep 8, dp 8, expert dp 4; pp 1, etp 1
    assert residual.total == TRAINER_CONTEXT_BYTES + 4 * NCCL_COMMUNICATOR_BYTES
    assert plan.rollout_outside_pool == RESERVED_BYTES + residual.total <= 0.3 * plan.allocation.gpu_bytes
    assert plan.rollout_peak == plan.rollout.total + plan.rollout_outside_pool and plan.fits
    assert main(["plan", str(RECIPE_30B)]) == 0
    out = capsys.readouterr().out
    assert ("colocated trainer's residual when offloaded (CUDA context, 4 NCCL communicators: tp, ep, dp, expert dp)"
            in out)
    assert "→ outside the pool 7.20 GB within the (1 − 0.7) × 80 GB = 24.00 GB it leaves" in out
    # apart, the trainer leaves the engines' GPUs alone; a pool that leaves too little does not fit
    assert make_plan(_recipe("cluster.colocate=false", "cluster.offload=auto", "cluster.nodes=8"), hf).trainer_residual is None
    tight = make_plan(_recipe("rollout.sglang.mem_fraction_static=0.95"), hf)
    assert not tight.fits and tight.rollout_outside_pool > 0.05 * tight.allocation.gpu_bytes
    assert main(["plan", str(RECIPE_30B), "rollout.sglang.mem_fraction_static=0.95"]) == 1
    assert "EXCEED the (1 − 0.95) × 80 GB = 4.00 GB it leaves: lower mem_fraction_static" in capsys.readouterr().out


# ------------------------------------------------------------------ checks, verdict, sweep
def test_the_30b_recipe_passes_plan_on_4x8x80(capsys):
    from bpo_megatron.cli import main

    assert main(["plan", str(RECIPE_30B)]) == 0
    out = capsys.readouterr().out
    assert "4 node(s) × 8 GPUs × 80 GB" in out
    assert "verdict: FITS" in out and "FAIL" not in out
    plan = make_plan(_recipe(), HFModelConfig.load(QWEN3_30B))
    assert plan.fits and plan.train_peak < 80e9 and plan.rollout_peak < 80e9
    # background evaluation on GPUs of its own: two engines of 4 GPUs need a fifth node
    background = make_plan(_recipe("eval.mode=background", "eval.engines=2", "cluster.nodes=5"),
                           HFModelConfig.load(QWEN3_30B))
    assert background.fits and any("+ evaluation engines 8 GPUs ≤ 40" in c.message for c in background.checks)


def test_checks_name_what_to_change():
    hf = HFModelConfig.load(QWEN3_30B)
    cases = [
        (["parallel.pp=5", "cluster.trainer_ranks=160"], "parallel.pp=5 must divide the model's 48 layers"),
        (["parallel.ep=256", "parallel.tp=1", "cluster.trainer_ranks=256"],
         "parallel.ep=256 must divide the model's 128 experts"),
        (["cluster.colocate=false", "cluster.offload=auto"], "trainer 32 + engines 32 GPUs ≤ 32"),
        (["eval.mode=background", "eval.engines=2"], "colocated: trainer 32 and engines 32 GPUs each + evaluation "
                                                     "engines 8 GPUs ≤ 32 (cluster.trainer_ranks, rollout.num_engines, "
                                                     "cluster.gpus_per_engine, eval.mode, eval.engines)"),
        (["cluster.gpus_per_engine=2"], "a sglang engine of tp 4 needs 4 GPUs"),
        (["parallel.tp=8", "cluster.gpus_per_node=4", "cluster.nodes=8"], "parallel.tp=8 must divide the 4 GPUs"),
    ]
    for overrides, message in cases:
        plan = make_plan(_recipe(*overrides), hf)
        failed = [c.message for c in plan.checks if not c.ok]
        assert any(message in m for m in failed), (overrides, failed)
        assert not plan.fits


def test_memory_verdict_against_a_smaller_gpu(capsys):
    from bpo_megatron.cli import main

    assert main(["plan", str(RECIPE_30B), "--gpu-memory-gb", "40"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit in 40 GB" in out and "verdict: DOES NOT FIT (memory exceeds the GPU)" in out


def test_sweep_lists_fitting_layouts_best_first(capsys):
    cfg, hf = _recipe(), HFModelConfig.load(QWEN3_30B)
    result = sweep(cfg, hf, Allocation(nodes=4, gpus_per_node=8, gpu_memory_gb=80))
    layouts = [(p.cfg.parallel.tp, p.cfg.parallel.pp, p.cfg.parallel.ep, p.cfg.parallel.expert_tp) for p in result.plans]
    assert (4, 1, 8, 1) in layouts  # the recipe's own
    assert all(p.fits and p.cfg.cluster.trainer_ranks == 32 for p in result.plans)
    keys = [(p.cfg.parallel.pp, p.cfg.parallel.tp, p.cfg.parallel.cp, p.cfg.parallel.expert_tp, p.train_peak)
            for p in result.plans]
    assert keys == sorted(keys)
    assert {p.cfg.parallel.cp for p in result.plans} >= {1, 2}  # packed micro-batches: CP is a candidate too
    assert result.rejected  # e.g. ep=1 keeps all 128 experts on every rank
    from bpo_megatron.cli import main

    # on 2 nodes the recipe's 8 engines of 4 GPUs do not fit; with 4 engines layouts do
    assert main(["plan", str(RECIPE_30B), "--sweep", "--nodes", "2"]) == 1
    assert "engines 32 GPUs each ≤ 16" in capsys.readouterr().out
    assert main(["plan", str(RECIPE_30B), "rollout.num_engines=4", "--sweep", "--nodes", "2", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) × 8 GPUs" in out and "tp  pp  cp  ep  etp  dp" in out and "more (--limit)" in out


def test_plan_reads_a_bare_config_json(tmp_path, capsys):
    from bpo_megatron.cli import main

    assert main(["plan", str(ROOT / "configs" / "tiny_moe_cpu.yaml"), "--hf-config", str(th.TINY_MOE)]) == 0
    assert "training memory per rank (MB)" in capsys.readouterr().out
    assert main(["plan", str(RECIPE_30B), "--hf-config", str(tmp_path / "missing.json")]) == 2


def test_plan_states_the_driver_memory_and_the_expected_weight_sync():
    from bpo_megatron.planner import format_plan, make_plan
    from bpo_megatron.planner.sync import expected_sync
    from bpo_megatron.weights.names import hf_tensor_count

    configs = Path(__file__).resolve().parents[1] / "configs"
    for recipe, transport in (("qwen3_30b_a3b_bpo.yaml", "cuda_ipc"),
                              ("qwen3_30b_a3b_bpo_disaggregated.yaml", "nccl_broadcast")):
        cfg = load_experiment(configs / recipe)
        plan = make_plan(cfg, cfg.hf_config())
        estimate = expected_sync(cfg, plan.hf, plan.model_size[0])
        assert estimate.transport == transport and 3.0 < estimate.seconds < 10.0
        assert sum(estimate.parts.values()) == pytest.approx(estimate.seconds)
        text = format_plan(plan)
        assert f"weight sync ({transport}): ≈ {estimate.seconds:.1f} s" in text
        assert "driver host memory: 72 GiB" in text
    # 48 layers × (128 experts × 3 + router + 4 attention + 2 QK norms + 2 layer norms) + 3
    assert hf_tensor_count(cfg.hf_config()) == 48 * (128 * 3 + 1 + 8) + 3 == 18867
    # score centering's top-32 per response token: 32 int32 ids and 32 float32 log-probs, 256 bytes
    # × 4096 responses × 16,384 tokens = 16 GiB more samples, held twice
    from bpo_megatron.planner.host import driver_memory_gib, step_sample_bytes

    centered = load_experiment(configs / "qwen3_30b_a3b_bpo.yaml", ["loss.score_centering=true"])
    assert step_sample_bytes(centered) - step_sample_bytes(cfg) == 4096 * 16_384 * 256 == 16 * 2**30
    assert driver_memory_gib(centered) == math.ceil(2 * step_sample_bytes(centered) / 2**30) + 16 == 104
    assert ("driver host memory: 104 GiB (a step's samples, 43.8 GiB at their longest, score centering's top-32 "
            "included (256 bytes a response token)" in format_plan(make_plan(centered, centered.hf_config())))
    demo = load_experiment(configs / "tiny_moe_cpu.yaml")
    assert expected_sync(demo, demo.hf_config(), 0) is None  # the embedded engine, no GPU transport
    assert hf_tensor_count(demo.hf_config()) == 45  # what a sync of the demo model sends (bench test)


# ------------------------------------------------------------------ host memory at a checkpoint save
def test_rank_host_memory_closed_forms():
    from bpo_megatron.planner.host import rank_host

    # DP rank 0 of a dense optimizer of 100 M parameters over dp 2: it writes its own half of the
    # fp32 state (12 B per parameter it owns) and the bf16 weights (2 B × 100 M); nothing gathered
    r = rank_host(100_000_000, 0, stage=0, param_bytes=2, offload_bytes=7, dp=2, expert_dp=1,
                  dense_writer=True, expert_writer=False, distributed=True)
    assert r.fp32_state == 12 * 50_000_000 and r.weights == 2 * 100_000_000
    assert r.staging == 12 * 50_000_000 + 2 * 100_000_000  # held until written, in the background too
    assert r.at_save == r.staging + 7 and r.load == 12 * 50_000_000
    # the other DP rank writes its own half of the state and no weights; a resume reads its half
    other = rank_host(100_000_000, 0, stage=0, param_bytes=2, offload_bytes=7, dp=2, expert_dp=1,
                      dense_writer=False, expert_writer=False, distributed=True)
    assert (other.fp32_state, other.weights, other.staging, other.load) == (12 * 50_000_000, 0, 12 * 50_000_000,
                                                                           12 * 50_000_000)
    # the state shrinks with DP (the gathered format held 12 B × 100 M on DP rank 0 at any dp);
    # expert parameters are sharded over expert DP, shards rounded up
    wide = rank_host(100_000_001, 30, stage=0, param_bytes=2, offload_bytes=0, dp=8, expert_dp=4,
                     dense_writer=True, expert_writer=True, distributed=True)
    assert wide.fp32_state == 12 * (12_500_001 + 8) and wide.weights == 2 * (100_000_001 + 30)
    # without the distributed optimizer the state is staged from the GPU and a load reads into it
    plain = rank_host(100, 50, stage=0, param_bytes=2, offload_bytes=0, dp=2, expert_dp=1,
                      dense_writer=True, expert_writer=True, distributed=False)
    assert (plain.staging, plain.load) == (12 * 150 + 2 * 150, 0)


def _host_closed_form(written: list[tuple[int, int]], shard: int, pinned: int) -> float:
    """Node host memory at a save: each rank holds its own shard of the fp32 state (``shard``
    bytes), the bf16 weights of the (dense, expert) parameters it writes (2 B each) and its pinned
    offload buffers; then the margin, 10 % and 8 GB per GPU of the 8."""
    counted = sum(shard + 2 * (d + e) + pinned for d, e in written)
    return counted * 1.1 + 8 * 8e9


def test_host_memory_at_a_save_for_both_30b_recipes_closed_forms(capsys):
    from bpo_megatron.cli import main

    hf = HFModelConfig.load(QWEN3_30B)
    # colocated, tp 4 ep 8 dp 8 (expert dp 4) on 4 nodes of 8: every rank writes its own shard of the
    # optimizer state (12 B per owned parameter); node 0 holds DP rank 0 of the dense optimizer
    # (ranks 0-3) and of the expert optimizer (ranks 0-7), which write the bf16 weights; all hold
    # offload buffers of their optimizer shard (cluster.offload=optimizer, what auto would choose,
    # offloads the optimizer state alone, the bf16 weights stay beside the engines), gradients not moved
    plan = make_plan(_recipe("cluster.offload=optimizer"), hf)
    [stage] = plan.stages
    d, e = stage.params.dense, stage.params.expert
    shard = 12 * (math.ceil(d / 8) + math.ceil(e / 4))
    pinned = shard
    assert plan.offload.parts == "optimizer" and pinned == stage.static.optimizer
    host = plan.host
    assert sum(r.dense_writer for r in host.save_ranks) == 4 and all(r.expert_writer for r in host.save_ranks)
    assert all(r.fp32_state == shard for r in host.ranks)  # every rank its own shard, none more
    assert host.at_save == pytest.approx(_host_closed_form([(d, e)] * 4 + [(0, e)] * 4, shard, pinned), rel=1e-12)
    assert host.at_load == pytest.approx(8 * shard * 1.1 + 64e9, rel=1e-12)
    # the gathered format held 12 B of every parameter of the model shard on DP rank 0: on this node
    # 4 × 12 (d + e) + 4 × 12 e more than the shards
    gathered = host.at_save + 1.1 * (4 * 12 * (d + e) + 4 * 12 * e - 8 * shard)
    assert 300e9 < host.at_save < 400e9 and gathered > 1.8 * host.at_save and plan.fits
    # offloading the weights too (the recipe's choice) pins 2 B more per parameter of every rank
    everything = make_plan(_recipe(), hf)
    assert everything.offload.parts == "everything"
    colocated = _host_closed_form([(d, e)] * 4 + [(0, e)] * 4, shard, pinned + 2 * (d + e))
    assert everything.host.at_save == pytest.approx(colocated, rel=1e-12)
    # disaggregated, tp 4 pp 1 dp 4 ep 8 (expert dp 2) on 16 ranks, no offloading: node 0 holds DP
    # rank 0 of the dense optimizer (ranks 0-3) and of the expert optimizer (ranks 0-7), the shards
    # of the colocated layout's
    plan = make_plan(load_experiment(ROOT / "configs" / "qwen3_30b_a3b_bpo_disaggregated.yaml", check_model=False), hf)
    [apart] = plan.stages
    assert (apart.params.dense, apart.params.expert) == (d, stage.params.expert)
    apart_shard = 12 * (math.ceil(d / 4) + math.ceil(e / 2))
    expected = _host_closed_form([(d, e)] * 4 + [(0, e)] * 4, apart_shard, 0)
    assert plan.host.at_save == pytest.approx(expected, rel=1e-12)
    assert 300e9 < plan.host.at_save < 400e9 and plan.fits
    # what plan prints, and its verdict against the node's memory
    for recipe, at_save, state in (("qwen3_30b_a3b_bpo.yaml", colocated, 8 * shard),
                                   ("qwen3_30b_a3b_bpo_disaggregated.yaml", expected, 8 * apart_shard)):
        assert main(["plan", str(ROOT / "configs" / recipe)]) == 0
        out = capsys.readouterr().out
        assert re.search(r"at a checkpoint save \(blocking or background: the staged copy is held until written\) +"
                         rf"{at_save / 1e9:.2f}\n", out), out
        assert re.search(r"fp32 master weights \+ 2 Adam moments, each rank its own shard \(12 B per parameter it "
                         rf"owns\) +{state / 1e9:.2f}\n", out), out
        assert "8 ranks: each writes its own optimizer shard; 4 write dense and expert weights, 4 write expert " \
               "weights" in out
        assert "fits in 1000 GB per node (plan --host-memory-gb)" in out and "verdict: FITS" in out
    assert main(["plan", str(RECIPE_30B), "--host-memory-gb", "350"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit in 350 GB per node" in out
    assert "pinned offload buffers (cluster.offload: everything; allocated before step 1, dropped before each save, " \
           "counted)" in out
    assert "verdict: DOES NOT FIT (host memory exceeds the node)" in out


def test_an_unset_params_dtype_is_planned_as_the_allocations_ranks_build_it():
    hf = HFModelConfig.load(QWEN3_30B)
    # the planner runs on a machine without a GPU; the trainer ranks of a GPU allocation train in bf16
    plan = make_plan(_recipe("model.params_dtype=null"), hf)
    assert plan.cfg.model.options.params_dtype is None and plan.precision.param_bytes == 2
    cpu = make_plan(_recipe("model.params_dtype=null"), hf, Allocation(nodes=1, gpus_per_node=0, gpu_memory_gb=80))
    assert cpu.precision.param_bytes == 4 and cpu.host is None


def test_the_readmes_context_parallel_plans_are_what_plan_prints(capsys):
    """Each line the README quotes under "Long samples" is a line of the command above it, as it
    prints now (a plan that changes fails here until the README shows it)."""
    from bpo_megatron.cli import main

    block = (ROOT / "README.md").read_text().split("## Long samples: context parallelism")[1].split("```text\n")[1]
    block = block.split("```")[0]
    commands: list[tuple[list[str], list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ bpo-megatron "):
            commands.append((line[len("$ bpo-megatron "):].split(), []))
        else:
            commands[-1][1].append(line)
    assert len(commands) == 2 and all(quoted for _, quoted in commands)
    for argv, quoted in commands:
        main(argv)
        printed = capsys.readouterr().out.splitlines()
        for line in quoted:
            assert line in printed, line


def test_the_pace_estimate_of_engines_apart_against_closed_forms(capsys):
    """Disaggregated: a step's training time is the model's FLOPs (forward, backward, a recomputed
    forward) over the trainer's GPUs at the assumed MFU; its rollout time is decode steps × one
    step's read of the engine GPU's weights and KV cache at the assumed bandwidth, the step count
    the larger of the response tokens over the requests in flight and the longest response."""
    from bpo_megatron.cli import main
    from bpo_megatron.planner import overlap

    hf = HFModelConfig.load(QWEN3_30B)
    cfg = load_experiment(ROOT / "configs" / "qwen3_30b_a3b_bpo_disaggregated.yaml", check_model=False)
    plan = make_plan(cfg, hf)
    r = plan.rollout
    lengths = [(2048, 16_384)] * 4096  # every sample at the caps
    # 2 FLOPs per active matrix weight (the input embedding is a lookup) and per (query, key) pair
    # 2 · 32 heads · (128 + 128) per layer, over 18,431 causal positions; × 4: forward, backward, recompute
    matmul = parameter_counts(hf)[1] - 151_936 * 2048
    n = 18_431
    forward = 4096 * (2 * matmul * n + 2 * 32 * 256 * 48 * n * (n + 1) / 2)
    assert overlap.train_seconds(plan, lengths) == pytest.approx(forward * 4 / (16 * 989e12 * 0.25))
    step = overlap.decode_step_seconds(plan, 2048 + 8192)
    assert step == pytest.approx((parameter_counts(hf)[0] * 2 / 4 + r.inflight * 10_240 * 2 * 48 * 128 * 2)
                                 / (3.35e12 * 0.5))
    # 4096 × 16,384 tokens over 14 engines × 107 requests: 44,800 decode steps (more than the longest's 16,384)
    assert r.inflight == 107
    assert overlap.rollout_seconds(plan, lengths, 14) == pytest.approx(4096 * 16_384 / (14 * 107) * step)
    assert overlap.rollout_seconds(plan, lengths[:10], 14) == pytest.approx(16_384 * step)  # the longest one's
    times = overlap.step_times(plan)
    assert times.engines == 14 and times.engines_to_keep_pace == 13 and times.rollout_s < times.train_s
    assert main(["plan", str(ROOT / "configs" / "qwen3_30b_a3b_bpo_disaggregated.yaml")]) == 0
    out = capsys.readouterr().out
    assert (f"rollout ≈ {times.rollout_s:.0f} s per step on 14 engine(s), training ≈ {times.train_s:.0f} s on 16 ranks, "
            "so the engines wait for the trainer; 13 engine(s) keep pace (rollout.num_engines); "
            "train.async.max_staleness=1: the slower side sets the step") in out
    # colocated, the phases alternate: no pace line
    assert main(["plan", str(RECIPE_30B)]) == 0 and "pace (engines" not in capsys.readouterr().out
