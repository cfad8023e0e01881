"""The RL loop end to end over SGLang stand-in servers (SGLang 0.5.23's own HTTP server, request
types, weight-update manager and memory-tag rules per TP rank; our generation): every health
check, release, resume and weight update in an order a real server accepts — the stand-in dies
of a generation on released memory, of a release while requests run and of resuming a tag it
holds, and refuses a caller without its key. Each run is a process of its own with its own Ray
(``run_loop.py``), whose workers send the colocated transport's buckets by value (no GPU here:
``standin_hooks.py``). The cluster runs are scaled to this machine: 2 trainer ranks and engines of
TP 2 (the recipes' 4 nodes × 8 GPUs would need ~40 GB of processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_sglang_contract import SGLANG_PYTHON, STANDIN

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

pytestmark = [
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is missing: bash tools/setup.sh --sglang"),
    pytest.mark.timeout(900),
]

SMALL = ("train.steps=3", "train.sft_warmup_steps=2", "train.sft_batch_size=8", "train.prompts_per_step=4",
         "rollout.group_size=4", "train.minibatches_per_step=2", "trainer.micro_batch_size=4", "eval.every=3",
         "eval.limit=8", "eval.k=2", "checkpoint.every=3", "logging.tensorboard=false", "rollout.engine=sglang",
         f"rollout.sglang.launcher=[{SGLANG_PYTHON}, {STANDIN}]", "rollout.sglang.tp_size=2",
         "rollout.sglang.max_inflight=16", "rollout.sglang.startup_timeout_s=300")


def _run(tmp_path: Path, *overrides: str, nodes: str | None = None, standin: tuple[str, ...] = ()
         ) -> tuple[list[dict], list[dict], str]:
    """The loop over stand-in servers; ``standin``: more of the stand-in's test controls."""
    log = tmp_path / "calls.jsonl"
    run_dir = tmp_path / "run"
    controls = ", ".join(["--standin-call-log", str(log), "--standin-token-delay", "'0.01'",
                          "--standin-marker-dir", str(tmp_path), *standin])
    command = [sys.executable, str(HERE / "run_loop.py"), *(["--nodes", nodes] if nodes else []), str(run_dir),
               *SMALL, f"rollout.sglang.extra_args=[{controls}]", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=850)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["step"] == 3
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return metrics, calls, output


def _servers(calls: list[dict]) -> dict[int, list[dict]]:
    by_port: dict[int, list[dict]] = {}
    for call in calls:
        by_port.setdefault(call["port"], []).append(call)
    return by_port


def _check_order(calls: list[dict], *, memory_saver: bool) -> None:
    """SGLang's rules, replayed: resume only what was released; no generation on released
    memory; weight updates inside a session."""
    released: set[str] = set()
    in_session = False
    for call in calls:
        kind = call["call"]
        if kind == "release_memory_occupation":
            assert not released & set(call["tags"]), call
            released |= set(call["tags"])
        elif kind == "resume_memory_occupation":
            assert set(call["tags"]) <= released, (call, released)
            released -= set(call["tags"])
        elif kind == "generate":
            assert not (memory_saver and call["released"]), call
        elif kind == "begin_weight_update":
            in_session = True
        elif kind == "end_weight_update":
            in_session = False
        elif kind.startswith("update_weights"):
            assert in_session and "weights" not in released, call


@pytest.mark.slow  # CI time (≈ 290 s; the colocated engine-death run below stays): run with -m slow
def test_a_colocated_run_over_four_nodes_keeps_each_engine_beside_its_trainer_rank(tmp_path):
    """cluster.colocate over four Ray nodes (127.0.0.2 … 127.0.0.5, one device each: the recipes'
    4 nodes, with one device per node where they have 8, as this machine holds ~10 GB of processes,
    not the ~50 GB of 32 trainer ranks and 32 TP ranks): four engines, each bound to and advertised
    at its own node's address, each given every bucket through the IPC route, and every
    release, resume, health check and weight update of the offload phases in an order SGLang
    accepts, on every server: all memory released at start, the weights resumed (and synced) before
    the KV cache and graphs, all released again for training; 3 RL steps and 2 evaluations.
    (One engine of TP 2 colocated is the death test's below.)"""
    metrics, calls, output = _run(tmp_path, "cluster.colocate=true", "rollout.num_engines=4", "cluster.trainer_ranks=4",
                                  "rollout.sglang.tp_size=1", nodes="1,1,1,1")
    assert "replacing" not in output
    assert [m["step"] for m in metrics if m["step"] > 0] == [1, 2, 3] and "eval/mean_avg@2" in metrics[-1]
    servers = _servers(calls)
    assert len(servers) == 4
    assert {server[0]["host"] for server in servers.values()} == {f"127.0.0.{i}" for i in (2, 3, 4, 5)}
    for server in servers.values():
        _check_order(server, memory_saver=True)
        memory = [(c["call"], tuple(c["tags"])) for c in server if "memory" in c["call"]]
        assert memory[0] == ("release_memory_occupation", ("kv_cache", "weights", "cuda_graph"))
        assert memory[1:4] == [("resume_memory_occupation", ("weights",)),
                               ("resume_memory_occupation", ("kv_cache", "cuda_graph")),
                               ("release_memory_occupation", ("kv_cache", "weights", "cuda_graph"))]
        assert {c["host"] for c in server} == {server[0]["host"]}
        assert sum(1 for c in server if c["call"] == "generate" and not c["health"]) > 0
        assert not any(c["call"] == "generate" and c["health"] for c in server)
        assert sum(c["call"] == "update_weights_from_tensor" for c in server) >= 3


@pytest.mark.slow  # CI time (≈ 180 s; the disaggregated broadcast test of test_sglang_contract stays): run with -m slow
def test_engines_on_another_node_are_reached_at_its_address(tmp_path):
    """Engines apart, on one Ray node of this machine (127.0.0.2 or 127.0.0.3) and the trainer on
    the other: each server binds and is advertised by its node's address, trainer rank 0 (the other
    node) announces every bucket there with the server's key and broadcasts it over the weight group
    it hosts at its own node's address."""
    metrics, calls, output = _run(tmp_path, "cluster.colocate=false", "rollout.num_engines=2", "cluster.trainer_ranks=2",
                                  nodes="2,2")
    assert "replacing" not in output
    assert [m["step"] for m in metrics if m["step"] > 0] == [1, 2, 3]
    servers = _servers(calls)
    assert len(servers) == 2
    for server in servers.values():
        _check_order(server, memory_saver=False)
        joins = [c for c in server if c["call"] == "init_weights_update_group"]
        assert len(joins) == 1 and joins[0]["world_size"] == 5
        assert sum(c["call"] == "update_weights_from_distributed" for c in server) >= 3
    # the placement fills one node with the trainer's bundles and the other with the engines'
    # (which node is which, Ray decides): every server bound the engines' node's address, and
    # trainer rank 0 hosted the weight group at the other node's
    hosts = {call["host"] for call in calls}
    masters = {call["master_address"] for call in calls if call["call"] == "init_weights_update_group"}
    assert len(hosts) == 1 and len(masters) == 1 and hosts | masters == {"127.0.0.2", "127.0.0.3"}, (hosts, masters)


def _trained_once(metrics: list[dict]) -> None:
    """Steps 1, 2, 3 each trained once, on a whole batch (its 4 prompts)."""
    steps = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["num_groups"] == 4 for m in steps), [m["num_groups"] for m in steps]


def test_an_engine_that_dies_while_the_colocated_trainer_trains_is_replaced(tmp_path):
    """cluster.colocate: the server dies 0.05 s after its second release (the trainer has the
    devices and trains step 1). The next rollout phase finds it dead before asking anything of it,
    starts one replacement while the trainer is still offloaded, brings it to its peers' memory
    state and the current weights, and the run trains steps 2 and 3 on it; the replacement, too,
    gets every call in an order SGLang accepts."""
    metrics, calls, output = _run(tmp_path, "cluster.colocate=true", "rollout.num_engines=1",
                                  standin=("--standin-die-after-release", "'2'", "--standin-die-delay", "'0.05'"))
    assert output.count("replacing it") + output.count("replacing them") == 1, output[-3000:]
    _trained_once(metrics)
    first, second = _servers(calls).values()
    assert sum(c["call"] == "release_memory_occupation" for c in first) == 2
    assert first[-1]["call"] == "release_memory_occupation", "it died under the trainer, before the next sync"
    for server in (first, second):
        _check_order(server, memory_saver=True)
    # the replacement received the weights before it generated anything
    updates = [i for i, c in enumerate(second) if c["call"].startswith("update_weights")]
    generations = [i for i, c in enumerate(second) if c["call"] == "generate" and not c["health"]]
    assert updates and generations and updates[0] < generations[0]


@pytest.mark.slow  # CI time (≈ 195 s; pause/continue per engine: test_partial_rollout_routing): run with -m slow
def test_an_async_run_four_steps_ahead_loses_an_engine_once_and_restarts_it_once(tmp_path):
    """train.async.max_staleness=4, engines apart: up to five batches under way while the trainer
    trains and weights are pushed (partial rollouts: pause in ``retract`` mode, update, continue),
    every sample at most 4 updates stale. The server exits on its 20th /generate (requests in
    flight): it is replaced once — one death, one restart, no engine taken for a hung one — the
    lost requests go to the replacement, and every step trains once on a whole batch."""
    metrics, calls, output = _run(tmp_path, "cluster.colocate=false", "rollout.num_engines=1",
                                  "train.async.max_staleness=4", "rollout.max_restarts=1",
                                  standin=("--standin-die-after", "'20'"))
    assert output.count("replacing it") + output.count("replacing them") == 1, output[-3000:]
    assert "restarts (at most" not in output
    _trained_once(metrics)
    assert all(m["async/staleness_max"] <= 4 for m in metrics if m["step"] > 0)
    servers = list(_servers(calls).values())
    assert len(servers) == 2
    for server in servers:
        _check_order(server, memory_saver=False)
    pauses = [c for server in servers for c in server if c["call"] == "pause_generation"]
    assert pauses and {c["mode"] for c in pauses} == {"retract"}


@pytest.mark.ci  # a second stand-in loop (≈ 230-350 s): the server's FP8 arguments, checkpoint and e4m3 buckets
# are in the default run in tests/test_fp8.py's FP8-server and launch tests and test_fp8_weights.py
def test_an_fp8_served_engine_starts_from_block_fp8_and_receives_e4m3_weights_with_their_scales(tmp_path):
    """rollout.sglang.quantization=fp8 over the stand-in (SGLang's own server arguments, weight-update
    requests and flattened-bucket receiving): the server is started with --quantization fp8 on the
    block-FP8 checkpoint beside the run's weights, and every weight update carries each linear
    weight as e4m3 with its weight_scale_inv (the stand-in's ranks load them by name and shape).
    The model is the tiny one widened to SGLang's 128-blocks per TP rank (q, k, v, o and the experts
    at the engine's TP 2), which FP8 serving needs (rollout/sglang/fp8_layout.py)."""
    aligned = json.loads((ROOT / "configs" / "models" / "tiny_qwen3_moe" / "config.json").read_text())
    aligned.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=256, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=128)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(aligned))
    metrics, calls, output = _run(tmp_path, "cluster.colocate=false", "rollout.num_engines=1",
                                  "cluster.trainer_ranks=2", "rollout.sglang.quantization=fp8",
                                  f"model.path={tmp_path / 'model'}")
    [start] = [call for call in calls if call["call"] == "start"]  # SGLang's own ServerArgs of the command line
    assert start["quantization"] == "fp8" and start["model_path"].endswith("initial_hf.fp8")
    updates = [call for call in calls if call["call"] == "update_weights_from_distributed"]
    assert updates
    scales = sum(call["scales"] for call in updates)
    assert scales > 0 and all("float8_e4m3fn" in call["dtypes"] for call in updates if call["scales"])
    assert [r["step"] for r in metrics if "reward_mean" in r] == [1, 2, 3]
