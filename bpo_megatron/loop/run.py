"""What a run needs around the algorithm: its directory, tokenizer, initial weights, resume state."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from bpo_megatron.experiment import ExperimentConfig, save_resolved
from bpo_megatron.trainer import checkpoint


@dataclass
class RunState:
    """Everything a checkpoint must restore besides the model and optimizer."""

    step: int = 0  # RL steps completed
    data_cursor: int = 0
    sft_done: bool = False
    best_step: int | None = None
    best_mean: float = float("-inf")
    eval_history: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rl_step": self.step, "data_cursor": self.data_cursor, "sft_done": self.sft_done,
                "best_step": self.best_step, "best_mean": self.best_mean, "eval_history": self.eval_history}

    @classmethod
    def from_checkpoint(cls, meta: dict) -> "RunState":
        return cls(step=meta["rl_step"], data_cursor=meta["data_cursor"], sft_done=meta["sft_done"],
                   best_step=meta.get("best_step"), best_mean=meta.get("best_mean", float("-inf")),
                   eval_history=[tuple(x) for x in meta.get("eval_history", [])])


def checkpoint_root(cfg: ExperimentConfig) -> Path:
    return cfg.run_dir / "checkpoints"


def prepare_run_dir(cfg: ExperimentConfig) -> Path:
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir)
    return run_dir


def initial_hf_dir(cfg: ExperimentConfig) -> str:
    """The Hugging Face directory both trainer and engines start from.

    ``model.init: random`` materialises random weights of ``model.path``'s config once per run
    (seeded by ``train.seed``), so a resumed run and its engines start from the same weights.
    """
    if cfg.model.init == "pretrained":
        return cfg.model.path
    target = cfg.run_dir / "initial_hf"
    if (target / "config.json").is_file():
        return str(target)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(cfg.model.path)
    hf_config = AutoConfig.from_pretrained(str(source if source.is_dir() else source.parent), local_files_only=True)
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    partial = target.with_name(".initial_hf.partial")
    model.save_pretrained(str(partial))
    partial.rename(target)
    return str(target)


def resume_state(cfg: ExperimentConfig) -> tuple[RunState, str | None]:
    """The state to start from and the checkpoint to load (None: a fresh run)."""
    root = checkpoint_root(cfg)
    if not cfg.checkpoint.resume or checkpoint.latest_step(root) is None:
        return RunState(), None
    meta = json.loads((checkpoint.resolve(root) / checkpoint.STATE_FILE).read_text())
    return RunState.from_checkpoint(meta), str(root)
