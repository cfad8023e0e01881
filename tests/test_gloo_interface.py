"""The trainer's gloo groups (the optimizer state of older, gathered checkpoints) follow NCCL's fast
interface instead of gloo's default, the host name's (often the management network)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from bpo_megatron.orchestration.gloo_interface import Interface, choose, nccl_rule_matches

NODE = [
    Interface("lo", True, 0, ("127.0.0.1",)),
    Interface("eno1", True, 1_000, ("10.0.0.5",)),  # management: the host name's address
    Interface("ib0", True, 200_000, ("10.1.0.5",)),
    Interface("ib1", True, 400_000, ("10.2.0.5",)),
    Interface("ib2", False, 400_000, ("10.3.0.5",)),  # down
    Interface("docker0", True, 10_000, ("172.17.0.1",)),
]


@pytest.mark.parametrize(("rule", "name", "matches"), [
    ("ib", "ib0", True), ("ib", "eno1", False), ("eno1,ib", "ib1", True), ("=ib", "ib0", False),
    ("=ib0", "ib0", True), ("^docker,lo", "docker0", False), ("^docker,lo", "ib0", True), ("^=ib0", "ib0", False),
])
def test_nccls_interface_rule(rule, name, matches):
    assert nccl_rule_matches(rule, name) is matches


def test_gloo_follows_the_fastest_interface_nccl_names(monkeypatch):
    monkeypatch.setattr("socket.gethostbyname", lambda _: "10.0.0.5")
    value, line = choose({"NCCL_SOCKET_IFNAME": "ib"}, NODE)
    assert value == "ib1" and "400 Gb/s" in line  # ib2 is faster but down
    assert choose({"NCCL_SOCKET_IFNAME": "^docker,lo,eno"}, NODE)[0] == "ib1"
    assert choose({"NCCL_SOCKET_IFNAME": "=ib0"}, NODE)[0] == "ib0"
    # the user's own choice for gloo stands
    assert choose({"GLOO_SOCKET_IFNAME": "eno1", "NCCL_SOCKET_IFNAME": "ib"}, NODE) == (None, None)


def test_a_rule_matching_nothing_is_refused_by_name():
    with pytest.raises(ValueError, match=r"NCCL_SOCKET_IFNAME=ens9 matches no interface .*has: lo, eno1, ib0, ib1, "
                                         r"docker0.*GLOO_SOCKET_IFNAME"):
        choose({"NCCL_SOCKET_IFNAME": "ens9"}, NODE)


def test_without_either_setting_a_faster_interface_than_gloos_default_is_named(monkeypatch):
    monkeypatch.setattr("socket.gethostbyname", lambda _: "10.0.0.5")
    value, line = choose({}, NODE)
    assert value is None
    assert line.startswith("gloo (optimizer state of older checkpoints) uses eno1 (1 Gb/s)")
    assert "GLOO_SOCKET_IFNAME=ib1" in line
    monkeypatch.setattr("socket.gethostbyname", lambda _: "10.2.0.5")  # already the fastest: nothing to say
    assert choose({}, NODE) == (None, None)


@pytest.mark.timeout(120)
def test_a_process_that_applies_the_rule_runs_its_gloo_group_on_that_interface():
    """Two processes on 127.0.0.1 with ``NCCL_SOCKET_IFNAME=lo``: each sets ``GLOO_SOCKET_IFNAME``
    to ``lo`` before its group starts, and the group's all-reduce runs over it."""
    script = textwrap.dedent("""
        import os, sys, datetime
        import torch
        torch.set_num_threads(1)
        import torch.distributed as dist
        from bpo_megatron.orchestration import gloo_interface
        gloo_interface.apply()
        rank = int(sys.argv[1])
        store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        print(os.environ["GLOO_SOCKET_IFNAME"], value.item(), flush=True)
        dist.destroy_process_group()
    """)
    from bpo_megatron.platform import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"} | {"NCCL_SOCKET_IFNAME": "lo"}
    processes = [subprocess.Popen([sys.executable, "-c", script, str(rank), str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert [out.strip().splitlines()[-1] for out in outputs] == ["lo 3.0", "lo 3.0"]
