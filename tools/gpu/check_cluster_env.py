"""Check that tools/gpu/requirements-cluster.txt resolves to ONE environment for a GPU node.

Trainer rank 0 and every SGLang TP rank meet in one NCCL communicator, which NCCL refuses when its
members load different NCCL libraries. So the node's single environment must hold exactly one
torch (the one SGLang 0.5.23 pins) and exactly one NCCL distribution (the one that torch requires).
This runs pip's resolver (``pip install --dry-run --report``, nothing is installed), prints the
versions that matter and exits 1 when the set breaks one of those rules.

    .venv/bin/python tools/gpu/check_cluster_env.py                       # this interpreter's Python
    .venv/bin/python tools/gpu/check_cluster_env.py --python-version 3.12 # the node's (wheels only)

By default pip runs isolated from this machine's pip configuration and resolves against PyPI, as a
node without a local mirror would (``--use-pip-config`` keeps the configuration). Needs network
access to the index; takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "tools" / "gpu" / "requirements-cluster.txt"
CONSTRAINTS = ROOT / "tools" / "gpu" / "constraints-cluster.txt"
NCCL = r"nvidia-nccl-cu\d+"  # NCCL's wheels, one per CUDA major version
RESOLVE_TIMEOUT_S = 1800  # the resolver downloads metadata of ~300 distributions; a stuck index must end


def resolve(python_version: str | None, use_pip_config: bool, report: Path) -> None:
    """Run pip's resolver over the requirements file, writing its JSON report to ``report``."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "-r", str(REQUIREMENTS)]
    env = dict(os.environ)
    if not use_pip_config:
        command.insert(4, "--isolated")  # no PIP_* variables
        env["PIP_CONFIG_FILE"] = os.devnull  # and no configuration file (mirrors, caps, constraints)
    if python_version:  # another interpreter's resolution: pip can then only judge wheels
        command += ["--python-version", python_version, "--only-binary=:all:"]
    try:
        # the file's `-e .` is relative to the working directory: the checkout's root
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sys.exit(f"pip did not resolve {REQUIREMENTS.name} within {RESOLVE_TIMEOUT_S} s (is the index reachable?)")
    if done.returncode != 0:
        sys.exit(f"pip could not resolve {REQUIREMENTS.name}:\n{done.stderr.strip() or done.stdout.strip()}")


def pinned(name: str) -> str | None:
    """The version constraints-cluster.txt pins ``name`` to (None when it does not)."""
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == canonicalize_name(name):
                return str(requirement.specifier).removeprefix("==")
    return None


def summarise(report: dict) -> tuple[dict[str, str], list[str]]:
    """The versions that matter in a pip report, and every rule the resolved set breaks."""
    installs = {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    version = {name: meta["version"] for name, meta in installs.items()}
    problems = []
    torches = [name for name in installs if name == "torch"]
    nccls = sorted(name for name in installs if re.fullmatch(NCCL, name))
    if torches != ["torch"]:
        problems.append(f"expected exactly one torch distribution, found {torches or 'none'}")
    if len(nccls) != 1:
        problems.append(f"expected exactly one NCCL distribution (nvidia-nccl-cu*), found {nccls or 'none'}")

    def requirement_of(package: str, wanted) -> Requirement | None:
        """``package``'s requirement on the distribution whose name matches ``wanted``."""
        for line in installs.get(package, {}).get("requires_dist") or []:
            requirement = Requirement(line)
            if re.fullmatch(wanted, canonicalize_name(requirement.name)):
                return requirement
        return None

    sglang_torch = requirement_of("sglang", "torch")
    if "torch" in version and sglang_torch is not None and Version(version["torch"]) not in sglang_torch.specifier:
        problems.append(f"torch {version['torch']} is not what sglang requires ({sglang_torch})")
    torch_nccl = requirement_of("torch", NCCL)
    if "torch" in version and torch_nccl is not None:
        wanted = canonicalize_name(torch_nccl.name)
        if wanted not in version or Version(version[wanted]) not in torch_nccl.specifier:
            problems.append(f"torch {version['torch']} requires {torch_nccl.name}{torch_nccl.specifier}, the set "
                            f"has {wanted + ' ' + version[wanted] if wanted in version else 'none'}")
    ours = requirement_of("bpo-megatron", "megatron-core")
    if ours is not None and "megatron-core" in version and Version(version["megatron-core"]) not in ours.specifier:
        problems.append(f"megatron-core {version['megatron-core']} is outside the package's window ({ours.specifier})")
    core = [name for name in installs if re.fullmatch(r"transformer-engine-cu\d+", name)]
    if "transformer-engine" in version and [version[name] for name in core] != [version["transformer-engine"]]:
        problems.append(f"transformer-engine {version['transformer-engine']} needs one core library of the same "
                        f"version, found {[f'{name} {version[name]}' for name in core]}"
                        + ("" if core else " (pip before 23.3 drops the [core_cu13] extra without a word: "
                                           "python -m pip install -U 'pip>=23.3')"))
    shown = {name: version.get(name, "-") for name in ("torch", "sglang", "megatron-core", "transformers", "ray")}
    shown["transformer-engine"] = version.get("transformer-engine", "-")
    shown["transformer-engine core"] = ", ".join(f"{name} {version[name]}" for name in core) or "-"
    shown["NCCL"] = ", ".join(f"{name} {version[name]}" for name in nccls) or "-"
    return shown, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", help="resolve for this Python (e.g. 3.12) instead of this interpreter's")
    parser.add_argument("--use-pip-config", action="store_true", help="keep this machine's pip configuration")
    parser.add_argument("--report", type=Path, help="keep pip's JSON report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        report_path = args.report or Path(scratch) / "report.json"
        resolve(args.python_version, args.use_pip_config, report_path)
        report = json.loads(report_path.read_text())
    shown, problems = summarise(report)
    te_torch = pinned("transformer-engine-torch")
    shown["transformer-engine torch part"] = (f"transformer-engine-torch {te_torch} (source build, second step)"
                                              if te_torch else "-")
    if te_torch and te_torch != shown["transformer-engine"]:
        problems.append(f"transformer-engine-torch {te_torch} (constraints-cluster.txt) differs from "
                        f"transformer-engine {shown['transformer-engine']}")
    python = args.python_version or ".".join(map(str, sys.version_info[:2]))
    print(f"{REQUIREMENTS.relative_to(ROOT)} resolved for Python {python} ({len(report['install'])} distributions):")
    for name, value in shown.items():
        print(f"  {name:<30} {value}")
    for problem in problems:
        print(f"NOT ONE ENVIRONMENT: {problem}", file=sys.stderr)
    if not problems:
        print("one torch, one NCCL: trainer and SGLang servers load the same libraries")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
