"""``runs.csv``: everything ``compare`` summarises, one row per run, evaluation and evaluation dataset.

Rows carry the run's method, its condition (``--condition``: a name for the settings that
compare call's overrides chose; empty without), ``train.async.max_staleness`` (empty without
``--staleness``), seed,
the evaluation's step and dataset, its Avg@k (``accuracy``) and, where the run recorded them,
its correct and total responses, also for the dataset's questions at even and at odd positions
(the two halves ``--stat heldout-peak`` selects on and reports). Then the run's training metrics
from ``metrics.jsonl``, each the mean over the RL steps since the previous evaluation (this
evaluation's step included; ``trained_steps`` of them, none at the evaluation of the initial
policy), so a run's mean over all its steps is the mean of its rows weighted by
``trained_steps``. ``compare --from-csv`` rebuilds every table from this file alone.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path

from bpo_megatron.eval.avg_at_k import HALVES
from bpo_megatron.observability.metrics import evaluation_only


Setting = tuple[str, "int | None"]  # (condition, staleness)


def setting_label(setting: Setting) -> str:
    """How tables and ``--primary`` name a setting: ``4``, ``bf16``, ``bf16/4`` or "" (the only one)."""
    condition, staleness = setting
    if staleness is None:
        return condition
    return f"{condition}/{staleness}" if condition else str(staleness)


@dataclass(frozen=True)
class EvalRow:
    run: str  # the run directory's name
    method: str  # its label in the tables
    method_id: str  # the name given to --losses (or the sweep value's slug)
    staleness: int | None  # train.async.max_staleness; None: compare ran without --staleness
    seed: int
    recompute_old_logprobs: bool  # π_old recomputed by the trainer (decoupled PPO when staleness > 0)
    step: int
    dataset: str
    eval_k: int  # responses per question (Avg@k)
    accuracy: float
    correct: int | None = None
    total: int | None = None
    even_correct: int | None = None
    even_total: int | None = None
    odd_correct: int | None = None
    odd_total: int | None = None
    trained_steps: int = 0
    training: dict[str, float] = field(default_factory=dict)  # metric -> mean over trained_steps
    condition: str = ""  # compare --condition: the name of the settings its overrides chose

    @property
    def setting(self) -> Setting:
        """Where the run stands apart from its method and seed: its condition and staleness."""
        return self.condition, self.staleness

    def half_accuracy(self, half: str) -> float:
        correct, total = getattr(self, f"{half}_correct"), getattr(self, f"{half}_total")
        if correct is None or not total:
            raise ValueError(f"run {self.run} recorded no counts of the {half} questions of {self.dataset} at step "
                             f"{self.step} (evaluated before they were kept)")
        return correct / total


COLUMNS = tuple(f.name for f in fields(EvalRow) if f.name != "training")
OPTIONAL = ("condition",)  # columns added since the first runs.csv files: empty when a file lacks them
INTEGERS = {"staleness", "seed", "step", "eval_k", "correct", "total", "even_correct", "even_total", "odd_correct",
            "odd_total", "trained_steps"}
NOT_TRAINING = ("eval/", "sft/")  # evaluations, and the warm start's metrics


def run_rows(records: list[dict], *, run: str, method: str, method_id: str, staleness: int | None, seed: int,
             recompute_old_logprobs: bool, condition: str = "") -> list[EvalRow]:
    """The rows of one run's ``metrics.jsonl`` records (``read_metrics``)."""
    mean_key = next((key for record in records for key in record if key.startswith("eval/mean_avg@")), None)
    if mean_key is None:
        raise ValueError(f"{run} has no evaluation results; set eval.every > 0")
    eval_k = int(mean_key.rpartition("@")[2])
    evaluations: dict[int, dict] = {}
    for record in records:
        if mean_key in record:
            evaluations[record["step"]] = record
    rows, previous = [], None
    for step in sorted(evaluations):
        record = evaluations[step]
        # RL steps are numbered from 1 (the warm start's records end at step 0); a background
        # evaluation's record is no step of training
        window = [r for r in records if (previous or 0) < r["step"] <= step and not evaluation_only(r)]
        training = _window_means(window)
        datasets = [key[len("eval/"):-len(f"_avg@{eval_k}")] for key in record
                    if key.startswith("eval/") and key.endswith(f"_avg@{eval_k}") and key != mean_key]
        for dataset in datasets or ["mean"]:  # a run that recorded only the mean: one pseudo-dataset
            key = f"eval/{dataset}_avg@{eval_k}" if datasets else mean_key
            halves = {}
            for half in HALVES:
                correct = record.get(f"eval/{dataset}_correct_{half}")
                total = record.get(f"eval/{dataset}_responses_{half}")
                halves[f"{half}_correct"] = None if correct is None else int(correct)
                halves[f"{half}_total"] = None if total is None else int(total)
            counted = None not in halves.values()
            rows.append(EvalRow(run=run, method=method, method_id=method_id, staleness=staleness, seed=seed,
                                condition=condition,
                                recompute_old_logprobs=recompute_old_logprobs, step=int(step), dataset=dataset,
                                eval_k=eval_k, accuracy=float(record[key]),
                                correct=halves["even_correct"] + halves["odd_correct"] if counted else None,
                                total=halves["even_total"] + halves["odd_total"] if counted else None,
                                trained_steps=len(window), training=training, **halves))
        previous = step
    return rows


def _window_means(window: list[dict]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for record in window:
        for key, value in record.items():
            if key in ("step", "time") or key.startswith(NOT_TRAINING):
                continue
            values.setdefault(key, []).append(float(value))
    return {key: statistics.fmean(v) for key, v in values.items()}


def write_csv(rows: list[EvalRow], path: Path) -> None:
    """Floats are written by ``repr``, which reads back to the same float: a summary of the CSV
    equals the summary of the runs."""
    metrics = sorted({key for row in rows for key in row.training})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, *metrics])
        for row in rows:
            writer.writerow([_cell(getattr(row, column)) for column in COLUMNS]
                            + [_cell(row.training.get(metric)) for metric in metrics])


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def read_csv(path: Path) -> list[EvalRow]:
    """The rows of a ``runs.csv``; a missing column or a bad cell raises naming the line."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or []) and c not in OPTIONAL]
        if missing:
            raise ValueError(f"{path} is not a compare runs.csv: it lacks the columns {', '.join(missing)}")
        metrics = [c for c in reader.fieldnames if c not in COLUMNS]
        rows = []
        for line, record in enumerate(reader, start=2):
            try:
                values = {c: _parse(c, record.get(c)) for c in COLUMNS}
                training = {m: float(record[m]) for m in metrics if record[m] not in ("", None)}
            except ValueError as exc:
                raise ValueError(f"{path}:{line}: {exc}") from exc
            rows.append(EvalRow(**values, training=training))
    if not rows:
        raise ValueError(f"{path} holds no runs")
    return rows


def _parse(column: str, text: str | None):
    if text in ("", None):
        if column in OPTIONAL:
            return ""
        if column in ("run", "method", "method_id", "seed", "step", "dataset", "eval_k", "accuracy"):
            raise ValueError(f"column {column} is empty")
        return None
    if column == "recompute_old_logprobs":
        if text not in ("true", "false"):
            raise ValueError(f"column {column} must be true or false, got {text!r}")
        return text == "true"
    if column in INTEGERS:
        return int(text)
    if column == "accuracy":
        return float(text)
    return text


def mean_over_steps(rows: list[dict], metric: str) -> float | None:
    """A run's mean of a training ``metric`` over its RL steps, from its rows as read by
    ``csv.DictReader``: each evaluation row holds the mean over the ``trained_steps`` since the
    previous one (None: no row with the metric, e.g. no such tokens)."""
    pairs = [(int(r["trained_steps"]), float(r[metric])) for r in rows
             if r.get(metric) and int(r["trained_steps"] or 0)]
    total = sum(n for n, _ in pairs)
    return sum(n * x for n, x in pairs) / total if total else None
