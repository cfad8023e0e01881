"""Silence what third-party libraries print on every CPU run and that says nothing about it.

Megatron-Core warns at import that apex and transformer-engine are absent (expected on CPU),
torch about deprecated collectives and ShardedTensor that Megatron calls, transformers with
progress bars for local loads. Each would repeat once per process (trainer rank, engine, gloo
rank). Exceptions and real errors are untouched.
"""

from __future__ import annotations

import logging
import warnings


def quiet_library_logs() -> None:
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
