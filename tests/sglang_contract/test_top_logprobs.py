"""Score centering's sampler top-k over SGLang 0.5.23's own code, in a process of SGLang's
environment: SGLang parses our ``/generate`` body's ``top_logprobs_num`` (``GenerateReqInput``,
batched), and the ``meta_info.output_top_logprobs`` its own code builds from a log-prob tensor
(``get_top_logprobs`` in layers/logprob_processor.py, ``TokenizerManager.detokenize_top_logprobs_tokens``),
sent as JSON, decodes into the sample's ``sampler_head_ids`` / ``sampler_head_logprobs``: the top-k
of that tensor. Needs that environment (``bash tools/setup.sh --sglang``); skips without it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from bpo_megatron.rollout import GenerationRequest, SamplingParams
from bpo_megatron.rollout.sglang.protocol import decode_sample, generate_body
from bpo_megatron.rollout.types import ProtocolError, response_slots

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"

pytestmark = pytest.mark.skipif(not SGLANG_PYTHON.exists(),
                                reason="SGLang's environment is missing: bash tools/setup.sh --sglang")

SGLANG_SIDE = """
import json, sys, torch
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.layers.logprob_processor import get_top_logprobs
from sglang.srt.managers.tokenizer_manager import TokenizerManager, _build_flat_top_logprobs_fields
body, logprobs_path, out_path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
request = GenerateReqInput(**body)
request.normalize_batch_and_arguments()
asked = request.top_logprobs_num
manager = TokenizerManager.__new__(TokenizerManager)  # its formatting methods only, no server behind it
manager.tokenizer = None
logprobs = torch.load(logprobs_path)  # [responses, tokens, vocab]
responses = []
for row, k in enumerate(asked):
    values, indices = get_top_logprobs(logprobs[row], [k] * logprobs.shape[1])
    top = manager.detokenize_top_logprobs_tokens(values, indices, False)
    sampled = logprobs[row].argmax(-1)
    token_logprobs = [[float(logprobs[row, t, s]), int(s), None] for t, s in enumerate(sampled.tolist())]
    # the flat form asked for, as SGLang's tokenizer manager builds it on a finished response
    flat = _build_flat_top_logprobs_fields("output", values, indices, k,
                                           return_b64=request.return_flat_raw_top_logprobs_b64)
    responses.append({"output_ids": sampled.tolist(), "meta_info": {
        "id": body["rid"][row], "output_token_logprobs": token_logprobs, "output_top_logprobs": top,
        "finish_reason": {"type": "length"}}, "flat": flat})
json.dump({"asked": asked, "flat": [request.return_flat_raw_output_top_logprobs,
                                    request.return_flat_raw_top_logprobs_b64],
           "responses": responses}, open(out_path, "w"))
"""


def test_sglang_takes_top_logprobs_num_and_its_top_logprobs_decode_into_the_samples_head(tmp_path):
    requests = [GenerationRequest(f"r{i}", (1, 2, 3), SamplingParams(max_new_tokens=6, top_logprobs=k))
                for i, k in enumerate((4, 7))]
    items = response_slots(requests)
    body = generate_body(items, capture_routing=False)
    assert body["top_logprobs_num"] == [4, 7]
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(len(items), 6, 50, generator=gen, dtype=torch.float64) * 3, -1).float()
    torch.save(logprobs, tmp_path / "logprobs.pt")
    done = subprocess.run([str(SGLANG_PYTHON), "-c", SGLANG_SIDE, json.dumps(body), str(tmp_path / "logprobs.pt"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads((tmp_path / "out.json").read_text())
    assert answer["asked"] == [4, 7]
    assert answer["flat"] == [True, True]  # SGLang takes the flat base64 form we ask for
    for row, (item, response) in enumerate(zip(items, answer["responses"], strict=True)):
        k = item.request.sampling.top_logprobs
        values, ids = logprobs[row].topk(k, dim=-1)
        flat = response.pop("flat")
        assert set(flat) >= {"output_top_logprobs_val_flat_b64", "output_top_logprobs_idx_flat_b64"}
        # the flat form (what SGLang sends) and the nested one (its fallback) decode alike
        for meta in ({**{k_: v for k_, v in response["meta_info"].items() if k_ != "output_top_logprobs"}, **flat},
                     response["meta_info"]):
            sample = decode_sample(item, {**response, "meta_info": meta}, routing=None)
            assert sample.sampler_head_ids.dtype == torch.int32 and sample.sampler_head_ids.shape == (6, k)
            assert torch.equal(sample.sampler_head_ids.long(), ids)
            assert torch.equal(sample.sampler_head_logprobs, values)
        # the flat payload: 4 bytes a value and 4 an id, in base64 (4 characters per 3 bytes), where
        # the nested JSON spends more than 20 characters an entry
        entries = 6 * k
        for field in ("output_top_logprobs_val_flat_b64", "output_top_logprobs_idx_flat_b64"):
            assert len(flat[field]) == 4 * -(-entries * 4 // 3)
        assert len(json.dumps(response["meta_info"]["output_top_logprobs"])) > 20 * entries
        # flat arrays that do not match their shape are refused
        with pytest.raises(ProtocolError, match="output_top_logprobs_shape"):
            decode_sample(item, {**response, "meta_info": {**response["meta_info"], **flat,
                                                           "output_top_logprobs_shape": [5, k]}}, routing=None)
        # a response without them, or with fewer than asked, is refused
        with pytest.raises(ProtocolError, match="output_top_logprobs"):
            decode_sample(item, {**response, "meta_info": {k_: v for k_, v in response["meta_info"].items()
                                                           if k_ != "output_top_logprobs"}}, routing=None)
        short = [entries[:k - 1] for entries in response["meta_info"]["output_top_logprobs"]]
        with pytest.raises(ProtocolError, match="fewer than"):
            decode_sample(item, {**response, "meta_info": {**response["meta_info"], "output_top_logprobs": short}},
                          routing=None)
    # a request that does not ask sends no top_logprobs_num
    plain = generate_body(response_slots([GenerationRequest("p", (1, 2), SamplingParams())]), capture_routing=False)
    assert "top_logprobs_num" not in plain
