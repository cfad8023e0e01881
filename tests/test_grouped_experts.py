"""Grouped-GEMM experts (the local spec's default: one stacked parameter per projection and layer)
against Megatron's SequentialMLP: one optimizer step from the same weights gives the same loss, grad
norm and updated parameters (fp32, within summation order), at EP=2, TP=2 with sequence parallel
(expert TP 2) and PP=2, with R3 replay and packing on; the sharded state dict is SequentialMLP's,
entry for entry, and checkpoints with Adam's moments go from one to the other and back bit for bit;
the same weights export the same HF names and bytes. The parameter count of the kit model's shape
and the ATen ops a MoE layer issues have budgets (``bpo-megatron bench ops``)."""

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


def _sharded_layout(actor) -> list[tuple]:
    """Every entry of the model's sharded state dict, plain and with ``singleton_local_shards``,
    factories built: key, shapes, global offset, fragmentation, replica id and a fingerprint of the
    data (objects: key, offset, replica id)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from bpo_megatron.weights.checksums import fingerprint

    layout = []
    for singleton in (False, True):
        state = actor.model.sharded_state_dict(prefix="", metadata={"singleton_local_shards": singleton})
        apply_factories(state)
        for item in nested_values(state):
            if isinstance(item, ShardedTensor):
                layout.append((singleton, item.key, item.local_shape, item.global_shape, item.global_offset,
                               item.axis_fragmentations, item.replica_id, item.prepend_axis_num,
                               fingerprint(item.data)))
            else:
                layout.append((singleton, item.key, item.global_shape, item.global_offset, item.replica_id))
    return sorted(layout, key=repr)


def _moments(actor) -> dict[str, torch.Tensor]:
    """Adam's moments of every parameter, the stacked experts' expert by expert under
    SequentialMLP's names (the fp32 optimizer of the CPU path keys its state by parameter)."""
    from bpo_megatron.models.grouped_experts import per_expert
    from bpo_megatron.trainer.optimizer_state import MOMENTS, inner_optimizers

    state = {param: entry for inner in inner_optimizers(actor.optimizer) for param, entry in inner.optimizer.state.items()}
    params = list(actor.model.named_parameters())
    return {f"{moment}:{name}": tensor.clone()
            for moment in MOMENTS
            for name, tensor in per_expert(actor.model, [(n, state[p][moment]) for n, p in params])}


def _export(actor) -> list[tuple[str, str]]:
    """The weight sync's export on this rank (rank 0 gets it all): each Hugging Face name and the
    fingerprint of its bytes, in export order."""
    from bpo_megatron.weights.checksums import fingerprint

    return [(name, fingerprint(tensor)) for bucket in actor.export_weights(1 << 16) for name, tensor in bucket]


def _gradient_reduction(actor) -> dict[str, tuple]:
    """Per parameter (the stacked experts' expert by expert, under SequentialMLP's names): the
    attributes Megatron's DDP, optimizer, grad norm and TP code read (tensors and DDP's own
    bookkeeping aside; a stacked parameter's ``partition_dim`` counted without its expert axis),
    whether DDP keeps its gradient with the expert-parallel buffers, and the ranks it is reduced over."""
    import torch.distributed as dist

    from bpo_megatron.models.grouped_experts import per_expert

    reduced = {}
    for chunk in actor.ddp:
        for expert, groups in ((False, chunk.bucket_groups), (True, chunk.expert_parallel_bucket_groups)):
            for group in groups:
                ranks = tuple(dist.get_process_group_ranks(group.data_parallel_group))
                reduced.update({param: (expert, ranks) for param in group.params})
    records = []
    for name, param in actor.model.named_parameters():
        attributes = {k: v for k, v in vars(param).items()
                      if not torch.is_tensor(v) and k not in ("grad_added_to_main_grad",)}
        if param.dim() == 3:  # stacked: [experts, out, in]
            attributes["partition_dim"] -= 1
        records.append((sorted(attributes.items()), *reduced[param]))
    # each parameter's record index, spread over its experts' names like the parameter itself
    index = [(name, torch.full((param.shape[0] if param.dim() == 3 else 1,), i))
             for i, (name, param) in enumerate(actor.model.named_parameters())]
    return {name: records[int(i.flatten()[0])] for name, i in per_expert(actor.model, index)}


def _both_ways(directory: str, layout: dict, losses: list[str], max_tokens: int, skip_expert: int | None) -> dict:
    """On every rank: per loss, SequentialMLP steps from fresh weights (saved first), the grouped
    experts load them and step, SequentialMLP loads the grouped model's checkpoint. Returns both
    steps' metrics and parameters, and the reloaded parameters. For the first loss also: both fresh
    models' sharded state dicts; after the steps, each checkpoint (with Adam's moments) loaded into
    the other module, and the HF export of the same weights from each."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from bpo_megatron.models.grouped_experts import GroupedSequentialMLP

    samples = _samples(skip_expert)
    results = {}
    for loss in losses:
        got = {}
        first = loss == losses[0]
        actor = _actor("sequential", layout, loss, max_tokens)
        kinds = {type(m) for m in actor.model.modules() if isinstance(m, SequentialMLP)}
        assert kinds <= {SequentialMLP}, kinds
        if first:
            got["seq_layout"] = _sharded_layout(actor)
            got["seq_reduction"] = _gradient_reduction(actor)
        actor.save(f"{directory}/{loss}-initial")
        got["initial"] = th.flat_params(actor)
        got["seq_metrics"] = actor.train_step(samples)
        got["seq_params"] = th.flat_params(actor)
        if first:
            got["seq_moments"] = _moments(actor)
            actor.save(f"{directory}/{loss}-sequential")
        actor.close()

        actor = _actor("grouped", layout, loss, max_tokens)
        got["grouped_modules"] = sum(isinstance(m, GroupedSequentialMLP) for m in actor.model.modules())
        if first:
            got["grp_layout"] = _sharded_layout(actor)  # fresh, from the same seed
            got["grp_reduction"] = _gradient_reduction(actor)
        actor.load(f"{directory}/{loss}-initial")
        got["grouped_initial"] = th.flat_params(actor)
        got["grp_metrics"] = actor.train_step(samples)
        got["grp_params"] = th.flat_params(actor)
        actor.save(f"{directory}/{loss}-grouped")
        if first:
            got["grp_moments"] = _moments(actor)
            got["grp_export"] = _export(actor)
            actor.load(f"{directory}/{loss}-sequential")
            got["grp_from_seq"] = (th.flat_params(actor), _moments(actor))
        actor.close()

        actor = _actor("sequential", layout, loss, max_tokens)
        actor.load(f"{directory}/{loss}-grouped")
        got["reloaded"] = th.flat_params(actor)
        if first:
            got["reloaded_moments"] = _moments(actor)
            got["seq_export"] = _export(actor)  # the grouped model's weights, exported by SequentialMLP
        actor.close()
        results[loss] = got
    return results


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert list(got) == list(want), where
    for key, value in want.items():
        assert torch.equal(got[key], value), (where, key)


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
            if "seq_layout" in got:
                # the sharded state dict is SequentialMLP's entry for entry (keys, shapes, offsets,
                # replica ids, the data of the same seed's weights), plain and singleton
                assert got["grp_layout"] == got["seq_layout"], where
                # the same attributes, gradient buffers and reduction groups, expert by expert
                assert got["grp_reduction"] == got["seq_reduction"], where
                # checkpoints with Adam's moments load bit for bit both ways
                _equal(got["grp_from_seq"][0], got["seq_params"], f"{where} sequential -> grouped")
                _equal(got["grp_from_seq"][1], got["seq_moments"], f"{where} sequential -> grouped moments")
                _equal(got["reloaded_moments"], got["grp_moments"], f"{where} grouped -> sequential moments")
                # the same weights export the same HF names and bytes (the weight sync's fingerprints)
                assert got["grp_export"] == got["seq_export"], where
                assert bool(got["grp_export"]) == (rank == 0), where
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


def _reductions(layout: dict) -> dict:
    """This rank's :func:`_gradient_reduction` of both expert modules, freshly built."""
    out = {}
    for gemm in ("sequential", "grouped"):
        actor = _actor(gemm, layout, "bpo", 24)
        out[gemm] = _gradient_reduction(actor)
        actor.close()
    return out


def test_expert_gradients_reduce_over_the_expert_data_parallel_group_as_before():
    """World 4 at EP=2 (expert data parallelism 2, which the two-rank layouts above lack): every
    stacked parameter carries its experts' attributes and sits in DDP's expert-parallel buffers,
    reduced over the same expert-data-parallel ranks as SequentialMLP's weights; dense ones over
    all four."""
    ranks = run_gloo_world(_reductions, 4, dict(ep=2), timeout=TIMEOUT)
    for rank, got in enumerate(ranks):
        assert got["grouped"] == got["sequential"], rank
        experts = {record[1:] for name, record in got["grouped"].items() if ".local_experts." in name}
        assert experts == {(True, (rank % 2, rank % 2 + 2))}, (rank, experts)


def test_unsupported_configurations_are_refused():
    """Expert biases are refused by name, not computed wrongly."""
    results = run_gloo_world(_build_with_bias, 1, timeout=TIMEOUT)
    assert "add_bias_linear" in results[0], results[0]


def _build_with_bias() -> str:
    from dataclasses import replace

    from megatron.core import parallel_state as ps

    from bpo_megatron.models import ModelOptions
    from bpo_megatron.models.grouped_experts import GroupedSequentialMLP
    from bpo_megatron.models.megatron_model import layer_spec, transformer_config
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


# Per decoder layer of the kit model's shape (Qwen3-MoE, QK-norm, no biases): the two block norms,
# QKV, the q and k norms, the attention output and the router, plus the experts' weights; per model
# the embedding, the final norm and the untied output layer.
LAYER_PARAMETERS = 7
MODEL_PARAMETERS = 3
OPS_PER_MOE_LAYER = 400  # ATen ops of one MoE layer of a micro-batch, forward and backward, all fast paths


def _ops_and_parameters() -> dict:
    """On a world-size-1 rank: ``bench ops``' counts with every fast path (1 and 2 layers of the
    kit model's shape), and the parameter tensors of the kit model itself (16 layers) built with
    either expert module."""
    from megatron.core import parallel_state as ps

    from bpo_megatron.bench.ops import MODEL, measure_with_layer
    from bpo_megatron.models import HFModelConfig, ModelOptions, build_gpt_model
    from bpo_megatron.models.options import fast_path_options
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.parallel.state import initialize_parallel

    out = {"counts": measure_with_layer(fast_path_options(on=True), {**MODEL, "num_hidden_layers": 1}, 1, 128)}
    initialize_parallel(ParallelConfig(), seed=0)
    hf = HFModelConfig.load({**MODEL, "num_hidden_layers": 16})
    for gemm in ("grouped", "sequential"):
        model = build_gpt_model(hf, ParallelConfig(), ModelOptions(params_dtype="fp32", expert_gemm=gemm))
        out[gemm] = len(list(model.parameters()))
    ps.destroy_model_parallel()
    out["experts"] = hf.num_experts
    return out


@pytest.fixture(scope="module")
def ops_and_parameters() -> dict:
    return run_gloo_world(_ops_and_parameters, 1, timeout=TIMEOUT)[0]


def test_the_kit_model_has_two_expert_parameters_per_layer(ops_and_parameters):
    """16 layers of 32 experts: 1,139 parameter tensors with SequentialMLP's two per expert, 147
    with the stacked experts' two per layer (each a gradient hook and an optimizer entry less)."""
    got, experts = ops_and_parameters, ops_and_parameters["experts"]
    assert got["sequential"] == MODEL_PARAMETERS + 16 * (LAYER_PARAMETERS + 2 * experts) == 1_139
    assert got["grouped"] == MODEL_PARAMETERS + 16 * (LAYER_PARAMETERS + 2) == 147
    counts = got["counts"]
    assert counts["micro_batch"]["parameters"] == MODEL_PARAMETERS + LAYER_PARAMETERS + 2
    assert counts["layer"]["parameters"] == LAYER_PARAMETERS + 2


def test_a_moe_layer_issues_at_most_its_budget_of_ops_and_reads_nothing(ops_and_parameters):
    """``bpo-megatron bench ops``' per-layer row with every fast path: forward and backward of one
    MoE layer of a micro-batch (R3 replay, packed) within :data:`OPS_PER_MOE_LAYER` ATen ops, two
    grouped GEMMs each way, no host read."""
    layer = ops_and_parameters["counts"]["layer"]
    assert layer["ops"] <= OPS_PER_MOE_LAYER, layer
    assert layer["grouped_mm"] == 6  # fc1 and fc2 forward, and their input and weight gradients
    assert layer["scalar_reads"] == layer["data_shaped"] == layer["tolist_cpu"] == 0, layer
