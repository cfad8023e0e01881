"""The one-request-per-sample client keeps an SGLang server's KV pool full: the measurement of
``concurrency.py`` beside this file at a small size, against the stand-in (SGLang 0.5.23's own HTTP
server, our scheduler in outline)."""

from __future__ import annotations

import argparse

import pytest

from test_sglang_contract import SGLANG_PYTHON

pytestmark = [
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is missing: bash tools/setup.sh --sglang"),
    pytest.mark.timeout(400),
]


@pytest.mark.slow  # CI time (≈ 80 s; a benchmark at small size): run with -m slow
def test_one_request_per_sample_keeps_the_kv_pool_full():
    from concurrency import run

    # a pool of ~170 average sequences, 256 samples: the pool stays supplied while work waits
    args = argparse.Namespace(kv_tokens=12288, prompts=32, group=8, max_new_tokens=128, step_ms=2.0, seq_us=20.0,
                              max_inflight=256)
    per_sample = run(args)
    assert per_sample["samples"] == 256
    assert per_sample["supplied"] >= 0.9, per_sample


def test_a_retried_request_carries_a_fresh_rid():
    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.sglang.client import _Attempt
    from bpo_megatron.rollout.sglang.protocol import generate_body
    from bpo_megatron.rollout.types import response_slots

    slot = response_slots([GenerationRequest("q", (1, 2), SamplingParams(n=2, seed=3))])[1]
    first, second = _Attempt(slot, 0), _Attempt(slot, 2)
    assert first.rid == slot.rid == "q#1" and second.rid == "q#1.retry2"
    body = generate_body([second], capture_routing=True)
    assert body["rid"] == ["q#1.retry2"] and body["sampling_params"][0]["sampling_seed"] == slot.seed
