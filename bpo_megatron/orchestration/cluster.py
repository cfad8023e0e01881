"""Starting Ray: an embedded local instance by default, or joining an existing cluster."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def address_and_free_port() -> tuple[str, int]:
    """This node's address (as Ray knows it) and a port free on it: a rendezvous to host here."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


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
    return True


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
