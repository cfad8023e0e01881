"""Grouped-GEMM experts (the local spec's default) against Megatron's SequentialMLP: one optimizer
step from the same weights gives the same loss, grad norm and updated parameters (fp32, within
summation order), at EP=2, TP=2 with sequence parallel and PP=2, with R3 replay and packing on; the
parameter names and checkpoints are SequentialMLP's (a checkpoint goes from one to the other and
back)."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world

TIMEOUT = 180
RTOL = 1e-6


def _actor(expert_gemm: str, layout: dict, loss: str, max_tokens: int):
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings
    from bpo_megatron.trainer.spec import TrainerSpec

    return TrainerSpec(
        hf=th.tiny_moe(),
        parallel=ParallelConfig(tp=layout.get("tp", 1), pp=layout.get("pp", 1), ep=layout.get("ep", 1)),
        model=ModelOptions(routing_replay=True, params_dtype="fp32", expert_gemm=expert_gemm),
        loss=loss,
        optimizer=OptimizerSettings(lr=1e-3, grad_clip=1.0),
        trainer=TrainerConfig(micro_batch_size=2, max_tokens_per_micro_batch=max_tokens),
    ).build()


def _samples(skip_expert: int | None):
    samples = th.make_samples(8, seed=1, routing=True)
    if skip_expert is None:
        return samples
    # replayed routing that never picks ``skip_expert``: it receives zero tokens in every layer
    hf = th.tiny_moe()
    gen = torch.Generator().manual_seed(7)
    others = torch.tensor([e for e in range(hf.num_experts) if e != skip_expert])
    out = []
    for s in samples:
        n = s.routed_experts.shape[0]
        scores = torch.rand(n, len(hf.moe_layers), len(others), generator=gen)
        routed = others[scores.argsort(dim=-1)[..., : hf.num_experts_per_tok]]
        out.append(s.__class__(**{**vars(s), "routed_experts": routed}))
    return out


def _both_ways(directory: str, layout: dict, losses: list[str], max_tokens: int, skip_expert: int | None) -> dict:
    """On every rank: per loss, SequentialMLP steps from fresh weights (saved first), the grouped
    experts load them and step, SequentialMLP loads the grouped model's checkpoint. Returns both
    steps' metrics and parameters, and the reloaded parameters."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from bpo_megatron.models.grouped_experts import GroupedSequentialMLP

    samples = _samples(skip_expert)
    results = {}
    for loss in losses:
        got = {}
        actor = _actor("sequential", layout, loss, max_tokens)
        kinds = {type(m) for m in actor.model.modules() if isinstance(m, SequentialMLP)}
        assert kinds <= {SequentialMLP}, kinds
        actor.save(f"{directory}/{loss}-initial")
        got["initial"] = th.flat_params(actor)
        got["seq_metrics"] = actor.train_step(samples)
        got["seq_params"] = th.flat_params(actor)
        actor.close()

        actor = _actor("grouped", layout, loss, max_tokens)
        got["grouped_modules"] = sum(isinstance(m, GroupedSequentialMLP) for m in actor.model.modules())
        actor.load(f"{directory}/{loss}-initial")
        got["grouped_initial"] = th.flat_params(actor)
        got["grp_metrics"] = actor.train_step(samples)
        got["grp_params"] = th.flat_params(actor)
        actor.save(f"{directory}/{loss}-grouped")
        actor.close()

        actor = _actor("sequential", layout, loss, max_tokens)
        actor.load(f"{directory}/{loss}-grouped")
        got["reloaded"] = th.flat_params(actor)
        actor.close()
        results[loss] = got
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check(results: list[dict], name: str, *, skip_expert: int | None = None) -> None:
    assert results
    for rank, per_loss in enumerate(results):
        for loss, got in per_loss.items():
            where = f"{name} rank {rank} {loss}"
            assert got["grouped_modules"] > 0, where
            # same parameter names (so the same checkpoints and converters), loaded exactly
            assert list(got["seq_params"]) == list(got["grp_params"]) == list(got["initial"]), where
            for key, value in got["initial"].items():
                assert torch.equal(got["grouped_initial"][key], value), (where, key)
            for key in ("loss", "grad_norm"):
                a, b = got["grp_metrics"][key], got["seq_metrics"][key]
                assert _rel(a, b) <= RTOL, (where, key, a, b)
            assert got["grp_metrics"]["num_tokens"] == got["seq_metrics"]["num_tokens"], where
            for key, seq in got["seq_params"].items():
                grp = got["grp_params"][key]
                # Adam's first step moves every weight by ~lr, so compare the update itself, up to
                # the rounding of the updated weight (one ulp of a norm weight near 1 is 1.2e-4 lr)
                scale = (seq - got["initial"][key]).abs().max().clamp_min(1e-12)
                ulp = torch.finfo(seq.dtype).eps * seq.abs().max()
                err = ((grp - seq).abs().max() - ulp).clamp_min(0) / scale
                assert err <= 1e-5, (where, key, float(err))
                torch.testing.assert_close(grp, seq, rtol=RTOL, atol=1e-7, msg=f"{where} {key}")
                # the grouped model's checkpoint, loaded into SequentialMLP: bit for bit
                assert torch.equal(got["reloaded"][key], grp), (where, key)
            if skip_expert is not None:
                # no tokens, no gradient: Adam's step is zero and only the decoupled weight decay
                # scales the weights (by the same factor everywhere)
                idle = [k for k in got["grp_params"] if f"local_experts.{skip_expert}." in k]
                assert idle, where
                for key in idle:
                    ratio = got["grp_params"][key] / got["initial"][key]
                    torch.testing.assert_close(ratio, torch.full_like(ratio, float(ratio.flatten()[0])),
                                               rtol=1e-6, atol=1e-7, msg=f"{where} {key}")


LAYOUTS = {  # name -> (world size, layout)
    "ep2": (2, dict(ep=2)),
    "tp2_sp": (2, dict(tp=2)),
    "pp2": (2, dict(pp=2)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_grouped_experts_step_like_sequential(tmp_path, name):
    """R3 replay, packing (≤ 24 tokens a micro-batch), BPO: same step at each layout."""
    world, layout = LAYOUTS[name]
    results = run_gloo_world(_both_ways, world, str(tmp_path), layout, ["bpo"], 24, None, timeout=TIMEOUT)
    _check(results, name)


def test_grouped_experts_every_loss_and_an_idle_expert(tmp_path):
    """World size 1, packing on, one step per registered loss (they differ only in per-token
    weights); replayed routing leaves expert 3 without tokens: it gets no update either way."""
    from bpo_megatron.losses import POLICY_LOSSES

    losses = sorted(POLICY_LOSSES)
    assert {"bpo", "grpo"} <= set(losses)
    results = run_gloo_world(_both_ways, 1, str(tmp_path), {}, losses, 24, 3, timeout=TIMEOUT)
    _check(results, "world1", skip_expert=3)


def test_unsupported_configurations_are_refused():
    """Expert biases are refused by name, not computed wrongly."""
    results = run_gloo_world(_build_with_bias, 1, timeout=TIMEOUT)
    assert "add_bias_linear" in results[0], results[0]


def _build_with_bias() -> str:
    from dataclasses import replace

    from megatron.core import parallel_state as ps

    from bpo_megatron.models import ModelOptions
    from bpo_megatron.models.grouped_experts import GroupedSequentialMLP
    from bpo_megatron.models.qwen3 import layer_spec, transformer_config
    from bpo_megatron.parallel import ParallelConfig

    ps.initialize_model_parallel()
    try:
        hf = th.tiny_moe()
        config = transformer_config(hf, ParallelConfig(), ModelOptions(params_dtype="fp32"))
        spec = layer_spec(hf, config)
        mlp = spec.layer_specs[0].submodules.mlp  # a ModuleSpec (Megatron 0.16) or a partial (0.19)
        experts = (mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules).experts
        built = experts.func if hasattr(experts, "keywords") else experts.module
        assert built is GroupedSequentialMLP
        submodules = experts.keywords["submodules"] if hasattr(experts, "keywords") else experts.submodules
        config = replace(config, add_bias_linear=True)
        try:
            GroupedSequentialMLP(4, config, submodules, pg_collection=_pg_collection())
        except ValueError as exc:
            return str(exc)
        return "built"
    finally:
        ps.destroy_model_parallel()


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def test_bench_ops_counts_ops_and_host_syncs():
    """The op-count benchmark's counters: ATen ops, scalar reads, data-shaped ops, tolist/cpu."""
    from bpo_megatron.bench.ops import _count

    x = torch.arange(6.0).reshape(2, 3)

    def work():
        y = x @ x.T
        y.sum().item()
        torch.nonzero(y > 3)
        x[x > 2]
        y.tolist()
        y.cpu()

    before = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "cpu", "numpy")}
    counts = _count(work)
    assert counts["mm"] == 1
    assert counts["scalar_reads"] == 1
    assert counts["data_shaped"] >= 2
    assert counts["tolist_cpu"] == 2
    assert counts["ops"] >= 6
    assert {name: torch.Tensor.__dict__.get(name) for name in before} == before  # patches undone
