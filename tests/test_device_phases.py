"""Colocated device phases when an engine dies: the replacement starts while the trainer is off
the devices, is brought to its peers' memory state and gets the current weights before it
generates, in whatever phase the step was (it used to end the run with a raw ActorDiedError at
the next rollout phase: the memory calls went to every engine before any liveness check).

The session's embedded Ray, the demo's trainer (2 ranks, EP=2) and two embedded engines sharing
its (declared) devices; the phases, groups and weight sync are the loop's own.
"""

from __future__ import annotations

import pytest

from bpo_megatron.rollout import GenerationRequest, SamplingParams

ray = pytest.importorskip("ray")


@pytest.fixture
def colocated(ray_session, small_run, tmp_path):
    from bpo_megatron.loop.run_dir import initial_hf_dir
    from bpo_megatron.orchestration.groups import EngineGroup, TrainerGroup, run_placement
    from bpo_megatron.orchestration.phases import DevicePhases, hand_devices_to_trainer
    from bpo_megatron.weight_sync.session import WeightSync

    cfg = small_run(tmp_path, "cluster.colocate=true", "rollout.num_engines=2", "weight_sync.bucket_mb=1",
                    "weight_sync.verify=true")
    model_dir = initial_hf_dir(cfg)
    placement = run_placement(cfg.cluster, cfg.rollout.num_engines)
    engines = EngineGroup(cfg.engine_group_spec(), model_dir, placement=placement)
    hand_devices_to_trainer(engines, shared=True)
    trainer = TrainerGroup(cfg.trainer_spec(), cfg.cluster, placement=placement)
    phases = DevicePhases(engines, trainer, WeightSync(trainer, engines, cfg.sync_plan()), shared=True)
    trainer.call("load_hf", model_dir)
    yield phases, engines, trainer
    engines.shutdown()
    trainer.shutdown()
    placement.remove()


def _events(monkeypatch, engines, trainer) -> list[str]:
    """What the trainer was told and when engines started, in order."""
    events: list[str] = []
    call, start = trainer.call, engines._start

    def traced_call(method, *args):
        events.append(method)
        return call(method, *args)

    def traced_start(indices):
        events.append(f"start {indices}")
        return start(indices)

    monkeypatch.setattr(trainer, "call", traced_call)
    monkeypatch.setattr(engines, "_start", traced_start)
    return events


REQUESTS = [GenerationRequest(f"q{i}", (3, 4, 5 + i), SamplingParams(max_new_tokens=3, n=2, seed=i)) for i in range(4)]


def test_an_engine_killed_while_the_colocated_trainer_trains_is_replaced_and_synced(colocated, monkeypatch):
    phases, engines, trainer = colocated
    phases.weights_changed(1)
    phases.rollout()
    assert {s.weight_version for s in engines.generate(REQUESTS)} == {1}
    phases.train()  # the trainer holds the devices, the engines hold nothing
    victim = engines.workers[0]
    ray.kill(victim)
    events = _events(monkeypatch, engines, trainer)
    phases.weights_changed(2)
    phases.rollout()  # with verify=True every engine's weights are compared with what was sent
    assert engines.workers[0] is not victim and engines.restarts == 1 and not engines.unsynced
    # the trainer's cached blocks freed first; the replacement started with the trainer offloaded,
    # then the trainer came back for the sync
    assert events == ["release_cached_memory", "offload", "start [0]", "onload", "push_weights", "offload"], events
    assert engines.call("weight_version") == [2, 2]
    assert {s.weight_version for s in engines.generate(REQUESTS)} == {2}


def test_an_engine_killed_while_it_generates_is_replaced_and_resynced_in_the_rollout_phase(colocated, monkeypatch):
    phases, engines, trainer = colocated
    phases.weights_changed(3)
    phases.rollout()  # the engines hold the devices
    ray.kill(engines.workers[1])
    events = _events(monkeypatch, engines, trainer)
    samples = engines.generate(REQUESTS)
    assert {s.weight_version for s in samples} == {3} and len(samples) == 8
    assert engines.restarts == 1
    # started while the trainer was offloaded (no offload needed), then one full sync: the trainer
    # onloads, frees its cached blocks, pushes to every engine, offloads again
    assert events == ["start [1]", "onload", "release_cached_memory", "push_weights", "offload"], events


# ---------------------------------------------------------------- what moves, and when nothing does
class _Engines:
    """The engine group as the phases use it, recording the calls."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.unsynced, self.custodian = events, set(), None

    def entrust(self, custodian) -> None:
        self.custodian = custodian

    def release_memory(self, only=None) -> None:
        self.events.append("release")

    def resume_memory(self, tags, only=None) -> None:
        self.events.append(f"resume {tags}")


class _Trainer:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __getattr__(self, method):
        def call(*args):
            self.events.append(method if method != "plan_offload" else f"plan_offload {args}")
            return 1000 if method in ("offload", "plan_offload") else None
        return call


def _phases(offload: str, shared: bool = True):
    from bpo_megatron.orchestration.phases import DevicePhases, hand_devices_to_trainer

    events: list[str] = []

    class Weights:
        def sync(self, version, only=None):
            events.append(f"push {version}")
            return {"sync_bytes": 64.0, "push_s": 0.25}

    engines = _Engines(events)
    hand_devices_to_trainer(engines, shared=shared, offload=offload)
    phases = DevicePhases(engines, _Trainer(events), Weights(), shared=shared, offload=offload,
                          keep_spares_across_saves=True)
    return phases, events


def test_every_move_is_timed_apart_and_a_step_without_them_records_zeros():
    from bpo_megatron.orchestration.phases import MOVE_KEYS

    phases, events = _phases("optimizer")
    assert events == ["release", "plan_offload ('optimizer', True)"]  # host buffers before the first step
    phases.weights_changed(1)
    phases.rollout()
    phases.train()
    assert events[2:] == ["release_cached_memory", "resume ('weights',)", "push 1", "offload", "resume ()", "release",
                          "onload"]
    moved = phases.take_moves()
    assert set(moved) == {*MOVE_KEYS, "sync_bytes_per_s"}
    assert (moved["sync_bytes"], moved["push_s"], moved["offload_bytes"], moved["sync_bytes_per_s"]) == (
        64.0, 0.25, 1000.0, 256.0)
    assert all(moved[key] > 0 for key in ("offload_s", "onload_s", "resume_s"))
    assert phases.take_moves() == dict.fromkeys(moved, 0.0)  # nothing since: every key, zero


def test_nothing_offloaded_keeps_trainer_and_engines_on_the_devices_as_if_apart():
    phases, events = _phases("nothing")
    phases.weights_changed(1)
    phases.rollout()
    phases.train()
    phases.weights_changed(2)
    phases.rollout()
    assert events == ["push 1", "push 2"]  # no release, resume, offload or onload; no host buffers
    moved = phases.take_moves()
    assert moved["push_s"] == 0.5 and moved["offload_s"] == moved["onload_s"] == moved["resume_s"] == 0.0
