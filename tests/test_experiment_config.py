"""Experiment configs: YAML + dotted overrides, typed sections, errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bpo_megatron.config import ConfigError
from bpo_megatron.experiment import load_experiment
from bpo_megatron.loop.run_dir import record_config
from bpo_megatron.testing import MODEL_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "tiny_moe_cpu.yaml"
MOE = str(MODEL_CONFIGS / "tiny_qwen3_moe")
DENSE = str(MODEL_CONFIGS / "tiny_qwen3")


def test_the_demo_config_loads_and_resolves_its_model_path():
    cfg = load_experiment(DEMO)
    assert cfg.model.options.routing_replay and cfg.rollout.capture_routed_experts
    assert Path(cfg.model.path).is_dir() and cfg.hf_config().num_experts == 4
    assert cfg.minibatch_size == 16 * 8 // 2 and cfg.data_parallel_size == 2


def test_overrides_are_typed():
    cfg = load_experiment(DEMO, ["loss.name=grpo", "loss.eps_high=0.3", "optimizer.betas=[0.9, 0.95]",
                                 "eval.datasets=[procedural:max]", "checkpoint.keep_last=null", "parallel.tp=2",
                                 "parallel.ep=1", "model.routing_replay=false"])
    assert cfg.loss.name == "grpo" and cfg.loss.eps_high == 0.3
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.eval.datasets == ("procedural:max",)
    assert cfg.checkpoint.keep_last is None and cfg.parallel.tp == 2


def test_resolved_config_round_trips(tmp_path):
    """The recorded config loads back as the same experiment; its paths (those that exist here)
    are recorded absolute, so it also works from another working directory."""
    import dataclasses

    def absolute(value: str) -> str:
        return str(Path(value).resolve()) if value and Path(value).exists() else value

    cfg = load_experiment(DEMO, ["loss.name=cispo"])
    path = record_config(cfg, tmp_path)
    again = load_experiment(path)
    assert Path(again.model.path).is_absolute()
    assert again == dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=absolute(cfg.model.path)),
                                        data=dataclasses.replace(cfg.data, root=absolute(cfg.data.root)))


@pytest.mark.parametrize(
    "overrides, match",
    [
        # unknown keys, anywhere
        (["loss.nmae=grpo"], "unknown key loss.nmae; valid keys of loss: agg, bpo_cap"),
        (["trian.steps=3"], "unknown key trian"),
        (["rollout.sglang.prot=1", "rollout.engine=sglang"], "rollout.sglang"),
        # wrong types and values
        (["train.steps=many"], "train.steps='many' must be an integer"),
        (["model.routing_replay=maybe"], "model.routing_replay='maybe' must be true or false"),
        (["rollout.engine=tgi"], r"rollout.engine='tgi' is unknown; choose one of \['hf', 'sglang', 'vllm'\]"),
        (["loss.name=ppo"], "PolicyLossConfig.name='ppo' is unknown"),
        # parallel sizes that do not divide the world ...
        (["parallel.tp=3", "parallel.ep=1"], "world size 2 is not divisible by parallel.tp × parallel.pp = 3 × 1"),
        (["cluster.trainer_ranks=3"], "world size 3 is not divisible|parallel.ep × parallel.etp = 2 × 1 must divide"),
        # ... or the model
        ([f"model.path={MOE}", "parallel.ep=1", "parallel.pp=4", "cluster.trainer_ranks=4"],
         "parallel.pp=4 must divide the model's 2 layers"),
        (["parallel.tp=2", "parallel.ep=1", "cluster.trainer_ranks=2", f"model.path={ROOT / 'configs/models/tiny_qwen3_moe'}",
          "parallel.tp=4", "cluster.trainer_ranks=4"], "parallel.tp=4 must divide the attention heads"),
        # EP larger than the number of experts
        (["parallel.ep=8", "cluster.trainer_ranks=8"], "parallel.ep=8 must divide the model's 4 experts"),
        # batch not divisible into minibatches, or minibatches over DP ranks
        (["train.minibatches_per_step=3"], "128 responses cannot be split into train.minibatches_per_step=3"),
        (["train.prompts_per_step=3", "rollout.group_size=2", "train.minibatches_per_step=2"],
         "minibatches of 3 responses cannot be split over 2 data-parallel ranks"),
        # R3 with an engine that cannot capture
        (["rollout.capture_routed_experts=false"], "model.routing_replay=true .* needs rollout.capture_routed_experts=true"),
        (["rollout.engine=vllm"], "rollout.engine=vllm: it records routed experts only on GPUs"),
        ([f"model.path={DENSE}", "parallel.ep=1"], "needs a Mixture-of-Experts model"),
        (["rollout.engine=sglang", "weight_sync.verify=true"], "which rollout.engine=sglang does not allow"),
        # the embedded engine's own options are typed
        (["rollout.hf.dtype=fp16"], r"rollout.hf.dtype='fp16' must be one of 'fp32', 'bf16'"),
        (["rollout.hf.max_rows=4"], "unknown key rollout.hf.max_rows; valid keys of rollout.hf: compile, decode, dtype, "
                                    "max_batch_rows, quantization, refill_every"),
        (["rollout.hf.max_batch_rows=0"], "rollout.hf.max_batch_rows must be >= 1"),
        (["rollout.hf.decode=fast"], "rollout.hf.decode='fast' must be one of 'auto', 'eager', 'cuda_graph'"),
        (["rollout.hf.refill_every=0"], "rollout.hf.refill_every must be between 1 and 64"),
        (["data.fields.question=prompt.0.content"], "data.fields.question is not a problem field"),
        # a loss that would depend on how samples are grouped into micro-batches
        (["loss.agg=seq-mean-token-sum-norm"], "set loss.norm_length .*rollout.max_new_tokens=4"),
        # a batch that trains nothing, or a sampler's head larger than the vocabulary (128 tokens)
        (["rollout.group_size=1", "train.minibatches_per_step=1", "train.prompts_per_step=2"],
         r"rollout.group_size=1: each response's advantage is its reward minus its group's mean, so in a group of one "
         r"it is 0 and no RL step trains anything .*set rollout.group_size >= 2"),
        (["rollout.group_size=1", "loss.score_centering=true", "train.minibatches_per_step=1",
          "train.prompts_per_step=2"], "rollout.group_size=1: "),
        (["loss.score_centering=true", "loss.score_centering_top_k=129"],
         r"loss.score_centering_top_k=129 asks the sampler for more of its most likely tokens than the model's "
         r"vocabulary holds \(vocab_size=128 in .*\); set loss.score_centering_top_k <= 128"),
        # missing model
        (["model.path=/nonexistent/model"], "model.path='/nonexistent/model'"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment(DEMO, overrides)


@pytest.mark.parametrize("override, match", [
    ("train.micro_batch_size=4", r"train.micro_batch_size moved to trainer.micro_batch_size: write trainer: "
                                 r"\{micro_batch_size: 4\} \(override: trainer.micro_batch_size=4\)"),
    ("train.max_tokens_per_micro_batch=64", "moved to trainer.max_tokens_per_micro_batch"),
    ("train.seed=3", r"train.seed moved to seed: write seed: 3 \(override: seed=3\)"),
    ("train.verify_weight_sync=true", "train.verify_weight_sync moved to weight_sync.verify"),
    ("rollout.weight_bucket_mb=64", "rollout.weight_bucket_mb moved to weight_sync.bucket_mb"),
    ("loss.tis_cap=3", r"loss.tis_cap moved to loss.correction.tis_cap: write loss: \{correction: \{tis_cap: 3\}\}"),
    ("trainer.temperature=0.5", "trainer.temperature is not a setting of its own: it is rollout.temperature"),
    ("trainer.seed=5", "trainer.seed is not a setting of its own: it is the experiment's seed"),
    ("model.options.recompute=full", "unknown key model.options; valid keys of model: .*recompute"),
    # a value naming a decode loop the embedded engine no longer has
    ("rollout.hf.decode=transformers", r"rollout.hf.decode='transformers' is gone: the embedded engine has one "
                                       r"decode loop now .*write rollout.hf.decode=eager"),
    ("rollout.hf.decode=static", r"rollout.hf.decode='static' is gone: .*rollout.hf.decode=eager"),
    # the engines' own bucket sizes, in bytes: one bucket setting now, in MiB
    ("rollout.sglang.weight_bucket_bytes=4096", r"rollout.sglang.weight_bucket_bytes is no longer a setting: the one "
                                                r"weight bucket size.* is weight_sync.bucket_mb, in MiB"),
    ("rollout.vllm.weight_bucket_bytes=4096", r"rollout.vllm.weight_bucket_bytes is no longer a setting: .*"
                                              r"weight_sync.bucket_mb, in MiB"),
])
def test_a_key_that_moved_is_refused_naming_its_new_home(override, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment(DEMO, [override], check_model=False)


def test_settings_reach_their_owners_sections_and_the_trainer_spec():
    cfg = load_experiment(DEMO, ["trainer.micro_batch_size=4", "trainer.logprob_kernel=chunked", "seed=7",
                                 "weight_sync.bucket_mb=64", "weight_sync.verify=true", "rollout.temperature=0.7",
                                 "model.recompute=full", "rollout.hf.max_batch_rows=32"])
    spec = cfg.trainer_spec()
    assert (spec.trainer.micro_batch_size, spec.trainer.logprob_kernel) == (4, "chunked")
    assert (spec.trainer.seed, spec.trainer.temperature) == (7, 0.7)  # the run's seed, the engines' temperature
    assert spec.model == cfg.model.options and spec.model.recompute == "full" and spec.hf.num_experts == 4
    assert (cfg.weight_sync.bucket_bytes, cfg.weight_sync.verify) == (64 * 2**20, True)
    assert cfg.rollout.options.max_batch_rows == 32  # the chosen engine's section, built by its spec's class


def test_the_engine_groups_are_built_from_the_experiments_engine_sections():
    cfg = load_experiment(DEMO, ["rollout.num_engines=2", "rollout.max_restarts=5", "rollout.hf.max_batch_rows=32",
                                 "data.max_prompt_tokens=12", "rollout.max_new_tokens=30", "eval.mode=background",
                                 "eval.engines=3", "cluster.colocate=false", "train.async.max_staleness=2"])
    rollout = cfg.engine_group_spec()
    assert (rollout.role, rollout.count, rollout.first_index) == ("rollout", 2, 0)
    assert rollout.rollout is cfg.rollout and rollout.cluster is cfg.cluster and rollout.hf == cfg.hf_config()
    assert rollout.rollout.options.max_batch_rows == 32 and rollout.rollout.max_restarts == 5
    assert (rollout.longest_sequence, rollout.max_staleness) == (12 + 30, 2)
    evaluation = cfg.engine_group_spec(evaluation=True)  # indexed after the two rollout engines
    assert (evaluation.role, evaluation.count, evaluation.first_index) == ("evaluation", 3, 2)
    assert evaluation.longest_sequence == 42 and evaluation.rollout is cfg.rollout
    from bpo_megatron.orchestration.engine_group_spec import EngineGroupSpec

    bare = EngineGroupSpec(hf=MOE)  # a test's group: the model's directory, every section at its defaults
    assert bare.hf.num_experts == 4 and (bare.count, bare.longest_sequence) == (1, 16384)
    with pytest.raises(ValueError, match="an engine group's role is 'rollout' or 'evaluation', not 'judge'"):
        EngineGroupSpec(hf=MOE, role="judge")
    with pytest.raises(ValueError, match="at least one engine, got num_engines=0"):
        EngineGroupSpec(hf=MOE, role="evaluation", num_engines=0)


SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_its_engine_sections_hold_what_it_writes(path):
    """Each config of configs/ validates, and what it writes under ``rollout.<engine>`` is that
    engine's section (one per registered engine), written back under the same keys."""
    from bpo_megatron.config import load_yaml, to_dict
    from bpo_megatron.experiment import RELATIVE_PATHS
    from bpo_megatron.rollout.engine import ENGINES, engine_spec

    cfg = load_experiment(path)
    written, recorded = load_yaml(path, relative_paths=RELATIVE_PATHS).get("rollout") or {}, to_dict(cfg)["rollout"]
    for engine in ENGINES:
        assert isinstance(cfg.rollout.engine_sections[engine], engine_spec(engine).options)
        assert {key: recorded[engine][key] for key in written.get(engine) or {}} == (written.get(engine) or {})
    assert len(SHIPPED) >= 14 and cfg.rollout.engine in ENGINES


def test_the_sync_plan_is_made_once_from_the_sections_that_decide_it():
    """Transport, the one bucket size (in bytes, from weight_sync.bucket_mb), dtype, FP8 form and
    check: what every sync of an engine group does, from the experiment as the loop makes it."""
    import torch

    cfg = load_experiment(DEMO, ["weight_sync.bucket_mb=64", "weight_sync.verify=true", "rollout.hf.dtype=bf16"])
    plan = cfg.sync_plan()
    assert (plan.transport, plan.bucket_bytes, plan.dtype, plan.quantization, plan.verify) == (
        cfg.weight_transport(), 64 * 2**20, torch.bfloat16, None, True)
    assert cfg.sync_plan(evaluation=True).transport == cfg.weight_transport(evaluation=True)


def test_each_engine_loads_weights_in_buckets_of_the_one_setting(tmp_path):
    """The engines' weight-update calls take buckets of weight_sync.bucket_mb, as the trainer's export does."""
    from bpo_megatron.rollout.engine import EngineContext
    from bpo_megatron.rollout.sglang import spec as sglang
    from bpo_megatron.rollout.vllm import spec as vllm

    for engine, spec in (("sglang", sglang), ("vllm", vllm)):
        cfg = load_experiment(DEMO, ["weight_sync.bucket_mb=3", f"rollout.engine={engine}", "model.routing_replay=false"],
                              check_model=False)
        context = EngineContext(model_dir=str(tmp_path), index=0, routing=None,
                                weight_bucket_bytes=cfg.weight_sync.bucket_bytes)
        assert spec.engine_config(cfg.rollout.options, context).weight_bucket_bytes == 3 * 2**20, engine


def test_a_correction_by_name_takes_its_bounds_from_the_file_or_later_overrides(tmp_path):
    """``loss.correction: tis`` is ``{name: tis}``: an override may then set a bound inside it, in the
    file's shorthand or after an override that named the correction."""
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {DEMO}\nloss: {{correction: mis}}\ntrain: {{recompute_old_logprobs: true}}\n")
    assert load_experiment(child, ["loss.correction.mis_cap=4"]).loss.correction.mis_cap == 4.0
    cfg = load_experiment(DEMO, ["loss.correction=tis", "loss.correction.tis_cap=3",
                                 "train.recompute_old_logprobs=true"], check_model=False)
    assert (cfg.loss.correction.name, cfg.loss.correction.tis_cap, cfg.loss.correction.mis_cap) == ("tis", 3.0, 2.0)


def test_malformed_override_and_file():
    with pytest.raises(ConfigError, match="not of the form"):
        load_experiment(DEMO, ["loss.name"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment("/nowhere.yaml")


def test_yaml_syntax_errors_name_the_file_line_or_override(tmp_path, capsys):
    from bpo_megatron.cli import main

    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ntrain:\n  steps: [1\n  seed: 2\n")
    with pytest.raises(ConfigError, match=rf"{path}:4:7: not valid YAML: expected ',' or '\]', but got ':'"):
        load_experiment(path)
    with pytest.raises(ConfigError, match=r"override 'train.steps=\[1': not valid YAML: expected ',' or '\]'"):
        load_experiment(DEMO, ["train.steps=[1"])
    assert main(["train", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"bpo-megatron train: {path}:4:7: not valid YAML")


def test_a_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_experiment(path)


def test_weights_are_synced_in_the_embedded_engines_precision():
    assert load_experiment(DEMO, []).rollout.sync_dtype == "fp32"
    assert load_experiment(DEMO, ["rollout.hf.dtype=bf16"]).rollout.sync_dtype == "bf16"
    # other engines receive the trainer's tensors and convert them themselves
    assert load_experiment(DEMO, ["rollout.engine=sglang", "rollout.hf.dtype=bf16"]).rollout.sync_dtype is None
