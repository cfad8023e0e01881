"""Run outputs: metrics as JSONL (and TensorBoard when installed), one readable line per step."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

# What the one-line summary shows, in order: (metric, label, format)
SUMMARY = (
    ("reward_mean", "reward", ".3f"),
    ("loss", "loss", ".4f"),
    ("clip_frac", "masked", ".3f"),
    ("weight_mean", "w", ".3f"),
    ("weight_max", "w_max", ".2f"),
    ("abs_logp_diff_mean", "|Δlogp|", ".2e"),
    ("routing_agreement", "route=", ".3f"),
    ("grad_norm", "gnorm", ".3f"),
    ("time/rollout_s", "rollout", ".1fs"),
    ("time/train_s", "train", ".1fs"),
    ("time/sync_s", "sync", ".1fs"),
)


class MetricsWriter:
    """Appends one record per step to ``metrics.jsonl`` (and TensorBoard events).

    ``resume_after``: the step the run resumes from. Records of later steps (and, with None, all
    records: a fresh start) are left over from an interrupted attempt that will be run again, so
    they are dropped first and every step is recorded once.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool, resume_after: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_metrics(run_dir, resume_after)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                SummaryWriter = None
            if SummaryWriter is not None:
                events = Path(run_dir) / "tensorboard"
                if resume_after is None:
                    shutil.rmtree(events, ignore_errors=True)
                # purge_step hides the events of steps after the checkpoint in TensorBoard
                self._tb = SummaryWriter(str(events), purge_step=None if resume_after is None else resume_after + 1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def summary_line(step: int, total: int, metrics: dict[str, float], *, bar: bool = False) -> str:
    parts = [f"{progress_bar(step, total)} step {step}/{total}" if bar else f"step {step}/{total}"]
    for key, label, fmt in SUMMARY:
        if key in metrics:
            unit = "s" if fmt.endswith("s") else ""
            spec = fmt[:-1] if unit else fmt
            sep = "" if label.endswith("=") else " "
            parts.append(f"{label}{sep}{format(metrics[key], spec)}{unit}")
    return " | ".join(parts)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every record of a run. A last line cut short (the driver was killed while writing it) is
    dropped with a warning; a damaged line before it raises naming the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: the last record is incomplete (a write was interrupted); "
                              "it is ignored", stacklevel=2)
                break
            raise ValueError(f"{path}:{number}: not a metrics record ({exc.msg})") from exc
    return records


def truncate_metrics(run_dir: str | Path, after_step: int | None) -> None:
    """Keep only the records of steps up to ``after_step`` (none for None), atomically."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn last line is dropped here on purpose
        records = read_metrics(run_dir)
    kept = [r for r in records if after_step is not None and r["step"] <= after_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
