"""The trainer's view of a generated sequence, from a transformers model: one unpadded forward
of every token but the last, its log-probabilities at a temperature and the experts each MoE
router picked — what an engine's log μ and captured routing are checked against."""

from __future__ import annotations

import torch


def teacher_forced(model: torch.nn.Module, tokens: torch.Tensor, temperature: float, *, start: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log-softmax(logits / T) of the next token at every input position from ``start`` on, and
    the experts every router picked at every input position (None for a dense model).

    ``tokens``: one sequence ``[L]`` (results ``[L − 1 − start, V]`` and ``[L − 1, layers, K]``)
    or rows of one length ``[B, L]`` (a leading ``B`` on both)."""
    rows = tokens[None] if tokens.dim() == 1 else tokens
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    picked: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda module, args, out: picked.append(out[2])) for r in routers]
    try:
        with torch.inference_mode():
            logits = model(input_ids=rows[:, :-1]).logits[:, start:].float()
    finally:
        for handle in handles:
            handle.remove()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    routing = (torch.stack(picked, dim=1).view(rows.shape[0], rows.shape[1] - 1, len(routers), -1)
               if picked else None)
    if tokens.dim() == 1:
        return logprobs[0], None if routing is None else routing[0]
    return logprobs, routing
