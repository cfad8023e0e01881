"""What the experiment commands share: loading a config or exiting with the reason."""

from __future__ import annotations

import errno
import shlex
import sys

REFUSED = 2  # exit status of a refused config, data set or run directory (nothing was started)
FAILED = 1  # exit status of a run that started and stopped on an error
MOSTLY_SKIPPED = 3  # exit status of a finished run most of whose RL steps trained nothing (its reward failed)


def load_or_exit(prog: str, config: str, overrides: list[str]):
    """The validated experiment, or None after printing why it is refused (exit code 2)."""
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment

    try:
        return load_experiment(config, overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


def override_list(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


NO_SPACE = "No space left on device"  # strerror(ENOSPC), as a rank's traceback carries it


def report_failure(prog: str, exc: BaseException, resume_command: list[str], run_dir=None) -> int:
    """A run that stopped on a failed rank, engine or reward, or on a full disk: the rank's
    traceback if it raised, then what failed and how to resume."""
    details = getattr(exc, "details", "")
    if details:
        print(details.rstrip(), file=sys.stderr)
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or NO_SPACE in f"{exc}\n{details}":
        where = getattr(exc, "filename", None) or run_dir or "the run directory"
        print(f"{prog}: no space left on the device holding {where}; what was being written is incomplete and never "
              "read (a checkpoint is written beside the newest complete one and published only once whole, so that "
              "one is kept). Free space there, then resume the run with: " + shlex.join(resume_command),
              file=sys.stderr)
        return FAILED
    print(f"{prog}: {exc}\nthe run stopped; resume it from its newest checkpoint with: "
          f"{shlex.join(resume_command)}", file=sys.stderr)
    return FAILED
