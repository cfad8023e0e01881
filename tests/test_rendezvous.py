"""Rendezvous on ports the OS assigns: a port is handed out only while its store already holds it.

A port probed free, released and bound later by the rendezvous host can be taken in between (a
trainer world once failed to start so: ``EADDRINUSE`` on rank 0's store); these tests show that
the port each rendezvous hands out is bound from the moment it is known, and that the worlds
formed at such stores compute what they should.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.parallel.local_world import GlooWorldError, run_gloo_world


def _bind(address: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, port))


def test_the_port_a_rendezvous_hands_out_is_already_held_by_its_store():
    from bpo_megatron.orchestration.cluster import host_rendezvous

    store, address, port = host_rendezvous(30)
    with pytest.raises(OSError) as taken:
        _bind(address, port)  # nobody can take it between the hand-out and the peers' arrival
    assert taken.value.errno == errno.EADDRINUSE
    peer = dist.TCPStore(address, port, None, is_master=False, timeout=datetime.timedelta(seconds=30))
    peer.set("rank 1", "here")
    assert store.get("rank 1") == b"here"


def _sum_of_ranks() -> tuple[int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), value.item()


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()


def test_a_local_world_meets_at_its_parents_store_and_reduces_across_every_rank():
    assert run_gloo_world(_sum_of_ranks, 3, timeout=120) == [(0, 6.0), (1, 6.0), (2, 6.0)]  # 1 + 2 + 3


def test_a_rank_that_raises_is_named_and_its_peers_are_stopped():
    with pytest.raises(GlooWorldError, match=r"(?s)_rank_one_raises failed on rank 1:.*ValueError: rank 1 refuses"):
        run_gloo_world(_rank_one_raises, 2, timeout=120)


def test_trainer_rank_0_hosts_the_world_from_its_construction():
    """Rank 0's rendezvous listens before any rank is told where it is (the ranks are told by the
    trainer group after rank 0 answers), and its address names the port its store holds."""
    from bpo_megatron.orchestration.workers import TrainWorker

    spec = SimpleNamespace(hf=None, parallel=ParallelConfig())  # the actor is built only as a rank joins
    rank0 = TrainWorker(spec, 0, 2)
    address, port = rank0.rendezvous().rsplit(":", 1)
    with pytest.raises(OSError):
        _bind(address, int(port))
    assert TrainWorker(spec, 1, 2)._store is None  # the others only join it


@pytest.mark.parametrize("tp, expected", [(1, None), (2, "1")])
def test_a_trainer_rank_sets_the_device_connections_megatron_wants_before_its_cuda_context(monkeypatch, tp, expected):
    """With tensor parallelism a rank's environment holds CUDA_DEVICE_MAX_CONNECTIONS=1 when it
    binds its device (which makes the CUDA context that reads it); without, it is left unset."""
    from bpo_megatron import platform
    from bpo_megatron.orchestration.workers import TrainWorker

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    seen = []
    monkeypatch.setattr(platform, "bind_device", lambda: seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")))
    TrainWorker(SimpleNamespace(hf=None, parallel=ParallelConfig(tp=tp)), 1, 2)
    assert seen == [expected]


def test_a_device_connections_value_the_user_set_is_kept_and_said():
    from bpo_megatron.platform import set_device_max_connections

    environ = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    note = set_device_max_connections("1", environ)
    assert environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8 kept" in note
    environ = {}
    assert set_device_max_connections("1", environ) is None and environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert set_device_max_connections(None, environ) is None
