"""Random Hugging Face checkpoints for tests and benchmarks (no hub access needed)."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def random_checkpoint(config, out: str | Path, *, seed: int) -> Path:
    """Save a random transformers model of ``config`` (a config object, or a directory or
    ``config.json`` holding one) to ``out``.

    The initialisation keeps logits (~N(0, 2²)) and router scores (~N(0, 4²)) far from uniform, so
    a wrong position, mask or expert shows up in log μ and routing is not decided by near-ties.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, (str, Path)):
        path = Path(config)
        config = AutoConfig.from_pretrained(str(path.parent if path.suffix == ".json" else path))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hidden = config.hidden_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms: distinct values, so a mix-up between them is visible
                param.normal_(1.0, 0.1)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 2.0 / math.sqrt(hidden) if config.tie_word_embeddings else 1.0)
            elif name.startswith("lm_head"):
                param.normal_(0.0, 2.0 / math.sqrt(hidden))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 4.0 / math.sqrt(hidden))
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
    model.save_pretrained(str(out))
    return Path(out)
