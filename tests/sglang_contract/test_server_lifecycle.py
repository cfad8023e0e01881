"""What a real SGLang 0.5.23 server does that hurts, and that our client must never trigger: its
``/health`` generates (SGLang's own handler), a forward pass on released memory kills it, a
release while requests run fails SGLang's own idle assertion, released weights are gone until new
ones arrive, it binds exactly its ``--host``, and with ``--api-key`` SGLang's own middleware
refuses callers without the key. The stand-in (``standin_server.py``) runs SGLang's code for
each; these tests show the stand-in enforcing it and the client staying clear of it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bpo_megatron.weights.checksums import fingerprints
from bpo_megatron.rollout.sglang import server as server_module
from bpo_megatron.rollout.engine import EngineLost
from bpo_megatron.rollout.sglang.http import ServerError, ServerUnavailable, request_json

from test_sglang_contract import SGLANG_PYTHON, TP, checkpoints, layout, pushed, requests, start, state  # noqa: F401

pytestmark = [
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is missing: bash tools/setup.sh --sglang"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def nodes(checkpoints, layout, tmp_path_factory):  # noqa: F811
    """Two servers with SGLang's memory saver on two "nodes" of this machine, 127.0.0.2 and
    127.0.0.3, shared by the tests that leave them alive (a server's start-up is most of such a
    test); the tests that kill a server, or need a test control from its start, start their own."""
    engines = []
    try:
        for n in (2, 3):
            engines.append(start(checkpoints[0], layout, tmp_path_factory.mktemp(f"node{n}"),
                                 node_address=f"127.0.0.{n}", memory_saver=True))
        yield engines
    finally:
        for engine in engines:
            engine.shutdown()


def _dies(engine, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not engine.server.alive():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow  # CI time (≈ 55 s; a demonstration of the stand-in's hazard, the client's side stays): run with -m slow
# -------------------------------------------------------------------------------- health
def test_sglangs_own_health_check_generates_and_kills_a_server_whose_memory_is_released(
        checkpoints, layout, tmp_path, monkeypatch):
    """A server started as the client used to start it (SGLang's default environment): its
    /health runs a one-token generation, which on a released KV cache is an illegal memory
    access. This is what every colocated sync's health check did."""
    monkeypatch.setattr(server_module, "SERVER_ENVIRONMENT", {})
    engine = start(checkpoints[0], layout, tmp_path, memory_saver=True)
    try:
        assert engine.health().healthy  # holds its memory: generating is fine
        engine.release_memory()
        with pytest.raises((ServerUnavailable, ServerError)):
            request_json("GET", f"{engine.base_url}/health", timeout=40.0)
        assert _dies(engine), "a generation on released memory kills the server"
        assert "illegal memory access" in engine.server.log_tail()
    finally:
        engine.shutdown()


def test_health_checks_of_a_released_engine_never_generate(nodes):
    """The client starts servers with generation-free /health and checks a released one for
    liveness only; a generating check runs only while it holds all its memory."""
    engine = nodes[0]
    tokens = state(engine)["tokens"]
    engine.release_memory()
    assert state(engine)["released"] == ["cuda_graph", "kv_cache", "weights"]
    for _ in range(3):
        assert engine.health().healthy
    engine.resume_memory(("weights",))
    assert engine.health().healthy and engine.server.alive()
    engine.resume_memory()
    assert state(engine)["released"] == [] and engine.health().healthy
    assert state(engine)["tokens"] == tokens, "no health check generated"
    assert len(engine.generate(requests(count=1))) == 2


@pytest.mark.slow  # CI time (≈ 50 s; a demonstration of the stand-in's hazard): run with -m slow
def test_a_release_while_requests_run_kills_the_server(checkpoints, layout, tmp_path):
    """SGLang's updater asserts the server is idle before it releases memory (its scheduler, and
    the server, die otherwise): the device phases release only between generations."""
    from concurrent.futures import ThreadPoolExecutor

    engine = start(checkpoints[0], layout, tmp_path, "--standin-token-delay", "0.3", memory_saver=True)
    try:
        with ThreadPoolExecutor(1) as pool:
            generating = pool.submit(engine.generate, requests(count=2))
            deadline = time.monotonic() + 60
            while state(engine)["tokens"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with pytest.raises((EngineLost, ServerError)):  # its server is gone: the engine is lost
                engine.release_memory()
            assert _dies(engine)
            with pytest.raises(Exception):
                generating.result(timeout=120)
    finally:
        engine.shutdown()


@pytest.mark.slow  # CI time (≈ 55 s; a demonstration of the stand-in's hazard): run with -m slow
def test_released_weights_are_gone_until_the_trainer_sends_new_ones(checkpoints, layout, pushed, tmp_path):
    """torch_memory_saver keeps no copy of released weights: resumed, they hold undefined values
    (NaN in the stand-in) until a sync, which the device phases always run after resuming them."""
    engine = start(checkpoints[0], layout, tmp_path, memory_saver=True)
    try:
        served = state(engine)["fingerprints"][0]
        engine.release_memory()
        engine.resume_memory(("weights",))
        assert state(engine)["fingerprints"][0] != served
        engine.begin_weight_update(1)
        engine.update_weights(iter(pushed))
        engine.end_weight_update()
        engine.resume_memory()
        assert all(ranks == fingerprints(pushed) for ranks in state(engine)["fingerprints"])
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------ addresses
def test_a_server_binds_its_nodes_address_and_is_reachable_there_only(nodes):
    """Two "nodes" of this machine, 127.0.0.2 and 127.0.0.3: each engine's server binds its own
    node's address and is advertised by it (it used to bind and advertise 127.0.0.1, which
    another node resolves to itself); the server's processes listen on that port at their own
    node's address only. (Read from the processes' sockets, not by calling the other addresses:
    on one machine, another process may hold the same port number there, e.g. the other server's
    own internal ports on 127.0.0.1.)"""
    import psutil

    for engine, own in zip(nodes, ("127.0.0.2", "127.0.0.3")):
        port = engine.server.port
        assert engine.base_url == f"http://{own}:{port}" and engine.endpoint().url == engine.base_url
        assert engine.health().healthy
        supervisor = psutil.Process(engine.server.process.pid)
        listening = {(c.laddr.ip, c.laddr.port) for p in (supervisor, *supervisor.children(recursive=True))
                     for c in getattr(p, "net_connections", p.connections)(kind="tcp")  # psutil < 6: connections
                     if c.status == psutil.CONN_LISTEN}
        assert {address for address, p in listening if p == port} == {own}, sorted(listening)
    assert all(len(e.generate(requests(count=1))) == 2 for e in nodes)


def test_a_server_refuses_callers_without_its_key_and_the_key_is_never_shown(nodes):
    """Every server gets a fresh secret (SGLang's --api-key) through a private config file: its
    weight-update routes take tensors from no one else. The key is on no command line, in no
    message and not left on disk; health probes need none (as SGLang decides)."""
    engine = nodes[1]
    assert engine.api_key != nodes[0].api_key, "each server its own key"
    key, url = engine.api_key, engine.base_url
    assert key and len(key) >= 32
    for route, body in (("generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
                        ("begin_weight_update", {}), ("update_weights_from_distributed", {})):
        with pytest.raises(ServerError, match="HTTP 401"):
            request_json("POST", f"{url}/{route}", body, timeout=10.0)
    with pytest.raises(ServerError, match="HTTP 401"):
        request_json("POST", f"{url}/generate", {"input_ids": [1]}, timeout=10.0, api_key="not-the-key")
    request_json("GET", f"{url}/health", timeout=10.0)
    assert len(engine.generate(requests(count=1))) == 2
    assert key not in " ".join(engine.server.command()) and key not in repr(engine.endpoint())
    # SGLang logs its arguments, the key among them: the log holds them with the key replaced
    log = Path(engine.server.log_path).read_text()
    assert key not in log and "'api_key': '<api-key>'" in log, log[:2000]
    assert not [p for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("sglang-key-*.yaml")
                if p.stat().st_mtime > time.time() - 600 and key in p.read_text()], "the key file is removed"


# -------------------------------------------------------------------------------- connections
# CI time (a server of its own, dropping from its start): the client's retry of a dropped request, sent once more
# with the server judged alive by /health, holds in the default run against a stub server in
# tests/test_sglang_engine.py::test_a_connection_lost_by_one_request_to_a_live_server_is_retried_not_taken_for_its_death
@pytest.mark.ci
def test_a_connection_dropped_on_one_request_is_sent_again_and_the_server_stays_up(checkpoints, layout, tmp_path):
    """The server closes the connection of one ``/generate`` unanswered (a keep-alive race): the
    client sends that request again, the other requests are untouched, and the server — alive and
    answering ``/health`` — is neither judged lost nor restarted."""
    engine = start(checkpoints[0], layout, tmp_path, "--standin-drop-generate", "3")
    try:
        pid = engine.server.process.pid
        samples = engine.generate(requests(count=4, n=2))
        after = state(engine)
        assert engine.server.alive() and engine.server.process.pid == pid
    finally:
        engine.shutdown()
    assert sorted((s.request_id, s.index) for s in samples) == [(f"q{i}", j) for i in range(4) for j in range(2)]
    assert all(s.response_tokens.numel() > 0 for s in samples)
    assert any(call["call"] == "dropped_generate" for call in after["calls"])
    # eight requests reached SGLang's tokenizer manager once each; the dropped POST was sent twice
    assert (after["generate_calls"], after["generate_posts"]) == (8, 9)
