"""``bpo-megatron train CONFIG [section.key=value ...]``: run an RL experiment.

Everything the run will read (config, data, evaluation sets, run directory, checkpoint) is
checked before anything starts; ``--check`` stops there and says what the run would do.
Exit status: 0 done, 2 refused before starting, 1 stopped by a failure (resumable), 3 done but
most of its RL steps trained nothing (a user reward failed on their batches, with
``data.on_reward_failure=skip_step``): its last line says how many.
"""

from __future__ import annotations

import argparse
import errno
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment YAML (e.g. configs/tiny_moe_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loss.name=grpo parallel.tp=2")
    parser.add_argument("--check", action="store_true", help="check everything the run would read, then exit")
    parser.add_argument("--override-resume", default="", metavar="SETTINGS",
                        help="comma-separated settings (e.g. optimizer.lr,loss.bpo_eps) allowed to differ from "
                             "the config recorded in the run directory when resuming it")
    args = parser.parse_args(argv)
    prog = "bpo-megatron train"

    from bpo_megatron.commands.common import REFUSED, load_or_exit, override_list, report_failure

    cfg = load_or_exit(prog, args.config, args.overrides)
    if cfg is None:
        return REFUSED
    from bpo_megatron.config import ConfigError
    from bpo_megatron.data.reward_values import RewardFailed
    from bpo_megatron.loop.preflight import prepare, summary
    from bpo_megatron.loop.rl_loop import execute
    from bpo_megatron.orchestration.groups import EnginesFailed, TrainerFailed

    try:
        plan = prepare(cfg, override_resume=override_list(args.override_resume))
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return REFUSED
    if args.check:
        print(summary(plan))
        return 0
    print(f"run directory: {cfg.run_dir}", flush=True)
    try:
        result = execute(plan, echo=lambda line: print(line, flush=True))
    except ConfigError as exc:  # the run directory was taken between the check and the start
        print(f"{prog}: {exc}", file=sys.stderr)
        return REFUSED
    except (TrainerFailed, EnginesFailed, RewardFailed) as exc:
        return report_failure(prog, exc, ["bpo-megatron", "train", *argv], run_dir=cfg.run_dir)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        return report_failure(prog, exc, ["bpo-megatron", "train", *argv], run_dir=cfg.run_dir)
    code, line = outcome(result, cfg)
    if code:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
    else:
        print(line, flush=True)
    return code


def outcome(result: dict, cfg) -> tuple[int, str]:
    """The exit status and last line of a finished run: ``done`` with its best evaluation, and the
    steps a failing reward skipped; more than half of the RL steps skipped is a run that did not do
    its job, whatever else it wrote, and exits ``MOSTLY_SKIPPED``."""
    from bpo_megatron.commands.common import MOSTLY_SKIPPED

    steps, skipped = result["step"], len(result.get("skipped_steps", ()))
    best = result["best_step"]
    where = (f"its weights: {result['best_weights']}" if result.get("best_weights") else
             "its weights were not saved: evaluated in the background after that step had passed")
    line = (f"done: {steps} steps; best eval mean {result['best_mean']:.3f} at step {best} ({where})"
            if best is not None else f"done: {steps} steps")
    if not skipped:
        return 0, line
    why = (f"data.reward={cfg.data.reward} failed on more than data.reward_max_failed_frac="
           f"{cfg.data.reward_max_failed_frac:g} of their batches and data.on_reward_failure=skip_step skipped them "
           f"(reward/skipped_step in {cfg.run_dir / 'metrics.jsonl'})")
    if 2 * skipped <= steps:
        return 0, f"{line}; {skipped} of the {steps} steps trained nothing: {why}"
    return MOSTLY_SKIPPED, (f"{line}, but {skipped} of the {steps} steps trained nothing (most of the run): {why}; "
                            "fix the reward, then raise train.steps and resume, or start a new run (exit status 3)")
