"""Per-step diagnostics beyond the loss: minibatch averages and trainer/engine routing agreement."""

from __future__ import annotations



def mean_over_minibatches(updates: list[dict[str, float]]) -> dict[str, float]:
    """Averages of the minibatch metrics; maxima stay maxima; the grad norm of each update too.
    A metric some updates do not report (a masked share of a μ bin without tokens there, see
    ``losses/statistics.py``) is averaged over those that do."""
    keys = dict.fromkeys(key for u in updates for key in u)
    out = {}
    for key in keys:
        values = [u[key] for u in updates if key in u]
        out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    out["grad_norm_max"] = max(u["grad_norm"] for u in updates)
    out.pop("step", None)
    return out


def routing_agreement(trainer, samples, cfg) -> dict[str, float]:
    """Fraction of (token, MoE layer) pairs where the trainer's own top-k set equals the engine's,
    on a few responses: how much R3 corrects (1.0 would mean replay changes nothing)."""
    routed = [s for s in samples if s.routed_experts is not None]
    # every data-parallel rank must get the same number of samples
    count = min(len(routed), cfg.train.routing_agreement_samples) // cfg.data_parallel_size * cfg.data_parallel_size
    subset = routed[:count]
    if not subset or not cfg.model.options.routing_replay:
        return {}
    scored = trainer.compute_logprobs(subset, record_routing=True)
    same = total = 0
    for sample, trainer_routing in zip(subset, scored.routed_experts):
        engine = sample.routed_experts.sort(dim=-1).values
        mine = trainer_routing.sort(dim=-1).values
        equal = (engine == mine).all(dim=-1)
        same, total = same + int(equal.sum()), total + equal.numel()
    return {"routing_agreement": same / max(total, 1)}
