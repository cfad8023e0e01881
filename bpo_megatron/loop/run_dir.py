"""A run directory as the record of one experiment, and the rules that keep it one.

    runs/<name>/config.yaml     the resolved config the run trains with
    runs/<name>/metrics.jsonl   one record per step (SFT steps ≤ 0), each step once (a background
                                evaluation's record later, under the step it evaluated)
    runs/<name>/trackers.json   each experiment tracker's run id, continued on resume
                                (``bpo_megatron.observability.trackers.mirror``); tensorboard/,
                                wandb/ and mlflow/ hold the trackers' own files
    runs/<name>/checkpoints/    trainer checkpoints (see ``bpo_megatron.trainer.checkpoint``)
    runs/<name>/initial_hf/     the random initial weights of a ``model.init: random`` run
    runs/<name>/.lock           the driver that owns the directory (pid, host)

A directory that already holds a run is continued only with the same settings: a config that
differs (except in :data:`RESUME_SAFE` settings, which change how a run is computed but not what
it learns) is refused, naming every differing setting, unless the caller lists them as overrides.
A model whose architecture differs from the checkpoint's is always refused. ``checkpoint.resume
=false`` on a directory that holds a run is refused rather than mixed into it. Nothing here
starts Ray or a model; every refusal is a :class:`RunRefused` raised before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bpo_megatron.config import ConfigError, to_dict

CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"

# Settings that may change between a run and its resumption: where and how fast it runs (layout,
# engines, threads, buckets), what it reports, how long it runs and how often it saves. None of
# them changes the sequence of updates beyond floating-point summation order.
RESUME_SAFE = (
    "name", "train.steps", "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch", "weight_sync.verify",
    "train.routing_agreement_samples", "parallel.", "cluster.", "logging.", "checkpoint.every",
    "checkpoint.keep_last", "checkpoint.resume", "checkpoint.background", "rollout.num_engines", "rollout.threads_per_engine",
    "weight_sync.bucket_mb", "rollout.sglang.weight_bucket_bytes", "rollout.vllm.weight_bucket_bytes",
    "rollout.hf.max_batch_rows", "rollout.hf.decode", "rollout.hf.refill_every",
    "rollout.generate_timeout_s",
    "rollout.max_restarts", "rollout.stall_timeout_s", "eval.mode", "eval.engines", "trainer.logprob_kernel",
)


class RunRefused(ConfigError):
    """The run directory cannot be used as asked; the message says why and what to do."""


@dataclass
class RunState:
    """Everything a checkpoint must restore besides the model and optimizer."""

    step: int = 0  # RL steps completed
    data_cursor: int = 0
    sft_done: bool = False
    best_step: int | None = None
    best_mean: float = float("-inf")
    eval_history: list = field(default_factory=list)  # see bpo_megatron.eval.avg_at_k.BestCheckpoint
    # Background evaluation: the steps whose evaluation was still running at the save (at most the
    # checkpoint's own step: its weights are the checkpoint's, so a resume runs it again), and how
    # many records metrics.jsonl held then (a resume keeps those; None: those up to the step)
    eval_pending: list = field(default_factory=list)
    metrics_records: int | None = None
    # RL steps that trained nothing: a user reward failed on their batches (data.on_reward_failure=skip_step)
    skipped_steps: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rl_step": self.step, "data_cursor": self.data_cursor, "sft_done": self.sft_done,
                "best_step": self.best_step, "best_mean": self.best_mean, "eval_history": self.eval_history,
                "eval_pending": list(self.eval_pending), "metrics_records": self.metrics_records,
                "skipped_steps": list(self.skipped_steps)}

    @classmethod
    def from_checkpoint(cls, meta: dict) -> "RunState":
        return cls(step=meta["rl_step"], data_cursor=meta["data_cursor"], sft_done=meta["sft_done"],
                   best_step=meta.get("best_step"), best_mean=meta.get("best_mean", float("-inf")),
                   eval_history=[tuple(x) for x in meta.get("eval_history", [])],
                   eval_pending=[int(s) for s in meta.get("eval_pending", [])],
                   metrics_records=meta.get("metrics_records"),
                   skipped_steps=[int(s) for s in meta.get("skipped_steps", [])])


def checkpoint_root(cfg) -> Path:
    return cfg.run_dir / "checkpoints"


def holds_a_run(run_dir: Path) -> bool:
    """Whether anything but a lock is in the directory."""
    return run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir())


# ------------------------------------------------------------------------------ recorded config
def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat if flat or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def _resume_safe(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in RESUME_SAFE)


# Settings holding file system paths: compared (and recorded) as absolute paths, so the same run
# started from another working directory is the same run.
PATH_SETTINGS = ("model.path", "model.tokenizer", "data.root", "data.train")


def _absolute_paths(flat: dict[str, Any]) -> dict[str, Any]:
    out = dict(flat)
    for key in PATH_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and value and Path(value).exists():
            out[key] = str(Path(value).resolve())
    return out


def _under_current_names(old: dict[str, Any], new: dict[str, Any], moved: dict[str, str]) -> dict[str, Any]:
    """A recorded config's settings under today's keys: those that ``moved`` (old -> new key) and
    those recorded as a plain value of what is a section now (its shorthand key, ``name``)."""
    out = {}
    for key, value in old.items():
        key = moved.get(key, key)
        if key not in new and f"{key}.name" in new:
            key = f"{key}.name"
        out[key] = value
    return out


def config_changes(recorded: dict[str, Any], current: dict[str, Any],
                   defaults: dict[str, Any] | None = None, moved: dict[str, str] | None = None
                   ) -> dict[str, tuple[Any, Any]]:
    """Setting -> (recorded value, current value) for every setting that differs and matters. A
    setting the recorded config lacks (one added to the package since) is no change while the
    current config keeps its default (``defaults``: a whole default config); one that moved since
    (``moved``: old -> new key) is compared at its new key."""
    new = _absolute_paths(_flatten(current))
    old = _under_current_names(_absolute_paths(_flatten(recorded)), new, moved or {})
    default = _flatten(defaults or {})
    missing = object()
    changes = {}
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, missing), new.get(key, missing)
        if before is missing and key in default and default[key] == after:
            continue
        if before != after and not _resume_safe(key):
            changes[key] = (None if before is missing else before, None if after is missing else after)
    return changes


def read_recorded_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        recorded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RunRefused(f"{path} is damaged ({exc}); restore it from a copy, or move {run_dir} aside "
                         "to start a new run") from exc
    if not isinstance(recorded, dict):
        raise RunRefused(f"{path} does not hold a config; move {run_dir} aside to start a new run")
    return recorded


def check_config_unchanged(cfg, run_dir: Path, overrides: tuple[str, ...]) -> dict[str, tuple[Any, Any]]:
    """The accepted changes against the recorded config (all named in ``overrides``), else
    :class:`RunRefused` listing the settings that differ."""
    recorded = read_recorded_config(run_dir)
    if recorded is None:
        return {}
    changes = config_changes(recorded, to_dict(cfg), defaults=to_dict(type(cfg)()),
                             moved=getattr(type(cfg), "MOVED_KEYS", {}))
    unexplained = {k: v for k, v in changes.items() if not any(k == o or k.startswith(f"{o}.") for o in overrides)}
    if unexplained:
        lines = "\n".join(f"  {key}: {old!r} -> {new!r}" for key, (old, new) in unexplained.items())
        raise RunRefused(
            f"{run_dir} holds a run recorded with other settings ({run_dir / CONFIG_FILE}); this config differs in:\n"
            f"{lines}\nresuming would continue that run with these settings. For a new run choose another "
            f"name (name=... or logging.run_dir=...); to continue this one with them, pass "
            f"--override-resume {','.join(unexplained)}")
    return changes


def record_config(cfg, run_dir: Path, *, changed_at_step: int | None = None) -> Path:
    """Write the resolved config; a config changed on resume keeps the previous one beside it."""
    path = run_dir / CONFIG_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    if changed_at_step is not None and path.is_file():
        path.replace(run_dir / f"config.before-step-{changed_at_step:08d}.yaml")
    tree = to_dict(cfg)
    for key, value in _absolute_paths(_flatten(tree)).items():
        if key in PATH_SETTINGS:
            section, name = key.split(".")
            tree[section][name] = value
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(tree, sort_keys=False))
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------- model config
def model_config_changes(current, recorded) -> dict[str, tuple[Any, Any]]:
    """Architecture field -> (recorded, current) for two ``HFModelConfig``s."""
    changes = {}
    for f in dataclasses.fields(current):
        if f.compare and getattr(current, f.name) != getattr(recorded, f.name):
            changes[f.name] = (getattr(recorded, f.name), getattr(current, f.name))
    return changes


def check_model_unchanged(current, recorded, *, what: str, model_path: str) -> None:
    changes = model_config_changes(current, recorded)
    if changes:
        lines = "\n".join(f"  {key}: {old!r} -> {new!r}" for key, (old, new) in changes.items())
        raise RunRefused(
            f"the model config at model.path={model_path} differs from {what}:\n{lines}\n"
            "the run would train a different model than it recorded (and than its engines serve). Restore "
            "the model's config.json, or start a new run under another name")


# ------------------------------------------------------------------------------------- lock
@dataclass(frozen=True)
class LockOwner:
    pid: int
    host: str
    started: float
    process_started: float | None = None  # the owner's process creation time (a reused pid differs)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}, since {when}"


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _read_owner(path: Path) -> LockOwner | None:
    try:
        return LockOwner(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # a lock torn by a crash while it was written owns nothing


def _alive(owner: LockOwner) -> bool:
    """Whether the lock's owner still runs; a driver on another host is assumed to."""
    if owner.host != socket.gethostname():
        return True
    started = _process_start(owner.pid)
    if started is None:
        return False
    return owner.process_started is None or abs(started - owner.process_started) < 1.0


def check_unlocked(run_dir: Path) -> None:
    owner = _read_owner(run_dir / LOCK_FILE) if (run_dir / LOCK_FILE).exists() else None
    if owner is not None and owner.pid != os.getpid() and _alive(owner):
        raise RunRefused(
            f"{run_dir} is in use by another driver ({owner.describe()}); wait for it to finish or stop it. "
            f"If that driver is gone (its host lost), delete {run_dir / LOCK_FILE}")


class RunLock:
    """Exclusive ownership of a run directory by this driver process, released on exit. A lock
    left by a driver that was killed on this host is taken over (its process is gone)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = LockOwner(pid=os.getpid(), host=socket.gethostname(), started=time.time(),
                       process_started=_process_start(os.getpid()))
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                check_unlocked(self.path.parent)  # refuses while the owner lives
                self.path.unlink(missing_ok=True)  # a stale lock: its driver is gone
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(dataclasses.asdict(me)))
            return self
        raise RunRefused(f"could not take {self.path}: another driver keeps taking it")

    def __exit__(self, *exc) -> None:
        owner = _read_owner(self.path)
        if owner is not None and owner.pid == os.getpid():
            self.path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- initial weights
def initial_hf_dir(cfg) -> str:
    """The Hugging Face directory both trainer and engines start from.

    ``model.init: random`` materialises random weights of ``model.path``'s config once per run
    (seeded by the run's ``seed``), so a resumed run and its engines start from the same weights.
    """
    if cfg.model.init == "pretrained":
        return cfg.model.path
    target = cfg.run_dir / "initial_hf"
    if (target / "config.json").is_file():
        return str(target)
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(cfg.model.path)
    hf_config = AutoConfig.from_pretrained(str(source if source.is_dir() else source.parent), local_files_only=True)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    partial = target.with_name(".initial_hf.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a driver killed while writing it
    model.save_pretrained(str(partial))
    partial.rename(target)
    return str(target)
