"""The sorted MoE token dispatch (``model.moe_dispatch: sorted``, the local spec's default) against
Megatron's dispatchers (``megatron``): one optimizer step from the same weights gives the same
loss, grad norm and updated parameters (fp32, within summation order) at TP=2 with sequence
parallel, EP=2 and PP=2, with R3 replay and packing on, two losses in each world and an expert
that receives no token in one layer; one MoE layer's forward and backward reads nothing on the host
at EP=1 (TP=2) and, at EP=2, only the all-to-all's split sizes Megatron reads as well; configurations
it does not cover are refused by name."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world

TIMEOUT = 240
RTOL = 1e-6
LOSSES = ["bpo", "grpo"]
IDLE_EXPERT = 3  # receives no token in the last MoE layer
# Adam's first step divides each gradient by its own magnitude (plus eps): where a gradient entry
# is about 1e-8 (the default eps), a summation-order difference of 1e-11 moves its update by
# percents. TP=2 sums an expert's k rows of a token before the reduce-scatter, Megatron's after it;
# eps=1e-3 keeps the update's sensitivity to such differences at lr/eps of them.
ADAM_EPS = 1e-3


def _actor(dispatch: str, layout: dict, loss: str, **model):
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings
    from bpo_megatron.trainer.spec import TrainerSpec

    return TrainerSpec(
        hf=th.tiny_moe(),
        parallel=ParallelConfig(tp=layout.get("tp", 1), pp=layout.get("pp", 1), ep=layout.get("ep", 1)),
        model=ModelOptions(routing_replay=True, params_dtype="fp32", moe_dispatch=dispatch, **model),
        loss=loss,
        optimizer=OptimizerSettings(lr=1e-3, grad_clip=1.0, eps=ADAM_EPS),
        trainer=TrainerConfig(micro_batch_size=2, max_tokens_per_micro_batch=24),  # packed
    ).build()


def _samples():
    """Replayed routing in which the last MoE layer never picks :data:`IDLE_EXPERT`."""
    hf = th.tiny_moe()
    gen = torch.Generator().manual_seed(7)
    others = torch.tensor([e for e in range(hf.num_experts) if e != IDLE_EXPERT])
    out = []
    for s in th.make_samples(8, seed=1, routing=True):
        routed = s.routed_experts.clone()
        scores = torch.rand(routed.shape[0], len(others), generator=gen)
        routed[:, -1] = others[scores.argsort(dim=-1)[:, : hf.num_experts_per_tok]]
        out.append(s.__class__(**{**vars(s), "routed_experts": routed}))
    return out


def _layer_syncs(actor) -> dict[str, int]:
    """Host reads of one MoE layer's forward and backward on random tokens (this rank's sequence
    shard), the layer's dispatcher class by name."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from bpo_megatron.bench.ops import _count

    layer = next(m for m in actor.model.modules() if isinstance(m, MoELayer))
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 1, layer.config.hidden_size, generator=gen, requires_grad=True)
    weights = torch.randn(6, 1, layer.config.hidden_size, generator=gen)

    def forward_backward():
        output, _ = layer(hidden)
        (output * weights).sum().backward()

    counts = _count(forward_backward)
    return {"dispatcher": type(layer.token_dispatcher).__name__,
            **{key: counts[key] for key in ("scalar_reads", "data_shaped", "tolist_cpu")}}


def _idle_expert_params(actor) -> list[str]:
    """Names of this rank's parameters of :data:`IDLE_EXPERT` in the last layer (pipeline stages
    and expert-parallel ranks number layers and experts locally)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [f"{name}.experts.local_experts.{layer.local_expert_indices.index(IDLE_EXPERT)}.{param}"
            for name, layer in actor.model.named_modules()
            if isinstance(layer, MoELayer) and layer.layer_number == actor.hf.num_hidden_layers
            and IDLE_EXPERT in layer.local_expert_indices
            for param in ("linear_fc1.weight", "linear_fc2.weight")]


def _both_ways(directory: str, layout: dict) -> dict:
    """On every rank, per loss: Megatron's dispatch steps from fresh weights (saved first), the
    sorted dispatch loads them and steps; one MoE layer's host reads of each (first loss)."""
    samples = _samples()
    results = {}
    for loss in LOSSES:
        got = {}
        for dispatch in ("megatron", "sorted"):
            actor = _actor(dispatch, layout, loss)
            if dispatch == "megatron":
                actor.save(f"{directory}/{loss}")
                got["initial"] = th.flat_params(actor)
                got["idle"] = _idle_expert_params(actor)
            else:
                actor.load(f"{directory}/{loss}")
            got[f"{dispatch}_metrics"] = actor.train_step(samples)
            got[f"{dispatch}_params"] = th.flat_params(actor)
            if loss == LOSSES[0]:
                got[f"{dispatch}_syncs"] = _layer_syncs(actor)
            if layout.get("ep", 1) > 1 and dispatch == "sorted":  # while its process groups exist
                results["allgather_refused"] = _refusal(actor.parallel, dict(moe_token_dispatcher="allgather"))
            actor.close()
        results[loss] = got
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check_steps(results: list[dict], name: str) -> None:
    assert results
    assert any(per_loss[loss]["idle"] for per_loss in results for loss in LOSSES), name
    for rank, per_loss in enumerate(results):
        for loss in LOSSES:
            got = per_loss[loss]
            where = f"{name} rank {rank} {loss}"
            for key in ("loss", "grad_norm"):
                a, b = got["sorted_metrics"][key], got["megatron_metrics"][key]
                assert _rel(a, b) <= RTOL, (where, key, a, b)
            assert got["sorted_metrics"]["num_tokens"] == got["megatron_metrics"]["num_tokens"], where
            assert list(got["sorted_params"]) == list(got["megatron_params"]), where  # same names
            for key, ref in got["megatron_params"].items():
                new = got["sorted_params"][key]
                torch.testing.assert_close(new, ref, rtol=RTOL, atol=1e-7, msg=f"{where} {key}")
                # Adam's first step moves every weight by up to lr: compare the update itself
                # (1e-3 of it: one rounding of a weight near 1 is 2e-4 of a 6e-4 update)
                scale = (ref - got["initial"][key]).abs().max().clamp_min(1e-12)
                assert (new - ref).abs().max() / scale <= 1e-3, (where, key)
            # no tokens, no gradient: Adam's step is zero and only the decoupled weight decay
            # scales the idle expert's weights, by the same factor everywhere
            for key in got["idle"]:
                ratio = got["sorted_params"][key] / got["initial"][key]
                torch.testing.assert_close(ratio, torch.full_like(ratio, float(ratio.flatten()[0])),
                                           rtol=1e-6, atol=1e-7, msg=f"{where} {key}")


LAYOUTS = {  # name -> (layout, the sorted dispatcher it selects)
    "tp2_sp": (dict(tp=2), "SortedTokenDispatcher"),
    "ep2": (dict(ep=2), "SortedAlltoAllTokenDispatcher"),
    "pp2": (dict(pp=2), "SortedTokenDispatcher"),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sorted_dispatch_steps_like_megatrons(tmp_path, name):
    """World size 2, R3 replay, packing, BPO and GRPO: the same step as Megatron's dispatch; an
    idle expert gets no update either way; the host reads of one MoE layer, forward and backward."""
    layout, dispatcher = LAYOUTS[name]
    results = run_gloo_world(_both_ways, 2, str(tmp_path), layout, timeout=TIMEOUT)
    _check_steps(results, name)
    for rank, per_loss in enumerate(results):
        sorted_syncs, megatron_syncs = per_loss["bpo"]["sorted_syncs"], per_loss["bpo"]["megatron_syncs"]
        assert sorted_syncs["dispatcher"] == dispatcher, (name, rank, sorted_syncs)
        assert megatron_syncs["dispatcher"] == "MoEAlltoAllTokenDispatcher", (name, rank, megatron_syncs)
        # no masked_select (Megatron 0.16's permute selects rows with it; 0.19's sorts the whole
        # [experts, tokens] map), no scalar read
        assert sorted_syncs["data_shaped"] == sorted_syncs["scalar_reads"] == 0, (name, rank, sorted_syncs)
        if layout.get("ep", 1) == 1:  # nothing reaches the host, Megatron copies its counts there
            assert sorted_syncs["tolist_cpu"] == 0 and megatron_syncs["tolist_cpu"] > 0, (name, rank, per_loss)
        else:  # the all-to-all's split sizes, Megatron's own copy
            assert sorted_syncs["tolist_cpu"] == megatron_syncs["tolist_cpu"] > 0, (name, rank, per_loss)
            assert "'allgather' dispatcher at expert parallelism 2" in per_loss["allgather_refused"], per_loss
            assert "model.moe_dispatch=megatron" in per_loss["allgather_refused"], per_loss


def _refusal(parallel, model: dict, **config) -> str:
    """The error building the tiny MoE's first MoE layer with the sorted dispatch raises, with
    ``model`` options and ``config`` fields replaced ('built': none), in Megatron's process groups
    of ``parallel``."""
    from dataclasses import replace
    from functools import partial

    from megatron.core.transformer.spec_utils import build_module

    from bpo_megatron.models import ModelOptions
    from bpo_megatron.models.megatron_model import layer_spec, transformer_config
    from bpo_megatron.models.sorted_dispatch import SortedDispatchMoELayer

    hf = th.tiny_moe()
    options = ModelOptions(params_dtype="fp32", **model)
    base = transformer_config(hf, parallel, options)
    config = replace(base, **config)
    mlp = layer_spec(hf, base, dispatch=options.moe_dispatch).layer_specs[0].submodules.mlp
    try:
        if isinstance(mlp, partial):  # Megatron 0.19 describes the MoE layer as a partial, 0.16 as a ModuleSpec
            assert mlp.func is SortedDispatchMoELayer
            mlp(config=config)
        else:
            assert mlp.module is SortedDispatchMoELayer
            build_module(mlp, config=config)
    except ValueError as exc:
        return str(exc)
    return "built"


def _refusals() -> dict[str, str]:
    from megatron.core import parallel_state as ps

    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.parallel.state import initialize_parallel

    parallel = ParallelConfig()
    initialize_parallel(parallel, seed=0)
    try:
        return {"capacity": _refusal(parallel, {}, moe_expert_capacity_factor=1.0),
                "padding": _refusal(parallel, {}, moe_expert_capacity_factor=1.0,
                                    moe_pad_expert_input_to_capacity=True),
                "allgather_ep1": _refusal(parallel, dict(moe_token_dispatcher="allgather"))}
    finally:
        ps.destroy_model_parallel()


def test_unsupported_configurations_are_refused():
    """Token dropping and padding are refused by name with the option that keeps Megatron's
    dispatch; the all-gather dispatcher at EP=1 is covered (the all-gather one at EP=2 is refused
    in the EP=2 world above)."""
    (got,) = run_gloo_world(_refusals, 1, timeout=TIMEOUT)
    assert "moe_expert_capacity_factor (token dropping)" in got["capacity"], got
    assert "moe_pad_expert_input_to_capacity" in got["padding"], got
    assert all("model.moe_dispatch=megatron" in got[k] for k in ("capacity", "padding")), got
    assert got["allgather_ep1"] == "built", got


def test_permute_by_expert_orders_rows_as_megatrons_permute():
    """The sorted permutation against Megatron's ``permute`` on the same routing (an expert with
    no token included): the same rows, probabilities and token of each row; the counts on the
    device; the combine restores the prob-weighted sum per token."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from bpo_megatron.models.sorted_dispatch import permute_by_expert, top_k_routing

    gen = torch.Generator().manual_seed(0)
    tokens, experts, topk, hidden = 11, 6, 3, 5
    ids = torch.rand(tokens, experts - 1, generator=gen).argsort(dim=1)[:, :topk]  # expert 5 idle
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.rand(tokens, experts, generator=gen) * routing_map
    x = torch.randn(tokens, hidden, generator=gen)

    want_rows, want_probs, want_tokens = permute(x, routing_map, probs=probs, num_out_tokens=tokens * topk)[:3]
    rows, row_probs, token_of_row, counts = permute_by_expert(x, *top_k_routing(routing_map, probs, topk), experts)
    assert torch.equal(token_of_row, want_tokens)
    assert torch.equal(rows, want_rows) and torch.equal(row_probs, want_probs)
    assert counts.tolist() == routing_map.sum(0).tolist() and counts[-1] == 0
    combined = unpermute(rows * row_probs[:, None], token_of_row, restore_shape=x.shape)
    torch.testing.assert_close(combined, probs.sum(1, keepdim=True) * x, rtol=1e-6, atol=1e-6)
