"""What the experiment commands share: loading a config or exiting with the reason."""

from __future__ import annotations

import sys


def load_or_exit(prog: str, config: str, overrides: list[str]):
    """The validated experiment, or None after printing why it is refused (exit code 2)."""
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment

    try:
        return load_experiment(config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
