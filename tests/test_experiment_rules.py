"""The experiment's cross-section rules (bpo_megatron/experiment_rules.py): each is named, reads real
config keys, and is broken here by one input that the config loader refuses with that rule's error;
a rule without a failing input below fails the coverage test."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from bpo_megatron.config import ConfigError
from bpo_megatron.experiment import RuleBroken, load_experiment
from bpo_megatron.experiment_rules import RULES
from bpo_megatron.testing import MODEL_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "tiny_moe_cpu.yaml"
DENSE = str(MODEL_CONFIGS / "tiny_qwen3")
LATENT = str(MODEL_CONFIGS / "tiny_deepseek_v3")
NO_R3 = ["model.routing_replay=false", "rollout.capture_routed_experts=false"]
SCORE_CENTERING = ["loss.score_centering=true", "train.recompute_old_logprobs=true"]
PACKED = ["trainer.max_tokens_per_micro_batch=64"]

Setup = Callable[[pytest.MonkeyPatch], None]


def _embedded_engine(**changes: object) -> Setup:
    """The embedded engine's spec with ``changes``: a property no registered engine has today."""

    def setup(monkeypatch: pytest.MonkeyPatch) -> None:
        from bpo_megatron.rollout.hf import spec

        monkeypatch.setattr(spec, "SPEC", dataclasses.replace(spec.SPEC, **changes))

    return setup


def _refuse_max_batch_rows(options: object) -> None:
    raise ValueError(f"rollout.hf.max_batch_rows={options.max_batch_rows} is refused by this engine")


def _megatron_19(monkeypatch: pytest.MonkeyPatch) -> None:
    from bpo_megatron.megatron import compat

    monkeypatch.setattr(compat, "megatron_minor", lambda: 19)
    monkeypatch.setattr(compat, "megatron_version", lambda: "0.19.2")


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from bpo_megatron import platform

    monkeypatch.setattr(platform, "has_cuda", lambda: False)


def _no_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from bpo_megatron import platform

    monkeypatch.setattr(platform, "has_transformer_engine", lambda: False)


# rule -> (overrides of the demo config that break it before any other rule, the error it raises,
# what the machine or an engine is made to be first)
BREAKING: dict[str, tuple[list[str], str, Setup | None]] = {
    "parallel_layout_fits_world": (
        ["parallel.tp=3", "parallel.ep=1"],
        r"world size 2 is not divisible by parallel.tp × parallel.pp = 3 × 1;.*\(cluster.trainer_ranks=2\)", None),
    "responses_split_into_minibatches": (
        ["train.minibatches_per_step=3"], "128 responses cannot be split into train.minibatches_per_step=3", None),
    "minibatch_splits_over_data_parallel": (
        ["train.prompts_per_step=3", "rollout.group_size=2", "train.minibatches_per_step=2"],
        r"minibatches of 3 responses cannot be split over 2 data-parallel ranks \(cluster.trainer_ranks", None),
    "routing_replay_needs_capture": (
        ["rollout.capture_routed_experts=false"],
        "model.routing_replay=true .* needs rollout.capture_routed_experts=true", None),
    "routing_replay_engine_captures_here": (
        ["rollout.engine=vllm"], "rollout.engine=vllm: it records routed experts only on GPUs; use rollout.engine=hf",
        _no_gpu),
    "asynchronous_needs_own_devices": (
        ["train.async.max_staleness=1", "cluster.colocate=true"],
        r"train.async.max_staleness=1 generates while the trainer trains.*set cluster.colocate=false", None),
    "delta_sync_needs_engines_that_keep_weights": (
        ["weight_sync.delta=true", "cluster.colocate=true"],
        r"weight_sync.delta=true with colocated hf engines: they drop their weights .*set weight_sync.delta=false",
        _embedded_engine(drops_weights_when_released=True)),
    "overlong_buffer_below_limit": (
        ["train.overlong_buffer=4"], "train.overlong_buffer=4 must be below rollout.max_new_tokens=4", None),
    "token_sum_norm_needs_length": (
        ["loss.agg=seq-mean-token-sum-norm"], "set loss.norm_length .*rollout.max_new_tokens=4", None),
    "correction_needs_recomputed_logprobs": (
        ["loss.correction.name=tis"], "loss.correction=tis corrects by .*set train.recompute_old_logprobs=true", None),
    "score_centering_engine_returns_top_logprobs": (
        SCORE_CENTERING, r"which rollout.engine=hf does not return here .*loss.score_centering=false",
        _embedded_engine(top_logprobs="none")),
    "score_centering_engine_top_logprobs_filtered": (
        [*NO_R3, *SCORE_CENTERING, "rollout.engine=sglang", "rollout.top_p=0.9"],
        r"loss.score_centering with rollout.engine=sglang: it reports the top-k of the distribution before its "
        r"top-k/top-p filters.*rollout.top_p=0.9, rollout.top_k=0; set rollout.top_p=1.0", None),
    "score_centering_filters_anchor_to_old_policy": (
        ["loss.score_centering=true", "rollout.top_k=5"],
        r"loss.score_centering with rollout.top_p=1.0, rollout.top_k=5: .*\(train.recompute_old_logprobs=true, "
        r"loss.correction=none\)", None),
    "score_centering_single_turn": (
        [*SCORE_CENTERING, "rollout.agent.name=calculator"],
        "loss.score_centering with rollout.agent.name=calculator: a multi-turn response", None),
    "groups_of_two_or_more": (
        ["rollout.group_size=1", "train.minibatches_per_step=1", "train.prompts_per_step=2"],
        r"rollout.group_size=1: .*set rollout.group_size >= 2", None),
    "verify_needs_readable_engine": (
        [*NO_R3, "rollout.engine=sglang", "weight_sync.verify=true"],
        r"weight_sync.verify=true reads the engine's weights back, which rollout.engine=sglang does not allow", None),
    "context_parallel_needs_packing": (
        ["parallel.cp=2", "parallel.ep=1"], "parallel.cp=2 splits packed samples over its ranks: set "
                                            "trainer.max_tokens_per_micro_batch", None),
    "token_budget_holds_longest_sample": (
        ["trainer.max_tokens_per_micro_batch=8"],
        r"trainer.max_tokens_per_micro_batch=8 cannot hold the longest sample: data.max_prompt_tokens=16 \+ "
        r"rollout.max_new_tokens=4 − 1 = 19 input positions", None),
    "engine_options": (
        ["rollout.hf.max_batch_rows=3"], r"^rollout.hf.max_batch_rows=3 is refused by this engine$",
        _embedded_engine(check=_refuse_max_batch_rows)),
    "layer_spec_needs_gpu_ranks": (
        ["model.layer_spec=transformer_engine"],
        r"model.layer_spec=transformer_engine runs on GPUs only and this trainer runs on CPUs .*"
        r"set model.layer_spec=local", None),
    "layer_spec_installed": (
        ["model.layer_spec=transformer_engine", "cluster.gpus_per_trainer_rank=1"],
        r"model.layer_spec=transformer_engine needs transformer-engine, which this environment does not have: "
        r"install it .*or set model.layer_spec=local", _no_transformer_engine),
    "parallel_layout_fits_model": (
        ["parallel.ep=8", "cluster.trainer_ranks=8"], "parallel.ep=8 must divide the model's 4 experts", None),
    "score_centering_top_k_within_vocabulary": (
        [*SCORE_CENTERING, "loss.score_centering_top_k=129"],
        r"loss.score_centering_top_k=129 asks the sampler for more .*set loss.score_centering_top_k <= 128", None),
    "routing_replay_needs_experts": (
        [f"model.path={DENSE}", "parallel.ep=1"],
        "model.routing_replay=true needs a Mixture-of-Experts model; model.path is dense", None),
    "fp8_serving_without_latent_attention": (
        [f"model.path={LATENT}", "rollout.hf.quantization=fp8"],
        r"rollout.hf.quantization=fp8 is not supported for DeepseekV3ForCausalLM \(multi-head latent attention\)",
        None),
    "quantized_layout_builds": (
        [*NO_R3, "rollout.engine=sglang", "rollout.sglang.quantization=fp8", "rollout.sglang.tp_size=2"],
        "^rollout.sglang.quantization: ", None),
    "megatron_builds_model": (
        [f"model.path={LATENT}"],
        r"model.path='.*tiny_deepseek_v3': DeepseekV3ForCausalLM \(multi-head latent attention\) is built with "
        r"megatron-core 0.16 only; megatron-core 0.19.2 is installed", _megatron_19),
    "context_parallel_without_latent_attention": (
        [f"model.path={LATENT}", "parallel.cp=2", "parallel.ep=1", *PACKED],
        r"parallel.cp=2 is not supported for DeepseekV3ForCausalLM \(multi-head latent attention\): set parallel.cp=1",
        None),
    "sample_fits_model_context": (
        ["eval.max_new_tokens=1000"],
        r"data.max_prompt_tokens=16 \+ eval.max_new_tokens=1000 = 1016 tokens exceed the model's "
        r"max_position_embeddings=", None),
}


def test_every_rule_is_named_once_and_broken_by_an_input_here():
    names = [rule.name for rule in RULES]
    assert all(name and name.isidentifier() for name in names)
    assert len(set(names)) == len(names)
    assert list(BREAKING) == names, "BREAKING lists each rule of RULES once, in their order"
    assert all(rule.summary and rule.reads for rule in RULES)
    # every rule over the config alone runs before the model's config.json is read, as before the table
    assert [rule.model for rule in RULES] == sorted(rule.model for rule in RULES)


def _flat(tree: dict, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in tree.items():
        keys |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}"}
    return keys


def test_the_keys_a_rule_reads_are_config_keys():
    """Each key in a rule's ``reads`` is a key of a resolved config (``<engine>``: some engine's section)."""
    from bpo_megatron.config import to_dict
    from bpo_megatron.experiment import ExperimentConfig
    from bpo_megatron.rollout.engine import ENGINES

    keys = _flat(to_dict(ExperimentConfig()))

    def known(read: str) -> bool:
        spelled = [read.replace("<engine>", engine) for engine in ENGINES] if "<engine>" in read else [read]
        return any(key == each or key.startswith(each + ".") for each in spelled for key in keys)

    unknown = {rule.name: [read for read in rule.reads if not known(read)] for rule in RULES}
    assert not {name: reads for name, reads in unknown.items() if reads}
    assert known("rollout.<engine>.quantization") and not known("rollout.<engine>.quantisation")


@pytest.mark.parametrize("name", list(BREAKING))
def test_each_rule_refuses_its_breaking_input_naming_the_fields(name, monkeypatch):
    overrides, match, setup = BREAKING[name]
    if setup is not None:
        setup(monkeypatch)
    with pytest.raises(RuleBroken, match=match) as refused:
        load_experiment(DEMO, overrides)
    assert refused.value.rule == name
    assert isinstance(refused.value, ConfigError)  # what `train --check` and the CLI report (exit 2)


def test_transformer_engines_spec_is_taken_where_it_is_installed_and_checked_where_the_model_is(monkeypatch):
    """Without transformer-engine here, a config check without the model (a launch's submitting
    machine) accepts the spec and leaves it to the cluster; with it, the experiment validates and
    its ranks build transformer-engine's modules."""
    from bpo_megatron import platform
    from bpo_megatron.models import megatron_model

    gpu_ranks = ["model.layer_spec=transformer_engine", "cluster.gpus_per_trainer_rank=1"]
    monkeypatch.setattr(platform, "has_transformer_engine", lambda: False)
    assert load_experiment(DEMO, gpu_ranks, check_model=False).model.options.layer_spec == "transformer_engine"
    with pytest.raises(ValueError, match="model.layer_spec=transformer_engine runs on GPUs only"):
        megatron_model.uses_transformer_engine("transformer_engine")  # a rank without a GPU
    monkeypatch.setattr(platform, "has_transformer_engine", lambda: True)
    assert load_experiment(DEMO, gpu_ranks).model.options.layer_spec == "transformer_engine"
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    assert megatron_model.uses_transformer_engine("transformer_engine") and not megatron_model.uses_transformer_engine("local")


def test_the_model_rules_wait_for_the_model_check():
    """``check_model=False`` (a config read before its model exists) skips the rules that read config.json."""
    overrides, _, _ = BREAKING["parallel_layout_fits_model"]
    cfg = load_experiment(DEMO, overrides, check_model=False)
    assert (cfg.parallel.ep, cfg.cluster.trainer_ranks) == (8, 8)
    assert next(rule for rule in RULES if rule.name == "parallel_layout_fits_model").model
