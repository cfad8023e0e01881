"""Faults of Ray rollout-engine groups: an engine killed or crashed mid-generate, hung, or dead
between rollouts.

The session's embedded Ray (``ray_session``) and one group of two embedded
(``hf``) engines built from an experiment config. Before each fault the engines get new weights
(another random checkpoint), so a replacement engine, which starts from ``model.path``, only
produces the expected samples if the group's custodian (its ``resync``) pushed the weights into it
again. The expected samples come from an in-process engine holding the new weights: per-row seeds make them
independent of how requests are split over engines.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from bpo_megatron.rollout import GenerationRequest, SamplingParams
from bpo_megatron.testing import MODEL_CONFIGS

ray = pytest.importorskip("ray")

FIXTURE = MODEL_CONFIGS / "tiny_qwen3_moe"
KILL_AFTER_S = 0.2  # each engine's share of BIG takes about a second: the kill lands mid-generate
TOLERANCE = 1e-5  # log μ of the same row decoded in another batch (fp32 summation order)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint) -> tuple[str, str]:
    """The engines' starting weights and the weights pushed to them."""
    return str(tiny_checkpoint(FIXTURE, seed=0)), str(tiny_checkpoint(FIXTURE, seed=1))


@pytest.fixture(scope="module")
def pushed_weights(checkpoints) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(Path(checkpoints[1]) / "model.safetensors").items())


@pytest.fixture(scope="module")
def group(ray_session, checkpoints):
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.groups import EngineGroup

    start_dir = checkpoints[0]
    cfg = load_experiment(None, [f"model.path={start_dir}", "model.tokenizer=char", "rollout.engine=hf",
                                 "rollout.num_engines=2", "rollout.max_restarts=3", "data.max_prompt_tokens=16",
                                 "rollout.max_new_tokens=240"], check_model=True)
    engines = EngineGroup(cfg.engine_group_spec(), start_dir)
    yield engines
    engines.shutdown()


def _requests(count: int, new_tokens: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(3)
    return [GenerationRequest(f"r{i}", tuple(torch.randint(0, 200, (int(torch.randint(2, 9, (1,), generator=gen)),),
                                                           generator=gen).tolist()),
                              SamplingParams(temperature=1.0, n=4, max_new_tokens=new_tokens, seed=50 + i))
            for i in range(count)]


BIG = _requests(32, 240)  # 128 rows: 64 per engine, about a second of decoding each (5x KILL_AFTER_S)
SMALL = _requests(4, 8)


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list]:
    from bpo_megatron.rollout.hf.engine import HFEngine

    engine = HFEngine(checkpoints[1], capture_routing=True)
    return {"big": engine.generate(BIG), "small": engine.generate(SMALL)}


def _arm(group, pushed_weights) -> list[list[int]]:
    """Push the new weights into every engine; record (and re-push on) every restart."""
    restarted: list[list[int]] = []

    class Reloads:  # the group's custodian: replacements start at once and get the pushed weights
        def starting_engines(self, indices: list[int], start) -> None:
            start()

        def resync(self, indices: list[int]) -> None:
            restarted.append(list(indices))
            ray.get([group.workers[i].update_weights.remote(pushed_weights) for i in indices])

    group.custodian = Reloads()  # each test arms the module's group afresh
    group.call("update_weights", pushed_weights)
    return restarted


def _check_samples(samples, requests, reference) -> None:
    """Every sample exactly once, in request order, equal to the in-process reference."""
    assert [(s.request_id, s.index) for s in samples] == [(r.request_id, i) for r in requests
                                                          for i in range(r.sampling.n)]
    for got, want in zip(samples, reference, strict=True):
        assert torch.equal(got.response_tokens, want.response_tokens), got.request_id
        assert torch.equal(got.routed_experts, want.routed_experts), got.request_id
        torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, atol=TOLERANCE, rtol=0)


def _engine_pid(worker) -> int:
    return ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))


@pytest.mark.parametrize("fault", ["ray.kill", "SIGKILL"])
def test_an_engine_that_dies_mid_generate_is_replaced_and_its_share_sent_again(
        group, pushed_weights, expected, fault):
    """``ray.kill`` of the actor, or the engine process killed outright (as the OOM killer does)."""
    victim_index = 1 if fault == "ray.kill" else 0
    victim = group.workers[victim_index]
    restarted = _arm(group, pushed_weights)
    restarts_before = group.restarts
    if fault == "ray.kill":
        kill = threading.Timer(KILL_AFTER_S, ray.kill, args=(victim,))
    else:
        kill = threading.Timer(KILL_AFTER_S, os.kill, args=(_engine_pid(victim), signal.SIGKILL))
    kill.start()
    try:
        samples = group.generate(BIG)
    finally:
        kill.join()
    # a kill that landed after the engine answered would leave nothing to restart
    assert restarted == [[victim_index]], "the engine was not replaced (or its custodian's resync not called)"
    assert group.restarts == restarts_before + 1 and group.workers[victim_index] is not victim
    _check_samples(samples, BIG, expected["big"])
    assert group.captures_routing()


# two engines, four requests each: the even ones end after 2 tokens, the odd ones after 240
MIXED = [GenerationRequest(r.request_id, r.prompt_tokens, SamplingParams(
    temperature=1.0, n=2, max_new_tokens=2 if i % 2 == 0 else 240, seed=r.sampling.seed)) for i, r in enumerate(BIG[:8])]
SHORT = {p for i in range(0, 8, 2) for p in (2 * i, 2 * i + 1)}  # their sample positions


@pytest.fixture(scope="module")
def expected_mixed(checkpoints) -> list:
    from bpo_megatron.rollout.hf.engine import HFEngine

    return HFEngine(checkpoints[1], capture_routing=True).generate(MIXED)


def _recording_generate_calls(group, monkeypatch) -> list[tuple[int, list[str]]]:
    """Each generate call the group makes: (engine, the ids of its requests)."""
    calls, remote = [], group.remote

    def recorded(worker, method, *args):
        if method == "generate":
            calls.append((next(i for i, w in enumerate(group.workers) if w is worker), [r.request_id for r in args[0]]))
        return remote(worker, method, *args)

    monkeypatch.setattr(group, "remote", recorded)
    return calls


def test_samples_come_back_as_they_finish(group, pushed_weights, expected_mixed):
    """The short answers are taken while the long ones still generate, each at its position; the
    whole equals the in-process reference."""
    _arm(group, pushed_weights)
    pending = group.submit(MIXED)
    first = pending.take_finished(wait_s=60)
    assert first and {p for p, _ in first} <= SHORT and not pending.done()
    came, deadline = dict(first), time.monotonic() + 120
    while len(came) < 16 and time.monotonic() < deadline:
        came.update(pending.take_finished(wait_s=1))
    assert sorted(came) == list(range(16)) and pending.done()
    _check_samples([came[p] for p in range(16)], MIXED, expected_mixed)
    _check_samples(pending.result(), MIXED, expected_mixed)
    # each sample says which engine (and which start of it) served it: a conversation's next turn goes there
    assert [s.served_by for s in pending.result()] == [(0, group.starts[0])] * 8 + [(1, group.starts[1])] * 8


def test_a_turn_goes_to_its_previous_engine_unless_that_one_was_replaced_or_is_full():
    from bpo_megatron.orchestration.engine_group import place

    def turn(i: int, affinity=None) -> GenerationRequest:
        return GenerationRequest(f"t{i}", (1, 2), SamplingParams(n=1), affinity=affinity)

    # no affinity, equal loads: the count split, the first slices one longer
    assert place([turn(i) for i in range(5)], [0, 0], [0, 0], 8) == [[0, 1, 2], [3, 4]]
    # a small batch goes to the least loaded engine, not to engine 0
    assert place([turn(0)], [3, 1], [0, 0], 8) == [[], [0]]
    turns = [turn(0, (1, 0)), turn(1, (1, 0)), turn(2), turn(3)]
    assert place(turns, [0, 0], [0, 0], 8) == [[2, 3], [0, 1]]  # kept on engine 1; the others even the load
    assert place(turns, [0, 0], [0, 1], 8) == [[0, 1], [2, 3]]  # engine 1 was replaced since: by load
    # full: engine 1 owes 8 samples more than the least loaded (rollout.agent.affinity_backlog=8)
    assert place(turns, [0, 8], [0, 0], 8) == [[0, 1, 2, 3], []]
    assert place(turns, [0, 8], [0, 0], 9) == [[1, 2, 3], [0]]  # room for one more there


def test_a_share_sent_again_holds_only_the_requests_still_unanswered(group, pushed_weights, expected_mixed,
                                                                    monkeypatch):
    """Engine 0 is killed once its short answers came: its replacement is sent only its long
    requests, and the short samples that came before are kept."""
    restarted = _arm(group, pushed_weights)
    calls = _recording_generate_calls(group, monkeypatch)
    pending = group.submit(MIXED)
    came: dict[int, object] = {}
    deadline = time.monotonic() + 60
    while not {0, 1, 4, 5} <= set(came) and time.monotonic() < deadline:  # engine 0's short samples
        came.update(pending.take_finished(wait_s=1))
    assert {0, 1, 4, 5} <= set(came) and not pending.done()
    ray.kill(group.workers[0])
    samples = pending.result()
    assert restarted == [[0]]
    assert calls == [(0, ["r0", "r1", "r2", "r3"]), (1, ["r4", "r5", "r6", "r7"]), (0, ["r1", "r3"])]
    assert all(samples[p] is came[p] for p in (0, 1, 4, 5))
    _check_samples(samples, MIXED, expected_mixed)


def test_an_engine_that_stops_answering_is_killed_replaced_and_its_share_sent_again(
        group, pushed_weights, expected):
    """A hung engine (here: busy in a call that never returns) is given ``generate_timeout_s``."""
    restarted = _arm(group, pushed_weights)
    hung = group.workers[0]
    # the engine's next generate call waits behind it (in the generate concurrency group)
    hung.__ray_call__.options(concurrency_group="generate").remote(lambda self: time.sleep(600))
    group.generate_timeout_s = 3.0  # a normal answer to SMALL takes a fraction of a second
    try:
        start = time.monotonic()
        samples = group.generate(SMALL)
        elapsed = time.monotonic() - start
    finally:
        group.generate_timeout_s = None
    assert restarted == [[0]] and group.workers[0] is not hung
    assert elapsed >= 3.0
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(hung.captures_routing.remote(), timeout=30)  # killed, not left running
    _check_samples(samples, SMALL, expected["small"])


def test_a_timeout_must_be_positive():
    from bpo_megatron.rollout.config import RolloutConfig

    with pytest.raises(ValueError, match=r"rollout.generate_timeout_s must be > 0 \(or null: no limit\)"):
        RolloutConfig(generate_timeout_s=-1.0)


def test_the_restart_budget_and_timeout_come_from_the_config(group):
    assert group.max_restarts == 3 and group.generate_timeout_s is None


class _WeightPusher:
    """The trainer's side of a sync as ``weight_sync.sender.send_weights`` does it (an engine that dies
    is reported in ``failed``), sending fixed Hugging Face weights."""

    def __init__(self, weights) -> None:
        from bpo_megatron.weights.checksums import fingerprint

        self.weights = weights
        self.fingerprints = {name: fingerprint(tensor) for name, tensor in weights}
        self.transports = {}

    def push_weights(self, plan, endpoints, version, role="rollout", held=None):
        from bpo_megatron.weight_sync import transport_class
        from bpo_megatron.weights.buckets import buckets

        sender = self.transports.setdefault(plan.transport, transport_class(plan.transport)())
        sender.prepare(endpoints)
        report = sender.send(buckets(self.weights, plan.bucket_bytes), version)
        return {**report, "seconds": 1.0, "fingerprints": self.fingerprints}


def _sync(trainer, engines, *, transport: str, version: int, bucket_bytes: int, verify: bool = False,
          only: list[int] | None = None) -> dict:
    """One sync of ``engines`` by their owner, built as the loop builds it (a plan of these settings)."""
    from bpo_megatron.weight_sync.plan import SyncPlan
    from bpo_megatron.weight_sync.session import WeightSync

    return WeightSync(trainer, engines, SyncPlan(transport, bucket_bytes, verify=verify)).sync(version, only)


# the embedded engine's own transport, as its spec declares it (the driver hands the trainer this)
SHARED_MEMORY = "bpo_megatron.rollout.hf.shared_memory:SharedMemory"


def test_an_engine_that_died_between_rollouts_is_replaced_by_the_next_sync(group, pushed_weights, expected):
    """Killed while the trainer trains: the sync replaces it and gives it the new weights."""
    restarted = _arm(group, pushed_weights)
    restarts_before = group.restarts
    victim = group.workers[0]
    ray.kill(victim)
    _sync(_WeightPusher(pushed_weights), group, transport="object_store", version=1, bucket_bytes=1 << 20,
          verify=True)
    assert group.workers[0] is not victim and group.restarts == restarts_before + 1
    assert restarted == [], "the sync itself loads the new engine; no separate reload"
    _check_samples(group.generate(SMALL), SMALL, expected["small"])


def _holders(name: str) -> set[int]:
    """Processes that map the memory file ``name`` or hold a descriptor of it."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if name in (proc / "maps").read_text() or any(
                    name in os.readlink(fd) for fd in (proc / "fd").iterdir()):
                found.add(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_shared_memory_sync_writes_each_engines_weights_in_place(group, pushed_weights, expected):
    """The embedded engines keep their weights in a shared memory file the driver (here, as
    trainer rank 0 on this node) writes into; the file has no name anywhere, so once a killed
    engine is replaced nothing holds its memory, and the replacement gets a file of its own."""
    pusher = _WeightPusher(pushed_weights)
    _sync(pusher, group, transport=SHARED_MEMORY, version=7, bucket_bytes=1 << 16, verify=True)
    _check_samples(group.generate(SMALL), SMALL, expected["small"])
    layouts = [layout for _, layout in group.call("weight_details")]
    assert all(layout is not None and _holders(layout.name) == {layout.pid, os.getpid()} for layout in layouts)
    assert set(layouts[0].places) == {name for name, _ in pushed_weights}
    attached = pusher.transports[SHARED_MEMORY]._attached
    assert set(attached) == {layout.name for layout in layouts}, "each engine's memory mapped once"

    victim = group.workers[0]
    ray.kill(victim)
    deadline = time.monotonic() + 20  # a kill is asynchronous; the next sync finds the process gone
    while Path(f"/proc/{layouts[0].pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    _sync(pusher, group, transport=SHARED_MEMORY, version=8, bucket_bytes=1 << 16, verify=True)
    assert group.workers[0] is not victim
    fresh = group.call("weight_details")[0][1]
    assert fresh.name != layouts[0].name and set(attached) == {fresh.name, layouts[1].name}
    assert _holders(layouts[0].name) == set(), "nothing holds a killed engine's weights"
    _check_samples(group.generate(SMALL), SMALL, expected["small"])
    assert group.call("weight_version") == [8, 8]


def test_engines_whose_weights_cannot_be_mapped_get_them_through_the_object_store(group, pushed_weights, expected,
                                                                                    monkeypatch):
    """A trainer that may not open an engine's memory (a /proc that forbids it) still syncs it."""
    from bpo_megatron.rollout.hf import shared_memory

    def refused(layout):
        raise PermissionError(f"/proc/{layout.pid}/fd/{layout.fd}: operation not permitted")

    monkeypatch.setattr(shared_memory, "attach", refused)
    pusher = _WeightPusher(pushed_weights)
    _sync(pusher, group, transport=SHARED_MEMORY, version=9, bucket_bytes=1 << 16, verify=True)
    assert pusher.transports[SHARED_MEMORY]._attached == {}
    _check_samples(group.generate(SMALL), SMALL, expected["small"])
    assert group.call("weight_version") == [9, 9]


CUDA_IPC = "bpo_megatron.rollout.hf.cuda_ipc:CudaIpc"  # what the embedded engine on the trainer's GPU takes


def test_the_cuda_ipc_transport_loads_each_bucket_through_the_engines_actor(group, checkpoints, pushed_weights):
    """The embedded engine's cuda_ipc path through its actor (``update_weights_shared``), the
    buffers handed by value where a GPU would map them: the sync's fingerprints check proves the
    engine holds exactly what was sent. The stand-in trainer is one rank: engine 0 sits beside it."""
    from safetensors.torch import load_file

    from bpo_megatron.rollout.hf.cuda_ipc import CudaIpc
    from bpo_megatron.weights.checksums import fingerprints
    from bpo_megatron.weights.shared_bucket import by_value

    start = list(load_file(Path(checkpoints[0]) / "model.safetensors").items())
    for weights, version in ((start, 10), (pushed_weights, 11)):  # other weights, then back to the pushed ones
        pusher = _WeightPusher(weights)
        pusher.transports[CUDA_IPC] = CudaIpc(share=by_value)
        report = _sync(pusher, group, transport=CUDA_IPC, version=version, bucket_bytes=1 << 16, verify=True,
                       only=[0])
        assert report["sync_bytes"] == sum(t.numel() * t.element_size() for _, t in weights) and report["push_s"] > 0
        assert group.call("fingerprints")[0] == fingerprints(weights)
        assert group.call("weight_version")[0] == version


# ------------------------------------------------------------------------- stalls and concurrency
STALL_S = 6.0  # the tests' rollout.stall_timeout_s (the default, 120 s, is for real engines)


@pytest.fixture(scope="module")
def async_group(ray_session, checkpoints):
    """Two engines whose generations overlap weight updates (train.async.max_staleness=2): each
    actor takes up to 3 generate calls at once, beside its control calls."""
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.groups import EngineGroup

    start_dir = checkpoints[0]
    cfg = load_experiment(None, [f"model.path={start_dir}", "model.tokenizer=char", "rollout.engine=hf",
                                 "rollout.num_engines=2", "rollout.max_restarts=4", "data.max_prompt_tokens=16",
                                 "rollout.max_new_tokens=240", "train.async.max_staleness=2",
                                 "cluster.colocate=false", f"rollout.stall_timeout_s={STALL_S}"], check_model=True)
    engines = EngineGroup(cfg.engine_group_spec(), start_dir)
    assert engines.partial_rollouts
    yield engines
    engines.shutdown()


def _stop_when_generating(worker, timer_s: float = KILL_AFTER_S) -> tuple[threading.Timer, int]:
    pid = _engine_pid(worker)
    stop = threading.Timer(timer_s, os.kill, args=(pid, signal.SIGSTOP))
    stop.start()
    return stop, pid


def test_control_calls_are_answered_while_generations_fill_the_engine(async_group, pushed_weights, expected):
    """Three generations under way on each engine (k = 2 batches ahead plus this step's): the
    sync's health check, version and a whole weight update still go through at once, and no
    busy engine is taken for a hung one (it used to be: two generations filled the actor's two
    call slots, the health check timed out after 30 s and the engine was killed)."""
    restarted = _arm(async_group, pushed_weights)
    restarts_before = async_group.restarts
    pending = [async_group.submit(BIG) for _ in range(3)]
    calls = [stream.generator for p in pending for stream in p._streams.values()]
    time.sleep(KILL_AFTER_S)
    start = time.monotonic()
    assert async_group.replace_unhealthy() == []
    assert async_group.call("weight_version") == [0, 0]
    checked_s = time.monotonic() - start
    still_generating = len(ray.wait(calls, num_returns=len(calls), timeout=0)[1])
    _sync(_WeightPusher(pushed_weights), async_group, transport="object_store", version=1,
          bucket_bytes=1 << 20, verify=True)
    answered_s = time.monotonic() - start
    samples = [p.result() for p in pending]
    # health and version answered at once, beside the generations (each engine's 3 take seconds)
    assert still_generating >= 4 and checked_s < 1.0, (still_generating, checked_s)
    assert answered_s < 10.0, f"control calls waited {answered_s:.1f} s behind the generations"
    assert async_group.restarts == restarts_before and restarted == []
    assert async_group.call("weight_version") == [1, 1]
    for got in samples:  # the same weights before and after the update: the same samples
        _check_samples(got, BIG, expected["big"])


def test_a_stopped_engine_is_found_by_its_progress_and_replaced(async_group, pushed_weights, expected):
    """SIGSTOP mid-generation, no generate timeout: the engine's progress stops, it is killed
    after rollout.stall_timeout_s and replaced, and its share is generated again by the new one."""
    restarted = _arm(async_group, pushed_weights)
    restarts_before = async_group.restarts
    victim = async_group.workers[0]
    stop, pid = _stop_when_generating(victim)
    start = time.monotonic()
    try:
        samples = async_group.generate(BIG)
    finally:
        stop.join()
    elapsed = time.monotonic() - start
    assert restarted == [[0]] and async_group.restarts == restarts_before + 1
    assert async_group.workers[0] is not victim
    assert STALL_S < elapsed < STALL_S + 30, f"replaced after {elapsed:.1f} s"
    assert not Path(f"/proc/{pid}").exists() or "T" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    _check_samples(samples, BIG, expected["big"])


def test_every_call_to_a_stopped_engine_is_bounded(async_group, pushed_weights, expected):
    """A stopped engine found by a control call (here: the version a sync reads) is killed after
    rollout.stall_timeout_s and replaced; the call is answered by the replacement, which waits
    for the current weights (it is recorded as not synced)."""
    _arm(async_group, pushed_weights)
    restarts_before = async_group.restarts
    victim = async_group.workers[1]
    os.kill(_engine_pid(victim), signal.SIGSTOP)
    start = time.monotonic()
    versions = async_group.call("weight_version")
    elapsed = time.monotonic() - start
    assert versions == [0, 0] and async_group.workers[1] is not victim
    assert async_group.restarts == restarts_before + 1 and async_group.unsynced == {1}
    assert STALL_S <= elapsed < STALL_S + 30
    async_group.custodian.resync([1])  # what the next sync does
    async_group.unsynced.clear()
    _check_samples(async_group.generate(SMALL), SMALL, expected["small"])


def test_one_death_under_two_generations_is_one_restart(async_group, pushed_weights, expected):
    """Two batches under way on an engine that dies (train.async): the first to notice replaces
    it; the second re-sends its share to that replacement instead of replacing it again (one
    death used to spend two restarts, and the second killed the fresh engine)."""
    restarted = _arm(async_group, pushed_weights)
    restarts_before = async_group.restarts
    first, second = async_group.submit(BIG), async_group.submit(BIG)
    kill = threading.Timer(KILL_AFTER_S, ray.kill, args=(async_group.workers[0],))
    kill.start()
    try:
        samples = [first.result(), second.result()]
    finally:
        kill.join()
    assert restarted == [[0]] and async_group.restarts == restarts_before + 1
    for got in samples:
        _check_samples(got, BIG, expected["big"])


def test_joining_the_weight_group_and_fingerprinting_have_bounds_of_their_own(async_group, monkeypatch):
    """Neither call goes through the stall watch: each waits at most its own bound, then names the
    engines that did not answer and what they were asked."""
    from bpo_megatron.orchestration import engine_group
    from bpo_megatron.orchestration.groups import EnginesFailed

    monkeypatch.setattr(engine_group, "FINGERPRINT_TIMEOUT_S", 3.0)
    monkeypatch.setattr(engine_group, "JOIN_TIMEOUT_S", 3.0)
    pid = _engine_pid(async_group.workers[1])
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(EnginesFailed, match=r"rollout engines \[1\] did not fingerprint their weights "
                                                r"\(weight_sync.verify\) within 3 s"):
            async_group.fingerprints(only=[0, 1])
        with pytest.raises(EnginesFailed, match=r"rollout engines \[1\] did not join the weight group at "
                                                r"127.0.0.1:1 within 3 s"):
            async_group.join_weight_group("127.0.0.1", 1, [1, 2], 3)
        assert time.monotonic() - start < 20
    finally:
        os.kill(pid, signal.SIGCONT)
