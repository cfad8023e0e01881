"""Training curves as PNG: reward and evaluation accuracy against step, several runs overlaid,
with a dashed line at each run's peak accuracy (the style of the paper's Figure 1)."""

from __future__ import annotations

from pathlib import Path

from bpo_megatron.observability.metrics import read_metrics


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    # by step: a background evaluation's record comes after later steps' records
    points = sorted((r["step"], r[key]) for r in records if key in r and r["step"] >= 0)
    return [p[0] for p in points], [p[1] for p in points]


def eval_key(records: list[dict]) -> str | None:
    """The mean-accuracy metric of a run (``eval/mean_avg@k``), whatever its k."""
    for record in records:
        for key in record:
            if key.startswith("eval/mean_avg@"):
                return key
    return None


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, labels: list[str] | None = None,
              smoothing: int = 5) -> Path:
    fig, (ax_reward, ax_eval) = _figure()
    for index, run_dir in enumerate(run_dirs):
        records = read_metrics(run_dir)
        label = labels[index] if labels else Path(run_dir).name
        color = f"C{index % 10}"
        steps, rewards = _series(records, "reward_mean")
        if steps:
            ax_reward.plot(steps, smooth(rewards, smoothing), color=color, label=label)
        key = eval_key(records)
        if key:
            steps, accuracy = _series(records, key)
            ax_eval.plot(steps, accuracy, color=color, marker="o", markersize=3, label=label)
            ax_eval.axhline(max(accuracy), color=color, linestyle="--", linewidth=0.8)
    ax_reward.set(xlabel="step", ylabel=f"train reward (moving mean of {smoothing})", title="Reward")
    ax_eval.set(xlabel="step", ylabel="mean Avg@k", title="Evaluation accuracy (dashed: peak)")
    return _save(fig, out)


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(12, 4.5))


def _save(fig, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_variants(variants: dict[str, list[str | Path]], out: str | Path) -> Path:
    """Evaluation accuracy per variant, averaged over its runs (seeds), with a dashed line at
    each variant's peak; train reward likewise."""
    fig, (ax_reward, ax_eval) = _figure()
    for index, (label, run_dirs) in enumerate(variants.items()):
        color = f"C{index % 10}"
        runs = [read_metrics(d) for d in run_dirs]
        for ax, key_of, marker in ((ax_reward, lambda r: "reward_mean", None), (ax_eval, eval_key, "o")):
            series = [_series(r, key_of(r)) for r in runs if key_of(r)]
            if not series:
                continue
            steps = sorted(set.intersection(*(set(s) for s, _ in series)))
            means = [sum(dict(zip(*s))[step] for s in series) / len(series) for step in steps]
            if ax is ax_reward:
                means = smooth(means, 5)
            ax.plot(steps, means, color=color, marker=marker, markersize=3, label=label)
            if ax is ax_eval:
                ax.axhline(max(means), color=color, linestyle="--", linewidth=0.8)
    ax_reward.set(xlabel="step", ylabel="train reward (mean over seeds, smoothed)", title="Reward")
    ax_eval.set(xlabel="step", ylabel="mean Avg@k (mean over seeds)", title="Evaluation accuracy (dashed: peak)")
    return _save(fig, out)


def plot_evaluation_panels(panels: dict[str, dict[str, list[dict[int, float]]]], out: str | Path, *,
                           ylabel: str) -> Path:
    """Evaluation curves from recorded numbers alone (no run directories): one panel per
    setting, one line per method, the mean over its seeds with a band of ± one standard error
    of that mean. ``panels``: panel title -> method label -> one ``{step: value}`` per seed."""
    import math

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False, sharey=True)
    for ax, (title, methods) in zip(axes[0], panels.items()):
        for index, (label, seeds) in enumerate(methods.items()):
            steps = sorted(set.intersection(*(set(seed) for seed in seeds)))
            values = [[seed[step] for seed in seeds] for step in steps]
            means = [sum(v) / len(v) for v in values]
            errors = [math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)) if len(v) > 1 else 0.0
                      for v, m in zip(values, means)]
            color = f"C{index % 10}"
            ax.plot(steps, means, color=color, marker="o", markersize=3, label=f"{label} ({len(seeds)} seeds)")
            ax.fill_between(steps, [m - e for m, e in zip(means, errors)], [m + e for m, e in zip(means, errors)],
                            color=color, alpha=0.15, linewidth=0)
        ax.set(xlabel="step", title=title)
    axes[0][0].set(ylabel=ylabel)
    return _save(fig, out)
