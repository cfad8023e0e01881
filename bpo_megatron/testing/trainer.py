"""The one way tests, benchmarks and the GPU kit build a train actor: a
:class:`~bpo_megatron.trainer.spec.TrainerSpec` of the sections they vary, the rest at defaults."""

from __future__ import annotations

import torch

from bpo_megatron.testing.models import tiny_moe


def build_actor(hf=None, *, tp=1, pp=1, ep=1, etp=None, cp=1, replay=False, recompute="none", lr=1e-3, loss="bpo",
                micro_batch_size=2, grad_clip=1.0, temperature=1.0, weights=None, max_tokens_per_micro_batch=0,
                params_dtype=None, logprob_kernel="auto", model_options=None, distributed_optimizer=None):
    """A train actor of ``hf`` (an ``HFModelConfig``, a config dict or path; the tiny MoE by
    default) in the current torch.distributed world; ``loss``: a loss name or a
    ``PolicyLossConfig``; ``weights``: a Hugging Face directory to load; ``params_dtype``: fp32 or
    bf16 (None: the platform's default); ``model_options``: further ``ModelOptions`` fields (e.g.
    ``{"expert_gemm": "sequential"}``); ``distributed_optimizer``: ``OptimizerSettings.distributed``.
    Release it with ``actor.close()``."""
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings
    from bpo_megatron.trainer.spec import TrainerSpec

    return TrainerSpec(
        hf=tiny_moe() if hf is None else hf,
        parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp),
        model=ModelOptions(routing_replay=replay, recompute=recompute, params_dtype=params_dtype,
                           **(model_options or {})),
        loss=loss,
        optimizer=OptimizerSettings(lr=lr, grad_clip=grad_clip, distributed=distributed_optimizer),
        trainer=TrainerConfig(micro_batch_size=micro_batch_size, temperature=temperature,
                              max_tokens_per_micro_batch=max_tokens_per_micro_batch, logprob_kernel=logprob_kernel),
        weights=weights,
    ).build()


def flat_params(actor) -> dict[str, torch.Tensor]:
    """A copy of every parameter of ``actor``'s model by name, the grouped experts' stacked
    parameters expert by expert under ``SequentialMLP``'s names (so either expert module compares)."""
    from bpo_megatron.models.grouped_experts import per_expert

    return {name: p.detach().clone() for name, p in per_expert(actor.model)}


def set_flat_params(actor, params: dict[str, torch.Tensor]) -> None:
    """Set every parameter of ``actor``'s model from ``params`` (as :func:`flat_params` names
    them: the stacked experts expert by expert)."""
    from bpo_megatron.models.grouped_experts import per_expert

    with torch.no_grad():
        for name, tensor in per_expert(actor.model):
            tensor.copy_(params[name])
