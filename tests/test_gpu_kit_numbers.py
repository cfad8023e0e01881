"""The GPU kit's numbers, on a CPU: the FLOP count against a count by hand, the trace's phases and
host syncs on a synthetic trace (and the committed H200 trace), ``rl_loop``'s step report from a
synthetic ``metrics.jsonl``, and the round report's goals."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "tools" / "gpu" / "records"


# ------------------------------------------------------------------ FLOPs
def test_flops_equal_a_count_by_hand_of_the_kit_model_and_the_30b_slice():
    from bpo_megatron.gpu_smoke.flops import forward_flops, train_flops
    from bpo_megatron.gpu_smoke.profiles import GPU
    from bpo_megatron.models import HFModelConfig

    for config, (hidden, heads, kv_heads, head_dim, layers, experts, top_k, ffn, vocab) in (
            (GPU.large_model, (1024, 16, 4, 128, 16, 32, 4, 512, 151936)),
            (GPU.slice_model, (2048, 32, 4, 128, 4, 128, 8, 768, 151936))):
        hf = HFModelConfig.load(config)
        # one layer: q, k, v and o projections, the router, top-k experts of gate, up and down
        per_layer = (hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
                     + experts * hidden + top_k * 3 * hidden * ffn)
        lengths = [37, 5]
        pairs = 37 * 38 / 2 + 5 * 6 / 2  # position t attends to t positions
        got = forward_flops(hf, lengths)
        assert got.layers == 2 * per_layer * layers * 42
        assert got.attention == pytest.approx(4 * heads * head_dim * layers * pairs, rel=1e-12)  # QKᵀ and AV
        assert got.lm_head == 2 * vocab * hidden * 42
        assert got.total == pytest.approx(got.layers + got.attention + got.lm_head)
        assert train_flops(hf, lengths).transformer == pytest.approx(3 * (got.layers + got.attention))
    # the slice: ≈ 0.5 B weights a token goes through, 58% of them the output layer's
    slice_flops = forward_flops(HFModelConfig.load(GPU.slice_model), [1])
    assert slice_flops.total / 2 == pytest.approx(538.6e6, rel=1e-3)
    assert slice_flops.lm_head / slice_flops.total == pytest.approx(0.578, abs=1e-3)


def test_flops_count_the_chosen_experts_and_every_dense_layer():
    """Only ``num_experts_per_tok`` experts per MoE layer; norms' scales and the embedding are no products."""
    from bpo_megatron.gpu_smoke.flops import layer_weights_per_token
    from bpo_megatron.gpu_smoke.profiles import CPU
    from bpo_megatron.models import HFModelConfig

    base = HFModelConfig.load(CPU.slice_model)
    more = HFModelConfig.load({**CPU.slice_model, "num_experts_per_tok": 5})
    one_expert = 3 * base.hidden_size * base.moe_intermediate_size
    assert layer_weights_per_token(more) - layer_weights_per_token(base) == base.num_hidden_layers * one_expert
    wider_vocab = HFModelConfig.load({**CPU.slice_model, "vocab_size": 4096})
    assert layer_weights_per_token(wider_vocab) == layer_weights_per_token(base)


# ------------------------------------------------------------------ traces
def _op(name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launch(ts, correlation, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts, "dur": 2,
            "args": {"correlation": correlation}}


def _kernel(ts, dur, correlation):
    return {"ph": "X", "cat": "kernel", "name": f"k{correlation}", "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def _sync(ts, dur, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": tid, "ts": ts,
            "dur": dur, "args": {}}


def synthetic_step() -> list[dict]:
    """A step of two micro-batches on a GPU (µs): host work 0–100 with a sync at 50 inside aten::item;
    forward 1 launches at 100 and 150 (kernels 110–130, 160–200); backward 1 on autograd's thread
    300–400 (kernel 310–350); forward 2 from 400 (a sync at 450 inside aten::to); backward 2 500–600;
    gradients 600–700 (a sync at 650 inside aten::item), the optimizer step 700–800 (kernel 700–790),
    then 800–900."""
    main, autograd = 1, 2
    return [
        _op("aten::min", 0, 60), _op("aten::item", 40, 20), _sync(50, 5),
        _op("aten::mm", 100, 10), _launch(101, 1), _op("aten::mm", 150, 10), _launch(151, 2),
        _kernel(110, 20, 1), _kernel(160, 40, 2),
        _op("autograd::engine::evaluate_function: MmBackward0", 300, 40, tid=autograd), _launch(301, 3, tid=autograd),
        _op("autograd::engine::evaluate_function: AccumulateGrad", 350, 50, tid=autograd),
        _kernel(310, 40, 3),
        _op("aten::to", 440, 20), _sync(450, 7),
        _op("autograd::engine::evaluate_function: MmBackward0", 500, 100, tid=autograd),
        _op("aten::_foreach_norm", 600, 40), _op("aten::item", 645, 10), _sync(650, 3),
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "pid": 1, "tid": main,
         "ts": 700, "dur": 100, "args": {}},
        _op("aten::_foreach_add_", 700, 90), _launch(701, 4), _kernel(700, 90, 4),
        _op("aten::copy_", 800, 100),
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": main, "args": {"name": "main"}},
    ]


def test_trace_phases_and_host_syncs_of_a_synthetic_step():
    from bpo_megatron.gpu_smoke.trace import analyse

    a = analyse(synthetic_step())
    assert a.on_gpu and a.span == 900 and a.busy == 20 + 40 + 40 + 90 and a.kernels == 4
    rows = {r["phase"]: r for r in a.phase_rows()}
    assert list(rows) == ["before the first kernel", "forward 1", "backward 1", "forward 2", "backward 2",
                          "after backward: gradients finished, clipped", "optimizer step", "after the optimizer step"]
    assert [(p.start, p.end) for p in a.phases] == [(0, 101), (101, 300), (300, 400), (400, 500), (500, 600), (600, 700), (700, 800), (800, 900)]
    assert rows["forward 1"]["kernels"] == 2 and rows["forward 1"]["gpu_busy_ms"] * 1e3 == pytest.approx(60)
    assert rows["backward 1"]["kernels"] == 1 and rows["backward 1"]["gpu_idle"] == pytest.approx(0.6)
    assert rows["optimizer step"]["gpu_busy_ms"] * 1e3 == pytest.approx(90)
    assert [(s.phase, s.caller, s.wait) for s in a.syncs] == [
        ("before the first kernel", "aten::min", 5), ("forward 2", "aten::to", 7),
        ("after backward: gradients finished, clipped", "aten::item", 3)]
    assert rows["forward 2"]["host_syncs"] == 1 and rows["forward 2"]["sync_wait_ms"] * 1e3 == pytest.approx(7)


def test_trace_summary_prints_the_phase_table_and_the_syncs(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "tools" / "gpu" / "trace_summary.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = tmp_path / "step.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": synthetic_step()}).encode()))
    assert tool.main([str(path), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("span 0.9 ms; GPU busy 0.2 ms (4 kernels), idle 78.9% of the span")
    assert "where the 3 host syncs (synchronize calls) fall" in text
    assert "  forward 2: 1, 0.01 ms; aten::to (1)" in text
    assert "optimizer step" in text and "autograd::engine::evaluate_function: MmBackward0" in text


def test_trace_of_a_cpu_step_places_its_scalar_reads():
    from bpo_megatron.gpu_smoke.trace import analyse

    events = [_op("aten::sum", 0, 10), _op("aten::item", 10, 5), _op("aten::_local_scalar_dense", 11, 3),
              _op("autograd::engine::evaluate_function: SumBackward0", 20, 10), _op("aten::add_", 40, 10)]
    a = analyse(events)
    assert not a.on_gpu and math.isnan(a.idle_share)
    assert [r["phase"] for r in a.phase_rows()] == ["forward", "backward", "after the last backward"]
    assert [(s.phase, s.caller) for s in a.syncs] == [("forward", "aten::item")]


def test_the_committed_h200_trace_is_host_bound():
    """The 2026-11-27 trace of one micro-batch: 452 ms, the GPU busy 89 ms; its 37 host syncs."""
    from bpo_megatron.gpu_smoke.trace import analyse, load

    a = analyse(load(RECORDS / "h200-2026-11-27-train_micro_batch.json.gz"))
    assert a.span / 1e3 == pytest.approx(452.2, abs=0.1) and a.busy / 1e3 == pytest.approx(88.6, abs=0.1)
    assert len(a.syncs) == 37 and sum(s.wait for s in a.syncs) / 1e3 == pytest.approx(1.77, abs=0.01)
    rows = {r["phase"]: r for r in a.phase_rows()}
    assert rows["before the first kernel"]["wall_ms"] == pytest.approx(32.3, abs=0.1)
    assert rows["backward"]["wall_ms"] == pytest.approx(169.2, abs=0.1)
    assert rows["optimizer step"]["wall_ms"] == pytest.approx(39.1, abs=0.1)


# ------------------------------------------------------------------ rl_loop's step report
def _record(step, *, rollout, sync, train, step_s, push=None, driver=None, **extra):
    record = {"step": step, "time/rollout_s": rollout, "time/sync_s": sync, "time/train_s": train,
              "time/step_s": step_s, "time/driver_s": step_s - rollout - sync - train if driver is None else driver,
              "response_length_mean": 512.0, "routing_agreement": 0.96, "abs_logp_diff_mean": 0.004, "loss": 0.0,
              "grad_norm": 0.0, "sync_bytes": 2.4e9, "offload_bytes": 16.8e9, **extra}
    if push is not None:
        record["push_s"] = push
    return record


def test_rl_loop_report_keeps_push_apart_from_the_sync_phase_and_sums_the_phases(tmp_path):
    from bpo_megatron.gpu_smoke.loop_steps import judge, step_rows
    from bpo_megatron.gpu_smoke.profiles import GPU
    from bpo_megatron.gpu_smoke.report import Outcome
    from bpo_megatron.observability.metrics import read_metrics

    records = [_record(1, rollout=4.6, sync=9.1, train=2.6, step_s=21.0, push=2.8, offload_s=6.0),
               _record(2, rollout=3.3, sync=8.6, train=1.5, step_s=13.4, push=2.1, offload_s=0.4),
               _record(3, rollout=3.2, sync=0.5, train=1.4, step_s=5.2, push=0.25, offload_s=0.1),
               _record(4, rollout=3.0, sync=0.4, train=1.3, step_s=4.8, push=0.2, offload_s=0.1),
               {"step": 4, "eval/avg": 0.0}]  # not a step
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = step_rows(read_metrics(tmp_path), responses=128, devices=1)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[1]["sync_s"] == 8.6 and rows[1]["push_s"] == 2.1  # the phase and the push, each under its name
    assert rows[1]["onload_s"] == rows[1]["resume_s"] == "not recorded"
    out = Outcome("rl_loop")
    judge(out, rows, GPU, exited=0, devices=1, responses=128, precision="bf16")
    n = out.numbers
    assert n["steady_steps"] == "3,4" and n["steady_step_s"] == pytest.approx(5.0)  # median of steps ≥ 3
    assert n["steady_tokens_per_s_per_device"] == pytest.approx((128 * 512 / 5.2 + 128 * 512 / 4.8) / 2)
    assert n["push_s"] == pytest.approx(0.225) and n["offload_s"] == pytest.approx(0.1)
    assert n["steady_sync_s"] == pytest.approx(0.45) and n["onload_s"] == "not recorded"
    assert n["first_step_s"] == 21.0 and n["last_step_s"] == 4.8
    assert all(c.startswith("PASS") for c in out.criteria), out.criteria
    assert any("onload_s, resume_s" in note for note in out.notes)
    # a phase the report does not know of: the step is no longer made up by its phases
    hidden = [_record(s, rollout=3.0, sync=0.4, train=1.3, step_s=4.8, driver=0.05) for s in (1, 2, 3, 4)]
    out = Outcome("rl_loop")
    judge(out, step_rows(hidden, responses=128, devices=1), GPU, exited=0, devices=1, responses=128,
          precision="bf16")
    [phases] = [c for c in out.criteria if "sum to its time" in c]
    assert phases.startswith("FAIL") and "largest gap +0.0500 s" in phases


def test_rl_loop_report_of_an_older_run_and_a_short_one():
    """A run before push_s (the push then recorded as sync_seconds) and one with fewer than 3 steps."""
    from bpo_megatron.gpu_smoke.loop_steps import steady, step_rows

    old = [_record(s, rollout=3.3, sync=8.6, train=1.5, step_s=13.4, sync_seconds=2.1) for s in (1, 2, 3)]
    rows = step_rows(old, responses=128, devices=1)
    assert rows[0]["push_s"] == 2.1 and rows[0]["sync_s"] == 8.6 and rows[0]["offload_s"] == "not recorded"
    assert steady(rows)["push_s"] == 2.1 and steady(rows)["offload_s"] == "not recorded"
    short = steady(rows[:2])
    assert short["steady_steps"] == "none" and math.isnan(short["steady_step_s"]) and math.isnan(short["push_s"])


# ------------------------------------------------------------------ the round's goals
def test_round_goals_hold_miss_or_are_not_measured():
    from bpo_megatron.gpu_smoke.goals import GOALS, goal_lines, judge_goals

    checks = [{"name": "rl_loop", "error": "", "numbers": {"steady_step_s": 13.4, "steady_tokens_per_s_per_device": 15e3,
                                                            "push_s": "not recorded"}},
              {"name": "train_fast_paths", "error": "", "numbers": {"train_mfu_32k": 0.31,
                                                                     "layer_mfu_30b_slice": float("nan")}},
              {"name": "rollout_decode", "error": "not run: 3 s left of --total 465 s", "numbers": {}}]
    rows = {row["number"]: row for row in judge_goals(checks)}
    assert list(rows) == [goal.key for goal in GOALS]
    assert rows["steady_step_s"]["verdict"] == "misses: 2.98× the bound (8.9 s over)"
    assert rows["steady_tokens_per_s_per_device"]["verdict"] == "holds"
    assert rows["push_s"]["verdict"] == "not measured: not recorded"
    assert rows["train_mfu_32k"]["verdict"] == "holds, the stretch too" and rows["train_mfu_32k"]["measured"] == "31.0%"
    assert rows["layer_mfu_30b_slice"]["verdict"].startswith("not measured: nan")
    assert rows["best_graph_hbm_fraction_ctx576"]["verdict"] == \
        "not measured: rollout_decode has no best_graph_hbm_fraction_ctx576 (it did not run)"
    low = judge_goals([{"name": "rollout_decode", "error": "", "numbers": {"best_graph_hbm_fraction_ctx192": 0.152}}])
    assert low[6]["verdict"] == "misses: 46% of the bound (17.8 points short)"
    assert low[5]["verdict"].endswith("(it reports no such number)") and low[0]["verdict"].endswith("did not run in this round")
    text = "\n".join(goal_lines(list(rows.values()), dry_run=False))
    assert "2 of 8 hold, 1 miss, 5 not measured." in text
    assert "| training MFU at 32,768-position micro-batches | `train_fast_paths`: `train_mfu_32k` | ≥ 25.0% (stretch 30.0%) " \
           "| 31.0% | holds, the stretch too |" in text


def test_the_offload_residual_numbers_and_the_pool_fraction_they_allow():
    """trainer_offload's residual, with a background save in flight, from the device's used bytes:
    the save's share, the margin to the planner's residual, and the largest mem_fraction_static
    whose rest of the GPU holds the engine's runtime (4 GB) and that residual."""
    from bpo_megatron.gpu_smoke.checks.trainer_offload import GiB, residual_numbers
    from bpo_megatron.planner.plan import RESERVED_BYTES, largest_pool_fraction

    numbers = residual_numbers(used_offloaded=0.6 * GiB, used_offloaded_saving=0.9 * GiB, total=80 * GiB,
                               planned=0.8e9)
    assert numbers["device_used_offloaded_saving_gib"] == pytest.approx(0.9)
    assert numbers["background_save_residual_gib"] == pytest.approx(0.3)
    assert numbers["planned_residual_gib"] == pytest.approx(0.8e9 / GiB)
    # 0.9 GiB (0.966 GB) against the planned 0.8 GB: missed
    assert numbers["residual_margin_gib"] == pytest.approx(0.8e9 / GiB - 0.9) and numbers["residual_margin_gib"] < 0
    assert numbers["mem_fraction_static_allowed"] == pytest.approx((80 * GiB - 4e9 - 0.9 * GiB) / (80 * GiB))
    assert RESERVED_BYTES == 4e9
    # the larger of the two residuals counts, whichever it is
    assert residual_numbers(used_offloaded=2 * GiB, used_offloaded_saving=GiB, total=80 * GiB,
                            planned=3 * GiB)["residual_margin_gib"] == pytest.approx(1.0)
    # the 30B recipe's planned residual (4 communicators) on 80 GB: 1 − (4 + 0.8 + 2.4) / 80 = 0.91
    assert largest_pool_fraction(0.8e9 + 4 * 0.6e9, 80e9) == pytest.approx(0.91)
    assert largest_pool_fraction(100e9, 80e9) == 0.0
    with pytest.raises(ValueError, match="no pool to size"):
        largest_pool_fraction(0.0, 0.0)
