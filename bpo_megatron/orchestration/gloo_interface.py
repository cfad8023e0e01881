"""The network interface the trainer's gloo groups use between nodes.

A save sends no optimizer state between ranks (each data-parallel rank writes its own shard,
:mod:`bpo_megatron.trainer.optimizer_state`), but gloo still carries the optimizer state of a
resume from a checkpoint of the older, gathered format (Megatron's fully reshardable one, which
the ranks exchange over gloo), and Megatron's gloo groups. Without
``GLOO_SOCKET_IFNAME`` gloo binds to the address the host name resolves to, which on most GPU clusters is the management network (often 1–25 Gb/s) rather than the fast one NCCL's
bootstrap is pointed at with ``NCCL_SOCKET_IFNAME`` (IPoIB or a 100–400 Gb/s Ethernet).

The rule, applied in every trainer process before its process group starts:

* ``GLOO_SOCKET_IFNAME`` set: it is used as it is.
* ``NCCL_SOCKET_IFNAME`` set: gloo uses the fastest interface of this node that NCCL's rule
  matches (comma-separated name prefixes, ``=`` for exact names, ``^`` to exclude), is up and has
  an IPv4 address; none matching is an error naming both variables (gloo would otherwise pick
  another network silently).
* neither: gloo's own default, and a line saying so when this node has an interface faster than
  that default's (set ``NCCL_SOCKET_IFNAME`` or ``GLOO_SOCKET_IFNAME``, e.g. in the launcher's
  ``--env``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    speed_mbps: int  # 0 where the kernel does not know (loopback, virtual NICs)
    ipv4: tuple[str, ...]


def node_interfaces() -> list[Interface]:
    import psutil

    stats, addresses = psutil.net_if_stats(), psutil.net_if_addrs()
    return [Interface(name, bool(stats[name].isup), int(stats[name].speed or 0),
                      tuple(a.address for a in addresses.get(name, ()) if a.family == socket.AF_INET))
            for name in sorted(stats)]


def nccl_rule_matches(rule: str, name: str) -> bool:
    """Whether NCCL's ``NCCL_SOCKET_IFNAME`` rule selects the interface ``name``."""
    rule = rule.strip()
    exclude = rule.startswith("^")
    rule = rule.lstrip("^")
    exact = rule.startswith("=")
    entries = [entry.strip() for entry in rule.lstrip("=").split(",") if entry.strip()]
    listed = any(name == entry if exact else name.startswith(entry) for entry in entries)
    return listed != exclude


def gloo_default(interfaces: list[Interface], hostname: str | None = None) -> Interface | None:
    """The interface gloo binds to without ``GLOO_SOCKET_IFNAME``: that of the host name's address."""
    try:
        address = socket.gethostbyname(hostname or socket.gethostname())
    except OSError:
        return None
    return next((i for i in interfaces if address in i.ipv4), None)


def choose(environ: Mapping[str, str], interfaces: list[Interface], hostname: str | None = None
           ) -> tuple[str | None, str | None]:
    """``(GLOO_SOCKET_IFNAME to set or None, a line for the log or None)`` by the rule above."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return None, None
    rule = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    usable = [i for i in interfaces if i.up and i.ipv4]
    if rule:
        matched = [i for i in usable if nccl_rule_matches(rule, i.name)]
        if not matched:
            raise ValueError(
                f"NCCL_SOCKET_IFNAME={rule} matches no interface of {socket.gethostname()} that is up and has an IPv4 "
                f"address (it has: {', '.join(i.name for i in usable) or 'none'}); the trainer's gloo groups "
                "(optimizer state of older checkpoints) follow it: fix it, or set GLOO_SOCKET_IFNAME to the interface "
                "gloo should use")
        fastest = max(matched, key=lambda i: i.speed_mbps)  # the first of equals
        return fastest.name, (f"gloo (optimizer state of older checkpoints) uses {fastest.name} ({_speed(fastest)}), "
                              f"the fastest interface NCCL_SOCKET_IFNAME={rule} names")
    default = gloo_default(interfaces, hostname)
    faster = [i for i in usable if i.speed_mbps > (default.speed_mbps if default else 0)]
    if default is not None and faster:
        best = max(faster, key=lambda i: i.speed_mbps)
        return None, (f"gloo (optimizer state of older checkpoints) uses {default.name} ({_speed(default)}), "
                      f"the interface of this host's name; {best.name} is faster ({_speed(best)}): set "
                      f"GLOO_SOCKET_IFNAME={best.name} (or NCCL_SOCKET_IFNAME) in the run's environment")
    return None, None


def _speed(interface: Interface) -> str:
    return f"{interface.speed_mbps / 1000:g} Gb/s" if interface.speed_mbps else "speed unknown"


def apply(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``environ`` (this process's) by the rule; returns the line to log."""
    environ = os.environ if environ is None else environ
    value, line = choose(environ, node_interfaces())
    if value is not None:
        environ["GLOO_SOCKET_IFNAME"] = value
    return line
