"""The GPU validation kit in its CPU mode (so it does not rot between GPU runs), the RL loop's
check and its one-GPU recipe included, and its parts: per-check budgets, the report, the round's
report, the payload search, the flattened bucket, the bundle's pins (the numbers the kit reads:
tests/test_gpu_kit_numbers.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _smoke(tmp_path: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bpo_megatron.gpu_smoke", "--device", "cpu",
                           "--out", str(tmp_path / "report"), "--workdir", str(tmp_path / "work"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# the kit's one check left to the tests marked ci (Ray's start-up and four RL steps: most of the run's time)
LEFT_TO_CI = "rl_loop"


@pytest.fixture(scope="module")
def kit_cpu_run(tmp_path_factory):
    """Every check of the GPU kit in its CPU mode but ``LEFT_TO_CI``, in one run, made once for the
    tests of this module that read its report (one module: a test worker makes it once): its
    folder (``report/``, ``work/``) and the finished process. ``rl_loop`` runs alone in
    test_the_kits_rl_loop_on_a_cpu_runs_four_steps_with_its_numbers."""
    from bpo_megatron.gpu_smoke.checks import CHECKS

    out = tmp_path_factory.mktemp("kit_cpu_run")
    return out, _smoke(out, "--checks", ",".join(name for name in CHECKS if name != LEFT_TO_CI), timeout=1400)


@pytest.mark.timeout(1500)  # the kit's run (kit_cpu_run), if this test is the first to ask for it
def test_cpu_smoke_run_passes_every_check_with_its_numbers(kit_cpu_run):
    """Every check but LEFT_TO_CI (the next test's)."""
    from bpo_megatron.gpu_smoke.checks import CHECKS

    tmp_path, done = kit_cpu_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["passed"] and list(checks) == [name for name in CHECKS if name != LEFT_TO_CI]
    assert all(c["criteria"] and all(line.startswith("PASS") for line in c["criteria"]) for c in checks.values())
    numbers = {name: c["numbers"] for name, c in checks.items()}
    # fp32 on a CPU: the trainer equals transformers' fp32 reference up to summation order
    assert numbers["trainer_step"]["loss_rel_diff"] <= 1e-5
    assert numbers["engine_replay"]["r3_routing_agreement"] == 1.0
    assert numbers["engine_replay"]["r3_logp_mean_abs_diff"] <= 1e-4
    assert numbers["ipc_weights"]["bytes_loaded_by_engine"] == numbers["ipc_weights"]["bucket_bytes"] > 0
    assert numbers["trainer_offload"]["parameter_storage_bytes_while_offloaded"] == 0
    assert numbers["driver_payloads"]["loaded_in_driver"] == numbers["driver_payloads"]["values"] == 7
    assert numbers["rl_throughput"]["response_tokens"] == 4 * 2 * 24
    # the decode loop op by op (no CUDA graph on a CPU), scored against a teacher-forced recompute (fp32)
    decode = numbers["rollout_decode"]
    assert decode["eager_routing_agreement"] == 1.0 and decode["eager_logp_max_abs_diff"] <= 1e-5
    assert all(decode[f"eager_{rows}_tokens_per_s"] > 0 for rows in (4, 8))
    assert not any(key.startswith(("transformers_", "static_", "cuda_graph_")) for key in decode)
    assert any("Not required here" in note for note in checks["rollout_decode"]["notes"])
    # packed and padded micro-batches score the same long-tailed samples alike (fp32)
    assert numbers["rl_throughput"]["packed_logp_max_abs_diff"] <= 1e-5
    assert 0 < numbers["rl_throughput"]["varied_positions"] < 4 * 2 * (8 + 24)
    assert numbers["rl_throughput"]["packed_train_tokens_per_s"] > 0 < numbers["rl_throughput"]["padded_train_tokens_per_s"]
    # every fast path off in turn and all off, from the same weights: fp32 steps equal the reference's
    from bpo_megatron.gpu_smoke.checks.train_fast_paths import variants

    rows = checks["train_fast_paths"]["tables"]["train step with and without each fast path"]
    assert [row["variant"] for row in rows] == list(variants()) and len(rows) >= 3
    assert all(abs(row["loss"] / rows[-1]["loss"] - 1) <= 1e-6 for row in rows)
    assert all(abs(row["grad_norm"] / rows[-1]["grad_norm"] - 1) <= 1e-6 for row in rows)
    # the MFU rows at both micro-batch sizes and the 30B slice's shape (no peak on a CPU: NaN), each profiled
    mfu = checks["train_fast_paths"]["tables"]["training MFU, every fast path on"]
    assert [(row["case"], row["label"]) for row in mfu] == [("kit", "4k"), ("kit", "32k"), ("30b_slice", "32k")]
    assert [row["micro_batch_positions"] for row in mfu] == [128, 256, 256]
    assert all(row["micro_batches"] == 2 and row["train_s"] > 0 and row["half_depth_train_s"] > 0 for row in mfu)
    assert all(row["kernels"] == 0 and row["host_syncs"] > 0 for row in mfu)  # no GPU here: scalar reads
    fast = numbers["train_fast_paths"]
    assert all(key in fast for key in ("train_mfu_32k", "busy_mfu_32k", "layer_mfu_32k", "layer_mfu_30b_slice"))
    import gzip

    for name in ("train-kit-4k", "train-kit-32k", "train-30b_slice-32k"):
        trace = tmp_path / "work" / "traces" / f"{name}.json.gz"
        assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert all(f"## {name}: pass" in markdown for name in checks)


@pytest.mark.ci  # Ray's start-up and four RL steps (CI time); the default run validates the recipe with the kit's
# overrides (test_the_kits_cpu_overrides_of_the_recipe_validate) and runs the loop in tests/test_loop_e2e.py
@pytest.mark.timeout(900)
def test_the_kits_rl_loop_on_a_cpu_runs_four_steps_with_its_numbers(tmp_path):
    done = _smoke(tmp_path, "--checks", LEFT_TO_CI)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [check] = json.loads((tmp_path / "report" / "report.json").read_text())["checks"]
    assert check["name"] == "rl_loop" and check["criteria"] and all(line.startswith("PASS") for line in check["criteria"])
    # the RL loop through Ray: the recipe's one-device layout on the CPU demo's model, four steps
    loop = check["numbers"]
    assert loop["steps"] == 4 and loop["exit_status"] == 0 and loop["engine_device"] == "cpu"
    assert loop["routing_agreement_min"] == 1.0 and loop["abs_logp_diff_mean_max"] <= 1e-4
    assert loop["last_tokens_per_s_per_device"] > 0 and loop["offload_gb"] > 0
    per_step = check["tables"]["per step"]
    assert [row["step"] for row in per_step] == [1, 2, 3, 4] and loop["steady_steps"] == "3,4"
    assert loop["steady_step_s"] == pytest.approx((per_step[2]["step_s"] + per_step[3]["step_s"]) / 2)
    assert loop["steady_tokens_per_s_per_device"] > 0 and "push_s" in loop and "offload_s" in loop
    assert any("sum to its time" in line for line in check["criteria"])


@pytest.mark.timeout(1500)  # the kit's run (kit_cpu_run), if this test is the first to ask for it
def test_logprobs_kernel_table_lists_the_fused_kernels_as_not_run_on_a_cpu(kit_cpu_run):
    tmp_path, done = kit_cpu_run  # the kit's run: its logprobs_kernel check
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    checks = json.loads((tmp_path / "report" / "report.json").read_text())["checks"]
    [check] = [c for c in checks if c["name"] == "logprobs_kernel"]
    [rows] = check["tables"].values()
    by_method = {(r["dtype"], r["method"]): r for r in rows}
    assert set(by_method) == {(d, m) for d in ("bf16", "fp32")
                              for m in ("megatron", "ours", "ours-inplace", "fused", "fused-inplace")}
    for dtype in ("bf16", "fp32"):
        for method in ("fused", "fused-inplace"):
            assert by_method[dtype, method]["note"] == "not run: needs CUDA and triton"
        assert by_method[dtype, "ours-inplace"]["note"] == "" and by_method[dtype, "ours-inplace"]["total_ms"] > 0
    assert any("fused kernels were not run" in note for note in check["notes"])


@pytest.mark.timeout(1500)  # the kit's run (kit_cpu_run), if this test is the first to ask for it
def test_rollout_decode_in_the_kits_cpu_mode_reports_every_decode_point(kit_cpu_run):
    import math

    from bpo_megatron.gpu_smoke.profiles import CPU

    tmp_path, done = kit_cpu_run  # the kit's run: its rollout_decode check
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [check] = [c for c in json.loads((tmp_path / "report" / "report.json").read_text())["checks"]
               if c["name"] == "rollout_decode"]
    numbers = check["numbers"]
    points = check["tables"]["decode step by context (replayed, largest size)"]
    assert {(r["point"], r["sampling"]) for r in points} == {(p.label, s) for p in CPU.decode_points
                                                             for s in ("plain", "filtered")}
    assert all(r["decode_step_ms"] > 0 and r["path"] == "eager" for r in points)
    # the goals' numbers are there on every device (nan without a graph); the scores cover every path's rows
    assert all(math.isnan(numbers[f"best_graph_hbm_fraction_{label}"]) for label in ("ctx192", "ctx576", "ctx1088"))
    assert numbers["eager_routing_agreement"] == 1.0 and numbers["eager_logp_max_abs_diff"] <= 1e-5
    assert (tmp_path / "work" / "traces" / "decode_step_eager_ctx576.json.gz").exists()


def test_unknown_checks_are_refused_and_a_check_out_of_time_is_a_reported_failure(tmp_path):
    refused = _smoke(tmp_path, "--checks", "trainer_step,warp_drive")
    assert refused.returncode == 2 and "warp_drive" in refused.stderr
    late = _smoke(tmp_path, "--checks", "trainer_step", "--timeout", "0.5")
    assert late.returncode == 1
    [check] = json.loads((tmp_path / "report" / "report.json").read_text())["checks"]
    assert not check["passed"] and "did not finish within its limit of 0 s" in check["error"]


def test_budgets_are_per_check_and_the_total_bounds_the_run(tmp_path):
    for bad in ("trainer_step", "trainer_step=0", "trainer_step=soon"):
        refused = _smoke(tmp_path, "--checks", "trainer_step", "--budgets", bad)
        assert refused.returncode == 2 and "is not NAME=SECONDS" in refused.stderr
    refused = _smoke(tmp_path, "--checks", "trainer_step", "--budgets", "warp_drive=3")
    assert refused.returncode == 2 and "--budgets: unknown warp_drive" in refused.stderr
    # trainer_step gets its budget (3 s: cut short); of 12 s of --total, too little is left for the next
    done = _smoke(tmp_path, "--checks", "trainer_step,driver_payloads", "--budgets", "trainer_step=3",
                  "--timeout", "600", "--total", "12")
    assert done.returncode == 1
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    first, second = report["checks"]
    assert "did not finish within its limit of 3 s" in first["error"]
    assert second["error"].startswith("not run:") and "left of --total 12 s" in second["error"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "| driver_payloads | not run |" in markdown and "| trainer_step | **FAIL** |" in markdown


def test_rl_loop_without_ray_is_not_run_and_says_how_the_round_brings_it(tmp_path, monkeypatch):
    from bpo_megatron.gpu_smoke.checks import rl_loop
    from bpo_megatron.gpu_smoke.profiles import CPU

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.delenv(rl_loop.RAY_STAGE_ENV, raising=False)
    out = rl_loop.run(CPU, tmp_path)
    assert out.error.startswith("not run: Ray cannot be imported") and "pip install 'ray[default]'" in out.error
    monkeypatch.setenv(rl_loop.RAY_STAGE_ENV, "missing")
    out = rl_loop.run(CPU, tmp_path).finish()
    assert not out.passed and out.error.startswith("not run: Ray not staged")
    assert "tools/gpu/stage.sh" in out.error and ".gpu-bundle-stage" in out.error


def test_payload_search_finds_every_tensor_off_the_host():
    from bpo_megatron.orchestration.host_values import device_tensors
    from bpo_megatron.trainer.actor import ScoredSamples

    off_host = torch.empty(3, device="meta")  # a device tensor a CPU machine can make
    value = {"metrics": {"loss": 1.0}, "scored": ScoredSamples(logprobs=[torch.zeros(2), off_host],
                                                               entropies=[torch.zeros(2)]),
             "nested": [(torch.zeros(1), off_host)]}
    assert device_tensors(value) == ["scored.logprobs.1 (meta)", "nested.0.1 (meta)"]
    assert device_tensors({"a": [torch.zeros(2)], "b": "text", "c": None}) == []


def test_flattened_bucket_round_trips_mixed_dtypes_exactly():
    from bpo_megatron.gpu_smoke.checks.ipc_weights import unflatten
    from bpo_megatron.rollout.sglang.weights import flattened_bucket

    named = [("a", torch.randn(3, 5).to(torch.bfloat16)), ("b", torch.randn(7)), ("c", torch.arange(4)),
             ("d", torch.randn(2, 3).t())]  # a non-contiguous view too
    bucket = flattened_bucket(named)
    flat, entries = bucket["flattened_tensor"], bucket["metadata"]
    assert flat.dtype == torch.uint8 and [e.start_idx for e in entries] == [0, 32, 64, 96]  # 16-byte aligned
    assert flat.numel() == 128  # 96 + 24 bytes, padded like every entry
    back = unflatten(flat, entries)
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert back[1][1].data_ptr() == flat.data_ptr() + entries[1].start_idx  # views, not copies


def test_peak_flops_by_device_name():
    from bpo_megatron.gpu_smoke.profiles import bf16_peak_flops

    assert bf16_peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert bf16_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert bf16_peak_flops("NVIDIA H200") == 989.4e12
    assert bf16_peak_flops("Quadro P400") is None


def test_the_bundle_carries_the_pinned_versions():
    def pins(path: Path) -> dict[str, str]:
        lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
        return dict(line.split("==") for line in lines if "==" in line)

    bundle, cpu = pins(ROOT / "tools/gpu/bundle-requirements.txt"), pins(ROOT / "tools/constraints-cpu.txt")
    for package in ("megatron-core", "transformers"):
        assert bundle[package] == cpu[package], package
    assert "torch" not in bundle  # the GPU machine's own CUDA build stays


def test_bundle_brings_what_ray_core_needs_beyond_the_gpu_image():
    lines = [line.split("#")[0].strip() for line in (ROOT / "tools/gpu/bundle-requirements.txt").read_text().splitlines()]
    bundled = {line.split("==")[0].lower() for line in lines if "==" in line}
    # Ray's own wheel travels split in two (build_bundle.sh), not through this list
    assert "ray" not in bundled
    assert {"jsonschema", "jsonschema-specifications", "referencing", "rpds-py"} <= bundled


# ------------------------------------------------------------------ the one-GPU recipe
RECIPE = ROOT / "configs" / "qwen3_moe_1gpu.yaml"


def test_one_gpu_recipe_is_the_kits_throughput_model_colocated_with_r3_and_packing():
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.gpu_smoke.profiles import GPU
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.planner import make_plan

    cfg = load_experiment(RECIPE, check_model=True)
    assert cfg.hf_config() == HFModelConfig.load(GPU.large_model)  # 16 layers, hidden 1024, 32 experts top-4
    assert cfg.model.init == "random" and cfg.data.train.startswith("procedural:")  # nothing to download
    assert (cfg.cluster.trainer_ranks, cfg.rollout.num_engines, cfg.cluster.colocate) == (1, 1, True)
    assert (cfg.cluster.gpus_per_trainer_rank, cfg.cluster.gpus_per_engine, cfg.cluster.gpus_per_node) == (1, 1, 1)
    assert cfg.rollout.engine == "hf" and cfg.rollout.options.dtype == "bf16" and cfg.rollout.options.decode == "auto"
    assert cfg.model.options.params_dtype == "bf16"
    assert cfg.model.options.routing_replay and cfg.rollout.capture_routed_experts  # R3
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1
    assert cfg.trainer.max_tokens_per_micro_batch >= 8 * longest  # packed, several samples a micro-batch
    # one minibatch: the update's weights sampled the batch, so |log π − log μ| is the engine/trainer gap
    assert cfg.train.minibatches_per_step == 1 and not cfg.train.recompute_old_logprobs
    assert cfg.eval.every == 0 and cfg.train.sft_warmup_steps == 0
    assert make_plan(cfg, cfg.hf_config()).fits


def test_one_gpu_recipe_passes_the_run_check_on_a_cpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bpo_megatron.cli", "train", str(RECIPE),
                           f"logging.run_dir={tmp_path / 'run'}", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "config ok: qwen3_moe_1gpu" in done.stdout and "starts a new run" in done.stdout


def test_the_kits_cpu_overrides_of_the_recipe_validate():
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.gpu_smoke.checks.rl_loop import MODELS
    from bpo_megatron.gpu_smoke.profiles import CPU

    cfg = load_experiment(RECIPE, [o.format(models=MODELS) for o in CPU.loop_overrides])
    assert cfg.hf_config().num_hidden_layers == 2 and cfg.cluster.gpus_per_engine == 0
    assert cfg.rollout.options.dtype == cfg.model.options.params_dtype == "fp32"


def test_the_embedded_engine_is_built_on_its_process_device(monkeypatch, tiny_checkpoint):
    """The loop's engine actor builds the engine through its spec: on the device its placement
    gave the process (a GPU under Ray's CUDA_VISIBLE_DEVICES), not always the host."""
    import torch

    from bpo_megatron import platform
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.models.routing import RoutingLayout
    from bpo_megatron.rollout import EngineContext, engine_spec
    from bpo_megatron.rollout.hf import engine as hf_engine
    from bpo_megatron.rollout.hf.options import HFEngineOptions

    model_dir = tiny_checkpoint("tiny_qwen3_moe")
    built = {}
    real = hf_engine.HFEngine.__init__

    def recording(self, *args, **kwargs):
        built.update(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(hf_engine.HFEngine, "__init__", recording)
    monkeypatch.setattr(platform, "device", lambda: torch.device("cpu", 0))  # "the process's device"
    engine = engine_spec("hf").build(HFEngineOptions(), EngineContext(str(model_dir), 0,
                                                                      RoutingLayout.of(HFModelConfig.load(model_dir))))
    assert built["device"] == torch.device("cpu", 0)
    assert next(engine.model.parameters()).device == torch.device("cpu")


# ------------------------------------------------------------------ the round's report
def test_device_slugs():
    from bpo_megatron.gpu_smoke.round_report import device_slug

    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_slug("cpu") == "cpu"


def test_pytest_summary_reads_counts_failures_and_skips():
    from bpo_megatron.gpu_smoke.round_report import pytest_summary

    text = ("..F.s\nSKIPPED [2] tests/test_x.py:12: CUDA graphs need a GPU\n"
            "FAILED tests/test_y.py::test_z - AssertionError: 0.2\n"
            "=== 1 failed, 3 passed, 2 skipped, 1 error in 9.1s ===\n")
    summary = pytest_summary(text)
    assert summary["counts"] == {"failed": 1, "passed": 3, "skipped": 2, "errors": 1}
    assert summary["failures"] == ["FAILED tests/test_y.py::test_z - AssertionError: 0.2"]
    assert summary["skips"] == ["SKIPPED [2] tests/test_x.py:12: CUDA graphs need a GPU"]
    assert not summary["timed_out"]


def test_round_report_gathers_the_parts_into_one_file_named_for_the_device(tmp_path):
    from bpo_megatron.gpu_smoke.report import Outcome, write
    from bpo_megatron.gpu_smoke.round_report import main

    out = tmp_path / "round"
    passed = Outcome("trainer_step", numbers={"loss": 1.5}, criteria=["PASS: finite"]).finish()
    skipped = Outcome("rl_loop", error="not run: Ray not staged. ...")
    slow = Outcome("train_fast_paths", numbers={"train_mfu_32k": 0.05}, criteria=["PASS: finite"]).finish()
    env = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}
    write(out / "kit", env, [skipped, slow], profile="cuda")  # the goals' part, then the rest's
    write(out / "kit-rest", env, [passed], profile="cuda")
    (out / "parts.tsv").write_text("part\tlimit_s\tseconds\tstatus\tnote\ninstall\t60\t21\t0\t12 wheels\n"
                                   "kit\t400\t300\t1\trl_loop,train_fast_paths\n"
                                   "cuda_tests\t75\t75\t124\tpytest -k cuda\nkit-rest\t0\t0\tnot run\tno time\n")
    from bpo_megatron.gpu_smoke.round_report import CHECKOUT

    (out / "cuda_tests.txt").write_text(f"..\n  {CHECKOUT}/tests/test_x.py:24: UserWarning: a warning\n"
                                        "[round] the CUDA tests did not finish within 75 s\n")
    (out / "gpu.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04\n")
    assert main([str(out), "--device", "cuda"]) == 0
    [md] = out.glob("h100-*.md")
    report = json.loads(md.with_suffix(".json").read_text())
    assert report["round"]["slug"] == "h100" and not report["round"]["passed"]
    assert report["round"]["cuda_tests"]["timed_out"] and report["round"]["seconds"] == 396
    assert [c["name"] for c in report["checks"]] == ["rl_loop", "train_fast_paths", "trainer_step"]
    goals = {g["number"]: g["verdict"] for g in report["round"]["goals"]}
    assert goals["steady_step_s"] == "not measured: rl_loop has no steady_step_s (it did not run)"
    assert goals["train_mfu_32k"] == "misses: 20% of the bound (20.0 points short)"
    text = md.read_text()
    assert text.index("## Goals") < text.index("| part |") and "0 of 8 hold, 1 miss, 7 not measured." in text
    assert "| cuda_tests | 75 | 75 | **cut at its limit** |" in text and "| kit-rest | 0 | 0 | not run |" in text
    assert "| rl_loop | not run |" in text and "### trainer_step: pass" in text
    # the report names files as the repository does, not where the machine held the checkout
    assert "  tests/test_x.py:24: UserWarning" in text and str(CHECKOUT) not in text + md.with_suffix(".json").read_text()
