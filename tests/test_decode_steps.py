"""The kit's decode points (``bpo_megatron/gpu_smoke/decode_steps.py``, ``rollout_decode``'s part 3)
on a CPU: a decode state built as the engine builds it (the graph path with capture faked, as in
tests/test_hf_decode_path.py) replayed with every row at a set context, plain and with top-k/top-p;
a profiled replay's trace; and ``rollout_decode`` with its numbers, read from the kit's whole CPU run."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch
from test_hf_decode_path import _cpu_graph_capture

from bpo_megatron.gpu_smoke import decode_steps
from bpo_megatron.gpu_smoke.profiles import CPU
from bpo_megatron.rollout.hf import graphs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    from bpo_megatron.gpu_smoke.checks.rollout_decode import decode_model

    return decode_model(CPU)


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "top_k_top_p"])
def test_a_captured_state_replays_with_every_row_at_the_context(model, monkeypatch, tmp_path, filtered):
    with _cpu_graph_capture(monkeypatch) as captured:
        state = decode_steps.build_state(model, 8, 128, cuda_graph=True, compile_layers=False, filtered=filtered)
        assert isinstance(state._replay, graphs.GraphedStep) and captured
        sampler = state.sampler
        if filtered:  # rows alternate between top-p and top-k, each its own setting
            assert sampler.top_p[0::2].eq(0.95).all() and sampler.top_k[1::2].eq(50).all()
        seconds = decode_steps.time_step(state, 40, 6, model.config.vocab_size)
        assert seconds > 0
        # centred on the context: 40 − 6/2 − warm-up, then warm-up + 6 replays
        assert state.position.eq(40 + 6 - 3).all() and not state.done.any()
        assert state.routing[:, 1:10].ne(0).any()  # the replays routed the rows, each its own token
        numbers = decode_steps.profile_step(state, tmp_path / "traces" / "step.json.gz")
    assert numbers["gpu_ops"] == 0 and numbers["profiled_ms"] > 0  # no GPU here: host ops only
    events = json.loads(gzip.decompress((tmp_path / "traces" / "step.json.gz").read_bytes()))["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)


def test_a_point_past_the_state_or_the_uniforms_is_refused(model):
    state = decode_steps.build_state(model, 4, 64, cuda_graph=False, compile_layers=False, filtered=False)
    with pytest.raises(ValueError, match="need a longer state"):
        decode_steps.time_step(state, 60, 8, model.config.vocab_size)
    with pytest.raises(ValueError, match="at most 64 uniforms"):
        decode_steps.time_step(state, 20, 61, model.config.vocab_size)


@pytest.mark.timeout(1500)  # the kit's whole run (tests/conftest.py), if this test is the first to ask for it
def test_rollout_decode_in_the_kits_cpu_mode_reports_every_decode_point(kit_cpu_run):
    tmp_path, done = kit_cpu_run  # the kit's whole run: its rollout_decode check, which ran a second time alone
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [check] = [c for c in json.loads((tmp_path / "report" / "report.json").read_text())["checks"]
               if c["name"] == "rollout_decode"]
    numbers = check["numbers"]
    points = check["tables"]["decode step by context (replayed, largest size)"]
    assert {(r["point"], r["sampling"]) for r in points} == {(p.label, s) for p in CPU.decode_points
                                                             for s in ("plain", "filtered")}
    assert all(r["decode_step_ms"] > 0 and r["path"] == "eager" for r in points)
    # the goals' numbers are there on every device (nan without a graph); the scores cover every path's rows
    assert all(math.isnan(numbers[f"best_graph_hbm_fraction_{label}"]) for label in ("ctx192", "ctx576", "ctx1088"))
    assert numbers["eager_routing_agreement"] == 1.0 and numbers["eager_logp_max_abs_diff"] <= 1e-5
    assert (tmp_path / "work" / "traces" / "decode_step_eager_ctx576.json.gz").exists()
