"""``bpo-megatron compare CONFIG [overrides]``: the paper's comparison, at any scale.

Runs BPO and the four baselines (or the points of a grid of settings, ``--sweep
loss.bpo_eps=0.05,0.1,0.2,0.3``, in the grammar ``launch`` sweeps with) with otherwise identical
settings over several seeds, then writes ``runs.csv`` (every evaluation of every run, with its
training metrics), ``results.md`` and ``curves.png``. ``--staleness 0,1,2,4``
repeats everything at each ``train.async.max_staleness`` (engines apart from the trainer).

The tables reduce each run to one number (``--stat``): the mean of its last ``--window``
evaluations (``final-window``, the default), the area under its evaluation curve per step
(``auc``), its best evaluation (``peak``, the paper's checkpoint rule, biased upward), its
accuracy on held-out questions at the step selected on others (``heldout-peak``: selected on the
first evaluation dataset and reported on the mean of the others; with one dataset, selected on its
questions at even positions and reported on those at odd positions), or what training added
(``gain``: the final window less the first evaluation). Each method is compared with
the first one by its per-seed differences (every method of a seed starts from the same policy): the
mean with a 95% Student t-interval over the n pairs, a paired t-test's p-value, and that p-value
adjusted by Holm's method over every contrast of the tables, or over the contrasts ``--primary``
declares before the runs (``grpo@4,cispo@4``: method and staleness; the rest is exploratory).

``--condition NAME`` names the settings this call's overrides choose (``--condition bf16
rollout.hf.dtype=bf16``); runs of several calls, each with its own condition, are summarised
together by ``--from-csv a/runs.csv,b/runs.csv``, a table per condition (and staleness), and
``--primary grpo@bf16,grpo@r3/4`` declares contrasts across them. Runs already complete in
``--out`` are kept, not run again, so a comparison stopped part-way is continued by the same
command (seeds may also be split between calls that run at the same time).

``grpo_tis`` is GRPO with truncated importance sampling by ρ = π_old/μ (``loss.correction=tis``),
π_old the trainer's own log-probs of the weights at each step's start: in the synchronous loop the
sampling weights, so ρ is the engine/trainer mismatch; at a staleness k > 0 newer weights, so it is
decoupled PPO and ρ carries the responses' staleness too (results.md says so under its tables).

    bpo-megatron compare configs/tiny_moe_cpu.yaml --seeds 1,2,3 --out runs/compare
    bpo-megatron compare configs/tiny_moe_cpu.yaml --losses bpo,grpo,gspo,cispo,dppo_tv,grpo_tis \\
        --staleness 0,1,2,4 --seeds 1,2,3,4,5 --out runs/staleness
    bpo-megatron compare --from-csv runs/staleness/runs.csv --stat auc --out runs/staleness_auc
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bpo_megatron.commands.runs_csv import EvalRow, Setting, read_csv, run_rows, setting_label, write_csv
from bpo_megatron.commands.statistics import (STATS, PairedDifference, area_under_curve, final_window, gain,
                                              heldout_peak, holm, paired_t, peak)
from bpo_megatron.config.grid import parse_axis, points

PAPER_LOSSES = ("bpo", "grpo", "gspo", "cispo", "dppo_tv")
LABELS = {"bpo": "BPO", "grpo": "GRPO-ClipHigher", "gspo": "GSPO", "cispo": "CISPO", "dppo_tv": "DPPO",
          "dppo_kl": "DPPO (binary KL)", "grpo_tis": "GRPO + TIS"}
# methods that are more than a loss name
LABELS.update({"grpo_dualclip": "GRPO-CH dual-clip", "bpo_eps1e3": "BPO ε=1e3", "grpo_sc": "GRPO-CH + SC",
               "bpo_sc": "BPO + SC"})
METHOD_OVERRIDES = {"grpo_tis": ("loss.name=grpo", "loss.correction=tis", "train.recompute_old_logprobs=true"),
                    # score centering (losses/score_centering.py) on top of the loss, no correction
                    "grpo_sc": ("loss.name=grpo", "loss.score_centering=true"),
                    "bpo_sc": ("loss.name=bpo", "loss.score_centering=true"),
                    # BPO with a band so wide that nothing is masked and ω within 1 ± 1e-3: plain policy gradient
                    "bpo_eps1e3": ("loss.name=bpo", "loss.bpo_eps=1000.0")}
# training metrics shown per method and setting, when the runs recorded them: (metric, heading)
DIAGNOSTICS = (("async/staleness_mean", "staleness of trained responses (RL steps)"),
               ("async/partial_frac", "responses spanning an update"),
               ("abs_logp_diff_mean", "\\|log π − log μ\\|"),
               ("routing_agreement", "routing agreement"),
               ("clip_frac", "masked tokens"),
               ("correction_weight_mean", "correction weight"),
               ("mismatch_abs_logp_diff_mean", "\\|log π_old − log μ\\|"),
               ("score_centering_rho", "score centering's ρ"))


@dataclass(frozen=True)
class Variant:
    label: str
    overrides: tuple[str, ...]  # e.g. ("loss.name=grpo",)
    slug: str


def variants(losses: list[str], sweep: list[str] | None) -> list[Variant]:
    """The methods compared: the losses named, or every point of the ``--sweep`` grid (the
    grammar ``bpo-megatron launch`` sweeps with: :mod:`bpo_megatron.config.grid`)."""
    if sweep:
        axes = [parse_axis(text) for text in sweep]
        if len({axis.key for axis in axes}) < len(axes):
            raise ValueError(f"--sweep {' '.join(sweep)!r}: a setting swept twice")
        return [Variant(" ".join(point.overrides), point.overrides, point.label) for point in points(axes)]
    return [Variant(LABELS.get(name, name), METHOD_OVERRIDES.get(name, (f"loss.name={name}",)), name)
            for name in losses]


Contrast = tuple[str, Setting]  # (method id, (condition, staleness))


def contrast_label(contrast: Contrast) -> str:
    method, setting = contrast
    label = setting_label(setting)
    return f"{method}@{label}" if label else method


def parse_primary(spec: str | None, available: list[Contrast], reference: str) -> list[Contrast]:
    """``--primary grpo@4,cispo@bf16/4`` (method@setting; ``grpo`` alone where there is one
    setting) as contrasts that exist."""
    if not spec:
        return []
    by_label = {contrast_label(c): c for c in available}
    contrasts = []
    for item in spec.split(","):
        item = item.strip()
        if item.partition("@")[0] == reference:
            raise ValueError(f"--primary {item!r}: {reference} is the reference every method is compared with")
        if item not in by_label:
            raise ValueError(f"--primary {item!r} is not a contrast of this comparison; choose among "
                             f"{', '.join(by_label)}")
        contrasts.append(by_label[item])
    return contrasts


# ------------------------------------------------------------------------------ one number per run
def _stat_text(stat: str, window: int, runs: dict) -> str:
    if stat == "final-window":
        steps = {tuple(step for step, _ in _evaluations(rows)[-window:]) for rows in runs.values()}
        at = f" (steps {', '.join(map(str, next(iter(steps))))})" if len(steps) == 1 else ""
        return f"final-window = the mean of each run's last {window} evaluations{at}"
    if stat == "gain":
        return (f"gain = the mean of each run's last {window} evaluations less its first evaluation (what training "
                "added)")
    if stat == "auc":
        return ("auc = the area under each run's evaluation curve (trapezoids between evaluations) divided by the "
                "steps it spans: its mean accuracy over training")
    if stat == "peak":
        return ("peak = each run's best evaluation (the paper's checkpoint rule; a maximum over noisy evaluations, "
                "so biased upward)")
    datasets = _datasets(next(iter(runs.values())))
    if len(datasets) > 1:
        return (f"heldout-peak = each run's mean accuracy on {', '.join(datasets[1:])} at the step of its best "
                f"accuracy on {datasets[0]} (the earlier on ties)")
    return (f"heldout-peak = each run's accuracy on the questions at odd positions of {datasets[0]} at the step of "
            "its best accuracy on those at even positions (the earlier on ties)")


def _datasets(rows: list[EvalRow]) -> list[str]:
    return list(dict.fromkeys(row.dataset for row in rows))


def evaluation_panels(rows: list[EvalRow], dataset: str) -> dict[str, dict[str, list[dict[int, float]]]]:
    """The evaluation curves of ``dataset`` in the rows, in points: setting -> method -> one
    ``{step: accuracy}`` per seed (what :func:`~bpo_megatron.observability.plot.plot_evaluation_panels`
    draws)."""
    runs: dict[tuple, dict[int, float]] = {}
    for row in rows:
        if row.dataset == dataset:
            runs.setdefault((row.setting, row.method, row.seed), {})[row.step] = 100 * row.accuracy
    panels: dict[str, dict[str, list[dict[int, float]]]] = {}
    for (setting, method, _), curve in runs.items():
        title = _setting_text(setting) if setting_label(setting) else dataset
        panels.setdefault(title, {}).setdefault(method, []).append(curve)
    return panels


def _evaluations(rows: list[EvalRow]) -> list[tuple[int, list[EvalRow]]]:
    by_step: dict[int, list[EvalRow]] = {}
    for row in rows:
        by_step.setdefault(row.step, []).append(row)
    return sorted(by_step.items())


def run_value(rows: list[EvalRow], stat: str, window: int) -> float:
    """One run's number: its rows (every evaluation and dataset) reduced by ``stat``."""
    evaluations = _evaluations(rows)
    curve = [(step, statistics.fmean(r.accuracy for r in at)) for step, at in evaluations]
    if stat in ("final-window", "gain"):
        if len(curve) < window:
            raise ValueError(f"--window {window}: run {rows[0].run} has {len(curve)} evaluations (steps "
                             f"{', '.join(str(s) for s, _ in curve)}); lower --window")
        return final_window(curve, window) if stat == "final-window" else gain(curve, window)
    if stat == "auc":
        return area_under_curve(curve)
    if stat == "peak":
        return peak(curve)
    if len(_datasets(rows)) > 1:
        selection = [(step, at[0].accuracy) for step, at in evaluations]
        report = [(step, statistics.fmean(r.accuracy for r in at[1:])) for step, at in evaluations]
    else:
        selection = [(step, at[0].half_accuracy("even")) for step, at in evaluations]
        report = [(step, at[0].half_accuracy("odd")) for step, at in evaluations]
    return heldout_peak(selection, report)[1]


# ------------------------------------------------------------------------------ the tables
def _points(value: float) -> str:
    return f"{100 * value:+.1f}"


def _p(p: float | None) -> str:
    if p is None:
        return "—"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _difference(d: PairedDifference) -> str:
    if d.low is None:
        return f"{_points(d.mean)} (one pair: no interval)"
    return f"{_points(d.mean)} [{_points(d.low)}, {_points(d.high)}]"


def summary(rows: list[EvalRow], *, stat: str = "final-window", window: int = 3, primary: str | None = None,
            between: str | None = None) -> str:
    """The results tables of ``rows`` (``runs.csv``'s), in ``compare``'s order: settings and
    methods as they first appear; the first method is the reference. ``between`` (``A,B``: two
    settings' labels) adds what going from setting A to B changes, per method and against the
    reference (:func:`between_table`)."""
    if stat not in STATS:
        raise ValueError(f"--stat {stat!r} is unknown; choose one of {', '.join(STATS)}")
    runs: dict[tuple[str, Setting, int], list[EvalRow]] = {}
    for row in rows:
        runs.setdefault((row.method_id, row.setting, row.seed), []).append(row)
    labels = {row.method_id: row.method for row in rows}
    methods = list(labels)
    settings = list(dict.fromkeys(row.setting for row in rows))
    seeds = sorted({row.seed for row in rows})
    values = {key: run_value(run, stat, window) for key, run in runs.items()}
    reference = methods[0]
    contrasts: dict[Contrast, PairedDifference] = {}
    for k in settings:
        for method in methods[1:]:
            paired = [seed for seed in seeds if (method, k, seed) in values and (reference, k, seed) in values]
            if paired:
                contrasts[(method, k)] = paired_t([values[(method, k, s)] for s in paired],
                                                  [values[(reference, k, s)] for s in paired])
    declared = parse_primary(primary, list(contrasts), reference)
    family = [c for c in (declared or contrasts) if contrasts[c].p is not None]
    adjusted = dict(zip(family, holm([contrasts[c].p for c in family])))
    k_eval = sorted({row.eval_k for row in rows})
    avg = f"Avg@{k_eval[0]}" if len(k_eval) == 1 else "Avg@k"
    if declared:
        named = ", ".join(labels[m] + (f" at {_setting_text(k, short=True)}" if setting_label(k) else "")
                          for m, k in declared)
        scope = (f"the {_count(len(family), 'contrast')} declared primary ({named}); the others are exploratory, "
                 "without an adjusted p-value")
    else:
        scope = f"the {_count(len(family), 'contrast')} of these tables"
    sections = [
        f"{_stat_text(stat, window, runs)}. Mean {avg} (%) over seeds {', '.join(map(str, seeds))} ± sample standard "
        f"deviation; runs = seeds of the method. Against {labels[reference]}: the per-seed differences in points, "
        "paired by seed, as mean [95% Student t-interval over the pairs, pairs − 1 degrees of freedom]; p: two-sided "
        f"paired t-test; p (Holm): p adjusted by Holm's method over {scope}."]
    for k in settings:
        lines = [f"| method | runs | {stat} | − {labels[reference]} [95% t-interval] | pairs | p | p (Holm) |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for method in methods:
            run_values = [values[(method, k, s)] for s in seeds if (method, k, s) in values]
            if not run_values:
                continue
            mean = 100 * statistics.fmean(run_values)
            cell = f"{mean:.1f} ± {100 * statistics.stdev(run_values):.1f}" if len(run_values) > 1 else f"{mean:.1f}"
            if method == reference:
                lines.append(f"| {labels[method]} | {len(run_values)} | {cell} | reference | | | |")
                continue
            d = contrasts.get((method, k))
            if d is None:
                lines.append(f"| {labels[method]} | {len(run_values)} | {cell} | no seed in common | | | |")
                continue
            holm_p = _p(adjusted[(method, k)]) if (method, k) in adjusted else "—"
            lines.append(f"| {labels[method]} | {len(run_values)} | {cell} | {_difference(d)} | {d.n} | {_p(d.p)} "
                         f"| {holm_p} |")
        heading = f"### {_setting_text(k)}\n\n" if setting_label(k) else ""
        sections.append(heading + "\n".join(lines))
    if between:
        sections.append(between_table(values, labels, methods, settings, seeds, between, stat))
    diagnostics = diagnostics_table(runs, labels, methods, settings, seeds)
    if diagnostics:
        sections.append(diagnostics)
    decoupled = decoupled_methods(rows)
    if decoupled:
        sections.append(f"{', '.join(decoupled)} at train.async.max_staleness > 0: π_old is the trainer's weights at "
                        "each step's start, newer than those that sampled the responses (decoupled PPO), so the "
                        "correction's ρ = π_old/μ carries staleness as well as the engine/trainer mismatch.")
    return "\n\n".join(sections)


def between_table(values: dict, labels: dict, methods: list[str], settings: list, seeds: list[int], between: str,
                  stat: str) -> str:
    """``--between A,B``: per method, the per-seed change of its number from setting A to
    setting B (paired by seed: the same seed in both), and for every method but the reference,
    that change less the reference's change (the difference of differences, paired by seed).
    Exploratory: unadjusted p-values."""
    by_label = {setting_label(k): k for k in settings}
    names = [name.strip() for name in between.split(",")]
    if len(names) != 2 or any(name not in by_label for name in names) or names[0] == names[1]:
        raise ValueError(f"--between {between!r}: name two different settings of these runs as A,B; they have "
                         f"{', '.join(by_label)}")
    a, b = by_label[names[0]], by_label[names[1]]
    reference = methods[0]

    def change(method: str, paired: list[int]) -> list[float]:
        return [values[(method, b, s)] - values[(method, a, s)] for s in paired]

    def seeds_of(*of: str) -> list[int]:
        return [s for s in seeds if all((m, k, s) in values for m in of for k in (a, b))]

    lines = [f"From {names[0]} to {names[1]} ({stat}; exploratory, p unadjusted): per method, the change B − A in "
             "points, paired by seed, mean [95% t-interval] and its per-seed SD; against "
             f"{labels[reference]}: that change less {labels[reference]}'s, paired by seed.", "",
             f"| method | pairs | {names[1]} − {names[0]} [95% t-interval] | SD | − {labels[reference]}'s change "
             "[95% t-interval] | p |", "|---|---:|---:|---:|---:|---:|"]
    for method in methods:
        paired = seeds_of(method)
        if not paired:
            continue
        own = paired_t(change(method, paired), [0.0] * len(paired))
        sd = f"{100 * statistics.stdev(change(method, paired)):.1f}" if len(paired) > 1 else ""
        versus, p = ("reference", "")
        if method != reference:
            both = seeds_of(method, reference)
            if both:
                d = paired_t(change(method, both), change(reference, both))
                versus, p = _difference(d), _p(d.p)
            else:
                versus = "no seed in common"
        lines.append(f"| {labels[method]} | {len(paired)} | {_difference(own)} | {sd} | {versus} | {p} |")
    return "\n".join(lines)


def _setting_text(setting: Setting, *, short: bool = False) -> str:
    condition, staleness = setting
    lag = "staleness" if short else "train.async.max_staleness ="
    parts = ([f"condition {condition}"] if condition else []) + ([] if staleness is None else [f"{lag} {staleness}"])
    return ", ".join(parts)


def decoupled_methods(rows: list[EvalRow]) -> list[str]:
    """The methods whose π_old, at some staleness k > 0, is not the sampling weights."""
    return list(dict.fromkeys(row.method for row in rows if row.staleness and row.recompute_old_logprobs))


def diagnostics_table(runs: dict, labels: dict, methods: list[str], settings: list, seeds: list[int]) -> str:
    """Each run's training metrics averaged over its RL steps, then over seeds (empty when the
    runs recorded none of :data:`DIAGNOSTICS`)."""
    per_run: dict[tuple, dict[str, float]] = {}
    for key, rows in runs.items():
        sums: dict[str, list[float]] = {}
        for _, at in _evaluations(rows):
            row = at[0]  # a row per dataset, all with the same training metrics
            for metric, value in row.training.items():
                total = sums.setdefault(metric, [0.0, 0.0])
                total[0] += value * row.trained_steps
                total[1] += row.trained_steps
        per_run[key] = {metric: num / steps for metric, (num, steps) in sums.items() if steps}
    shown = [(metric, heading) for metric, heading in DIAGNOSTICS if any(metric in m for m in per_run.values())]
    if not shown:
        return ""
    several = settings != [("", None)]
    lines = ["Training diagnostics: each run's mean over its RL steps, then the mean over seeds.", "",
             "| " + ("setting | " if several else "") + "method | " + " | ".join(h for _, h in shown) + " |",
             "|" + ("---:|" if several else "") + "---|" + "---:|" * len(shown)]
    for k in settings:
        for method in methods:
            keys = [(method, k, s) for s in seeds if (method, k, s) in per_run]
            if not keys:
                continue
            cells = []
            for metric, _ in shown:
                present = [per_run[key][metric] for key in keys if metric in per_run[key]]
                cells.append(f"{statistics.fmean(present):.4g}" if present else "—")
            lines.append("| " + (f"{setting_label(k)} | " if several else "") + f"{labels[method]} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_evaluations(cfg, stat: str, window: int) -> None:
    """A run about to start must evaluate, and often enough for ``--window``."""
    ev = cfg.eval
    if not ev.every:
        raise ValueError(f"{cfg.name}: eval.every=0 never evaluates, and compare compares evaluations; set "
                         "eval.every > 0")
    count = int(ev.at_start) + cfg.train.steps // ev.every
    if stat in ("final-window", "gain") and count < window:
        raise ValueError(f"--window {window}: {cfg.name} will evaluate {count} times (eval.at_start={ev.at_start}, "
                         f"then every eval.every={ev.every} of train.steps={cfg.train.steps} steps); lower --window "
                         "or evaluate more often")


# ------------------------------------------------------------------------------ the command
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="the experiment (not with --from-csv)")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--losses", default=",".join(PAPER_LOSSES))
    parser.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                        help="compare settings' values instead of --losses (repeat it for a grid of several)")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated; the methods are paired by seed")
    parser.add_argument("--staleness", default=None,
                        help="comma-separated train.async.max_staleness values: the whole grid at each")
    parser.add_argument("--condition", default="",
                        help="a name for the settings this call's overrides choose (its runs.csv rows carry it)")
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--stat", default="final-window", choices=STATS, help="the number each run is reduced to")
    parser.add_argument("--window", type=int, default=3, help="final-window: how many last evaluations it averages")
    parser.add_argument("--primary", default=None,
                        help="pre-declared contrasts, e.g. grpo@4,cispo@4 (method@staleness): Holm adjusts over these")
    parser.add_argument("--between", default=None, metavar="A,B",
                        help="also tabulate what going from setting A to setting B changes (e.g. r3/0,r3/4): per "
                             "method, and against the first method's change, paired by seed (exploratory)")
    parser.add_argument("--summarise-only", action="store_true", help="only rebuild runs.csv, the tables and the plot")
    parser.add_argument("--from-csv", default=None, metavar="PATH[,PATH...]",
                        help="rebuild the tables and the evaluation curves from runs.csv files alone (no config, "
                             "no run directories)")
    parser.add_argument("--check", action="store_true", help="check every run's config, data and directory, then exit")
    args = parser.parse_args(argv)

    out = Path(args.out)
    if args.window < 1:
        return _refuse(f"--window {args.window} must be >= 1")
    if args.from_csv:
        if args.config or args.overrides:
            return _refuse("--from-csv rebuilds the tables from the CSV alone: drop CONFIG and its overrides")
        try:
            rows = [row for path in args.from_csv.split(",") for row in read_csv(Path(path))]
            text = summary(rows, stat=args.stat, window=args.window, primary=args.primary, between=args.between)
        except (FileNotFoundError, ValueError) as exc:
            return _refuse(str(exc))
        from bpo_megatron.observability.plot import plot_evaluation_panels

        dataset = _datasets(rows)[0]
        plot_evaluation_panels(evaluation_panels(rows, dataset), out / "curves.png",
                               ylabel=f"Avg@k on {dataset} (%; mean over seeds ± s.e.)")
        return _write(text, out, note=f"wrote {out / 'results.md'} and {out / 'curves.png'} (from the CSV alone)")
    if not args.config:
        return _refuse("name the experiment CONFIG (or rebuild the tables from a runs.csv with --from-csv PATH)")

    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.observability.plot import plot_variants

    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        staleness = [int(k) for k in args.staleness.split(",")] if args.staleness else [None]
        methods = variants(args.losses.split(","), args.sweep)
        # the pre-declared contrasts are checked before any run starts
        if args.condition and not args.condition.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"--condition {args.condition!r}: use letters, digits, '-' and '_' (it names run "
                             "directories and --primary contrasts)")
        parse_primary(args.primary, [(v.slug, (args.condition, k)) for k in staleness for v in methods[1:]],
                      methods[0].slug)
        configs = {}
        for k in staleness:
            lag = () if k is None else (f"train.async.max_staleness={k}", "cluster.colocate=false")
            for seed in seeds:  # every method of a seed before the next seed: a stopped comparison keeps pairs
                for variant in methods:
                    name = "-".join([variant.slug, *([args.condition] if args.condition else []),
                                     *([] if k is None else [f"k{k}"]), f"s{seed}"])
                    configs[(variant, k, seed)] = load_experiment(args.config, [
                        *args.overrides, *variant.overrides, *lag, f"name={name}", f"seed={seed}",
                        f"rollout.seed={seed}", f"logging.run_dir={out / name}"])
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        return _refuse(str(exc))
    if not args.summarise_only:
        try:  # runs that could not be summarised as asked are refused before any starts
            for cfg in configs.values():
                check_evaluations(cfg, args.stat, args.window)
        except ValueError as exc:
            return _refuse(str(exc))
        from bpo_megatron.loop.preflight import prepare, summary as plan_summary
        from bpo_megatron.loop.rl_loop import execute
        from bpo_megatron.orchestration.groups import EnginesFailed, TrainerFailed

        plans = {}
        try:  # every run is checked before the first one starts
            for key, cfg in configs.items():
                plans[key] = prepare(cfg)
        except ConfigError as exc:
            return _refuse(str(exc))
        if args.check:
            print("\n".join(plan_summary(run_plan) for run_plan in plans.values()))
            return 0
        for (variant, k, seed), run_plan in plans.items():
            at = (f", {args.condition}" if args.condition else "") + ("" if k is None else f", staleness {k}")
            if run_plan.state.step >= run_plan.cfg.train.steps:
                print(f"=== {variant.label}{at}, seed {seed}: complete in {run_plan.cfg.run_dir} (step "
                      f"{run_plan.state.step}); kept", flush=True)
                continue
            print(f"=== {variant.label}{at}, seed {seed} -> {run_plan.cfg.run_dir}", flush=True)
            try:
                execute(run_plan, echo=lambda line: print(f"  {line}", flush=True))
            except (TrainerFailed, EnginesFailed) as exc:
                from bpo_megatron.commands.common import report_failure

                return report_failure("bpo-megatron compare", exc, ["bpo-megatron", "compare", *argv])
    from bpo_megatron.observability.metrics import read_metrics

    rows, curves = [], {}
    try:
        for (variant, k, seed), cfg in configs.items():
            rows += run_rows(read_metrics(cfg.run_dir), run=cfg.run_dir.name, method=variant.label,
                             method_id=variant.slug, staleness=k, seed=seed, condition=args.condition,
                             recompute_old_logprobs=cfg.train.recompute_old_logprobs)
            where = setting_label((args.condition, k))
            curves.setdefault(f"{variant.label}, {where}" if where else variant.label, []).append(cfg.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        return _refuse(str(exc))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "runs.csv")  # first: whatever the tables ask, the runs' numbers are kept
    try:
        text = summary(rows, stat=args.stat, window=args.window, primary=args.primary, between=args.between)
    except ValueError as exc:
        return _refuse(f"{exc} (the runs are in {out / 'runs.csv'}: summarise them again with --from-csv)")
    plot_variants(curves, out / "curves.png")
    return _write(text, out, note=f"wrote {out / 'results.md'}, {out / 'runs.csv'} and {out / 'curves.png'}")


def _refuse(message: str) -> int:
    print(f"bpo-megatron compare: {message}", file=sys.stderr)
    return 2


def _write(text: str, out: Path, *, note: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    print(text)
    print(note)
    return 0
