"""``bpo-megatron compare CONFIG [overrides]``: the paper's comparison, at any scale.

Runs BPO and the four baselines (or a sweep of one setting, e.g. ``--sweep loss.bpo_eps=0.05,0.1,0.2,0.3``)
with otherwise identical settings over several seeds, then writes ``results.md`` (a table like the
paper's Table 1: peak mean accuracy at the best checkpoint, final accuracy) and ``curves.png``.
``--staleness 0,1,2,4`` repeats everything at each ``train.async.max_staleness`` (engines apart from
the trainer) and adds, per staleness, each method's paired per-seed difference of peak accuracy
from the first method's, with a bootstrap 95% interval over the seeds. ``grpo_tis`` is GRPO with
truncated importance sampling by ρ = π_old/μ (``loss.correction=tis``), π_old the trainer's own
log-probs of the weights at each step's start: in the synchronous loop the sampling weights, so ρ
is the engine/trainer mismatch; at a staleness k > 0 newer weights (decoupled PPO), so ρ carries
the responses' staleness too (results.md says so under its tables).

    bpo-megatron compare configs/tiny_moe_cpu.yaml --seeds 1,2,3 --out runs/compare
    bpo-megatron compare configs/tiny_moe_cpu.yaml --losses bpo,grpo,gspo,cispo,dppo_tv,grpo_tis \
        --staleness 0,1,2,4 --seeds 1,2,3,4,5 --out runs/staleness
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

PAPER_LOSSES = ("bpo", "grpo", "gspo", "cispo", "dppo_tv")
LABELS = {"bpo": "BPO", "grpo": "GRPO-ClipHigher", "gspo": "GSPO", "cispo": "CISPO", "dppo_tv": "DPPO",
          "dppo_kl": "DPPO (binary KL)", "grpo_tis": "GRPO + TIS"}
# methods that are more than a loss name
METHOD_OVERRIDES = {"grpo_tis": ("loss.name=grpo", "loss.correction=tis", "train.recompute_old_logprobs=true")}
BOOTSTRAP_RESAMPLES = 10_000


@dataclass(frozen=True)
class Variant:
    label: str
    overrides: tuple[str, ...]  # e.g. ("loss.name=grpo",)
    slug: str


def variants(losses: list[str], sweep: str | None) -> list[Variant]:
    if sweep:
        key, _, values = sweep.partition("=")
        if not values:
            raise ValueError(f"--sweep {sweep!r} must look like section.key=v1,v2,...")
        return [Variant(f"{key}={v}", (f"{key}={v}",), f"{key.split('.')[-1]}{v}") for v in values.split(",")]
    return [Variant(LABELS.get(name, name), METHOD_OVERRIDES.get(name, (f"loss.name={name}",)), name)
            for name in losses]


def paired_delta(values: list[float], reference: list[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float, float]:
    """Mean of the per-seed differences ``values − reference`` and the percentile bootstrap 95%
    interval of that mean (seeds resampled with replacement)."""
    import random

    deltas = [v - r for v, r in zip(values, reference, strict=True)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(deltas, k=len(deltas))) for _ in range(resamples))
    return statistics.fmean(deltas), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def delta_table(peaks: dict[tuple[str, int], list[float]], labels: list[str], staleness: list[int]) -> str:
    """Per staleness, each method's paired peak-accuracy difference from ``labels[0]``."""
    base = labels[0]
    lines = [f"Peak mean Avg@k minus {base}'s, in points, paired by seed: mean [bootstrap 95% interval].", "",
             "| method | " + " | ".join(f"staleness {k}" for k in staleness) + " |",
             "|---|" + "---:|" * len(staleness)]
    for label in labels[1:]:
        cells = []
        for k in staleness:
            mean, low, high = paired_delta(peaks[(label, k)], peaks[(base, k)])
            cells.append(f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decoupled_methods(configs: dict) -> list[str]:
    """The methods whose π_old, at some staleness k > 0, is not the sampling weights (``configs``:
    (variant, k, seed) -> experiment)."""
    labels = []
    for (variant, k, _), cfg in configs.items():
        if k and cfg.train.recompute_old_logprobs and variant.label not in labels:
            labels.append(variant.label)
    return labels


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
    parser.add_argument("--staleness", default=None,
                        help="comma-separated train.async.max_staleness values: the whole grid at each")
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
        staleness = [int(k) for k in args.staleness.split(",")] if args.staleness else [None]
        methods = variants(args.losses.split(","), args.sweep)
        configs = {}
        for k in staleness:
            lag = () if k is None else (f"train.async.max_staleness={k}", "cluster.colocate=false")
            for variant in methods:
                for seed in seeds:
                    name = f"{variant.slug}-s{seed}" if k is None else f"{variant.slug}-k{k}-s{seed}"
                    configs[(variant, k, seed)] = load_experiment(args.config, [
                        *args.overrides, *variant.overrides, *lag, f"name={name}", f"train.seed={seed}",
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
            print("\n".join(summary(run_plan) for run_plan in plans.values()))
            return 0
        for (variant, k, seed), run_plan in plans.items():
            at = "" if k is None else f", staleness {k}"
            print(f"=== {variant.label}{at}, seed {seed} -> {run_plan.cfg.run_dir}", flush=True)
            try:
                execute(run_plan, echo=lambda line: print(f"  {line}", flush=True))
            except (TrainerFailed, EnginesFailed) as exc:
                from bpo_megatron.commands.common import report_failure

                return report_failure("bpo-megatron compare", exc, ["bpo-megatron", "compare", *argv])
    sections, curves, all_peaks = [], {}, {}
    for k in staleness:
        rows = []
        for variant in methods:
            dirs = [configs[(variant, k, seed)].run_dir for seed in seeds]
            try:
                peaks, finals = summarise(dirs)
            except (FileNotFoundError, ValueError) as exc:
                print(f"bpo-megatron compare: {exc}", file=sys.stderr)
                return 2
            rows.append((variant.label, peaks, finals))
            all_peaks[(variant.label, k)] = peaks
            curves[variant.label if k is None else f"{variant.label}, k={k}"] = dirs
        heading = "" if k is None else f"### train.async.max_staleness = {k}\n\n"
        sections.append(heading + table(rows, seeds))
    if staleness != [None] and len(methods) > 1:
        sections.append(delta_table(all_peaks, [v.label for v in methods], staleness))
    decoupled = decoupled_methods(configs)
    if decoupled:
        sections.append(f"{', '.join(decoupled)} at train.async.max_staleness > 0: π_old is the trainer's weights at "
                        "each step's start, newer than those that sampled the responses (decoupled PPO), so the "
                        "correction's ρ = π_old/μ carries staleness as well as the engine/trainer mismatch.")
    text = "\n\n".join(sections)
    (out / "results.md").write_text(text + "\n")
    plot_variants(curves, out / "curves.png")
    print(text)
    print(f"wrote {out / 'results.md'} and {out / 'curves.png'}")
    return 0
