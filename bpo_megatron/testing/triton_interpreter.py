"""Triton kernels run on a CPU: a test module's ``interpret_all(path)`` in a process of its own with
``TRITON_INTERPRET=1`` (triton reads it when it is imported, so the test process itself cannot
switch), its results handed back through ``torch.save``/``torch.load``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def interpreted_results(test_file: str, out: Path, *, timeout: float) -> object:
    """Run ``interpret_all(out)`` of the test module ``test_file`` (its path) under triton's
    interpreter, bounded by ``timeout`` seconds; what it saved to ``out``."""
    path = Path(test_file).resolve()
    code = (f"import sys; sys.path.insert(0, {str(path.parent)!r}); import {path.stem} as t; "
            "t.interpret_all(sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", code, str(out)], env=os.environ | {"TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{path.name}'s interpret_all failed under triton's interpreter:\n"
                             + done.stdout[-3000:] + done.stderr[-3000:])
    return torch.load(out)
