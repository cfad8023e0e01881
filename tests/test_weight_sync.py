"""The weight transports as the driver chooses them: every engine's spec names one that exists
for either placement (its own, declared in its spec, or a generic one), and colocated engine TP
ranks map to the trainer ranks on their GPUs."""

from __future__ import annotations

import pytest

from bpo_megatron.rollout.engine import ENGINES, engine_spec
from bpo_megatron.weight_sync import TRANSPORTS, transport_class
from bpo_megatron.rollout.sglang.cuda_ipc import colocated_ranks


def _every_transport() -> list[str]:
    """The generic transports by name and each engine's own as the ``module:Class`` it declares."""
    return sorted(TRANSPORTS) + sorted({ref for name in ENGINES for ref in engine_spec(name).transports.values()})


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("gpus", [False, True])
def test_every_engine_receives_weights_over_a_transport_that_exists(engine, colocated, gpus):
    spec = engine_spec(engine)
    name = spec.transport(spec.options(), colocated, gpus)
    ref = spec.weight_transport(spec.options(), colocated, gpus)
    sender = transport_class(ref)
    # its own, declared in its spec, or a generic one
    assert ref == spec.transports[name] if name in spec.transports else (ref == name and name in TRANSPORTS)
    assert sender.__module__.startswith(f"bpo_megatron.rollout.{engine}.") or name in TRANSPORTS
    # a transport that reaches engines on the trainer's GPUs never moves host tensors into them
    assert not ((engine == "sglang" or engine == "hf" and gpus) and colocated and sender.host_tensors)


def test_sglang_transport_follows_the_placement():
    spec = engine_spec("sglang")
    assert [spec.transport(spec.options(), colocated, True) for colocated in (False, True)] == ["nccl_broadcast",
                                                                                                 "cuda_ipc"]


def test_the_embedded_engine_on_the_trainers_gpu_takes_its_weights_by_cuda_ipc():
    """Sharing the trainer's GPU, the embedded engine maps the trainer's device buffers; on a CPU,
    or on a GPU of its own, it takes them through shared memory (Ray's object store off the
    trainer's node). The experiment chooses where the engines sit, once."""
    from pathlib import Path

    from bpo_megatron.experiment import load_experiment

    spec = engine_spec("hf")
    assert {(c, g): spec.transport(spec.options(), c, g) for c in (False, True) for g in (False, True)} == {
        (False, False): "shared_memory", (True, False): "shared_memory", (False, True): "shared_memory",
        (True, True): "cuda_ipc"}
    one_gpu = Path(__file__).resolve().parents[1] / "configs" / "qwen3_moe_1gpu.yaml"
    cfg = load_experiment(one_gpu, [])
    assert cfg.weight_transport() == "bpo_megatron.rollout.hf.cuda_ipc:CudaIpc"
    assert cfg.weight_transport(evaluation=True) == "bpo_megatron.rollout.hf.shared_memory:SharedMemory"
    on_cpu = load_experiment(one_gpu, ["cluster.gpus_per_node=0", "cluster.gpus_per_trainer_rank=0",
                                       "cluster.gpus_per_engine=0"])
    assert on_cpu.weight_transport() == "bpo_megatron.rollout.hf.shared_memory:SharedMemory"


def test_colocated_engine_tp_ranks_sit_beside_consecutive_trainer_ranks():
    # the 30B-A3B recipe: 8 engines of TP 4 over 32 trainer ranks (bundles e*4 .. e*4+3)
    assert [colocated_ranks(e, 4, 32) for e in (0, 1, 7)] == [(0, 1, 2, 3), (4, 5, 6, 7), (28, 29, 30, 31)]
    with pytest.raises(ValueError, match=r"needs trainer ranks 32–35, the trainer has 32 .*cluster.trainer_ranks"):
        colocated_ranks(8, 4, 32)


def test_an_unknown_transport_names_those_there_are():
    with pytest.raises(ValueError, match=r"no weight transport 'rdma'; the generic ones are \['object_store'\], "
                                         r"and an engine's own is given as the 'module:Class' its spec declares"):
        transport_class("rdma")


@pytest.mark.parametrize("name", _every_transport())
def test_every_transport_is_prepared_with_endpoints_then_sends_and_closes(name):
    """The protocol: ``prepare(endpoints)``, ``send(buckets, version)``, ``close()``; a transport
    names the parts of an endpoint it reads, and nothing else of the engine group."""
    import inspect

    from bpo_megatron.weight_sync.transport import ENDPOINT_PARTS

    sender = transport_class(name)
    assert list(inspect.signature(sender.prepare).parameters) == ["self", "endpoints"]
    assert list(inspect.signature(sender.send).parameters) == ["self", "buckets", "version"]
    assert list(inspect.signature(sender.close).parameters) == ["self"]
    assert sender.needs and sender.needs <= ENDPOINT_PARTS
    assert all(isinstance(getattr(sender, flag), bool) for flag in ("host_tensors", "views", "every_rank", "whole_group"))


def test_the_engine_group_asks_its_engines_only_for_what_the_transport_needs():
    from bpo_megatron.orchestration.engine_group import EngineGroup
    from bpo_megatron.weight_sync.transport import EngineEndpoint

    asked: list[str] = []
    group = EngineGroup.__new__(EngineGroup)  # its calls to the engines stood in for
    group.workers = ["actor 0", "actor 1", "actor 2"]
    group.weight_details = lambda only: (asked.append("weight_details")
                                         or [(f"node {i}", f"details {i}") for i in only])

    assert group.weight_endpoints([2, 0], frozenset({"actor"})) == [EngineEndpoint(2, actor="actor 2"),
                                                                     EngineEndpoint(0, actor="actor 0")]
    assert asked == []
    assert group.weight_endpoints([1], frozenset({"actor", "node", "details"})) == [
        EngineEndpoint(1, actor="actor 1", node="node 1", details="details 1")]
    assert asked == ["weight_details"]
    with pytest.raises(ValueError, match=r"needs \['cfg'\]"):
        group.weight_endpoints([0], frozenset({"details", "cfg"}))


# ------------------------------------------------------------------------------ a rank's side of a sync
class _Actor:
    """A train actor's export as the sender calls it: fixed buckets, the arguments recorded."""

    def __init__(self, buckets) -> None:
        self.buckets, self.asked = buckets, None

    def export_weights(self, bucket_bytes, *, dtype=None, host=False, all_ranks=False, views=False):
        self.asked = (bucket_bytes, dtype, host, all_ranks, views)
        yield from self.buckets


class _Recorder:
    """A transport that keeps what it was prepared for and sent."""

    host_tensors, views, every_rank, whole_group = True, False, False, False
    needs = frozenset()

    def prepare(self, endpoints) -> None:
        self.endpoints, self.sent = endpoints, []

    def send(self, buckets, version):
        self.sent = [list(bucket) for bucket in buckets]
        return {"bytes": sum(t.numel() * t.element_size() for bucket in self.sent for _, t in bucket), "failed": [1]}


def test_a_rank_exports_converts_quantizes_fingerprints_and_sends_as_the_plan_says():
    """export (the plan's bucket size and dtype, the transport's memory) → the engines' FP8 form
    (linear weights rounded through e4m3, the others as they are) → fingerprints of exactly what
    is sent (rank 0, with verify) → the transport; a rank that does not send only takes part in
    the gather."""
    import torch

    from bpo_megatron.weight_sync.plan import SyncPlan
    from bpo_megatron.weight_sync.sender import send_weights
    from bpo_megatron.weights.checksums import fingerprint
    from bpo_megatron.weights.fp8 import SyncQuantization, round_through_fp8

    gen = torch.Generator().manual_seed(0)
    linear, norm = "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"
    buckets = [[(linear, torch.randn(256, 128, generator=gen))], [(norm, torch.randn(128, generator=gen))]]
    plan = SyncPlan("object_store", 4096, dtype=torch.bfloat16, quantization=SyncQuantization("fp8"), verify=True)
    actor, transport = _Actor(buckets), _Recorder()
    report = send_weights(actor, transport, plan, ["e0", "e1"], 3, rank=0)
    assert actor.asked == (4096, torch.bfloat16, True, False, False)
    assert transport.endpoints == ["e0", "e1"]
    (sent_linear,), (sent_norm,) = transport.sent
    assert torch.equal(sent_linear[1], round_through_fp8(buckets[0][0][1]))
    assert not torch.equal(sent_linear[1], buckets[0][0][1]) and sent_norm[1] is buckets[1][0][1]
    assert report["bytes"] == (256 * 128 + 128) * 4 and report["failed"] == [1] and report["seconds"] > 0
    assert report["fingerprints"] == {linear: fingerprint(sent_linear[1]), norm: fingerprint(sent_norm[1])}

    quiet = _Recorder()
    drained = _Actor(iter(buckets))
    assert send_weights(drained, quiet, plan, ["e0"], 3, rank=1) == {"bytes": 0, "failed": [], "seconds": 0.0,
                                                                     "fingerprints": {}, "delta": False}
    assert not hasattr(quiet, "endpoints") and list(drained.buckets) == [], "rank 1 ran its export through"
    unchecked = send_weights(_Actor(buckets), _Recorder(), SyncPlan("object_store", 4096), ["e0"], 4, rank=0)
    assert unchecked["fingerprints"] == {}


def test_a_plan_refuses_empty_buckets():
    from bpo_megatron.weight_sync.plan import SyncPlan

    with pytest.raises(ValueError, match="at least one byte"):
        SyncPlan("object_store", 0)
