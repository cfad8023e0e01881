"""The one kit tests, benchmarks and the GPU kit share beyond the product: tiny model configs and
random checkpoints (``models``), training samples (``samples``), a teacher-forced recompute
(``recompute``), the train actor built through a
:class:`~bpo_megatron.trainer.spec.TrainerSpec` (``trainer``), routing seen from Megatron's
routers (``routing``), the activation memory autograd keeps, measured (``activations``), and the log-prob
op timed against Megatron's (``logprob_timing``)."""

from bpo_megatron.testing.activations import MeasuredActivations, measure_activations, saved_activation_bytes
from bpo_megatron.testing.models import MODEL_CONFIGS, TINY_MOE, random_checkpoint, random_model_dir, tiny_moe, write_config
from bpo_megatron.testing.routing import DispatchRecorder, same_expert_sets
from bpo_megatron.testing.samples import (
    long_tailed,
    make_samples,
    random_routing,
    random_tokens,
    samples_of_lengths,
    train_samples,
)
from bpo_megatron.testing.trainer import build_actor, flat_params, set_flat_params

__all__ = [
    "MODEL_CONFIGS", "TINY_MOE", "DispatchRecorder", "MeasuredActivations", "build_actor", "flat_params",
    "long_tailed", "make_samples", "measure_activations", "random_checkpoint", "random_model_dir", "random_routing",
    "random_tokens", "same_expert_sets", "samples_of_lengths", "saved_activation_bytes", "set_flat_params", "tiny_moe",
    "train_samples", "write_config",
]
