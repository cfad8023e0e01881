"""Starting Ray (an embedded local instance by default, or joining an existing cluster), and
rendezvous stores hosted on a Ray node."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys


def host_rendezvous(timeout_s: float):
    """A rendezvous store hosted in this process on a port the OS assigns as it binds, and where
    this node's peers reach it (the node's address as Ray knows it): ``(store, address, port)``.

    Binding port 0 and handing out the port the store got leaves no window: a port probed free
    and bound later can be taken in between (Ray's own workers bind ephemeral ports all the
    time), and then a whole trainer world fails to start."""
    import ray
    import torch.distributed as dist

    address = ray.util.get_node_ip_address()
    store = dist.TCPStore(address, 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, address, store.port


def start_ray(cluster, *, cpus_needed: int) -> bool:
    """``cluster.ray_address`` None: a private Ray on this machine, bound to loopback, with a
    bounded object store (a stray ``RAY_ADDRESS`` in the environment is not followed). Returns
    whether this call connected (False: Ray was already up, and whoever started it stops it)."""
    import ray

    if ray.is_initialized():
        return False
    if cluster.ray_address:
        ray.init(address=cluster.ray_address, log_to_driver=True)
        return True
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, cpus_needed),
        object_store_memory=cluster.object_store_mb * 1024 * 1024,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=True,
        logging_level="ERROR",
    )
    start_reaper()
    return True


_reapers: list[subprocess.Popen] = []


def start_reaper() -> None:
    """A process in a session of its own that ends what this process started (Ray's processes
    among them) once this process ends, killed or not (:mod:`bpo_megatron.orchestration.reaper`);
    :func:`stop_ray` ends it once Ray is shut down in order."""
    _reapers.append(subprocess.Popen(
        [sys.executable, "-m", "bpo_megatron.orchestration.reaper", "--parent", str(os.getpid())],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    while _reapers:  # Ray is down in order: nothing left for them to end
        reaper = _reapers.pop()
        reaper.terminate()
        try:
            reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait(timeout=10)
