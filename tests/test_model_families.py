"""One contract for every model family of :data:`bpo_megatron.models.families.FAMILIES`, against
transformers' own model.

Parametrized over the registry, so a new entry is tested by construction (and fails here until its
test data, ``tests/family_kit.py``, is written): its tiny config onto the family-neutral description
and Megatron's ``TransformerConfig``; the Hugging Face names and shapes against what transformers
writes; conversion at TP=2/EP=2 or PP=2 giving transformers' logits at fp32 and exporting every
tensor back bit for bit; the embedded engine's weight updates by on-disk names; for MoE families,
the trainer's router choosing what the engine captured and R3 training at TP=2, EP=2 and both equal
to one rank; the weight sync's names from a sharded trainer; the planner's per-rank parameters
against the built model; the recipe's parameter count against transformers, ``plan`` and ``train
--check``. What only one family has (its refusals, latent attention, YaRN, group limits ...) is in
the family's own module (``tests/test_glm4_moe.py``, ``tests/test_deepseek_v3.py``,
``tests/test_models.py`` for Qwen3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_kit import (
    CASES,
    R3_LAYOUTS,
    ROOT,
    TIMEOUT,
    FamilyCase,
    assert_same_step,
    checkpoint_config,
    missing_test_data,
    r3_rank,
    rank_parameter_counts,
    sorted_experts,
    tiny_config_path,
)
from test_convert import _check_export, _check_megatron_logits, _live_export, _safetensors, _save

from bpo_megatron.convert import convert_hf_to_mcore
from bpo_megatron.convert.world import world_size_for
from bpo_megatron.models import FAMILIES, HFModelConfig, ModelOptions
from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.weights import HFWeightsReader, hf_tensor_shapes

MOE_FAMILIES = [name for name, family in FAMILIES.items() if family.moe]


def case_of(model_type: str) -> FamilyCase:
    if (missing := missing_test_data(model_type)) is not None:
        pytest.fail(missing)
    return CASES[model_type]


def _checkpoints() -> list[tuple[str, str]]:
    """(family, checkpoint) for every family; a family without test data keeps one entry, which fails."""
    return [(family, name) for family in FAMILIES for name in (CASES[family].checkpoints if family in CASES else [""])]


def _r3_layouts() -> list[tuple[str, str, dict]]:
    return [(family, layout_id, layout) for family in MOE_FAMILIES
            for layout_id, layout in {**R3_LAYOUTS, **(CASES[family].r3_layouts if family in CASES else {})}.items()]


def _required_fields() -> list[tuple[str, str]]:
    return [(name, field) for name, family in FAMILIES.items() for field in family.required]


def _megatron_builds(model_type: str) -> None:
    """Skip, with the package's own refusal, where the installed megatron-core does not build the family
    (CI's newest-megatron leg: latent attention)."""
    from bpo_megatron.models.megatron_model import check_megatron_builds

    try:
        check_megatron_builds(HFModelConfig.load(tiny_config_path(model_type)))
    except ValueError as refused:
        pytest.skip(str(refused))


def _engine_decodes(model_type: str) -> None:
    if not FAMILIES[model_type].embedded_decode:
        pytest.skip(f"{model_type} sets embedded_decode=False: the embedded engine does not serve it")


# ------------------------------------------------------------------------------- the registry
def test_every_registered_family_has_its_contract_test_data() -> None:
    missing = [message for family in FAMILIES if (message := missing_test_data(family)) is not None]
    assert not missing, "\n".join(missing)
    assert sorted(CASES) == sorted(FAMILIES), f"tests/family_kit.py CASES names no registered family: " \
                                              f"{sorted(set(CASES) - set(FAMILIES))}"


def test_a_family_without_test_data_is_told_what_to_add() -> None:
    message = missing_test_data("made_up_moe")
    assert message.startswith("model family 'made_up_moe' is registered in bpo_megatron/models/families.py FAMILIES "
                              "but its contract has no test data: add a FamilyCase entry in tests/family_kit.py CASES "
                              "and bpo_megatron/testing/configs/tiny_made_up_moe/config.json (")
    assert missing_test_data("glm4_moe") is None


# ----------------------------------------------------------------------------------- config
@pytest.mark.parametrize("family", FAMILIES)
def test_the_tiny_config_maps_onto_the_family_neutral_description(family: str) -> None:
    want = case_of(family).description
    hf = HFModelConfig.load(tiny_config_path(family))
    assert hf.model_type == family and hf.architecture == FAMILIES[family].architecture
    assert {name: getattr(hf, name) for name in want} == want
    # the export writes the family's own fields back, and they parse to the same description
    bare = HFModelConfig(**{f: getattr(hf, f) for f in hf.__dataclass_fields__ if f != "source"})
    assert HFModelConfig.load(bare.to_hf_dict()) == hf


@pytest.mark.parametrize("family, field", _required_fields(), ids=[f"{f}-{n}" for f, n in _required_fields()])
def test_a_missing_required_field_is_refused_naming_it(family: str, field: str) -> None:
    """transformers would fill the field in with its own default (for latent attention: DeepSeek-V3's own
    sizes, never this checkpoint's)."""
    raw = json.loads(tiny_config_path(family).read_text())
    del raw[field]
    with pytest.raises(ValueError, match=f"required field '{field}'"):
        HFModelConfig.load(raw)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_megatron_config_maps_the_description(family: str) -> None:
    from bpo_megatron.models import transformer_config

    want = case_of(family).megatron
    _megatron_builds(family)
    config = transformer_config(HFModelConfig.load(tiny_config_path(family)), ParallelConfig(),
                                ModelOptions(params_dtype="fp32"))
    assert {name: getattr(config, name) for name in want} == want


# ------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("family, name", _checkpoints(), ids=[f"{f}-{n}" for f, n in _checkpoints()])
def test_expected_names_and_shapes_are_what_transformers_writes(family_models, family: str, name: str) -> None:
    case_of(family)
    directory, _ = family_models.checkpoint(family, name)
    with HFWeightsReader(directory) as reader:
        written = {n: reader.shape(n) for n in reader.weight_map}
    assert hf_tensor_shapes(HFModelConfig.load(directory)) == written


@pytest.mark.parametrize("family, name", _checkpoints(), ids=[f"{f}-{n}" for f, n in _checkpoints()])
def test_conversion_gives_transformers_logits_and_exports_bit_for_bit(family_models, family: str, name: str,
                                                                     tmp_path) -> None:
    """Converted at the checkpoint's layout; loaded there and resharded into its other layouts, the
    Megatron model gives transformers' fp32 logits; exported, every tensor is the original's."""
    spec = case_of(family).checkpoints[name]
    _megatron_builds(family)
    hf_dir, ref = family_models.checkpoint(family, name)
    checkpoint = convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", parallel=ParallelConfig(**spec.layout),
                                     progress=False, timeout=TIMEOUT)
    for layout in (spec.layout, *spec.reloads):
        _check_megatron_logits(checkpoint, layout, world_size_for(ParallelConfig(**layout)), ref)
    export = spec.layout if spec.export_layout is None else spec.export_layout
    _check_export(checkpoint, tmp_path / "hf", hf_dir, ref, parallel=ParallelConfig(**export))


# ----------------------------------------------------------------------- engine, R3, sync
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_weight_updates_by_on_disk_names_reach_every_weight(family_models, family: str, tmp_path) -> None:
    """What a weight sync sends (the on-disk names: per-expert tensors, the routers' expert bias, the
    family's attention projections and norms) lands in the live engine, which then samples exactly as
    an engine started from those weights."""
    from safetensors.torch import load_file

    from bpo_megatron.rollout import GenerationRequest, SamplingParams
    from bpo_megatron.rollout.hf.engine import HFEngine

    case = case_of(family)
    _engine_decodes(family)
    first = next(iter(case.checkpoints))
    other, _ = _save(checkpoint_config(family, first), tmp_path / "other", seed=case.checkpoints[first].seed + 1000)
    new = load_file(other / "model.safetensors")
    engine = HFEngine(family_models.checkpoint(family)[0], capture_routing=FAMILIES[family].moe)
    assert engine.update_weights(iter(new.items())) == sum(t.numel() * t.element_size() for t in new.values())
    live = dict(engine.named_hf_weights())
    assert sorted(live) == sorted(new) and all(torch.equal(live[name], tensor) for name, tensor in new.items())
    requests = [GenerationRequest("q", (5, 9, 13), SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1))]
    fresh = HFEngine(other, capture_routing=FAMILIES[family].moe)
    for a, b in zip(engine.generate(requests), fresh.generate(requests), strict=True):
        assert torch.equal(a.response_tokens, b.response_tokens)
        assert (a.routed_experts is None) == (not FAMILIES[family].moe)
        if FAMILIES[family].moe:
            assert torch.equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_trainers_router_chooses_what_the_engine_captured(family_models, family: str) -> None:
    """Teacher-forced, Megatron's router (with the converted expert bias, group limits and scale
    where the family has them) picks exactly the experts the embedded engine captured at every
    position of every MoE layer; log π with the engine's routing replayed equals the engine's log μ;
    a router's expert bias is the checkpoint's (never trained, not even by the step)."""
    from safetensors.torch import load_file

    case_of(family)
    _megatron_builds(family)
    _engine_decodes(family)
    hf_dir, samples, got = family_models.r3_reference(family)
    positions = 0
    for sample, routing in zip(samples, got["free_routing"], strict=True):
        assert torch.equal(sorted_experts(routing), sorted_experts(sample.routed_experts))
        positions += sample.routed_experts.shape[0]
    assert positions == sum(s.tokens.numel() - 1 for s in samples)
    for sample, logprobs in zip(samples, got["replayed"], strict=True):
        torch.testing.assert_close(logprobs, sample.rollout_logprobs, rtol=0, atol=2e-5)
    hf = HFModelConfig.load(hf_dir)
    on_disk = load_file(hf_dir / "model.safetensors")
    want = [on_disk[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] for layer in hf.moe_layers
            if hf.router_expert_bias]
    assert len(got["bias"]) == len(want) and all(torch.equal(a, b) for a, b in zip(got["bias"], want))


@pytest.mark.parametrize("family, layout_id, layout", _r3_layouts(), ids=[f"{f}-{i}" for f, i, _ in _r3_layouts()])
def test_r3_training_at_tp2_and_ep2_equals_one_rank(family_models, family: str, layout_id: str, layout: dict) -> None:
    case_of(family)
    _megatron_builds(family)
    _engine_decodes(family)
    hf_dir, samples, ref = family_models.r3_reference(family)
    results = [r for r in run_gloo_world(r3_rank, 2, str(hf_dir), samples, layout, timeout=TIMEOUT) if r]
    assert results
    for got in results:
        assert_same_step(got, ref)
        for a, b in zip(got["free_routing"], ref["free_routing"], strict=True):
            assert torch.equal(sorted_experts(a), sorted_experts(b))
        assert all(torch.equal(a, b) for a, b in zip(got["bias"], ref["bias"], strict=True))  # never trained
    moved = max((a - b).abs().max().item() for a, b in zip(ref["after"], ref["replayed"]))
    assert moved > 1e-3, "the step must change log π for the comparison to cover it"


def _sharded(family: str) -> dict[str, int]:
    return {"tp": 2, "ep": 2} if FAMILIES[family].moe else {"tp": 2}


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_sync_streams_every_hf_tensor_from_a_sharded_trainer(family_models, family: str) -> None:
    """The trainer's weight export (what a weight sync sends) at TP=2 (with EP=2 for MoE) yields every
    on-disk tensor of the checkpoint once, bit for bit, on every rank, layer by layer."""
    case = case_of(family)
    _megatron_builds(family)
    hf_dir, _ = family_models.checkpoint(family)
    ranks = run_gloo_world(_live_export, 2, str(hf_dir), _sharded(family), True, timeout=TIMEOUT)
    original = _safetensors(hf_dir)
    for rank in ranks:
        assert sorted(rank["names"]) == sorted(original)
        assert all(torch.equal(tensor, original[name]) for name, tensor in rank["tensors"].items())
        layers = [int(name.split(".")[2]) for name in rank["names"] if name.startswith("model.layers.")]
        assert layers == sorted(layers)
        for layer in range(HFModelConfig.load(hf_dir).num_hidden_layers):
            for first, second in case.sync_adjacent:
                at = rank["names"].index(f"model.layers.{layer}.{first}")
                assert rank["names"][at + 1] == f"model.layers.{layer}.{second}"


# --------------------------------------------------------------------------------- planner
@pytest.mark.parametrize("family", FAMILIES)
def test_planner_counts_the_parameters_megatron_builds(family: str) -> None:
    """Per rank at TP=2 (with EP=2 for MoE), for every tiny checkpoint's config: the planner's count is
    the built model's."""
    from bpo_megatron.planner.params import rank_parameters

    configs = [checkpoint_config(family, name) for name in case_of(family).checkpoints]
    _megatron_builds(family)
    layout = _sharded(family)
    counts = run_gloo_world(rank_parameter_counts, 2, configs, layout, timeout=TIMEOUT)
    for index, raw in enumerate(configs):
        [stage] = rank_parameters(HFModelConfig.load(raw), ParallelConfig(**layout), ModelOptions(params_dtype="fp32"))
        assert [rank[index] for rank in counts] == [stage.total, stage.total], raw


# --------------------------------------------------------------------------------- recipe
@pytest.mark.parametrize("family", FAMILIES)
def test_the_recipes_model_has_transformers_parameter_count(family: str) -> None:
    """The planner's count of the released model is transformers' own (a meta-device model), and one
    rank holding the whole model holds exactly that."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bpo_megatron.planner.params import rank_parameters
    from bpo_megatron.weights.names import parameter_counts

    case = case_of(family)
    path = ROOT / "configs" / "models" / case.model / "config.json"
    hf = HFModelConfig.load(path)
    assert hf.model_type == family
    total, _ = parameter_counts(hf)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(path.read_text())))
    assert total == sum(p.numel() for p in reference.parameters()) == case.parameters
    [whole] = rank_parameters(hf, ParallelConfig(), ModelOptions(params_dtype="bf16"))
    assert whole.total == total


@pytest.mark.parametrize("family", FAMILIES)
def test_the_recipe_fits_and_passes_train_check(family: str, tmp_path: Path, capsys) -> None:
    """``bpo-megatron plan`` sizes the recipe and says it fits; ``train --check`` accepts it with the
    files it reads stood in for: a checkpoint of its model's config (every tensor name and shape,
    sparse zeros), the character tokenizer and a few training records."""
    from bpo_megatron.cli import main
    from bpo_megatron.testing.models import placeholder_checkpoint

    case = case_of(family)
    _megatron_builds(family)
    config = ROOT / "configs" / f"{case.recipe}.yaml"
    assert main(["plan", str(config)]) == 0
    out = capsys.readouterr().out
    assert case.plan in out and "verdict: FITS" in out and "FAIL" not in out
    checkpoint = placeholder_checkpoint(ROOT / "configs" / "models" / case.model / "config.json", tmp_path / case.model)
    records = tmp_path / "train.jsonl"
    records.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i),
                                           "source": "test"}) + "\n" for i in range(1, 9)))
    code = main(["train", str(config), f"model.path={checkpoint}", "model.tokenizer=char",
                 f"data.train={records}", "data.on_bad_record=skip", f"logging.run_dir={tmp_path / 'run'}", "--check"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"config ok: {case.recipe}" in out.out.lower() and "training prompts: 8 problems" in out.out
    assert not (tmp_path / "run").exists(), "a check writes nothing"
