"""Megatron-Core 0.16 on CPU over gloo, through bpo-megatron's compat layer.

A tiny MoE GPT is built at world size 1 and saved as a distributed checkpoint; every parallel
layout (TP=2 with sequence parallelism, EP=2, PP=2) loads that checkpoint, resharding it, and
must reproduce the world-size-1 loss (and gradients, where they are comparable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tiny_gpt as tg
from bpo_megatron import platform
from bpo_megatron.megatron import compat
from bpo_megatron.parallel.local_world import run_gloo_world

REL_TOL = 1e-5
WORLD_TIMEOUT_S = 120.0


def rel_diff(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def assert_rng_streams_seeded(out: dict[str, Any]) -> None:
    """Megatron's tracked RNG streams draw what their documented seeds give on a CPU generator."""
    seeds = {  # the seeding rule of model_parallel_cuda_manual_seed
        "data-parallel-rng": tg.SEED,
        "model-parallel-rng": tg.SEED + 2718 + out["tp_rank"],
        "expert-parallel-rng": tg.SEED + 1024 + 100 * out["ep_rank"] + out["etp_rank"],
    }
    assert set(out["rng_draws"]) == set(seeds)
    for name, seed in seeds.items():
        expected = torch.rand(4, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(out["rng_draws"][name], expected), name


# --------------------------------------------------------------------------------------------
# Rank functions (module level so that the gloo ranks can import them)
# --------------------------------------------------------------------------------------------


def _train_step_rank(layout: tg.Layout, checkpoint: str, save: bool) -> dict[str, Any]:
    """One forward/backward on batch 0; with ``save``, first write the checkpoint instead of
    loading it, and also report the batch-1 loss (the second pipeline microbatch)."""
    from megatron.core import parallel_state

    tg.init_parallel(layout)
    rng_draws = tg.tracked_rng_draws()
    model = tg.build_tiny_gpt(layout)
    if save:
        tg.save_checkpoint(model, Path(checkpoint))
    else:
        tg.load_checkpoint(model, Path(checkpoint))

    loss = tg.forward_losses(model, tg.make_batch(0)).mean()
    loss.backward()
    tg.allreduce_sequence_parallel_grads(model)
    result: dict[str, Any] = {
        "loss": loss.item(),
        "embedding_grad": tg.embedding_grad(model),
        # replicated over TP and fed only by the local sequence shard under SP
        "final_norm_grad": model.decoder.final_layernorm.weight.grad.clone(),
        "sequence_parallel": model.config.sequence_parallel,
        "rng_draws": rng_draws,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "etp_rank": parallel_state.get_expert_tensor_parallel_rank(),
    }
    if layout.ep == 1:  # with EP the dense params are data-parallel replicas
        result["grad_norm"] = tg.grad_norm(model)
    if save:
        with torch.no_grad():
            result["loss_batch1"] = tg.forward_losses(model, tg.make_batch(1)).mean().item()
    parallel_state.destroy_model_parallel()
    return result


def _pipeline_rank(checkpoint: str) -> list[float]:
    """PP=2 through Megatron's schedule with two microbatches; returns last-stage losses."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    layout = tg.Layout(pp=2)
    tg.init_parallel(layout)
    model = tg.build_tiny_gpt(layout)
    tg.load_checkpoint(model, Path(checkpoint))

    reports = get_forward_backward_func()(
        forward_step_func=tg.mean_loss_forward_step,
        data_iterator=iter([tg.make_batch(0), tg.make_batch(1)]),
        model=[model],
        num_microbatches=2,
        seq_length=tg.SEQ_LENGTH,
        micro_batch_size=tg.MICRO_BATCH_SIZE,
        forward_only=False,
    )
    grads_finite = all(
        torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None
    )
    has_grads = any(p.grad is not None for p in model.parameters())
    parallel_state.destroy_model_parallel()
    assert has_grads and grads_finite, "the pipeline backward left no (finite) gradients"
    return [report["loss"].item() for report in reports]


def _router_replay_rank() -> dict[str, float]:
    """RECORD, then REPLAY_FORWARD of the recorded and of different expert indices."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    layout = tg.Layout()
    tg.init_parallel(layout)
    model = tg.build_tiny_gpt(layout, routing_replay=True)
    batch = tg.make_batch(0)
    assert len(RouterReplay.global_router_replay_instances) == tg.NUM_LAYERS

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    logp_recorded = -tg.forward_losses(model, batch).detach()
    recorded = [indices.clone() for indices in RouterReplay.get_recorded_data()]
    tokens = tg.MICRO_BATCH_SIZE * tg.SEQ_LENGTH
    assert [tuple(t.shape) for t in recorded] == [(tokens, tg.TOPK)] * tg.NUM_LAYERS

    def replay(indices: list[torch.Tensor]) -> torch.Tensor:
        RouterReplay.clear_global_indices()
        RouterReplay.set_replay_data(indices)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        losses = tg.forward_losses(model, batch)
        losses.mean().backward()  # replayed routing must be differentiable through the router
        return -losses.detach()

    logp_same = replay(recorded)
    # shifting every index by one keeps the k choices of a token distinct but changes them all
    logp_other = replay([(indices + 1) % tg.NUM_EXPERTS for indices in recorded])
    router_grad = model.decoder.layers[0].mlp.router.weight.grad
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    parallel_state.destroy_model_parallel()
    return {
        "same_max_abs_diff": (logp_same - logp_recorded).abs().max().item(),
        "other_max_abs_diff": (logp_other - logp_recorded).abs().max().item(),
        "router_grad_norm": router_grad.norm().item(),
    }


def _patch_targets() -> dict[str, Any]:
    """The objects the compat layer replaces, by a readable name."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mcore_optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return {
        "torch.cuda.current_device": torch.cuda.current_device,
        "torch.cuda.Stream": torch.cuda.Stream,
        "torch.cuda.current_stream": torch.cuda.current_stream,
        "torch.cuda.synchronize": torch.cuda.synchronize,
        "torch.cuda.get_rng_state": torch.cuda.get_rng_state,
        "torch.cuda.manual_seed": torch.cuda.manual_seed,
        "random._set_cuda_rng_state": mcore_random._set_cuda_rng_state,
        "utils.get_default_causal_mask": transformer_utils.get_default_causal_mask,
        "fused_softmax.get_default_causal_mask": fused_softmax.get_default_causal_mask,
        "moe_utils.te_general_gemm": getattr(moe_utils, "te_general_gemm", "<missing>"),
        "token_dispatcher.maybe_move_tensor_to_cpu": token_dispatcher.maybe_move_tensor_to_cpu,
        "WrappedTorchNorm.__new__": WrappedTorchNorm.__dict__["__new__"],
        "schedules.torch": schedules.torch,
        "clip_grads.l2_norm_impl": clip_grads.l2_norm_impl,
        "clip_grads.multi_tensor_scale_impl": clip_grads.multi_tensor_scale_impl,
        "optimizer.multi_tensor_scale_impl": mcore_optimizer.multi_tensor_scale_impl,
        "rope_utils._apply_rotary_pos_emb_thd": rope_utils._apply_rotary_pos_emb_thd,
        "multi_latent_attention.HAVE_TE": multi_latent_attention.HAVE_TE,
        "DistributedOptimizer._build_model_and_main_param_groups":
            DistributedOptimizer.__dict__["_build_model_and_main_param_groups"],
    }


def _idempotency_rank() -> dict[str, Any]:
    before = _patch_targets()
    first = compat.ensure_megatron_cpu_compat()
    after_first = _patch_targets()
    second = compat.ensure_megatron_cpu_compat()
    after_second = _patch_targets()
    return {
        "first": first,
        "second": second,
        "registered": [patch.name for patch in compat._PATCHES],
        # 0.17+ define te_general_gemm themselves and set latent attention's HAVE_TE from TE (the
        # 0.16 fixes are not applied there)
        "not_replaced": [name for name in before if before[name] is after_first[name]
                         and not (name in ("moe_utils.te_general_gemm", "multi_latent_attention.HAVE_TE")
                                  and compat.megatron_minor() > 16)],
        "changed_by_second_call": [
            name for name in after_first if after_first[name] is not after_second[name]
        ],
    }


def _cuda_present_rank() -> dict[str, Any]:
    torch.cuda.is_available = lambda: True  # this process pretends to own a GPU
    before = _patch_targets()
    applied = compat.ensure_megatron_cpu_compat()
    after = _patch_targets()
    fixed = compat.ensure_megatron_fixes()  # what initialize_parallel applies on every platform
    after_fixes = _patch_targets()
    return {
        "needs_cpu_compat": compat.needs_cpu_compat(),
        "applied": applied,
        "changed": [name for name in before if before[name] is not after[name]],
        "fixed": fixed,
        "changed_by_fixes": [name for name in after if after[name] is not after_fixes[name]],
        "te_general_gemm": after_fixes["moe_utils.te_general_gemm"],
    }


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """World size 1: write the shared checkpoint and record the reference loss and gradients."""
    checkpoint = tmp_path_factory.mktemp("tiny_gpt_checkpoint")
    [result] = run_gloo_world(
        _train_step_rank, 1, tg.Layout(), str(checkpoint), True, timeout=WORLD_TIMEOUT_S
    )
    result["checkpoint"] = str(checkpoint)
    return result


def test_platform_selects_cpu_without_cuda() -> None:
    assert not platform.has_cuda()
    assert platform.device() == torch.device("cpu")
    assert platform.distributed_backend() == "gloo"
    assert not platform.has_transformer_engine()


def test_unsupported_megatron_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.megatron_minor() in compat.SUPPORTED_MINORS
    for outside in ("0.15.3", "0.20.0", "1.16.0"):
        monkeypatch.setattr(compat, "megatron_version", lambda version=outside: version)
        with pytest.raises(RuntimeError, match=rf"supports megatron-core 0\.16\.x to 0\.19\.x; found {outside}"):
            compat._check_supported_version()


def test_compat_is_idempotent() -> None:
    [out] = run_gloo_world(_idempotency_rank, 1, timeout=WORLD_TIMEOUT_S)
    assert out["first"] == tuple(out["registered"]) and len(out["first"]) > 0
    assert out["second"] == out["first"]  # nothing applied twice
    assert out["not_replaced"] == []  # the first call really patched every target
    assert out["changed_by_second_call"] == []


def test_compat_is_a_no_op_with_cuda() -> None:
    [out] = run_gloo_world(_cuda_present_rank, 1, timeout=WORLD_TIMEOUT_S)
    assert out["needs_cpu_compat"] is False
    assert out["applied"] == ()
    assert out["changed"] == []
    # without transformer-engine or apex four things show on GPUs too, and only they are mended:
    # the 0.16 router bug (0.17 fixed it upstream), latent attention that cannot be built (0.16), the
    # per-tensor syncs of the grad norm and the packed RoPE's host reads
    mended = ["clip_grads.l2_norm_impl", "clip_grads.multi_tensor_scale_impl", "optimizer.multi_tensor_scale_impl",
              "rope_utils._apply_rotary_pos_emb_thd"]
    always = ("multi_tensor_ops_without_per_tensor_syncs", "packed_rotary_embedding_without_host_reads")
    if compat.megatron_minor() == 16:
        assert out["fixed"] == ("define_te_general_gemm_without_te", "latent_attention_without_te", *always)
        assert out["changed_by_fixes"] == ["moe_utils.te_general_gemm", *mended, "multi_latent_attention.HAVE_TE"]
        assert out["te_general_gemm"] is None
    else:
        assert out["fixed"] == always
        assert out["changed_by_fixes"] == mended


def test_foreach_multi_tensor_ops_equal_the_closed_form_without_a_host_read() -> None:
    """The grad norm and scale that replace Megatron's apex-free fallbacks: the norm of many tensors
    (fp32 and bf16, one empty) equals sqrt(Σ x²) in fp64 within fp32 rounding, with no device→host
    read (``aten::_local_scalar_dense``) on the way; scaling in place and into other tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ScalarReads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator) for shape in ((7, 3), (129,), (0,), (2, 2, 2))]
    tensors.append(torch.randn(33, generator=generator).bfloat16())
    exact = sum(float((t.double() ** 2).sum()) for t in tensors) ** 0.5
    with ScalarReads():
        norm, _ = compat.foreach_l2_norm(2048, torch.zeros(1), [tensors[:3], tensors[3:]], False)
    assert ScalarReads.count == 0 and norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(float(norm) - exact) <= 1e-6 * exact
    assert float(compat.foreach_l2_norm(2048, torch.zeros(1), [[]], False)[0]) == 0.0

    sources = [t.clone() for t in tensors[:3]]
    targets = [torch.empty_like(t) for t in sources]
    compat.foreach_scale(2048, torch.zeros(1), [sources, targets], 0.25)
    assert all(torch.equal(t, s * 0.25) for s, t in zip(sources, targets))
    compat.foreach_scale(2048, torch.zeros(1), [sources, sources], 0.5)
    assert all(torch.equal(scaled, original * 0.5) for original, scaled in zip(tensors[:3], sources))


def test_tensor_parallel_with_sequence_parallel_matches_single_rank(reference) -> None:
    ranks = run_gloo_world(
        _train_step_rank, 2, tg.Layout(tp=2), reference["checkpoint"], False,
        timeout=WORLD_TIMEOUT_S,
    )
    assert [out["tp_rank"] for out in ranks] == [0, 1]
    for out in ranks:
        assert out["sequence_parallel"] is True
        assert_rng_streams_seeded(out)  # TP ranks get distinct tensor-parallel streams
        assert rel_diff(out["loss"], reference["loss"]) <= REL_TOL
        assert rel_diff(out["grad_norm"], reference["grad_norm"]) <= REL_TOL
        for name in ("embedding_grad", "final_norm_grad"):
            diff = (out[name] - reference[name]).norm().item()
            assert diff <= REL_TOL * reference[name].norm().item(), name


def test_expert_parallel_matches_single_rank(reference) -> None:
    ranks = run_gloo_world(
        _train_step_rank, 2, tg.Layout(ep=2), reference["checkpoint"], False,
        timeout=WORLD_TIMEOUT_S,
    )
    assert [out["ep_rank"] for out in ranks] == [0, 1]
    for out in ranks:
        assert_rng_streams_seeded(out)  # EP ranks get distinct expert streams
        assert rel_diff(out["loss"], reference["loss"]) <= REL_TOL
        # every EP rank ran the full batch, so its dense gradients equal the single-rank ones
        emb_diff = (out["embedding_grad"] - reference["embedding_grad"]).norm().item()
        assert emb_diff <= REL_TOL * reference["embedding_grad"].norm().item()


def test_pipeline_parallel_schedule_matches_single_rank(reference) -> None:
    first_stage, last_stage = run_gloo_world(
        _pipeline_rank, 2, reference["checkpoint"], timeout=WORLD_TIMEOUT_S
    )
    assert first_stage == []  # only the last stage computes losses
    assert len(last_stage) == 2
    assert rel_diff(last_stage[0], reference["loss"]) <= REL_TOL
    assert rel_diff(last_stage[1], reference["loss_batch1"]) <= REL_TOL


def test_router_replay_reproduces_recorded_routing() -> None:
    [out] = run_gloo_world(_router_replay_rank, 1, timeout=WORLD_TIMEOUT_S)
    assert out["same_max_abs_diff"] == 0.0
    assert out["other_max_abs_diff"] > 1e-3
    assert out["router_grad_norm"] > 0.0
