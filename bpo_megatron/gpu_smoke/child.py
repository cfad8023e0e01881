"""Runs one check in this process and writes its outcome as JSON (started by :mod:`.cli`)."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from dataclasses import asdict
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("check")
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()

    from bpo_megatron.observability.library_logs import quiet_library_logs

    quiet_library_logs()
    import torch

    from bpo_megatron.gpu_smoke.checks import check_function
    from bpo_megatron.gpu_smoke.profiles import PROFILES
    from bpo_megatron.gpu_smoke.report import Outcome

    if args.device == "cpu":
        torch.set_num_threads(1)  # CI machines have 2 cores; the ipc check runs a second process
    start = time.perf_counter()
    try:
        outcome = check_function(args.check)(PROFILES[args.device], args.workdir)
    except BaseException:  # noqa: BLE001 - a failing check is a result, not a crash of the kit
        outcome = Outcome(args.check, error=traceback.format_exc())
    outcome.seconds = time.perf_counter() - start
    outcome.finish()
    args.result.write_text(json.dumps(asdict(outcome), default=str))


if __name__ == "__main__":
    main()
