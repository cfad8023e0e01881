"""The GPU validation kit in its CPU mode (so it does not rot between GPU runs), and its parts:
the report, the payload search, the flattened bucket, the FLOP count, the bundle's pins."""

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


def test_cpu_smoke_run_passes_every_check_with_its_numbers(tmp_path):
    from bpo_megatron.gpu_smoke.checks import CHECKS

    done = _smoke(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["passed"] and list(checks) == list(CHECKS)
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
    # both decode loops, side by side, scored against a teacher-forced recompute (fp32)
    decode = numbers["rollout_decode"]
    for path in ("transformers", "static"):
        assert decode[f"{path}_routing_agreement"] == 1.0
        assert decode[f"{path}_logp_max_abs_diff"] <= 1e-5
        assert all(decode[f"{path}_{rows}_tokens_per_s"] > 0 for rows in (4, 8))
    # packed and padded micro-batches score the same long-tailed samples alike (fp32)
    assert numbers["rl_throughput"]["packed_logp_max_abs_diff"] <= 1e-5
    assert 0 < numbers["rl_throughput"]["varied_positions"] < 4 * 2 * (8 + 24)
    assert numbers["rl_throughput"]["packed_train_tokens_per_s"] > 0 < numbers["rl_throughput"]["padded_train_tokens_per_s"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert all(f"## {name}: pass" in markdown for name in CHECKS)


def test_logprobs_kernel_table_lists_the_fused_kernels_as_not_run_on_a_cpu(tmp_path):
    done = _smoke(tmp_path, "--checks", "logprobs_kernel")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [check] = json.loads((tmp_path / "report" / "report.json").read_text())["checks"]
    [rows] = check["tables"].values()
    by_method = {(r["dtype"], r["method"]): r for r in rows}
    assert set(by_method) == {(d, m) for d in ("bf16", "fp32")
                              for m in ("megatron", "ours", "ours-inplace", "fused", "fused-inplace")}
    for dtype in ("bf16", "fp32"):
        for method in ("fused", "fused-inplace"):
            assert by_method[dtype, method]["note"] == "not run: needs CUDA and triton"
        assert by_method[dtype, "ours-inplace"]["note"] == "" and by_method[dtype, "ours-inplace"]["total_ms"] > 0
    assert any("fused kernels were not run" in note for note in check["notes"])


def test_unknown_checks_are_refused_and_a_check_out_of_time_is_a_reported_failure(tmp_path):
    refused = _smoke(tmp_path, "--checks", "trainer_step,warp_drive")
    assert refused.returncode == 2 and "warp_drive" in refused.stderr
    late = _smoke(tmp_path, "--checks", "trainer_step", "--timeout", "0.5")
    assert late.returncode == 1
    [check] = json.loads((tmp_path / "report" / "report.json").read_text())["checks"]
    assert not check["passed"] and "did not finish within --timeout 0" in check["error"]


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


def test_flops_count_matches_a_per_position_sum():
    from bpo_megatron.gpu_smoke.checks.rl_throughput import forward_flops
    from bpo_megatron.gpu_smoke.profiles import GPU
    from bpo_megatron.models import HFModelConfig
    from bpo_megatron.weights.names import parameter_counts

    hf = HFModelConfig.load(GPU.large_model)
    _, active = parameter_counts(hf)
    width = hf.num_attention_heads * hf.head_dim
    n = 37
    # position i attends to i + 1 keys: QKᵀ and AV cost 2·width FLOPs per key each, in every layer
    by_position = sum(2 * (active - hf.vocab_size * hf.hidden_size) + 4 * width * hf.num_hidden_layers * (i + 1)
                      for i in range(n))
    assert forward_flops(hf, [n], active) == pytest.approx(by_position, rel=1e-12)
    assert forward_flops(hf, [n, 5], active) == pytest.approx(by_position + forward_flops(hf, [5], active))


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
