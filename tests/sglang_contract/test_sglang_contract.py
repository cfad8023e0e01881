"""Our SGLang client against SGLang 0.5.23's own code (``standin_server.py``): its HTTP routes and
request types, its ``ServerArgs`` parser (our launch command), its weight-update session rules, its
per-TP-rank deserialisation, its ``init_custom_process_group`` receivers and its memory-tag rules,
with TP = 2, in a separate process tree with its own authkey. They need SGLang's environment
(``bash tools/setup.sh --sglang``; CI builds it) and skip without it.

What the stand-in cannot show (no GPU here): CUDA IPC handles, NCCL, real generation. The model is
a random tiny Qwen3-MoE whose first layer is dense, so SGLang's routed experts (every layer) and
the trainer's (MoE layers only) differ in layout.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bpo_megatron.models import HFModelConfig
from bpo_megatron.models.routing import RoutingLayout
from bpo_megatron.rollout import GenerationRequest, SamplingParams
from bpo_megatron.rollout.agents import Agent, AgentConfig, Conversations
from bpo_megatron.weights.checksums import fingerprints
from bpo_megatron.rollout.engine import EngineLost
from bpo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from bpo_megatron.rollout.sglang.engine import WeightUpdateRefused
from bpo_megatron.rollout.sglang.protocol import generate_body
from bpo_megatron.rollout.sglang.weights import flattened_bucket, inline_serializer, ipc_payload, ipc_update_body
from bpo_megatron.rollout.types import response_slots
from bpo_megatron.testing.models import random_checkpoint
from bpo_megatron.testing import MODEL_CONFIGS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
STANDIN = HERE / "standin_server.py"
FIXTURE = MODEL_CONFIGS / "tiny_qwen3_moe" / "config.json"
TP = 2

pytestmark = [
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is missing: bash tools/setup.sh --sglang"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """The served model (3 layers, the first dense) and other weights of it to push."""
    config = {**json.loads(FIXTURE.read_text()), "num_hidden_layers": 3, "mlp_only_layers": [0]}
    root = tmp_path_factory.mktemp("sglang_models")
    (root / "config.json").write_text(json.dumps(config))
    return (random_checkpoint(root / "config.json", root / "served", seed=0),
            random_checkpoint(root / "config.json", root / "pushed", seed=1))


@pytest.fixture(scope="module")
def layout(checkpoints) -> RoutingLayout:
    return RoutingLayout.of(HFModelConfig.load(checkpoints[0]))


@pytest.fixture(scope="module")
def pushed(checkpoints) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(checkpoints[1] / "model.safetensors")).items())


def start(model_dir: Path, layout: RoutingLayout, work: Path, *controls: str, **options) -> SGLangEngine:
    cfg = SGLangConfig(model_path=str(model_dir), launcher=(str(SGLANG_PYTHON), str(STANDIN)), tp_size=TP,
                       extra_args=("--standin-marker-dir", str(work), *controls), startup_timeout_s=300,
                       request_timeout_s=60, max_inflight=4, weight_bucket_bytes=4096,
                       **options)
    return SGLangEngine(cfg, routing=layout, serializer=inline_serializer)


@pytest.fixture(scope="module")
def engine(checkpoints, layout, tmp_path_factory):
    made = start(checkpoints[0], layout, tmp_path_factory.mktemp("standin"))
    yield made
    made.shutdown()


def state(engine: SGLangEngine) -> dict:
    return engine.endpoint().get("standin/state", timeout=30)


def requests(count: int = 4, n: int = 2) -> list[GenerationRequest]:
    return [GenerationRequest(f"q{i}", tuple(range(1, 4 + i)), SamplingParams(max_new_tokens=6, n=n, seed=10 * i))
            for i in range(count)]


# ------------------------------------------------------------------------------ generation
def test_routing_from_every_layer_is_cut_to_the_moe_layers(engine, layout):
    """SGLang reports routed experts for all 3 layers (the dense one zero); samples carry the
    2 MoE layers' rows, as bytes, exactly as the server sent them."""
    samples = engine.generate(requests())
    assert [(s.request_id, s.index) for s in samples] == [(f"q{i}", j) for i in range(4) for j in range(2)]
    raw = engine.endpoint().post("generate", generate_body(response_slots(requests()), capture_routing=True),
                                 timeout=60)
    for sample, answer in zip(samples, raw):
        every_layer = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), "<i4").reshape(
            -1, 3, layout.topk)
        assert not every_layer[:, 0].any() and every_layer.shape[0] == sample.tokens.numel() - 1
        assert sample.routed_experts.dtype == torch.uint8
        assert torch.equal(sample.routed_experts.long(), torch.from_numpy(every_layer[:, [1, 2]].copy()).long())
        assert sample.weight_version == 0  # SGLang's "default": the checkpoint it started from


def test_requests_that_do_not_ask_for_routing_get_none_over_the_wire(engine, layout, monkeypatch):
    """Evaluation's requests (``capture_routing=False``) beside training's in one generation: their
    bodies do not ask SGLang for routed experts, its answers carry none, and their samples have
    none; the others' routing is what a capturing request always got."""
    import bpo_megatron.rollout.sglang.client as client_module

    posted = {}

    def recording(items, *, capture_routing):
        body = generate_body(items, capture_routing=capture_routing)
        posted.update({rid: body["return_routed_experts"] for rid in body["rid"]})
        return body

    monkeypatch.setattr(client_module, "generate_body", recording)
    mixed = [GenerationRequest(r.request_id, r.prompt_tokens, r.sampling, capture_routing=i % 2 == 0)
             for i, r in enumerate(requests())]
    samples = engine.generate(mixed)
    assert posted == {f"q{i}#{j}": i % 2 == 0 for i in range(4) for j in range(2)}
    reference = engine.generate(requests())
    assert all(posted.values())
    for sample, other in zip(samples, reference):
        if int(sample.request_id[1:]) % 2:
            assert sample.routed_experts is None
        else:
            assert torch.equal(sample.routed_experts, other.routed_experts)
    raw = engine.endpoint().post("generate", generate_body(response_slots(mixed[1:2]), capture_routing=True),
                                 timeout=60)
    assert all("routed_experts" not in answer["meta_info"] for answer in raw)


@pytest.mark.ci  # a server of its own (CI time): every check of it holds in the default run on the same pause, update and continue, test_partial_rollout_routing.py's [retract] run
def test_a_generation_paused_for_a_weight_update_continues_and_dates_every_token(checkpoints, layout, pushed,
                                                                                tmp_path):
    """Partial rollouts (train.async): a weight update reaches the engine while it generates. The
    client pauses SGLang (retract: requests and their output kept), pushes the weights in SGLang's
    session and continues; the same /generate answers finish with the new weights. Each token's
    version comes from SGLang's own weight_versions spans (its recording rule and span functions
    run in the stand-in), and its μ is the log-prob computed with that version's weights."""
    from concurrent.futures import ThreadPoolExecutor

    engine = start(checkpoints[0], layout, tmp_path, "--standin-token-delay", "0.3")
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(engine.generate, requests(count=2, n=2))
            deadline = time.monotonic() + 60
            while state(engine)["tokens"] < 4:  # every request has decoded a token
                assert time.monotonic() < deadline, "the stand-in decoded no token in 60 s"
                time.sleep(0.05)
            engine.begin_weight_update(1)
            paused_at = state(engine)["tokens"]
            time.sleep(1.0)  # three decoding steps' time: nothing decodes while paused
            assert state(engine)["tokens"] == paused_at
            engine.update_weights(iter(pushed))
            engine.end_weight_update()
            samples = future.result(timeout=120)
    finally:
        engine.shutdown()
    assert len(samples) == 4 and sum(s.response_tokens.numel() for s in samples) > paused_at
    spanning = 0
    for sample in samples:
        versions = sample.token_versions
        assert versions.shape == sample.response_tokens.shape and set(versions.tolist()) <= {0, 1}
        assert (versions.diff() >= 0).all() and sample.weight_version == int(versions.min())
        want = torch.tensor([-0.1 * (i + 1) - 0.01 * v for i, v in enumerate(versions.tolist())])
        assert torch.allclose(sample.rollout_logprobs, want)
        spanning += versions[0] == 0 and versions[-1] == 1
    assert spanning >= 1, [s.token_versions.tolist() for s in samples]
    assert sum(int((s.token_versions == 0).sum()) for s in samples) == paused_at


# --------------------------------------------------------------------------------- weights
def test_an_update_outside_sglangs_session_is_refused(engine, pushed):
    """What the client did before: update_weights_from_tensor with no begin_weight_update."""
    body = ipc_update_body([ipc_payload(flattened_bucket(pushed[:2]), inline_serializer)] * TP, version=1)
    with pytest.raises(WeightUpdateRefused, match="must run between begin_weight_update"):
        engine._checked("update_weights_from_tensor", body)


def test_ipc_route_updates_every_tp_rank_inside_a_session_with_its_version(engine, pushed):
    """SGLang's flattened buckets, one entry per TP rank, loaded by SGLang's own loader."""
    before = state(engine)
    engine.begin_weight_update(3)
    sent = engine.update_weights(iter(pushed))
    engine.end_weight_update()
    after = state(engine)
    want = fingerprints(pushed)
    assert sent == sum(t.numel() * t.element_size() for _, t in pushed)
    assert len(after["fingerprints"]) == TP and all(ranks == want for ranks in after["fingerprints"])
    assert before["fingerprints"][0] != want
    assert after["versions"] == ["3"] * TP
    calls = after["calls"][len(before["calls"]):]
    names = [c["call"] for c in calls]
    assert names[:2] == ["pause_generation", "begin_weight_update"] and calls[0]["mode"] == "retract"
    assert names[-3:] == ["end_weight_update", "flush_cache", "continue_generation"]
    updates = [c for c in calls if c["call"] == "update_weights_from_tensor"]
    assert len(updates) > 1 and all(u["entries"] == TP and u["version"] == "3" for u in updates)
    assert {u["load_format"] for u in updates} == {"flattened_bucket"}
    assert {s.weight_version for s in engine.generate(requests(count=1))} == {3}


def test_host_tensors_never_travel_as_ipc_handles(pushed):
    """A host tensor pickled by SGLang's serializer is a file descriptor of this process tree,
    which the server cannot open (the next test): the client refuses host tensors on that route."""
    with pytest.raises(ValueError, match="in host memory, which another process cannot map"):
        ipc_payload(flattened_bucket(pushed[:1]))


@pytest.mark.ci  # a server killed on purpose (CI time): the client's refusal that keeps every server clear of it is the test above
def test_a_host_tensor_sent_as_an_ipc_handle_kills_the_server(pushed, checkpoints, layout, tmp_path):
    """The server (another process tree, another authkey) cannot open the file descriptor a host
    tensor pickles to: its scheduler dies."""
    from multiprocessing.reduction import ForkingPickler

    victim = start(checkpoints[0], layout, tmp_path)
    victim._serializer = lambda named: bytes(ForkingPickler.dumps(named))  # SGLang's serializer's pickling
    try:
        victim.begin_weight_update(1)
        with pytest.raises((WeightUpdateRefused, EngineLost)):  # refused, or its server died of it
            victim.update_weights(iter(pushed[:1]))
        time.sleep(1.0)
        assert not victim.health().healthy, "the stand-in's TP rank could not open the descriptor and died"
    finally:
        victim.shutdown()


# ---------------------------------------------------------------------------------- memory
def test_memory_is_released_and_resumed_by_sglangs_tags(engine, pushed):
    """The colocated order: release everything, resume the weights, sync, resume the rest."""
    from bpo_megatron.orchestration.phases import WEIGHTS

    before = len(state(engine)["calls"])
    engine.release_memory()
    engine.resume_memory(WEIGHTS)
    engine.begin_weight_update(4)
    engine.update_weights(iter(pushed))
    engine.end_weight_update()
    engine.resume_memory(())  # the rest of what it released
    assert len(engine.generate(requests(count=1))) == 2
    memory = [c for c in state(engine)["calls"][before:] if "memory" in c["call"]]
    assert memory == [{"call": "release_memory_occupation", "tags": ["kv_cache", "weights", "cuda_graph"]},
                      {"call": "resume_memory_occupation", "tags": ["weights"]},
                      {"call": "resume_memory_occupation", "tags": ["kv_cache", "cuda_graph"]}]


def test_the_client_resumes_only_memory_it_released(engine):
    """Resuming a tag that was not released kills SGLang's scheduler (the next test): the client
    names only tags it released, so this resume sends nothing."""
    before = len(state(engine)["calls"])
    engine.resume_memory(("kv_cache",))
    assert engine.health().healthy and not [c for c in state(engine)["calls"][before:] if "memory" in c["call"]]


@pytest.mark.ci  # a server killed on purpose (CI time): the client's side, that it never sends such a call, is the test above
def test_resuming_memory_that_was_not_released_kills_sglangs_scheduler(checkpoints, layout, tmp_path):
    """SGLang's own rule, which the colocation phases must never break."""
    engine = start(checkpoints[0], layout, tmp_path)
    try:
        engine.resume_memory(("kv_cache",))  # the client names only tags it released: no call
        assert engine.health().healthy and not [c for c in state(engine)["calls"] if "memory" in c["call"]]
        with pytest.raises(Exception):  # what the client never sends
            engine._post("resume_memory_occupation", {"tags": ["kv_cache"]})
        time.sleep(1.0)
        assert not engine.health().healthy
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------- lifecycle
def test_a_server_that_dies_mid_generate_loses_the_engine_instead_of_serving_old_weights(
        checkpoints, layout, tmp_path):
    engine = start(checkpoints[0], layout, tmp_path, "--standin-die-after", "2")
    with pytest.raises(EngineLost, match="weights of version 0 gone"):
        engine.generate(requests(count=6))
    assert engine.server.process is None  # stopped, not restarted with the initial weights


def _gone(pids: list[int], within_s: float = 15.0) -> bool:
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow  # CI time (≈ 145 s; a replaced engine resynced: test_loop_over_standin's engine death): run with -m slow
@pytest.mark.timeout(600)
def test_a_lost_engine_is_replaced_and_given_the_current_weights_before_its_requests(
        ray_session, checkpoints, pushed, tmp_path):
    """The server dies mid-step: its actor is replaced, the new server (a fresh port) gets the
    current weights (version 7) before the engine's requests are sent again, so no sample comes
    from the initial weights. Then the actor itself is killed: its server goes with it."""
    import ray

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.groups import EngineGroup

    def _use_inline_serializer(worker) -> None:  # defined here: Ray ships it by value to the actor
        from bpo_megatron.rollout.sglang.weights import inline_serializer

        worker.engine._serializer = inline_serializer  # the test's stand-in for the trainer's transport

    def _server_pids(worker) -> list[int]:
        import psutil

        supervisor = worker.engine.server.process.pid
        return [supervisor] + [p.pid for p in psutil.Process(supervisor).children(recursive=True)]

    cfg = load_experiment(None, [
        f"model.path={checkpoints[0]}", "model.tokenizer=char", "rollout.engine=sglang", "rollout.num_engines=1",
        "rollout.max_restarts=2", "data.max_prompt_tokens=16", "rollout.max_new_tokens=8",
        f"rollout.sglang.launcher=[{SGLANG_PYTHON}, {STANDIN}]", f"rollout.sglang.tp_size={TP}",
        f"rollout.sglang.extra_args=[--standin-marker-dir, {tmp_path}, --standin-die-after, '2']",
        "rollout.sglang.startup_timeout_s=300",
        "rollout.sglang.max_inflight=3"], check_model=True)
    group = EngineGroup(cfg.engine_group_spec(), str(checkpoints[0]))
    given: list[tuple[list[int], int]] = []

    def give_current_weights(indices: list[int]) -> None:
        for i in indices:
            ray.get(group.workers[i].__ray_call__.remote(_use_inline_serializer))
        group.call("begin_weight_update", 7, only=indices)
        group.call("update_weights", pushed, only=indices)
        group.call("end_weight_update", only=indices)
        given.append((indices, group.call("weight_version", only=indices)[0]))

    class GivesCurrentWeights:  # the group's custodian: a replacement starts at once and gets version 7
        def starting_engines(self, indices: list[int], start) -> None:
            start()

        def resync(self, indices: list[int]) -> None:
            give_current_weights(indices)

    try:
        group.entrust(GivesCurrentWeights())
        give_current_weights([0])
        first_server = ray.get(group.workers[0].__ray_call__.remote(_server_pids))
        samples = group.generate(requests(count=6))
        assert given == [([0], 7), ([0], 7)], "the replacement got the current weights"
        assert len(samples) == 12 and {s.weight_version for s in samples} == {7}
        assert _gone(first_server), "the dead server's processes are gone"

        second_server = ray.get(group.workers[0].__ray_call__.remote(_server_pids))
        assert set(second_server).isdisjoint(first_server)
        ray.kill(group.workers[0], no_restart=True)
        assert _gone(second_server), "a killed engine actor leaves no server behind"
    finally:
        group.shutdown()


@pytest.mark.timeout(600)
def test_trainer_rank_0_broadcasts_each_bucket_to_every_engine_rank_at_once(ray_session, checkpoints, tmp_path):
    """The disaggregated transport end to end: a Megatron trainer (holding the pushed weights)
    and 2 engines of TP 2 form one group of 5 (trainer rank 0 hosting it, the servers' ranks
    joining through SGLang's own code); each sync is one session per engine and one broadcast per
    bucket. An engine replaced between syncs makes the next one re-form the group."""
    import ray

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.groups import EngineGroup, TrainerGroup
    from bpo_megatron.weight_sync.plan import SyncPlan
    from bpo_megatron.weight_sync.session import WeightSync

    served, pushed_dir = checkpoints
    cfg = load_experiment(None, [
        f"model.path={served}", "model.tokenizer=char", "model.routing_replay=false", "rollout.engine=sglang",
        "rollout.num_engines=2", "cluster.colocate=false", "data.max_prompt_tokens=16", "rollout.max_new_tokens=8",
        f"rollout.sglang.launcher=[{SGLANG_PYTHON}, {STANDIN}]", f"rollout.sglang.tp_size={TP}",
        "rollout.sglang.startup_timeout_s=300"], check_model=True)
    transport = cfg.weight_transport()
    engines = EngineGroup(cfg.engine_group_spec(), str(served))
    trainer = TrainerGroup(cfg.trainer_spec(), cfg.cluster)
    try:
        trainer.call("load_hf", str(pushed_dir))
        want = fingerprints(pushed_of(pushed_dir).items())

        def states():
            return [server.get("standin/state", timeout=30) for server in engines.call("endpoint")]

        assert transport == "bpo_megatron.rollout.sglang.nccl_broadcast:NcclBroadcast" and all(s["fingerprints"][0] != want for s in states())
        report = WeightSync(trainer, engines, SyncPlan(transport, bucket_bytes=8192)).sync(1)
        assert report["sync_bytes"] == sum(t.numel() * t.element_size() for t in pushed_of(pushed_dir).values())
        after = states()
        assert all(ranks == want for s in after for ranks in s["fingerprints"])
        assert [s["versions"] for s in after] == [["1"] * TP] * 2
        announced = [c for s in after for c in s["calls"] if c["call"] == "update_weights_from_distributed"]
        # one broadcast per bucket: SGLang receives it into one flattened buffer and loads from there
        assert announced and {c["load_format"] for c in announced} == {"flattened_bucket"}
        joins = [[c for c in s["calls"] if c["call"] == "init_weights_update_group"] for s in after]
        assert [j[0]["rank_offset"] for j in joins] == [1, 1 + TP] and {j[0]["world_size"] for j in joins} == {5}

        ray.kill(engines.workers[1], no_restart=True)  # dies between syncs
        WeightSync(trainer, engines, SyncPlan(transport, bucket_bytes=8192)).sync(2)
        assert engines.restarts == 1
        assert [s["versions"] for s in states()] == [["2"] * TP] * 2
        assert all(ranks == want for s in states() for ranks in s["fingerprints"])
    finally:
        engines.shutdown()
        trainer.shutdown()


def pushed_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


# CI time (a server and 2 trainer ranks of its own). In the default run: the colocated transport end to end in
# test_loop_over_standin.py's engine-death run (2 trainer ranks' buckets through the weight sync to an engine of
# TP 2, colocated); every TP rank's fingerprints after an update on the same route in
# test_ipc_route_updates_every_tp_rank_inside_a_session_with_its_version; TP rank r reading rank r's entry in
# test_ipc_payload.py
@pytest.mark.ci
@pytest.mark.timeout(600)
def test_colocated_engine_ranks_each_map_the_trainer_rank_beside_them(ray_session, checkpoints, tmp_path):
    """The colocated transport end to end: 2 trainer ranks and an engine of TP 2 on the same
    (here: declared) GPUs; each trainer rank flattens every bucket on its own device and SGLang's
    TP rank t loads the entry made by trainer rank t, inside one session with the version."""
    import ray

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.groups import EngineGroup, TrainerGroup
    from bpo_megatron.weight_sync.plan import SyncPlan
    from bpo_megatron.weight_sync.session import WeightSync

    def _tag_ipc_payloads(worker) -> None:  # defined here: Ray ships it by value to the trainer actor
        """The trainer rank's CUDA IPC transport with the test's serializer (host bytes inline, as no
        GPU is here), its buckets tagged with the rank that made them."""
        from bpo_megatron.rollout.sglang.weights import inline_serializer
        from bpo_megatron.rollout.sglang.cuda_ipc import CudaIpc

        def serializer(bucket, rank=worker.rank):
            for entry in bucket["metadata"]:
                entry.origin = rank  # SGLang's loader reads only the fields it knows
            return inline_serializer(bucket)

        # (transport, engine group): the transport as the engine's spec declares it
        worker._transports[("bpo_megatron.rollout.sglang.cuda_ipc:CudaIpc", "rollout")] = CudaIpc(serializer=serializer)

    served, pushed_dir = checkpoints
    cfg = load_experiment(None, [
        f"model.path={served}", "model.tokenizer=char", "model.routing_replay=false", "rollout.engine=sglang",
        "rollout.num_engines=1", "cluster.colocate=true", "cluster.trainer_ranks=2", "data.max_prompt_tokens=16",
        "rollout.max_new_tokens=8", f"rollout.sglang.launcher=[{SGLANG_PYTHON}, {STANDIN}]",
        f"rollout.sglang.tp_size={TP}", "rollout.sglang.startup_timeout_s=300"], check_model=True)
    transport = cfg.weight_transport()
    engines = EngineGroup(cfg.engine_group_spec(), str(served))
    trainer = TrainerGroup(cfg.trainer_spec(), cfg.cluster)
    try:
        trainer.call("load_hf", str(pushed_dir))
        ray.get([w.__ray_call__.remote(_tag_ipc_payloads) for w in trainer.workers])
        report = WeightSync(trainer, engines, SyncPlan(transport, bucket_bytes=8192)).sync(1)
        after = engines.call("endpoint")[0].get("standin/state", timeout=30)
        want = fingerprints(pushed_of(pushed_dir).items())
        assert transport == "bpo_megatron.rollout.sglang.cuda_ipc:CudaIpc"
        assert report["sync_bytes"] == sum(t.numel() * t.element_size() for t in pushed_of(pushed_dir).values())
        assert all(ranks == want for ranks in after["fingerprints"]) and after["versions"] == ["1"] * TP
        updates = [c for c in after["calls"] if c["call"] == "update_weights_from_tensor"]
        assert len(updates) > 1 and {(u["entries"], u["load_format"], u["version"]) for u in updates} == {
            (TP, "flattened_bucket", "1")}
        assert after["origins"] == [[t] * len(updates) for t in range(TP)], "TP rank t maps trainer rank t's copy"
        names = [c["call"] for c in after["calls"]]
        assert names.index("begin_weight_update") < names.index("update_weights_from_tensor")
        assert names[-3:] == ["end_weight_update", "flush_cache", "continue_generation"]
    finally:
        engines.shutdown()
        trainer.shutdown()


# ------------------------------------------------------------------------------ multi-turn
class _IdTokenizer:
    """Token ids written as text, space-separated: what the agent reads and answers is ids."""

    eos_token_ids, end_of_turn_ids = (), ()

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


CALL_ID = 7  # the stand-in draws tokens uniformly from the vocabulary: a few of 256 responses call
TOOL_OUTPUT = [150, 151, 152]


class _Tool(Agent):
    call_token = str(CALL_ID)

    def respond(self, prompt, transcript):
        return " ".join(map(str, TOOL_OUTPUT))


class _Recording:
    """The engine's generate, keeping each call's requests and samples (the turns)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, requests):
        samples = self.engine.generate(requests)
        self.calls.append((requests, samples))
        return samples


def test_multi_turn_rollouts_send_every_turn_as_input_ids_and_keep_each_turns_routing(engine, layout, monkeypatch):
    """Conversations through SGLang's ``/generate``: a turn after a tool call is one request
    whose ``input_ids`` are the prompt, the engine's own output ids and the tool's ids (nothing is
    retokenised); the sample is the turns end to end, log μ as SGLang reported each model token
    and 0 on the tool's, and each position's routed experts as reported by the turn that first
    processed it: a later turn asks SGLang (``routed_experts_start_len``) for the positions after
    the earlier turns' only, and gets exactly those."""
    import bpo_megatron.rollout.sglang.client as client_module

    posted, starts = {}, {}

    def recording(items, *, capture_routing):
        body = generate_body(items, capture_routing=capture_routing)
        posted.update({rid: ids for rid, ids in zip(body["rid"], body["input_ids"])})
        starts.update({rid: body["routed_experts_start_len"] for rid in body["rid"]})
        return body

    monkeypatch.setattr(client_module, "generate_body", recording)
    asked = [GenerationRequest(f"c{i}", tuple(range(20, 24 + i % 3)), SamplingParams(max_new_tokens=24, n=4, seed=i))
             for i in range(64)]
    recorder = _Recording(engine)
    samples = Conversations(recorder, _Tool(AgentConfig(name="x:_Tool")), _IdTokenizer(), max_turns=3).generate(asked)
    assert len(samples) == 256 and all(CALL_ID in r.sampling.stop_token_ids for r in recorder.calls[0][0])
    turns = {(s.request_id, s.index): [s] for s in recorder.calls[0][1]}
    for requests, answers in recorder.calls[1:]:
        for request, answer in zip(requests, answers):
            key = request.request_id.split("/t")[0]
            turns[(key.split("#")[0], int(key.split("#")[1]))].append(answer)
    talking = [s for s in samples if s.from_environment.any()]
    print(f"\n[multi-turn over SGLang] {len(talking)} of {len(samples)} responses called the tool, "
          f"{sum(len(turns[(s.request_id, s.index)]) for s in talking)} model turns")
    assert len(talking) >= 3, "too few responses called the tool to show anything"
    for sample in talking:
        parts = turns[(sample.request_id, sample.index)]
        for k in range(1, len(parts)):
            sent = posted[parts[k].request_id + "#0"]
            before = list(parts[k - 1].prompt_tokens.tolist()) + parts[k - 1].response_tokens.tolist() + TOOL_OUTPUT
            assert sent == before, "a later turn must be sent as the whole sequence's ids"
            known = parts[k - 1].prompt_tokens.numel() + parts[k - 1].response_tokens.numel() - 1
            assert starts[parts[k].request_id + "#0"] == known == parts[k].routing_start
            # only the positions after the earlier turns' came over the wire
            assert parts[k].routed_experts.shape[0] == parts[k].prompt_tokens.numel() + parts[k].response_tokens.numel() - 1 - known
        assert starts[parts[0].request_id + "#" + str(parts[0].index)] == 0 == parts[0].routing_start
        expected, env, logprobs, rows, start = [], [], [], [], 0
        for k, part in enumerate(parts):
            expected += part.response_tokens.tolist()
            env += [False] * part.response_tokens.numel()
            logprobs.append(part.rollout_logprobs)
            end = part.prompt_tokens.numel() + part.response_tokens.numel() - 1
            rows.append(part.routed_experts[start - part.routing_start:end - part.routing_start])
            start = end
            if k < len(parts) - 1:
                expected += TOOL_OUTPUT
                env += [True] * len(TOOL_OUTPUT)
                logprobs.append(torch.zeros(len(TOOL_OUTPUT)))
        assert sample.response_tokens.tolist() == expected and sample.from_environment.tolist() == env
        assert torch.equal(sample.rollout_logprobs, torch.cat(logprobs))
        assert torch.equal(sample.routed_experts, torch.cat(rows))
        assert sample.routed_experts.shape[0] == sample.tokens.numel() - 1
        sample.check(num_moe_layers=layout.num_moe_layers, topk=layout.topk)
        # the stand-in's made-up log μ of output position i is −0.1·(i + 1) − 0.01·version, counted
        # per turn (the engine fixture carries the versions earlier tests pushed)
        for part in parts:
            positions = torch.arange(1, part.response_tokens.numel() + 1).float()
            torch.testing.assert_close(part.rollout_logprobs, -0.1 * positions - 0.01 * part.weight_version)
