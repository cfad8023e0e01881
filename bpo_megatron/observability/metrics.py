"""Run outputs: metrics as JSONL (and TensorBoard when installed), one readable line per step."""

from __future__ import annotations

import json
import time
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
    def __init__(self, run_dir: str | Path, *, tensorboard: bool) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                self._tb = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
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
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
