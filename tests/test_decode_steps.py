"""The kit's decode points (``bpo_megatron/gpu_smoke/decode_steps.py``, ``rollout_decode``'s part 3)
on a CPU: a decode state built as the engine builds it (the graph path with capture faked, as in
tests/test_hf_decode_path.py) replayed with every row at a set context, plain and with top-k/top-p;
and a profiled replay's trace (``rollout_decode``'s numbers in the kit's CPU run: tests/test_gpu_smoke.py)."""

from __future__ import annotations

import gzip
import json

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
