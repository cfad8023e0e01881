"""The SGLang engine client's own parts: launch command, request bodies, response decoding,
payload construction. Everything that talks to a server is tested against SGLang's own code in
``tests/sglang_contract``."""

from __future__ import annotations

import base64
import inspect
import json
import pickle
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.rollout import GenerationRequest, SamplingParams
from bpo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from bpo_megatron.rollout.sglang.options import SGLangOptions
from bpo_megatron.rollout.sglang.protocol import ProtocolError, decode_sample, generate_body
from bpo_megatron.rollout.types import response_slots as expand
from bpo_megatron.rollout.sglang.weights import ALIGN, flattened_bucket, inline_serializer, ipc_payload, ipc_update_body

# a model of 2 layers, both MoE, top-2 of 4 experts
LAYOUT = RoutingLayout(num_hidden_layers=2, moe_layers=(0, 1), topk=2, num_experts=4)


# ------------------------------------------------------------------------- pure protocol
def test_launch_command_from_config():
    cfg = SGLangConfig(model_path="/ckpt/hf", port=31000, tp_size=4, mem_fraction_static=0.7,
                       extra_args=("--dtype", "bfloat16"))
    cmd = cfg.launch_command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == ["--model-path", "/ckpt/hf", "--host", "127.0.0.1", "--port", "31000", "--tp-size", "4",
                       "--skip-tokenizer-init", "--enable-return-routed-experts", "--enable-metrics",
                       "--mem-fraction-static", "0.7", "--dtype", "bfloat16"]
    assert "--enable-return-routed-experts" not in SGLangConfig(model_path="m", capture_routed_experts=False).launch_command()


def test_engine_i_of_a_run_gets_its_port_the_checkpoint_and_the_memory_saver_when_colocated():
    from bpo_megatron.rollout import EngineContext
    from bpo_megatron.rollout.sglang.options import SGLangOptions
    from bpo_megatron.rollout.sglang.spec import engine_config

    options = SGLangOptions(port=31000, tp_size=2)
    shared = engine_config(options, EngineContext("/ckpt", 3, LAYOUT, colocated=True))
    assert (shared.model_path, shared.port, shared.capture_routed_experts) == ("/ckpt", 31003, True)
    assert "--enable-memory-saver" in shared.launch_command()
    apart = engine_config(options, EngineContext("/ckpt", 0, None))
    assert apart.port == 31000 and not apart.capture_routed_experts
    assert "--enable-memory-saver" not in apart.launch_command()
    assert "--enable-return-routed-experts" not in apart.launch_command()


def test_generate_body_uses_sglang_field_names():
    items = expand([GenerationRequest("a", (5, 6), SamplingParams(temperature=0.5, top_k=0, max_new_tokens=9,
                                                                stop_token_ids=(2,), seed=3, n=2))])
    body = generate_body(items, capture_routing=True)
    assert body["rid"] == ["a#0", "a#1"] and body["input_ids"] == [[5, 6], [5, 6]]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 0
    first, second = body["sampling_params"]
    assert first == {"temperature": 0.5, "top_p": 1.0, "top_k": -1, "max_new_tokens": 9, "n": 1,
                     "skip_special_tokens": False, "no_stop_trim": True, "stop_token_ids": [2], "sampling_seed": 3}
    assert second["sampling_seed"] == 4  # one seed per sample, so the n samples differ


def test_decode_a_response_with_sglang_encodings():
    item = expand([GenerationRequest("r", (1, 2, 3))])[0]
    experts = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 4  # 3 prompt + 2 output − 1 rows
    response = {"output_ids": [9, 4], "meta_info": {
        "id": "r#0", "finish_reason": {"type": "stop", "matched": 4},
        "output_token_logprobs": [[-0.5, 9, None], [-1.25, 4, None]],
        "weight_versions": [{"version": "default", "start": 0, "end": 2}],
        "routed_experts": base64.b64encode(experts.tobytes()).decode()}}
    sample = decode_sample(item, response, routing=LAYOUT)
    assert sample.response_tokens.tolist() == [9, 4] and sample.finish_reason == "stop"
    assert sample.routing_valid is None  # one version: every token's routing is its own
    assert sample.rollout_logprobs.tolist() == [-0.5, -1.25]
    assert sample.routed_experts.dtype == torch.uint8  # 4 experts: ids travel as bytes
    assert torch.equal(sample.routed_experts, torch.from_numpy(experts).to(torch.uint8))


def test_routing_over_every_layer_keeps_the_moe_layers_rows():
    """SGLang returns a row for each of the model's layers, dense ones included; the MoE layers'
    rows are selected (here layer 0 is dense: its row holds what the server put there)."""
    item = expand([GenerationRequest("r", (1, 2, 3))])[0]
    layout = RoutingLayout(num_hidden_layers=3, moe_layers=(1, 2), topk=2, num_experts=200)
    experts = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2) * 7 % 200
    experts[:, 0] = -1  # what a dense layer's row may hold: never read
    response = {"output_ids": [9, 4], "meta_info": {
        "id": "r#0", "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 9, None], [-1.0, 4, None]],
        "weight_versions": [{"version": "default", "start": 0, "end": 2}],
        "routed_experts": base64.b64encode(experts.tobytes()).decode()}}
    sample = decode_sample(item, response, routing=layout)
    assert sample.routed_experts.shape == (4, 2, 2) and sample.routed_experts.dtype == torch.uint8
    assert torch.equal(sample.routed_experts.long(), torch.from_numpy(experts[:, 1:]).long())
    # decoded as MoE layers only, the same bytes would have been misread: refused by size
    with pytest.raises(ProtocolError, match="not a multiple of 4 x 3 layers"):
        decode_sample(item, {**response, "meta_info": {**response["meta_info"], "routed_experts":
                      base64.b64encode(experts[:, 1:].copy().tobytes()[:-8]).decode()}}, routing=layout)


def test_a_response_that_spans_a_weight_update_dates_every_token_from_sglangs_spans():
    """SGLang's ``meta_info.weight_versions`` (version strings over output-token ranges; "default"
    is the checkpoint the server started from): each token gets its version, the sample the
    oldest; ``meta_info.weight_version`` names only the last."""
    item = expand([GenerationRequest("r", (1, 2))])[0]
    response = {"output_ids": [5, 6, 7, 8], "meta_info": {
        "id": "r#0", "finish_reason": {"type": "length"},
        "output_token_logprobs": [[-1.0, 5, None], [-1.0, 6, None], [-2.0, 7, None], [-2.0, 8, None]],
        "weight_version": "4", "weight_versions": [{"version": "default", "start": 0, "end": 1},
                                                   {"version": "3", "start": 1, "end": 2},
                                                   {"version": "4", "start": 2, "end": 4}]}}
    sample = decode_sample(item, response, routing=None)
    assert sample.token_versions.tolist() == [0, 3, 4, 4] and sample.weight_version == 0
    one_version = {**response["meta_info"], "weight_versions": [{"version": "4", "start": 0, "end": 4}]}
    sample = decode_sample(item, {**response, "meta_info": one_version}, routing=None)
    assert sample.token_versions.tolist() == [4, 4, 4, 4] and sample.weight_version == 4
    without = {k: v for k, v in response["meta_info"].items() if k != "weight_versions"}  # an older server
    sample = decode_sample(item, {**response, "meta_info": without}, routing=None)
    assert sample.token_versions is None and sample.weight_version == 4
    for spans in ([{"version": "3", "start": 0, "end": 3}],  # a token without a version
                  [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 1, "end": 4}],  # overlap
                  [{"version": "x", "start": 0, "end": 4}]):  # not a version the trainer sent
        with pytest.raises(ProtocolError, match="weight_version"):
            decode_sample(item, {**response, "meta_info": {**without, "weight_versions": spans}}, routing=None)


def test_routing_is_valid_only_for_tokens_of_the_last_version_under_retract():
    """Under retract each weight update a request spans re-prefills it with the new weights, so the
    routing reported for every position is that of its last version: only the tokens that version
    sampled were sampled from it. In place, each position keeps the routing that processed it."""
    from bpo_megatron.rollout.sglang.protocol import routing_valid

    assert routing_valid(torch.tensor([0, 0, 1, 1]), "retract").tolist() == [False, False, True, True]
    assert routing_valid(torch.tensor([2, 3, 3, 5, 5]), "retract").tolist() == [False, False, False, True, True]
    assert routing_valid(torch.tensor([4, 4, 4]), "retract") is None  # none masked
    assert routing_valid(torch.tensor([], dtype=torch.long), "retract") is None
    assert routing_valid(torch.tensor([0, 0, 1, 1]), "in_place") is None
    with pytest.raises(ValueError, match="pause mode 'abort'"):
        routing_valid(torch.tensor([0, 1]), "abort")


def test_a_decoded_partial_rollout_marks_the_tokens_whose_routing_was_recomputed():
    """SGLang's spans say tokens 0–1 came from the checkpoint it started from and 2–3 from version
    1: with routing captured and the engine's retract, tokens 0 and 1 are not valid for R3."""
    from bpo_megatron.rollout.sglang import engine as engine_module

    item = expand([GenerationRequest("r", (1, 2))])[0]
    experts = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 4  # 2 prompt + 4 output − 1 rows
    meta = {"id": "r#0", "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-1.0, 5, None], [-1.0, 6, None], [-2.0, 7, None], [-2.0, 8, None]],
            "weight_version": "1", "weight_versions": [{"version": "default", "start": 0, "end": 2},
                                                       {"version": "1", "start": 2, "end": 4}],
            "routed_experts": base64.b64encode(experts.tobytes()).decode()}
    response = {"output_ids": [5, 6, 7, 8], "meta_info": meta}
    sample = decode_sample(item, response, routing=LAYOUT)
    assert sample.routing_valid.tolist() == [False, False, True, True]
    assert sample.token_versions.tolist() == [0, 0, 1, 1]
    assert decode_sample(item, response, routing=LAYOUT, pause_mode="in_place").routing_valid is None
    assert decode_sample(item, response, routing=None).routing_valid is None  # no routing to replay
    one = {**meta, "weight_versions": [{"version": "1", "start": 0, "end": 4}]}
    assert decode_sample(item, {**response, "meta_info": one}, routing=LAYOUT).routing_valid is None
    undated = {k: v for k, v in meta.items() if k != "weight_versions"}  # a server that does not date tokens
    with pytest.raises(ProtocolError, match="without meta_info.weight_versions"):
        decode_sample(item, {**response, "meta_info": undated}, routing=LAYOUT)
    # what the engine calls it with: its own pause mode
    assert inspect.signature(decode_sample).parameters["pause_mode"].default == engine_module.PAUSE_MODE


def test_a_request_retracted_for_kv_space_has_no_token_whose_routing_is_trusted():
    """SGLang counts every retraction in meta_info.num_retractions: those of the weight updates a
    request spanned (retract: one per version change) and those for KV space, after which it
    re-prefills the request with the same weights and reports the re-prefill's routing for every
    earlier position. It does not say where: every token of such a response is masked for R3, and
    counted (rollout/retracted_frac)."""
    from bpo_megatron.loop.samples import training_samples

    item = expand([GenerationRequest("r", (1, 2))])[0]
    experts = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 4
    meta = {"id": "r#0", "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-1.0, 5, None], [-1.0, 6, None], [-2.0, 7, None], [-2.0, 8, None]],
            "weight_versions": [{"version": "default", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 4}],
            "routed_experts": base64.b64encode(experts.tobytes()).decode()}
    decode = lambda **changes: decode_sample(item, {"output_ids": [5, 6, 7, 8], "meta_info": {**meta, **changes}},  # noqa: E731
                                             routing=LAYOUT)
    update_only = decode(num_retractions=1)  # the one retraction is the update's: as before
    assert update_only.routing_valid.tolist() == [False, False, True, True] and not update_only.retracted_for_space
    for space in (decode(num_retractions=2),  # one more than the update's
                  decode(num_retractions=1, weight_versions=[{"version": "1", "start": 0, "end": 4}])):
        assert space.retracted_for_space and space.routing_valid.tolist() == [False] * 4
    assert not decode().retracted_for_space  # SGLang reported none
    # without routing captured there is nothing to mask, and nothing retracted to count
    plain = decode_sample(item, {"output_ids": [5, 6, 7, 8], "meta_info": {**meta, "num_retractions": 3}}, routing=None)
    assert plain.routing_valid is None
    train, metrics = training_samples([decode(num_retractions=2), update_only], torch.tensor([1.0, 0.0]), 2,
                                      keep_routing=True)
    assert metrics["rollout/retracted_frac"] == 0.5
    assert train[0].train_mask.tolist() == [False] * 4 and train[1].train_mask.tolist() == [False, False, True, True]


def test_a_pause_that_retracted_a_request_before_its_first_token_is_no_retraction_for_space():
    """SGLang's ``retract`` pause also retracts a request still in chunked prefill: one more in its
    ``num_retractions``, and no output token yet to carry the version change. No sampled token lost
    its routing, so nothing is masked — when the server's count of retractions for KV space
    (``/metrics``) shows none since that pause (a retraction for space needs output: it would come
    after). Where that cannot be shown, the retraction counts as one for space, as before."""
    from bpo_megatron.rollout.sglang.protocol import Pause, retracted_before_output, space_retractions_total

    exposition = ("# TYPE sglang:num_retracted_requests_total counter\n"
                  'sglang:num_retracted_requests_total{model_name="m",tp_rank="0"} 3.0\n'
                  'sglang:num_retracted_requests_total{model_name="m",tp_rank="1"} 2.0\n'
                  'sglang:num_retracted_requests_created{model_name="m",tp_rank="0"} 1.7e9\n'
                  'sglang:num_retracted_reqs{model_name="m",tp_rank="0"} 1.0\n')
    assert space_retractions_total(exposition) == 5.0
    assert space_retractions_total("sglang:num_running_reqs 1.0\n") is None  # metrics without the counter
    after = torch.tensor([1, 1, 1, 1])  # every token by the weights the pause brought
    assert retracted_before_output(1, after, [Pause(1, 5.0)], lambda: 5.0)
    assert not retracted_before_output(1, after, [Pause(1, 5.0)], lambda: 6.0)  # a space retraction since
    assert not retracted_before_output(2, after, [Pause(1, 5.0)], lambda: 5.0)  # more than the pauses could do
    assert not retracted_before_output(1, after, [Pause(2, 5.0)], lambda: 5.0)  # that pause came after token 0
    assert not retracted_before_output(1, after, [Pause(1, None)], lambda: 5.0)  # no count then
    assert not retracted_before_output(1, after, [Pause(1, 5.0)], None)  # no count now

    item = expand([GenerationRequest("r", (1, 2))])[0]
    experts = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 4
    response = {"output_ids": [5, 6, 7, 8], "meta_info": {
        "id": "r#0", "finish_reason": {"type": "length"}, "num_retractions": 1,
        "output_token_logprobs": [[-1.0, t, None] for t in (5, 6, 7, 8)],
        "weight_versions": [{"version": "1", "start": 0, "end": 4}],
        "routed_experts": base64.b64encode(experts.tobytes()).decode()}}
    kept = decode_sample(item, response, routing=LAYOUT, pauses=[Pause(1, 5.0)], space_retractions_now=lambda: 5.0)
    assert not kept.retracted_for_space and kept.routing_valid is None
    unknown = decode_sample(item, response, routing=LAYOUT)  # as the client decoded it before
    assert unknown.retracted_for_space and unknown.routing_valid.tolist() == [False] * 4


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r: r["meta_info"].pop("routed_experts"), "--enable-return-routed-experts"),
        (lambda r: r["meta_info"].update(routed_experts=base64.b64encode(b"\0" * 12).decode()), "not a multiple"),
        (lambda r: r["meta_info"].update(id="other#0"), "where 'r#0' was expected"),
        (lambda r: r.update(output_ids=[1]), "disagree"),
        (lambda r: r["meta_info"].pop("output_token_logprobs"), "return_logprob"),
    ],
)
def test_malformed_responses_are_refused(mutate, match):
    item = expand([GenerationRequest("r", (1, 2))])[0]
    experts = np.zeros((2, 2, 2), dtype=np.int32)
    response = {"output_ids": [5], "meta_info": {
        "id": "r#0", "finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 5, None]],
        "routed_experts": base64.b64encode(experts.tobytes()).decode()}}
    mutate(response)
    with pytest.raises(ProtocolError, match=match):
        decode_sample(item, response, routing=LAYOUT)


def test_a_flattened_bucket_holds_every_tensor_at_an_aligned_offset_bit_for_bit():
    """SGLang's flattened_bucket layout: its loader views flat[start_idx:end_idx] as the dtype and
    reshapes it, which needs each start aligned to the element size (mixed dtypes here)."""
    bucket = [("a", torch.randn(3, dtype=torch.bfloat16)), ("b", torch.randn(2, 5)),
              ("c", torch.arange(7, dtype=torch.int64)), ("d", torch.randn(4, 3).t())]
    flat = flattened_bucket(bucket)
    assert flat["flattened_tensor"].dtype == torch.uint8
    for (name, tensor), entry in zip(bucket, flat["metadata"]):
        assert entry.name == name and entry.start_idx % ALIGN == 0 and entry.numel == entry.end_idx - entry.start_idx
        view = flat["flattened_tensor"][entry.start_idx:entry.end_idx].view(entry.dtype).reshape(entry.shape)
        assert torch.equal(view, tensor)
    body = ipc_update_body([ipc_payload(flat, inline_serializer)] * 2, version=4)
    assert body["load_format"] == "flattened_bucket" and body["weight_version"] == "4"
    decoded = pickle.loads(base64.b64decode(body["serialized_named_tensors"][1]))
    assert torch.equal(decoded["flattened_tensor"], flat["flattened_tensor"])
    # without a test serializer only device memory may travel (CUDA IPC): host tensors are refused
    with pytest.raises(ValueError, match="host memory"):
        ipc_payload(flat)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"needs model_path \(model.path\) unless rollout.sglang.url"):
        SGLangConfig()
    with pytest.raises(ValueError, match="routing layout"):
        SGLangEngine(SGLangConfig(model_path="m", url="http://127.0.0.1:1"))


def test_the_contract_tests_run_the_sglang_the_extra_names():
    """tests/sglang_contract test against the lowest SGLang release the [sglang] extra admits."""
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    lower = re.search(r"sglang>=([\d.]+)", extra[0]).group(1)
    pins = dict(line.split("==") for line in (root / "tools/constraints-sglang.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["sglang"] == lower == "0.5.23"


def test_a_control_call_to_a_server_that_is_gone_reports_the_engine_lost(monkeypatch):
    """The colocated trainer trains while the engine's server dies: the next memory, version or
    weight call finds nothing at its address. That is the engine lost (its group replaces it and
    gives it the weights), never a refusal that ends the run; what it had released stays recorded."""
    from bpo_megatron.rollout.engine import EngineLost
    from bpo_megatron.rollout.sglang import engine as engine_module

    from bpo_megatron.platform import free_port

    port = free_port()  # nothing listens there

    class GoneServer:
        base_url, api_key = f"http://127.0.0.1:{port}", "k"

        def __init__(self, cfg):
            self.stopped = False

        def start(self):
            pass

        def alive(self):
            return False

        def log_tail(self):
            return "Killed"

        def stop(self):
            self.stopped = True

    monkeypatch.setattr(engine_module, "ServerProcess", GoneServer)
    engine = SGLangEngine(SGLangConfig(model_path="/m", capture_routed_experts=False))
    engine.released = {"kv_cache", "weights", "cuda_graph"}
    for call in (lambda: engine.resume_memory(("weights",)), lambda: engine.begin_weight_update(3)):
        with pytest.raises(EngineLost, match="the SGLang server died"):
            call()
    assert engine.released == {"kv_cache", "weights", "cuda_graph"} and engine.server.stopped


def test_every_api_key_is_read_by_sglangs_argument_parser_as_a_value(monkeypatch):
    """SGLang merges the key's config file into its argv (``--api-key VALUE``): a value starting
    with "-" would be read as a flag and the server would refuse to start (1 start in 64 with a
    URL-safe token). Every key is hex, and an argparse parser like SGLang's takes it as the value."""
    import argparse

    from bpo_megatron.rollout.sglang.server import ServerProcess

    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key", type=str)
    server = ServerProcess.__new__(ServerProcess)
    for _ in range(2000):
        server._key_file = None
        server._write_key()
        server._remove_key_file()
        assert parser.parse_args(["--api-key", server.api_key]).api_key == server.api_key
        assert len(server.api_key) == 64 and int(server.api_key, 16) >= 0


def test_the_servers_log_never_holds_its_api_key(tmp_path):
    """A server that prints its arguments (as SGLang does), on stdout and stderr, through the
    supervisor that ServerProcess starts it with: the log has each line, the key replaced."""
    import os
    import subprocess
    import sys

    from bpo_megatron.rollout.sglang.server import ServerProcess

    server = ServerProcess.__new__(ServerProcess)
    server._key_file = None
    server._write_key()
    key, key_file = server.api_key, server._key_file
    try:
        printer = ("import sys, yaml; k = yaml.safe_load(open(sys.argv[1]))['api-key']; "
                   "print(f\"server_args=ServerArgs(api_key='{k}', port=1)\"); "
                   "print(f'Traceback: bad key {k}!', file=sys.stderr); print('last line, no key', end='')")
        log = tmp_path / "server.log"
        with open(log, "wb") as out:
            status = subprocess.run([sys.executable, "-m", "bpo_megatron.rollout.sglang.supervise", "--parent",
                                     str(os.getpid()), "--interval", "0.05", "--redact-key-in", str(key_file), "--",
                                     sys.executable, "-c", printer, str(key_file)], stdout=out, timeout=60).returncode
        assert status == 0
        text = log.read_text()
        assert key not in text
        assert sorted(text.splitlines()) == sorted(["server_args=ServerArgs(api_key='<api-key>', port=1)",
                                                    "Traceback: bad key <api-key>!", "last line, no key"])
    finally:
        server._remove_key_file()


class _GenerateServer:
    """A /generate and /health on 127.0.0.1 answering as SGLang does (one request per POST);
    ``behaviour(n, rid)`` for the n-th POST (1-based), of request ``rid``: "answer", "drop" (close
    the connection without a word) or a number of seconds to wait before answering."""

    def __init__(self, behaviour):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.posts: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                (rid,) = body["rid"]  # one request per POST
                outer.posts.append(rid)
                what = behaviour(len(outer.posts), rid)
                if what == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(what, (int, float)):
                    time.sleep(what)
                self._send([{"output_ids": [9, 4], "meta_info": {
                    "id": rid, "finish_reason": {"type": "stop", "matched": 4},
                    "output_token_logprobs": [[-0.5, 9, None], [-1.25, 4, None]],
                    "weight_versions": [{"version": "default", "start": 0, "end": 2}]}}])

            def do_GET(self):  # noqa: N802
                self._send({})

            def _send(self, answer):
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def _client(url, **kwargs):
    from bpo_megatron.rollout.sglang.client import GenerationClient
    from bpo_megatron.rollout.sglang.engine import PAUSE_MODE

    settings = dict(max_inflight=4, request_timeout_s=None, max_retries=2, capture_routing=False, routing=None,
                    pause_mode=PAUSE_MODE)
    return GenerationClient(url, None, **{**settings, **kwargs})


def _one_slot():
    return expand([GenerationRequest("r", (1, 2, 3))])


def test_a_request_has_no_deadline_by_default_so_a_long_queue_costs_no_retry():
    """A request that waits in SGLang's queue is not timed out and sent again (from token 0, at
    the back of the queue): no deadline per request unless one is set; the stall watch bounds a
    server that stops making progress."""
    from bpo_megatron.rollout.sglang.client import RolloutFailed

    assert SGLangOptions().request_timeout_s is None
    with _GenerateServer(lambda n, rid: 2.5) as server:  # every answer waits 2.5 s (a long queue)
        (sample,) = _client(server.url).generate(_one_slot())
        assert sample.response_tokens.tolist() == [9, 4] and server.posts == ["r#0"]
    with _GenerateServer(lambda n, rid: 2.5) as server:  # a deadline shorter than the queue: each retry re-queues
        with pytest.raises(RolloutFailed, match=r"request r#0 failed 2 times \(last: POST .* gave no answer within "):
            _client(server.url, request_timeout_s=1.0, max_retries=1).generate(_one_slot())
        assert server.posts == ["r#0", "r#0.retry1"]
    with pytest.raises(ValueError, match="rollout.sglang.request_timeout_s must be > 0 seconds, or null"):
        SGLangOptions(request_timeout_s=0)


def test_each_sample_is_handed_over_as_its_request_returns():
    """Three requests, the first answered 3 s late: the other two are handed over at once, each
    with its position (what an engine group streams to the driver), then the late one."""
    from bpo_megatron.rollout.engine import as_finished

    slots = expand([GenerationRequest("r", (1, 2, 3), SamplingParams(n=3))])
    with _GenerateServer(lambda n, rid: 3.0 if rid == "r#0" else "answer") as server:
        start = time.monotonic()
        batches = as_finished(lambda report: _client(server.url).generate(slots, report))
        first = next(batches)
        first_s = time.monotonic() - start
        rest = [pair for batch in batches for pair in batch]
    assert first_s < 2.5 and 0 not in dict(first)
    came = dict(first + rest)
    assert sorted(came) == [0, 1, 2] and rest[-1][0] == 0
    assert [came[p].index for p in range(3)] == [0, 1, 2]


def test_a_connection_lost_by_one_request_to_a_live_server_is_retried_not_taken_for_its_death():
    """A dropped connection (a keep-alive race, one bad socket) costs that request a retry when the
    server still answers /health; only a server that does not is given up (the engine is lost)."""
    from bpo_megatron.rollout.sglang.http import ServerUnavailable

    probes = []
    with _GenerateServer(lambda n, rid: "drop" if n == 1 else "answer") as server:
        (sample,) = _client(server.url, healthy=lambda: probes.append(1) or True).generate(_one_slot())
        assert sample.response_tokens.tolist() == [9, 4]
        assert server.posts == ["r#0", "r#0.retry1"] and probes == [1]
    for healthy in (lambda: False, None):  # the server is gone, or nobody can tell: lost
        with _GenerateServer(lambda n, rid: "drop" if n == 1 else "answer") as server:
            with pytest.raises(ServerUnavailable):
                _client(server.url, healthy=healthy).generate(_one_slot())
            assert server.posts == ["r#0"]


def test_the_servers_nccl_version_is_asked_beside_its_start_not_within_a_weight_group_call(monkeypatch):
    """The probe (a process importing torch) runs while the server starts: the weight-group call,
    bounded by rollout.stall_timeout_s, only reads its answer; a probe that failed raises there."""
    import threading

    from bpo_megatron.rollout.sglang import engine as engine_module
    from bpo_megatron.rollout.sglang.nccl import NcclVersionUnknown

    probed = threading.Event()

    class SlowServer:
        base_url, api_key = "http://127.0.0.1:1", "k"

        def __init__(self, cfg):
            pass

        def start(self):
            assert probed.wait(10), "the probe runs while the server starts"

        def stop(self):
            pass

    def probe(launcher, visible_devices):
        probed.set()
        return (2, 30, 7)

    monkeypatch.setattr(engine_module, "ServerProcess", SlowServer)
    monkeypatch.setattr(engine_module, "server_nccl_version", probe)
    engine = SGLangEngine(SGLangConfig(model_path="/m", capture_routed_experts=False))
    assert engine.nccl_version() == (2, 30, 7)

    def failing(launcher, visible_devices):
        probed.set()
        raise NcclVersionUnknown("the server's interpreter did not report its NCCL version within 120 s")

    monkeypatch.setattr(engine_module, "server_nccl_version", failing)
    engine = SGLangEngine(SGLangConfig(model_path="/m", capture_routed_experts=False))
    with pytest.raises(NcclVersionUnknown, match="did not report"):
        engine.nccl_version()
    attached = SGLangEngine(SGLangConfig(model_path="/m", url="http://127.0.0.1:1", capture_routed_experts=False))
    assert attached.nccl_version() == engine_module.UNKNOWN


def test_closing_the_weight_sender_aborts_an_nccl_group_and_drops_a_gloo_one(monkeypatch):
    """Replaced engines leave the old group first; the trainer's end of it must not linger: an
    NCCL communicator is aborted (its peers may be gone), a gloo group has nothing to abort."""
    from bpo_megatron.rollout.sglang import weights as weights_module
    from bpo_megatron.rollout.sglang.weights import DistributedWeightSender

    class FakeNccl:
        aborted = 0

        def abort(self):
            FakeNccl.aborted += 1

    monkeypatch.setattr(weights_module, "_ABORTABLE", (FakeNccl,))
    sender = DistributedWeightSender.__new__(DistributedWeightSender)
    sender._group, sender._store = FakeNccl(), object()
    sender.close()
    assert FakeNccl.aborted == 1 and sender._group is None and sender._store is None
    sender.close()  # closing twice aborts nothing more
    assert FakeNccl.aborted == 1
    sender._group, sender._store = object(), object()  # a gloo group: dropped
    sender.close()
    assert sender._group is None and FakeNccl.aborted == 1


def test_a_server_starts_on_its_gpus_only_once_the_previous_servers_supervisor_is_gone(tmp_path, monkeypatch):
    """A replaced engine's server may still be stopping (SIGTERM, its grace, SIGKILL) when its
    replacement starts on the same GPUs: the supervisor holds a lock per GPU until it exits, and a
    start waits for the locks (bounded, naming the GPU)."""
    import os
    import subprocess
    import sys

    from bpo_megatron.rollout.sglang import server as server_module
    from bpo_megatron.rollout.sglang.server import ServerStartError, gpu_locks

    monkeypatch.setattr(server_module, "GPU_LOCK_DIR", tmp_path)
    fds = gpu_locks("10.0.0.7", ["0", "1"], timeout_s=1)
    # what a supervisor does: inherit the locks, hold them while it lives (here: 2 s)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"], pass_fds=fds)
    for fd in fds:
        os.close(fd)
    with pytest.raises(ServerStartError, match=r"GPU 1 is still held by another SGLang server .* after 0 s"):
        gpu_locks("10.0.0.7", ["1"], timeout_s=0.3)
    other = gpu_locks("10.0.0.8", ["1"], timeout_s=0.3)  # another node's GPU 1: free
    assert len(other) == 1
    os.close(other[0])
    start = time.monotonic()
    again = gpu_locks("10.0.0.7", ["0", "1"], timeout_s=30)
    assert holder.poll() is not None and time.monotonic() - start < 10
    for fd in again:
        os.close(fd)
    assert gpu_locks("10.0.0.7", [], timeout_s=0) == []  # no GPU (a CPU server): nothing to wait for


def test_a_later_turn_asks_only_for_the_routing_after_what_it_has():
    """``routing_from`` becomes SGLang's ``routed_experts_start_len``; the sample's routing starts
    there and is checked against the positions from there on."""
    layout = RoutingLayout(num_hidden_layers=2, moe_layers=(1,), topk=2, num_experts=4)
    request = GenerationRequest("c#0/t1", tuple(range(1, 11)), SamplingParams(max_new_tokens=4), routing_from=7)
    (slot,) = expand([request])
    assert generate_body([slot], capture_routing=True)["routed_experts_start_len"] == 7
    rows = np.arange((10 + 3 - 1 - 7) * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 4  # positions 7 … 11
    response = {"output_ids": [5, 6, 7], "meta_info": {
        "id": slot.rid, "finish_reason": {"type": "stop"}, "weight_version": "0",
        "output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None), (-0.3, 7, None)],
        "weight_versions": [{"start": 0, "end": 3, "version": "0"}],
        "routed_experts": base64.b64encode(rows.tobytes()).decode()}}
    sample = decode_sample(slot, response, routing=layout)
    assert sample.routing_start == 7 and sample.routed_experts.shape == (5, 1, 2)
    with pytest.raises(ValueError, match="routing_from=11 must be within its 10 prompt tokens"):
        GenerationRequest("c", tuple(range(1, 11)), routing_from=11)
    other = GenerationRequest("d", (1, 2), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"one routed_experts_start_len; these items ask \[0, 7\]"):
        generate_body(expand([request, other]), capture_routing=True)


def test_requests_in_flight_stay_within_the_full_length_sequences_the_servers_kv_pool_holds(capsys):
    """SGLang retracts running requests when they outgrow its KV pool, and a response retracted for
    space leaves the loss: an engine keeps no more in flight than its pool holds at full length
    (token capacity // longest sequence), lowering a configured value above it with a note."""
    asked_info = []

    class Endpoint:
        def __init__(self, info):
            self.info = info

        def get(self, route, timeout):
            asked_info.append(route)
            return self.info

    def engine(info, **options):
        built = SGLangEngine(SGLangConfig(model_path="/m", url="http://127.0.0.1:1", capture_routed_experts=False,
                                          **options))
        built.endpoint = lambda: Endpoint(info)
        return built

    pool = {"internal_states": [{"effective_max_running_requests_per_dp": 4096,
                                 "memory_usage": {"token_capacity": 1_000_000}}]}
    # unset: the server's limit (4096, bounded to 1024), then the pool: 1,000,000 // 18,432 = 54
    unset = engine(pool, sequence_tokens=18_432)
    assert unset.max_inflight == 54 == 1_000_000 // 18_432
    assert "max_inflight unset: 54 requests in flight, the sequences of 18432 tokens" in capsys.readouterr().out
    assert unset.max_inflight == 54 and capsys.readouterr().out == ""  # asked once, said once
    assert asked_info == ["server_info"]
    # a configured value above the pool is lowered, and said; one within it is kept as it is
    assert engine(pool, sequence_tokens=18_432, max_inflight=512).max_inflight == 54
    assert "rollout.sglang.max_inflight=512 lowered: 54 requests in flight" in capsys.readouterr().out
    assert engine(pool, sequence_tokens=18_432, max_inflight=16).max_inflight == 16
    assert capsys.readouterr().out == ""
    # a pool smaller than one full-length sequence still runs one request at a time
    assert engine({"internal_states": [{"memory_usage": {"token_capacity": 1000}}]},
                  sequence_tokens=18_432).max_inflight == 1
    # without the pool's size, or the longest sequence: the server's limit, or the configured value
    asked_info.clear()
    assert engine({"internal_states": [{"effective_max_running_requests_per_dp": 300}]},
                  sequence_tokens=18_432).max_inflight == 300
    assert engine(pool, max_inflight=512).max_inflight == 512 and asked_info == ["server_info"]


def test_each_responses_seed_goes_to_sglang_and_check_says_when_sglang_ignores_it():
    """A response's seed (rollout.seed, the step, the prompt and the sample index) is sent as
    sampling_params.sampling_seed; SGLang samples with it only under --enable-deterministic-inference,
    which --check says when the servers run without it."""
    from bpo_megatron.rollout.engine import engine_spec

    request = GenerationRequest("r", (1, 2), SamplingParams(n=3, seed=40))
    body = generate_body(expand([request]), capture_routing=False)
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [40, 41, 42]
    unseeded = generate_body(expand([GenerationRequest("u", (1,), SamplingParams())]), capture_routing=False)
    assert "sampling_seed" not in unseeded["sampling_params"][0]
    spec = engine_spec("sglang")
    [note] = spec.notes(SGLangOptions())
    assert "sampling_seed, which SGLang samples with only when its servers run --enable-deterministic-inference" in note
    assert spec.notes(SGLangOptions(extra_args=("--enable-deterministic-inference",))) == []
    assert engine_spec("hf").notes(engine_spec("hf").options()) == []
