"""Faults of the Ray trainer group (2 ranks of the demo trainer, EP=2, gloo): one rank raising
while the other waits in a collective, or one rank's process killed, stops the whole group within
seconds with that rank's error, not after the collective's 30-minute timeout."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")
# the rank functions below travel to the Ray workers by value (the workers cannot import tests)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STOP_WITHIN_S = 30.0


def _pid(worker) -> int:
    return os.getpid()


def _raise_on_rank_1(worker) -> str:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("injected failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    return "unreachable"


def _wait_in_a_collective(worker) -> str:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)  # killed meanwhile
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def trainer(ray_session, small_run, tmp_path):
    from bpo_megatron.orchestration.groups import TrainerGroup

    cfg = small_run(tmp_path / "run")
    group = TrainerGroup(cfg.trainer_spec(), cfg.cluster)
    yield group
    group.shutdown()


@pytest.mark.timeout(240)
def test_an_exception_on_one_rank_stops_every_rank_within_seconds(trainer, capsys):
    from bpo_megatron.commands.common import report_failure
    from bpo_megatron.orchestration.groups import TrainerFailed

    pids = trainer.on_every_rank(_pid)
    start = time.monotonic()
    with pytest.raises(TrainerFailed) as failure:
        trainer.on_every_rank(_raise_on_rank_1)
    assert time.monotonic() - start < STOP_WITHIN_S
    assert str(failure.value) == "trainer rank 1 failed in _raise_on_rank_1: ValueError: injected failure on rank 1"
    assert "_raise_on_rank_1" in failure.value.details  # the rank's own traceback
    assert _wait_gone(pids, 10.0), "rank 0, blocked in its all-reduce, was not stopped"
    assert report_failure("bpo-megatron train", failure.value, ["bpo-megatron", "train", "x.yaml", "a=b c"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-2:] == ["bpo-megatron train: trainer rank 1 failed in _raise_on_rank_1: ValueError: injected failure "
                        "on rank 1", "the run stopped; resume it from its newest checkpoint with: bpo-megatron train "
                        "x.yaml 'a=b c'"]


@pytest.mark.timeout(240)
def test_a_killed_rank_is_reported_as_dead_in_one_line(trainer):
    from bpo_megatron.orchestration.groups import TrainerFailed

    pids = trainer.on_every_rank(_pid)
    threading.Timer(1.0, os.kill, args=(pids[0], signal.SIGKILL)).start()  # as the OOM killer does
    start = time.monotonic()
    with pytest.raises(TrainerFailed) as failure:
        trainer.on_every_rank(_wait_in_a_collective)
    assert time.monotonic() - start < STOP_WITHIN_S
    assert str(failure.value) == ("trainer rank 0 died during _wait_in_a_collective (its process was killed or "
                                  "crashed); every rank was stopped")
    assert _wait_gone(pids, 10.0)
