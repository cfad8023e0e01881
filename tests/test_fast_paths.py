"""Every fast path of the local spec at once (``models.options.FAST_PATHS``: grouped-GEMM experts,
fused attention, the sorted MoE dispatch) against Megatron's reference modules, for every registered
policy loss: one optimizer step from the same weights gives the same loss, grad norm and updated
parameters (fp32, within summation order) at TP=2 with sequence parallel, EP=2 and PP=2, with R3
replay and packing on. Each fast path alone is compared at those layouts in its own test file
(``test_grouped_experts.py``, ``test_fused_attention.py``, ``test_sorted_dispatch.py``)."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world

TIMEOUT = 300
RTOL = 1e-6
# Adam's first step divides each gradient by its own magnitude (plus eps): a gradient entry near the
# default eps (1e-8) turns a summation-order difference of 1e-11 into percents of its update; with
# eps=1e-3 an update moves by lr/eps of such differences (test_sorted_dispatch.py says more).
ADAM_EPS = 1e-3


LAYOUTS = {"tp2_sp": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2)}  # sequence parallel with TP by default


def _actor(loss: str, options: dict, layout: dict):
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings
    from bpo_megatron.trainer.spec import TrainerSpec

    return TrainerSpec(
        hf=th.tiny_moe(),
        parallel=ParallelConfig(**layout),
        model=ModelOptions(routing_replay=True, params_dtype="fp32", **options),
        loss=loss,
        optimizer=OptimizerSettings(lr=1e-3, grad_clip=1.0, eps=ADAM_EPS),
        trainer=TrainerConfig(micro_batch_size=2, max_tokens_per_micro_batch=24),  # packed
    ).build()


def _every_loss_both_ways(directory: str, layout: dict) -> dict:
    """On every rank, per loss: the reference steps from fresh weights (saved first), every fast
    path on loads them and steps; both steps' metrics and parameters."""
    from bpo_megatron.losses import POLICY_LOSSES
    from bpo_megatron.models.options import fast_path_options

    samples = th.make_samples(8, seed=1, routing=True)
    results = {}
    for loss in sorted(POLICY_LOSSES):
        got = {}
        for on in (False, True):
            actor = _actor(loss, fast_path_options(on=on), layout)
            if on:
                actor.load(f"{directory}/{loss}")
            else:
                actor.save(f"{directory}/{loss}")
                got["initial"] = th.flat_params(actor)
            got[on] = (actor.train_step(samples), th.flat_params(actor))
            actor.close()
        results[loss] = got
    return results


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_fast_path_steps_like_the_reference_for_every_loss(tmp_path, name):
    from bpo_megatron.losses import POLICY_LOSSES

    results = run_gloo_world(_every_loss_both_ways, 2, str(tmp_path), LAYOUTS[name], timeout=TIMEOUT)
    assert len(POLICY_LOSSES) >= 6 and all(set(per_loss) == set(POLICY_LOSSES) for per_loss in results)
    for rank, per_loss in enumerate(results):
        for loss, got in per_loss.items():
            (reference, ref_params), (fast, fast_params) = got[False], got[True]
            where = f"{name} rank {rank} {loss}"
            for key in ("loss", "grad_norm"):
                # a loss near 0 (a difference of terms near 1) is compared on the terms' scale
                scale = max(abs(reference[key]), 1.0 if key == "loss" else 1e-12)
                assert abs(fast[key] - reference[key]) <= RTOL * scale, (where, key, fast[key], reference[key])
            assert fast["num_tokens"] == reference["num_tokens"], where
            assert list(fast_params) == list(ref_params), where  # same parameters, same names
            for name, ref in ref_params.items():
                torch.testing.assert_close(fast_params[name], ref, rtol=RTOL, atol=1e-7, msg=f"{where} {name}")
                moved = (ref - got["initial"][name]).abs().max()
                assert moved > 0 or name.endswith("layernorm.weight"), (where, name)  # the step did update
