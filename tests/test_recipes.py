"""The shipped recipes: they load and validate against their model configs, carry the paper's
settings, differ from each other only where the paper's runs do, and fit their clusters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bpo_megatron.config import ConfigError, to_dict
from bpo_megatron.experiment import load_experiment
from bpo_megatron.launch import plan_batch
from bpo_megatron.launch.settings import ExecutorSettings
from bpo_megatron.weights.names import parameter_counts
from bpo_megatron.planner import make_plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MAIN = CONFIGS / "qwen3_30b_a3b_bpo.yaml"
ABLATION = CONFIGS / "qwen3_4b_ablation.yaml"
BASELINES = {  # the paper's hyper-parameters of each baseline (appendix, experimental details)
    "grpo": {"name": "grpo", "eps_low": 0.2, "eps_high": 0.28},
    "gspo": {"name": "gspo", "gspo_eps_low": 3e-3, "gspo_eps_high": 5e-3},
    "cispo": {"name": "cispo", "cispo_cap": 3.0},
    "dppo": {"name": "dppo_tv", "dppo_delta": 0.1, "dppo_ratio_cap": 10.0},
}
DISAGGREGATED = CONFIGS / "qwen3_30b_a3b_bpo_disaggregated.yaml"
GLM_AIR = CONFIGS / "glm4_5_air_bpo.yaml"  # the main setting on GLM-4.5-Air
MOONLIGHT = CONFIGS / "moonlight_16b_a3b_bpo.yaml"  # the main setting on Moonlight-16B-A3B
# every family's recipe also passes `plan` and `train --check` in tests/test_model_families.py
RECIPES = [MAIN, DISAGGREGATED, ABLATION, *(CONFIGS / f"qwen3_30b_a3b_{b}.yaml" for b in BASELINES), GLM_AIR,
           MOONLIGHT, CONFIGS / "qwen3_235b_a22b_bpo.yaml"]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_with_its_model_and_fits_its_cluster(path):
    cfg = load_experiment(path, check_model=True)  # model.path: the shipped config.json
    assert cfg.name == path.stem
    assert cfg.data.train == "/data/dapo_math_17k.jsonl"
    assert cfg.model.options.params_dtype == "bf16" and cfg.model.init == "pretrained"
    plan = make_plan(cfg, cfg.hf_config())
    assert plan.fits, [c.message for c in plan.checks if not c.ok]


def test_main_setting_is_the_papers():
    cfg = load_experiment(MAIN)
    assert (cfg.train.prompts_per_step, cfg.rollout.group_size) == (256, 16)
    assert (cfg.train.minibatches_per_step, cfg.minibatch_size) == (8, 512)
    assert cfg.train.steps == 400 and cfg.rollout.max_new_tokens == 16_384
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.weight_decay, cfg.optimizer.grad_clip) == (
        1e-6, (0.9, 0.98), 0.1, 1.0)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (1.0, 1.0, 0)
    assert cfg.model.options.routing_replay and cfg.rollout.capture_routed_experts  # R3
    assert (cfg.loss.name, cfg.loss.bpo_eps, cfg.loss.bpo_cap, cfg.loss.agg) == ("bpo", 0.1, 3.0, "seq-mean-token-mean")
    # every bound and cap written out in the recipe itself, not left to the defaults
    loss = yaml.safe_load(MAIN.read_text())["loss"]
    assert {k: loss[k] for k in ("bpo_eps", "bpo_cap", "eps_low", "eps_high")} == {
        "bpo_eps": 0.1, "bpo_cap": 3.0, "eps_low": 0.2, "eps_high": 0.28}
    assert (cfg.data.reward, cfg.data.truncated_reward) == ("math", 0.0)  # a truncated response scores 0
    assert cfg.data.template == cfg.eval.template == "math-boxed"
    assert (cfg.eval.every, cfg.eval.k, cfg.eval.datasets) == (10, 32, ("aime24", "aime25", "aime26"))
    assert (cfg.eval.temperature, cfg.eval.top_p, cfg.eval.max_new_tokens) == (1.0, 1.0, None)  # training's limit
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.gpu_memory_gb) == (4, 8, 80.0)
    total, active = parameter_counts(cfg.hf_config())
    assert round(total / 1e9, 1) == 30.5


def test_main_setting_in_both_placements():
    """Colocated (engines on the trainer's 32 GPUs, CUDA IPC) and disaggregated (2 nodes train, 7
    serve, NCCL broadcast, generation one step ahead): the same algorithm and batch, only the
    layout and its pace differ; the disaggregated engines are as many as the planner's estimate
    says keep pace with the trainer."""
    from bpo_megatron.planner.overlap import step_times

    shared, apart = load_experiment(MAIN), load_experiment(DISAGGREGATED)
    transports = [cfg.rollout.spec.transport(cfg.rollout.options, cfg.cluster.colocate, cfg.cluster.gpus_per_engine > 0)
                  for cfg in (shared, apart)]
    assert transports == ["cuda_ipc", "nccl_broadcast"]
    assert (apart.cluster.trainer_ranks, apart.rollout.num_engines * apart.cluster.gpus_per_engine) == (16, 56)
    assert apart.cluster.nodes * apart.cluster.gpus_per_node == 16 + 56
    assert shared.rollout.num_engines * shared.cluster.gpus_per_engine == shared.cluster.trainer_ranks == 32
    assert (shared.train.asynchronous.max_staleness, apart.train.asynchronous.max_staleness) == (0, 1)
    times = step_times(make_plan(apart, apart.hf_config()))
    assert times.engines_to_keep_pace <= apart.rollout.num_engines and times.rollout_s <= times.train_s
    one, other = to_dict(shared), to_dict(apart)
    for setting in ("name", "cluster.nodes", "cluster.trainer_ranks", "cluster.colocate", "cluster.offload",
                    "rollout.num_engines", "train.async"):
        section, _, key = setting.rpartition(".")
        for cfg in (one, other):
            (cfg[section] if section else cfg).pop(key)
    for cfg in (one, other):
        cfg["rollout"]["sglang"].pop("mem_fraction_static")  # no trainer residual beside engines apart
    assert one == other


@pytest.mark.parametrize("baseline", BASELINES)
def test_baselines_change_only_the_policy_loss(baseline):
    main = to_dict(load_experiment(MAIN))
    cfg = to_dict(load_experiment(CONFIGS / f"qwen3_30b_a3b_{baseline}.yaml"))
    for key, value in BASELINES[baseline].items():
        assert cfg["loss"][key] == value
    assert cfg.pop("name") == f"qwen3_30b_a3b_{baseline}"
    main.pop("name"), main.pop("loss"), cfg.pop("loss")
    assert cfg == main


def test_ablation_setting_and_its_sweeps():
    cfg = load_experiment(ABLATION)
    assert cfg.hf_config().architecture == "Qwen3ForCausalLM"
    assert (cfg.train.prompts_per_step, cfg.rollout.group_size, cfg.train.minibatches_per_step) == (128, 16, 4)
    assert cfg.minibatch_size == 512 and cfg.rollout.max_new_tokens == 8192 and cfg.train.steps == 1000
    assert (cfg.loss.bpo_eps, cfg.loss.bpo_cap) == (0.1, 3.0)
    assert not cfg.model.options.routing_replay  # dense: nothing to replay
    assert abs(parameter_counts(cfg.hf_config())[0] - 4.02e9) / 4.02e9 < 0.01  # Qwen3-4B
    eps = plan_batch(str(ABLATION), ["loss.bpo_eps=0.05,0.1,0.2,0.3"], ExecutorSettings())
    cap = plan_batch(str(ABLATION), ["loss.bpo_cap=2,3,4"], ExecutorSettings())
    assert [r.name for r in eps.runs] == [f"qwen3_4b_ablation-bpo_eps-{e}" for e in ("0.05", "0.1", "0.2", "0.3")]
    assert [r.name for r in cap.runs] == [f"qwen3_4b_ablation-bpo_cap-{c}" for c in (2, 3, 4)]
    for run in (*eps.runs, *cap.runs):  # every point validates
        load_experiment(run.config, list(run.overrides))


def test_shipped_model_configs():
    # the published Qwen3-30B-A3B (the tests' one copy of it, too)
    qwen3_30b = json.loads((CONFIGS / "models" / "qwen3_30b_a3b" / "config.json").read_text())
    expected = {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                "vocab_size": 151936, "max_position_embeddings": 40960}
    assert {k: qwen3_30b[k] for k in expected} == expected
    qwen3_4b = json.loads((CONFIGS / "models" / "qwen3_4b" / "config.json").read_text())
    expected = {"num_hidden_layers": 36, "hidden_size": 2560, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "rope_theta": 1_000_000,
                "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
    assert {k: qwen3_4b[k] for k in expected} == expected


def test_recipes_are_plain_yaml_without_unknown_keys():
    for path in RECIPES:
        data = yaml.safe_load(path.read_text())
        assert set(data) <= {"extends", "name", "seed", "model", "parallel", "rollout", "loss", "optimizer", "trainer", "weight_sync", "train", "data",
                             "eval", "checkpoint", "logging", "cluster"}


@pytest.mark.parametrize("baseline", BASELINES)
def test_baseline_recipes_are_the_bpo_recipe_plus_their_loss(baseline):
    data = yaml.safe_load((CONFIGS / f"qwen3_30b_a3b_{baseline}.yaml").read_text())
    assert data == {"extends": MAIN.name, "name": f"qwen3_30b_a3b_{baseline}",
                    "loss": {**BASELINES[baseline], "agg": "seq-mean-token-mean"}}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_extends_chains_and_the_child_wins(tmp_path):
    model = CONFIGS / "models" / "tiny_qwen3_moe"
    _write(tmp_path / "base" / "models" / "m" / "config.json", (model / "config.json").read_text())
    _write(tmp_path / "base" / "base.yaml", "name: base\nmodel: {path: models/m, init: random, tokenizer: char}\n"
           "parallel: {tp: 1, ep: 2}\ncluster: {trainer_ranks: 2}\ntrain: {steps: 7}\nseed: 3\n"
           "eval: {every: 5, datasets: [procedural:add, procedural:max]}\n"
           "rollout: {max_new_tokens: 4, group_size: 8}\ndata: {max_prompt_tokens: 16, train: procedural:add}\n")
    _write(tmp_path / "mid.yaml", "extends: base/base.yaml\nname: mid\ntrain: {steps: 9}\n"
           "eval: {datasets: [procedural:reverse]}\n")
    child = _write(tmp_path / "deep" / "child.yaml", "extends: ../mid.yaml\nname: child\nloss: {name: cispo}\n")
    cfg = load_experiment(child, ["seed=5"])
    assert cfg.name == "child" and cfg.loss.name == "cispo"
    assert (cfg.train.steps, cfg.seed) == (9, 5)  # mid's steps, the override's seed
    assert cfg.eval.datasets == ("procedural:reverse",) and cfg.eval.every == 5  # a list replaces, a mapping merges
    assert Path(cfg.model.path).resolve() == tmp_path / "base" / "models" / "m"  # relative to the file that set it
    assert cfg.parallel.ep == 2 and cfg.hf_config().num_experts == 4


def test_extends_errors_name_the_files(tmp_path):
    missing = _write(tmp_path / "a.yaml", "extends: nowhere.yaml\nname: a\n")
    with pytest.raises(ConfigError, match=r"config file .*nowhere.yaml does not exist \(extended by .*a.yaml\)"):
        load_experiment(missing)
    _write(tmp_path / "b.yaml", "extends: c.yaml\n")
    _write(tmp_path / "c.yaml", "extends: b.yaml\n")
    with pytest.raises(ConfigError, match=r"b.yaml: 'extends' makes a cycle: .*b.yaml -> .*c.yaml -> .*b.yaml"):
        load_experiment(tmp_path / "b.yaml")
    with pytest.raises(ConfigError, match=r"'extends' must name one YAML file, got \['x'\]"):
        load_experiment(_write(tmp_path / "d.yaml", "extends: [x]\n"))


def test_plan_and_launchers_see_the_parents_settings(tmp_path, capsys):
    from bpo_megatron.cli import main

    grpo = CONFIGS / "qwen3_30b_a3b_grpo.yaml"
    assert main(["plan", str(grpo)]) == 0
    report = capsys.readouterr().out
    assert main(["plan", str(MAIN)]) == 0
    main_report = capsys.readouterr().out
    assert report.splitlines()[0] == "plan: qwen3_30b_a3b_grpo on 4 node(s) × 8 GPUs × 80 GB"
    assert report.splitlines()[1:] == main_report.splitlines()[1:]  # the loss does not change the memory plan
    batch = plan_batch(str(grpo), ["loss.eps_high=0.3,0.35"], ExecutorSettings())
    assert [r.name for r in batch.runs] == ["qwen3_30b_a3b_grpo-eps_high-0.3", "qwen3_30b_a3b_grpo-eps_high-0.35"]
