"""Multi-turn R3 over two SGLang stand-in servers: which engine a turn goes to, what its prefix
cache held, and what each token was sampled after.

Each stand-in logs every request (``"call": "request"``): the prefix its first prefill took from
its cache (``cached_tokens``) and, for every prefill, which computation (server, request, weights
version, retractions) routed the positions before the request's ``routed_experts_start_len`` —
what the tokens sampled after that prefill saw — and the origin of every row it reported. A
conversation's replayed routing is, for each position, the row the first turn that fed it
reported. So for every model token of a later turn the log says whether the routing it was sampled
after is the one R3 replays; no such token may stay in the loss when it is not. The conversations
go to the engines as the engine group places them (:func:`~bpo_megatron.orchestration.engine_group.place`):
a turn to its previous turn's engine, the others where the load is least.

The runs: both caches large (the prefix of every later turn is reused); one engine's cache small
(evictions: those turns masked and counted); and a weight update that reaches both engines mid-turn
(a ``retract`` pause re-prefills every position with the new weights). Then a request paused while
still in chunked prefill: SGLang counts that retraction in ``num_retractions`` with no output token
to show the version change, yet it costs no token its routing — not a retraction for space.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_sglang_contract import (  # noqa: F401
    SGLANG_PYTHON, STANDIN, TOOL_OUTPUT, _IdTokenizer, _Tool, checkpoints, layout, pushed, state,
)

from bpo_megatron.loop.samples import training_samples
from bpo_megatron.orchestration.engine_group import place
from bpo_megatron.rollout import GenerationRequest, SamplingParams
from bpo_megatron.rollout.agents import AgentConfig, Conversations
from bpo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from bpo_megatron.rollout.sglang.weights import inline_serializer

pytestmark = [
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is missing: bash tools/setup.sh --sglang"),
    pytest.mark.timeout(900),  # two servers start in ~2 min on a busy 2-core machine
    # two stand-in servers per test (minutes each): CI runs them (-m ci); the default run keeps each
    # masking case against fake engines in tests/test_agents.py
    pytest.mark.ci,
]

EOS = 0  # the conversations' end token; every turn ends on it or on the call token (--standin-stop-at-end)
BACKLOG = 64  # rollout.agent.affinity_backlog


def _start(model_dir: Path, layout, work: Path, log: Path, *controls: str) -> SGLangEngine:
    work.mkdir(parents=True, exist_ok=True)
    cfg = SGLangConfig(model_path=str(model_dir), launcher=(str(SGLANG_PYTHON), str(STANDIN)), tp_size=1,
                       extra_args=("--standin-marker-dir", str(work), "--standin-call-log", str(log),
                                   "--standin-stop-at-end", "1", *controls),
                       startup_timeout_s=300, request_timeout_s=120, max_inflight=8, weight_bucket_bytes=1 << 20)
    return SGLangEngine(cfg, routing=layout, serializer=inline_serializer)


class _Generation:
    """One batch of turns under way on the engines (what an engine group's pending generation offers)."""

    def __init__(self, pair: _Pair, requests: list[GenerationRequest]) -> None:
        first = [0]
        for request in requests:
            first.append(first[-1] + request.sampling.n)
        self.samples: list = [None] * first[-1]
        self.untaken: list[int] = []
        self.lock = threading.Lock()
        self.futures = []
        for engine, share in enumerate(place(requests, pair.load(), [0, 0], pair.backlog)):
            positions = [p for r in share for p in range(first[r], first[r + 1])]
            if share:
                with pair.lock:
                    pair.outstanding[engine] += len(positions)
                self.futures.append(pair.pool.submit(self._run, pair, engine, [requests[r] for r in share], positions))

    def _run(self, pair: _Pair, engine: int, requests: list, positions: list[int]) -> None:
        samples = pair.engines[engine].generate(requests)
        with self.lock, pair.lock:
            for position, sample in zip(positions, samples):
                sample.served_by = (engine, 0)
                self.samples[position] = sample
                self.untaken.append(position)
                pair.turns[f"{sample.request_id}#{sample.index}"] = sample
            pair.outstanding[engine] -= len(positions)

    def take_finished(self, wait_s: float = 0.0, *, watch=None):
        deadline = time.monotonic() + wait_s
        while True:
            for future in self.futures:
                if future.done():
                    future.result()  # raise what a generation raised
            with self.lock:
                taken, self.untaken = [(p, self.samples[p]) for p in self.untaken], []
            if taken or time.monotonic() >= deadline or self.done():
                return taken
            time.sleep(0.01)

    def done(self) -> bool:
        return all(future.done() for future in self.futures) and not self.untaken

    def result(self):
        for future in self.futures:
            future.result()
        return self.samples


class _Pair:
    """Two engines behind ``submit``; ``affinity=False``: every turn placed by load alone."""

    def __init__(self, engines: list[SGLangEngine], *, affinity: bool = True) -> None:
        self.engines, self.affinity, self.backlog = engines, affinity, BACKLOG
        self.outstanding, self.lock = [0, 0], threading.Lock()
        self.turns: dict[str, object] = {}  # a turn's response id (as posted) -> its sample
        self.pool = ThreadPoolExecutor(16)

    def load(self) -> list[int]:
        with self.lock:
            return list(self.outstanding)

    def submit(self, requests):
        if not self.affinity:
            requests = [dataclasses.replace(r, affinity=None) for r in requests]
        return _Generation(self, requests)


def _asked(count: int, seed: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{seed}c{i}", tuple(range(20 + i % 5, 30 + i % 5)),
                              SamplingParams(max_new_tokens=40, n=2, seed=100 * seed + i, stop_token_ids=(EOS,)))
            for i in range(count)]


def _requests_logged(log: Path) -> dict[str, dict]:
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return {call["rid"]: call for call in calls if call["call"] == "request"}


def _origins(segments: list, start: int) -> list[tuple]:
    """Run-length origins back to one per row, from row ``start``."""
    rows, row = [], start
    for end, *origin in segments:
        rows += [tuple(origin)] * (end - row)
        row = end
    return rows


def _turns(sample, pair: _Pair) -> list[str]:
    """The response ids (as posted) of a conversation's model turns, in order."""
    keys, t = [f"{sample.request_id}#{sample.index}"], 1
    while f"{sample.request_id}#{sample.index}/t{t}#0" in pair.turns:
        keys.append(f"{sample.request_id}#{sample.index}/t{t}#0")
        t += 1
    return keys


def _check_against_log(samples, pair: _Pair, logged: dict[str, dict]) -> dict[str, int]:
    """Every model token of a later turn left in the loss was sampled after the prefix routing R3
    replays (and, where no pause came, a turn is masked exactly when it was not); the counts of
    later turns, hops, masked turns, prefix rows and those the cache held, and the tokens kept."""
    counts = dict(later=0, hops=0, masked=0, prefix=0, cached=0, kept_tokens=0)
    for sample in samples:
        keys = _turns(sample, pair)
        replayed: list[tuple] = []
        offset, valid = 0, sample.routing_valid
        for k, key in enumerate(keys):
            record, turn = logged[key], pair.turns[key]
            length = turn.response_tokens.numel()
            assert record["start"] == len(replayed), (key, record["start"], len(replayed))
            if k:
                previous = pair.turns[keys[k - 1]]
                counts["later"] += 1
                counts["hops"] += turn.served_by != previous.served_by
                counts["prefix"] += record["start"]
                counts["cached"] += min(record["cached_tokens"], record["start"])
                kept = torch.ones(length, dtype=torch.bool) if valid is None else valid[offset:offset + length]
                counts["masked"] += not bool(kept.any())
                prefills = record["prefills"]
                for j in range(length):
                    seen = max((p for p in prefills if p[0] <= j), key=lambda p: p[0])
                    if kept[j]:
                        counts["kept_tokens"] += 1
                        assert _origins(seen[1], 0) == replayed, \
                            f"{key} token {j}: sampled after another prefix routing than the one replayed"
                if record["retractions"] == 0:  # no pause: masked exactly when the prefix was not reused
                    reused = _origins(prefills[0][1], 0) == replayed
                    assert bool(kept.all()) == reused and bool(kept.any()) == reused, (key, record)
            fed = turn.prompt_tokens.numel() + length - 1
            replayed += _origins(record["reported"], record["start"])[: fed - len(replayed)]
            offset += length + (len(TOOL_OUTPUT) if k < len(keys) - 1 else 0)
    return counts


def _logged(*logs: Path) -> dict[str, dict]:
    merged = {}
    for log in logs:
        merged.update(_requests_logged(log))
    return merged


def _converse(pair: _Pair, asked: list[GenerationRequest]):
    return Conversations(pair, _Tool(AgentConfig(name="x:_Tool")), _IdTokenizer(), max_turns=4).generate(asked)


def _metrics(samples) -> dict[str, float]:
    rewards = torch.tensor([1.0, 0.0] * (len(samples) // 2))
    return training_samples(samples, rewards, group_size=2, keep_routing=True)[1]


def _agree(metrics: dict[str, float], counts: dict[str, int]) -> None:
    """The run's metrics are what the servers' logs say happened."""
    assert metrics["rollout/multi_turn_hop_frac"] == pytest.approx(counts["hops"] / counts["later"])
    assert metrics["rollout/prefix_cache_hit_rate"] == pytest.approx(counts["cached"] / counts["prefix"])
    assert metrics["rollout/multi_turn_prefix_recomputed_frac"] == pytest.approx(counts["masked"] / counts["later"])


def _later_turn_decoding(engines: list[SGLangEngine], conversations, min_left: int = 3) -> int:
    """Wait (bounded) until an engine decodes a later turn with at least ``min_left`` tokens still
    to come — at 0.1 s a token, a pause sent now reaches it mid-generation — and return that
    engine's index. Polling the servers' running requests, not the turns finished so far: how far
    the conversations have got when a turn finishes depends on the machine's load."""
    deadline = time.monotonic() + 180
    while True:
        for index, engine in enumerate(engines):
            running = engine.endpoint().get("standin/running", timeout=30)
            if any("/t" in r["rid"] and r["output"] >= 1 and r["left"] >= min_left for r in running):
                return index
        assert time.monotonic() < deadline and not conversations.done(), \
            "no engine decoded a later turn with tokens to come within 180 s"
        time.sleep(0.02)


def test_turns_stay_on_their_engine_reuse_its_cache_and_keep_the_routing_they_were_sampled_after(
        checkpoints, layout, tmp_path):
    logs = [tmp_path / "e0.jsonl", tmp_path / "e1.jsonl"]
    engines = [_start(checkpoints[0], layout, tmp_path / f"e{i}", logs[i], "--standin-token-delay", "0.01")
               for i in range(2)]
    try:
        with_affinity = _Pair(engines)
        kept = _converse(with_affinity, _asked(16, seed=0))
        without = _Pair(engines, affinity=False)  # every turn where the load is least: the old placement's hops
        spread = _converse(without, _asked(16, seed=1))
    finally:
        for engine in engines:
            engine.shutdown()
    logged = _logged(*logs)
    counts = _check_against_log(kept, with_affinity, logged)
    print(f"\n[affinity] {counts}")
    assert counts["later"] >= 16, "too few conversations went on to show anything"
    assert counts["hops"] == 0 and counts["masked"] == 0
    assert counts["cached"] / counts["prefix"] >= 0.9  # the prefix of later turns reused
    _agree(_metrics(kept), counts)
    assert _metrics(kept)["rollout/r3_prefix_mismatch_frac"] == 0.0

    counts = _check_against_log(spread, without, logged)
    print(f"[no affinity] {counts}")
    assert counts["hops"] >= 1 and counts["masked"] >= counts["hops"]  # a hop recomputes the prefix
    assert counts["kept_tokens"] >= 1 or counts["masked"] == counts["later"]
    _agree(_metrics(spread), counts)
    assert _metrics(spread)["rollout/r3_prefix_mismatch_frac"] > 0.0


def test_evictions_and_a_weight_update_mid_turn_mask_exactly_the_turns_that_recomputed_their_prefix(
        checkpoints, layout, pushed, tmp_path):
    logs = [tmp_path / "e0.jsonl", tmp_path / "e1.jsonl"]
    engines = [_start(checkpoints[0], layout, tmp_path / "e0", logs[0], "--standin-token-delay", "0.1"),
               _start(checkpoints[0], layout, tmp_path / "e1", logs[1], "--standin-token-delay", "0.1",
                      "--standin-prefix-cache-tokens", "48")]  # a small cache: evictions
    pair = _Pair(engines)
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(_converse, pair, _asked(16, seed=2))
            deadline = time.monotonic() + 120
            while sum("/t" in key for key in pair.turns) < 4:  # later turns finished: evictions before the update
                assert time.monotonic() < deadline and not future.done(), "no four later turns finished"
                time.sleep(0.05)
            first = _later_turn_decoding(engines, future)
            for engine in engines[first:] + engines[:first]:  # the engine decoding a later turn paused first
                engine.begin_weight_update(1)
                engine.update_weights(iter(pushed))
                engine.end_weight_update()
            samples = future.result(timeout=300)
    finally:
        for engine in engines:
            engine.shutdown()
    logged = _logged(*logs)
    counts = _check_against_log(samples, pair, logged)
    print(f"\n[evictions, update mid-turn] {counts}")
    later = {key: record for key, record in logged.items() if "/t" in key and key in pair.turns}
    # before the update (its first token by the first weights), no pause, and the prefix not all cached
    evicted = [key for key, record in later.items() if record["retractions"] == 0
               and record["versions"][0]["version"] == "default" and record["cached_tokens"] < record["start"]]
    paused = [key for key, record in later.items() if record["retractions"]]
    assert evicted, "no later turn found its prefix evicted"
    assert paused, "the update reached no later turn mid-generation"
    assert counts["masked"] >= len(evicted) and counts["kept_tokens"] >= 1
    _agree(_metrics(samples), counts)


def test_a_pause_that_retracts_a_request_still_in_chunked_prefill_is_no_retraction_for_space(
        checkpoints, layout, pushed, tmp_path, monkeypatch):
    """A ``retract`` pause retracts a request SGLang is still prefilling in chunks; SGLang counts it
    in ``num_retractions`` but the request has no output token to show the version change. Its
    tokens all come after the re-prefill, with the routing reported: nothing to mask. Told apart
    from a retraction for space by the server's space-retraction counter (``/metrics``), which did
    not move after the pause; without the counter it is masked, as before."""
    log = tmp_path / "calls.jsonl"
    engine = _start(checkpoints[0], layout, tmp_path / "e", log, "--standin-token-delay", "0.2",
                    "--standin-chunked-prefill", "1")
    try:
        results = []
        for counter in (True, False):  # prompts of their own each round: none in the cache
            asked = [GenerationRequest(f"long{counter}{i}", tuple(range(30 + 30 * counter + i, 50 + 30 * counter + i)),
                                       SamplingParams(max_new_tokens=4, seed=i)) for i in range(2)]
            if not counter:
                monkeypatch.setattr(engine, "space_retractions", lambda: None)
            posted = state(engine)["generate_calls"]
            with ThreadPoolExecutor(1) as pool:
                future = pool.submit(engine.generate, asked)
                deadline = time.monotonic() + 60
                while state(engine)["generate_calls"] < posted + len(asked):
                    assert time.monotonic() < deadline, "the requests did not reach the stand-in in 60 s"
                    time.sleep(0.05)
                time.sleep(0.5)  # admitted; 20 prompt tokens, one per 0.2 s step: still in prefill
                engine.begin_weight_update(engine.weight_version + 1)
                engine.update_weights(iter(pushed))
                engine.end_weight_update()
                results.append(future.result(timeout=120))
    finally:
        engine.shutdown()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records = [r for r in records if r["call"] == "request"]
    assert len(records) == 4
    for record in records:  # the situation: retracted by the pause before its first token, never for space
        assert record["retractions"] == 1 and record["space_retractions"] == 0, record
        assert len(record["versions"]) == 1, record  # every token after the update
    with_counter, without_counter = results
    for sample in with_counter:
        assert not sample.retracted_for_space and sample.routing_valid is None
    for sample in without_counter:  # no counter to rule out a space retraction: masked, as the old client did
        assert sample.retracted_for_space and not bool(sample.routing_valid.any())
