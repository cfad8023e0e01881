"""The NCCL version of every member of the weight group, checked before the first broadcast.

NCCL refuses a communicator whose members load different NCCL libraries ("Mismatched NCCL version
detected"), and it finds out only when the first collective creates the communicator: the group
itself forms (process groups start lazily), then the first weight broadcast fails on every member.
Trainer rank 0 knows its own version; SGLang's TP ranks run SGLang's code and take part in no
collective of ours, so an engine's version is asked of its server's interpreter (the first element
of ``rollout.sglang.launcher``) once, in a separate process started with the server's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence

import torch

NcclVersion = tuple[int, ...]  # (major, minor, patch); None where a process has no NCCL
UNKNOWN = "unknown"  # an engine attached to a running server (rollout.sglang.url): nobody can ask it

PROBE_TIMEOUT_S = 120.0  # importing torch and querying CUDA on a busy node; a hung probe must not stall startup
_MARKER = "bpo-nccl-version "  # the probe's answer line, told apart from whatever else the interpreter prints
_FIX = ("run trainer and SGLang servers from one environment, built from tools/gpu/requirements-cluster.txt "
        "(docs/gpu-environment.md), and point rollout.sglang.launcher at its Python")

# Runs in the server's interpreter: the same rule as nccl_version() below, with nothing of ours imported
# (that interpreter need not have this package).
_PROBE = f"""
import json, torch, torch.distributed as dist
version = None
if torch.cuda.is_available() and dist.is_nccl_available():
    version = [int(part) for part in torch.cuda.nccl.version()[:3]]
print({_MARKER!r} + json.dumps(version), flush=True)
"""


class NcclVersionMismatch(RuntimeError):
    """Members of the weight group would load different NCCL libraries; the message names them."""


class NcclVersionUnknown(RuntimeError):
    """The server's interpreter could not be asked for its NCCL version; the message says why."""


def nccl_version() -> NcclVersion | None:
    """This process's NCCL (major, minor, patch), or None without CUDA or NCCL (the group is then gloo)."""
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return None
    return tuple(int(part) for part in torch.cuda.nccl.version()[:3])  # a 4th element is a build suffix


def server_nccl_version(launcher: Sequence[str], visible_devices: Sequence[int] = (),
                        env: Mapping[str, str] | None = None, timeout_s: float = PROBE_TIMEOUT_S
                        ) -> NcclVersion | None:
    """The NCCL version the SGLang server started by ``launcher`` will load: its interpreter
    (``launcher[0]``) runs the same query as :func:`nccl_version`, with the GPUs the server sees
    (``visible_devices``, as ``CUDA_VISIBLE_DEVICES``; none given: this process's)."""
    if not launcher:
        raise NcclVersionUnknown("rollout.sglang.launcher is empty: its first element must be the server's Python")
    python = launcher[0]
    environment = dict(os.environ if env is None else env)
    if visible_devices:
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible_devices))
    where = f"the server's interpreter {python} (rollout.sglang.launcher[0])"
    try:
        done = subprocess.run([python, "-c", _PROBE], env=environment, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise NcclVersionUnknown(f"{where} did not report its NCCL version within {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise NcclVersionUnknown(f"{where} could not be started ({exc}); rollout.sglang.launcher must begin "
                                 "with the server's Python, e.g. [/opt/bpo/bin/python, -m, sglang.launch_server]"
                                 ) from exc
    answers = [line[len(_MARKER):] for line in done.stdout.splitlines() if line.startswith(_MARKER)]
    if done.returncode != 0 or not answers:
        output = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise NcclVersionUnknown(f"{where} could not report its NCCL version (exit {done.returncode}): "
                                 + " | ".join(output) + "; rollout.sglang.launcher must begin with a Python "
                                 "that has torch, e.g. [/opt/bpo/bin/python, -m, sglang.launch_server]")
    version = json.loads(answers[-1])
    return None if version is None else tuple(version)


def describe(version: NcclVersion | None) -> str:
    return "no NCCL (torch without CUDA)" if version is None else "NCCL " + ".".join(map(str, version))


def check_nccl_versions(trainer_version: NcclVersion | None,
                        engine_versions: Sequence[NcclVersion | None | str]) -> None:
    """Refuse a weight group whose members would load different NCCL libraries.

    ``trainer_version``: trainer rank 0's (:func:`nccl_version`); ``engine_versions[i]``: rollout
    engine ``i``'s server's (:func:`server_nccl_version`; :data:`UNKNOWN` for an attached server,
    which is not checked). A trainer without NCCL broadcasts with gloo, where versions do not matter.
    """
    if trainer_version is None:
        return
    trainer_version = tuple(trainer_version[:3])
    differing = [f"rollout engine {index}'s SGLang server runs {describe(None if v is None else tuple(v[:3]))}"
                 for index, v in enumerate(engine_versions)
                 if v != UNKNOWN and (v is None or tuple(v[:3]) != trainer_version)]
    if differing:
        raise NcclVersionMismatch(
            f"the weight group would mix NCCL libraries: trainer rank 0 runs {describe(trainer_version)}, "
            + "; ".join(differing) + ". NCCL refuses a communicator whose members differ (\"Mismatched NCCL "
            f"version detected\" at the first weight broadcast): {_FIX}")
