"""``bpo-megatron compare CONFIG [overrides]``: the paper's comparison, at any scale.

Runs BPO and the four baselines (or a sweep of one setting, e.g. ``--sweep loss.bpo_eps=0.05,0.1,0.2,0.3``)
with otherwise identical settings over several seeds, then writes ``results.md`` (a table like the
paper's Table 1: peak mean accuracy at the best checkpoint, final accuracy) and ``curves.png``.

    bpo-megatron compare configs/tiny_moe_cpu.yaml --seeds 1,2,3 --out runs/compare
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

PAPER_LOSSES = ("bpo", "grpo", "gspo", "cispo", "dppo_tv")
LABELS = {"bpo": "BPO", "grpo": "GRPO-ClipHigher", "gspo": "GSPO", "cispo": "CISPO", "dppo_tv": "DPPO",
          "dppo_kl": "DPPO (binary KL)"}


@dataclass(frozen=True)
class Variant:
    label: str
    override: str  # e.g. "loss.name=grpo"
    slug: str


def variants(losses: list[str], sweep: str | None) -> list[Variant]:
    if sweep:
        key, _, values = sweep.partition("=")
        if not values:
            raise ValueError(f"--sweep {sweep!r} must look like section.key=v1,v2,...")
        return [Variant(f"{key}={v}", f"{key}={v}", f"{key.split('.')[-1]}{v}") for v in values.split(",")]
    return [Variant(LABELS.get(name, name), f"loss.name={name}", name) for name in losses]


def summarise(run_dirs: list[Path]) -> tuple[list[float], list[float]]:
    """(peak mean accuracy, final accuracy) per run."""
    from bpo_megatron.observability.metrics import read_metrics
    from bpo_megatron.observability.plot import eval_key

    peaks, finals = [], []
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        key = eval_key(records)
        if key is None:
            raise ValueError(f"{run_dir} has no evaluation results; set eval.every > 0")
        curve = [r[key] for r in records if key in r]
        peaks.append(max(curve))
        finals.append(curve[-1])
    return peaks, finals


def table(rows: list[tuple[str, list[float], list[float]]], seeds: list[int]) -> str:
    def cell(values: list[float]) -> str:
        mean = 100 * statistics.fmean(values)
        return f"{mean:.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else f"{mean:.1f}"

    lines = [f"Mean Avg@k (%) over seeds {', '.join(map(str, seeds))}: peak = best evaluation of the run "
             "(the paper's checkpoint rule), final = last evaluation.", "",
             "| method | peak | final |", "|---|---:|---:|"]
    best_peak = max(statistics.fmean(p) for _, p, _ in rows)
    for label, peaks, finals in rows:
        peak = cell(peaks)
        if statistics.fmean(peaks) == best_peak:
            peak = f"**{peak}**"
        lines.append(f"| {label} | {peak} | {cell(finals)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--losses", default=",".join(PAPER_LOSSES))
    parser.add_argument("--sweep", default=None, help="one setting's values instead of --losses")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated; the table shows mean ± std over them")
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--summarise-only", action="store_true", help="only rebuild the table and the plot")
    parser.add_argument("--check", action="store_true", help="check every run's config, data and directory, then exit")
    args = parser.parse_args(argv)

    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.observability.plot import plot_variants

    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    try:
        plan = variants(args.losses.split(","), args.sweep)
        configs = {}
        for variant in plan:
            for seed in seeds:
                name = f"{variant.slug}-s{seed}"
                configs[(variant, seed)] = load_experiment(args.config, [
                    *args.overrides, variant.override, f"name={name}", f"train.seed={seed}",
                    f"rollout.seed={seed}", f"logging.run_dir={out / name}"])
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"bpo-megatron compare: {exc}", file=sys.stderr)
        return 2
    if not args.summarise_only:
        from bpo_megatron.loop.preflight import prepare, summary
        from bpo_megatron.loop.rl_loop import execute
        from bpo_megatron.orchestration.groups import EnginesFailed, TrainerFailed

        plans = {}
        try:  # every run is checked before the first one starts
            for key, cfg in configs.items():
                plans[key] = prepare(cfg)
        except ConfigError as exc:
            print(f"bpo-megatron compare: {exc}", file=sys.stderr)
            return 2
        if args.check:
            print("\n".join(summary(plan) for plan in plans.values()))
            return 0
        for (variant, seed), plan in plans.items():
            print(f"=== {variant.label}, seed {seed} -> {plan.cfg.run_dir}", flush=True)
            try:
                execute(plan, echo=lambda line: print(f"  {line}", flush=True))
            except (TrainerFailed, EnginesFailed) as exc:
                from bpo_megatron.commands.common import report_failure

                return report_failure("bpo-megatron compare", exc, ["bpo-megatron", "compare", *argv])
    rows, curves = [], {}
    for variant in plan:
        dirs = [configs[(variant, seed)].run_dir for seed in seeds]
        try:
            peaks, finals = summarise(dirs)
        except (FileNotFoundError, ValueError) as exc:
            print(f"bpo-megatron compare: {exc}", file=sys.stderr)
            return 2
        rows.append((variant.label, peaks, finals))
        curves[variant.label] = dirs
    text = table(rows, seeds)
    (out / "results.md").write_text(text + "\n")
    plot_variants(curves, out / "curves.png")
    print(text)
    print(f"wrote {out / 'results.md'} and {out / 'curves.png'}")
    return 0
