"""The documented cluster install (``tools/gpu/requirements-cluster.txt`` with its constraints) gives a
megatron-core that the config check admits for every shipped recipe: the package's window
(``>=0.16,<0.20``) alone resolves to 0.19.2 on Python 3.12, on which the latent-attention recipe
(Moonlight, DeepSeek-V3's family) is refused at ``train --check``."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from bpo_megatron.experiment import ConfigError, load_experiment
from bpo_megatron.megatron import compat
from bpo_megatron.models.megatron_model import LATENT_ATTENTION_MEGATRON_MINORS

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILES = (ROOT / "tools" / "gpu" / "requirements-cluster.txt",
                 ROOT / "tools" / "gpu" / "constraints-cluster.txt")
MOONLIGHT_RECIPE = ROOT / "configs" / "moonlight_16b_a3b_bpo.yaml"
NEWEST_IN_WINDOW = "0.19.2"  # what the window resolves to on Python 3.12 without a pin


def _install_specifier(name: str) -> SpecifierSet:
    """Every constraint the cluster install's two files put on ``name``, together."""
    specifier = SpecifierSet()
    for path in CLUSTER_FILES:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                requirement = Requirement(line)
                if canonicalize_name(requirement.name) == canonicalize_name(name):
                    specifier &= requirement.specifier
    return specifier


def _package_window(name: str) -> SpecifierSet:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (window,) = [Requirement(d).specifier for d in dependencies if canonicalize_name(Requirement(d).name) == name]
    return window


def _installed(monkeypatch, version: Version) -> None:
    """The config check reads the installed megatron-core from package metadata: answer ``version``."""
    monkeypatch.setattr(compat, "megatron_version", lambda: str(version))
    monkeypatch.setattr(compat, "megatron_minor", lambda: version.minor)


def test_the_cluster_install_pins_the_megatron_core_whose_latent_attention_the_check_admits(monkeypatch) -> None:
    install = _install_specifier("megatron-core")
    pins = [Version(spec.version) for spec in install if spec.operator == "=="]
    assert len(pins) == 1, f"the cluster install must pin one megatron-core, it says {install}"
    (pinned,) = pins
    assert _package_window("megatron-core").contains(pinned)
    assert pinned.minor in compat.SUPPORTED_MINORS and pinned.minor in LATENT_ATTENTION_MEGATRON_MINORS
    assert not install.contains(NEWEST_IN_WINDOW)  # what the window alone would give on 3.12

    _installed(monkeypatch, pinned)
    cfg = load_experiment(MOONLIGHT_RECIPE)  # the whole config check, the architecture's build included
    assert cfg.hf_config().multi_latent_attention

    _installed(monkeypatch, Version(NEWEST_IN_WINDOW))  # the control: the check does refuse the unpinned one
    with pytest.raises(ConfigError, match=f"megatron-core {NEWEST_IN_WINDOW} is installed"):
        load_experiment(MOONLIGHT_RECIPE)
