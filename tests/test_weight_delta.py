"""Delta weight sync (``weight_sync.delta``): the trainer's record of what the engines hold, the
diff it sends (sparse indices and values, or changed tensors whole), and the engines applying it
in place. Every check compares with what a full sync gives, bit for bit, and counts the bytes
handed to the transport against the closed form: a sparse piece of ``c`` changed elements costs
``c × (4 + itemsize)`` bytes (int32 index, value), a whole tensor its bytes, an unchanged one none.

The first part runs without Ray (the encoding, the sender's choice of full or delta, FP8 forms, an
FP8 embedded engine in this process); the second drives a group of two embedded engines through
the session (``WeightSync``) over every embedded-engine transport, with an engine killed and
replaced between syncs.
"""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.weight_sync.delta import INDICES, VALUES, HeldWeights, Sparse, encode, scatter, updates
from bpo_megatron.weight_sync.plan import SyncPlan
from bpo_megatron.weight_sync.sender import send_weights
from bpo_megatron.weights.buckets import buckets

INDEX = 4  # bytes of an int32 index


def _perturb(weights: dict[str, torch.Tensor], share: float, gen: torch.Generator,
             names: list[str] | None = None) -> int:
    """Change ``share`` of the elements (at least one) of every second tensor (or of ``names``)
    in place, each by at least 0.01 so its bytes change in any float dtype; the elements changed."""
    changed = 0
    for k, (name, tensor) in enumerate(weights.items()):
        if (names is None and k % 2) or (names is not None and name not in names):
            continue
        count = max(1, int(tensor.numel() * share))
        where = torch.randperm(tensor.numel(), generator=gen)[:count]
        flat = tensor.view(-1)
        flat[where] = (flat[where].float() + 0.01 + torch.rand(count, generator=gen)).to(tensor.dtype)
        changed += count
    return changed


def _apply(engine: dict[str, torch.Tensor], bucket) -> None:
    """An engine made of a dict: what the embedded engine does with a bucket, full or delta."""
    for name, tensor in updates(bucket):
        if isinstance(tensor, Sparse):
            scatter(engine[name], tensor)
        else:
            engine[name].copy_(tensor)


def _weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (200, 64), "model.layers.0.self_attn.q_proj.weight": (128, 64),
              "model.layers.0.mlp.experts.0.gate_proj.weight": (32, 64), "model.norm.weight": (64,),
              "model.layers.0.mlp.experts.0.down_proj.weight": (64, 32)}
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deltas_rebuild_the_full_sync_bit_for_bit_and_send_only_the_changed_elements(dtype):
    """4 versions of small random updates (2% of every second tensor) and one with no change: the
    engine fed deltas equals the one fed full syncs, and each delta's bytes are c × (4 + itemsize)."""
    trainer, gen = _weights(dtype), torch.Generator().manual_seed(1)
    record, by_delta = HeldWeights(), {n: torch.zeros_like(t) for n, t in trainer.items()}
    for bucket in buckets(list(trainer.items()), 16384):
        record.keep(bucket)
        _apply(by_delta, bucket)
    for step in range(5):
        changed = _perturb(trainer, 0.02, gen) if step < 4 else 0
        sent = [encode(bucket, record, "sparse") for bucket in buckets(list(trainer.items()), 16384)]
        assert sum(e.changed for e in sent) == changed
        assert sum(t.numel() * t.element_size() for e in sent for _, t in e.tensors) == changed * (INDEX + dtype.itemsize)
        for encoded in sent:
            _apply(by_delta, encoded.tensors)
        assert all(torch.equal(by_delta[n], trainer[n]) for n in trainer), f"step {step}"
        assert all(torch.equal(record.tensors[n], trainer[n]) for n in trainer)
    assert [e.tensors for e in sent] == [[]] * len(sent), "no change: nothing to send"


def test_a_bucket_goes_whole_where_sparse_costs_more_and_tensors_mode_sends_changed_tensors_whole():
    """One tensor of 8192 fp32 elements: 2000 changed cost 2000 × 8 = 16000 bytes sparse, less than
    its 32768 whole; 5000 changed (40000 sparse) go whole. ``tensors`` mode sends whole always, and
    an unchanged tensor of the bucket never."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(8192, generator=gen), torch.randn(100, generator=gen)
    record = HeldWeights()
    record.keep([("a", a), ("b", b)])
    for count, expect in ((2000, "sparse"), (5000, "whole")):
        new = a.clone()
        new[:count] += 1.0
        encoded = encode([("a", new), ("b", b)], record, "sparse")
        names = [name for name, _ in encoded.tensors]
        assert names == (["a" + INDICES, "a" + VALUES] if expect == "sparse" else ["a"]), count
        assert sum(t.numel() * t.element_size() for _, t in encoded.tensors) == (
            count * 8 if expect == "sparse" else 8192 * 4)
        a = new
    new = a.clone()
    new[7] += 1.0
    assert [name for name, _ in encode([("a", new), ("b", b)], record, "tensors").tensors] == ["a"]


def test_tensors_mode_sends_a_changed_tensors_load_group_whole():
    """DeepSeek's q_a_proj and kv_a_proj_with_mqa load together (SGLang fuses them): one changed,
    both go."""
    q, kv = "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    gen = torch.Generator().manual_seed(3)
    bucket = [(q, torch.randn(16, 8, generator=gen)), (kv, torch.randn(24, 8, generator=gen))]
    record = HeldWeights()
    record.keep(bucket)
    changed = [(q, bucket[0][1] + 1.0), bucket[1]]
    assert [name for name, _ in encode(changed, record, "tensors").tensors] == [q, kv]
    # the embedded engine writes each tensor in place: no group goes with it
    assert [name for name, _ in encode([(q, changed[0][1] + 1.0), bucket[1]], record, "sparse").tensors] == [q]


def test_fp8_block_form_deltas_carry_the_changed_e4m3_bytes_and_scales():
    """An FP8-serialized engine holds e4m3 values and per-block scales (``fp8-blocks``): a small
    update changes some values' bytes and, where a block's largest value moved, its scale; the
    delta carries exactly the changed bytes of both, rebuilding the full sync's form bit for bit."""
    from bpo_megatron.weights.fp8 import SyncQuantization

    form = SyncQuantization("fp8-blocks").tensors
    gen = torch.Generator().manual_seed(4)
    trainer = {"model.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(256, 256, generator=gen).bfloat16(),
               "model.layers.0.self_attn.o_proj.weight": torch.randn(128, 256, generator=gen).bfloat16()}

    def engines_form() -> list[tuple[str, torch.Tensor]]:
        return [pair for name, tensor in trainer.items() for pair in form(name, tensor)]

    record, engine = HeldWeights(), {name: tensor.clone() for name, tensor in engines_form()}
    record.keep(engines_form())
    assert {t.dtype for t in engine.values()} == {torch.float8_e4m3fn, torch.float32}
    for step in range(4):
        _perturb(trainer, 0.01, gen, names=list(trainer)[:1] if step % 2 else None)
        full = engines_form()
        expected = sum(int((a.view(torch.uint8 if a.element_size() == 1 else torch.int32)
                            != record.tensors[n].view(torch.uint8 if a.element_size() == 1 else torch.int32)).sum())
                       for n, a in full)
        encoded = encode(full, record, "sparse")
        assert encoded.changed == expected > 0
        _apply(engine, encoded.tensors)
        assert all(torch.equal(engine[n].view(torch.uint8), t.view(torch.uint8)) for n, t in full), step
    assert encode(engines_form(), record, "sparse").tensors == []


def test_scatter_writes_in_place_through_any_strides_and_refuses_what_does_not_fit():
    base = torch.zeros(4, 6)
    view = base[:, 1:4]  # not contiguous
    scatter(view, Sparse("w", torch.tensor([0, 5, 11], dtype=torch.int32), torch.tensor([1.0, 2.0, 3.0])))
    assert base[0, 1] == 1.0 and base[1, 3] == 2.0 and base[3, 3] == 3.0 and base.sum() == 6.0
    with pytest.raises(ValueError, match=r"'w' indices outside its 12 elements"):
        scatter(view, Sparse("w", torch.tensor([12]), torch.tensor([1.0])))
    with pytest.raises(ValueError, match=r"'w' values are torch.bfloat16, the weight is torch.float32"):
        scatter(view, Sparse("w", torch.tensor([1]), torch.tensor([1.0], dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"'w' has no values"):
        list(updates([("w" + INDICES, torch.tensor([1])), ("v", torch.ones(1))]))


# ------------------------------------------------------------------------- the sending rank's choice
class _Export:
    """A train actor's export of fixed weights (the live tensors: a step changes them in place)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def export_weights(self, bucket_bytes, *, dtype=None, host=False, all_ranks=False, views=False):
        yield from buckets([(n, t if dtype is None else t.to(dtype)) for n, t in self.weights.items()], bucket_bytes)


class _Counting:
    """A transport that counts the bytes and buckets handed to it."""

    host_tensors, views, every_rank, whole_group = True, True, False, False
    needs = frozenset()

    def prepare(self, endpoints) -> None:
        self.buckets = []

    def send(self, buckets, version):
        self.buckets = [list(bucket) for bucket in buckets]
        return {"bytes": sum(t.numel() * t.element_size() for b in self.buckets for _, t in b), "failed": []}


def test_the_sender_sends_full_at_first_then_deltas_then_full_every_n_and_nothing_for_an_unchanged_model():
    """First sync full (no record), then deltas while the engines hold the record's version, a
    full sync every ``full_every`` versions and whenever the engines hold another version (or an
    unknown one); an unchanged model's delta hands the transport no bucket and no byte. The
    fingerprints are always the whole tensors' (a delta is verified like a full sync)."""
    from bpo_megatron.weights.checksums import fingerprints

    trainer, gen = _weights(torch.float32), torch.Generator().manual_seed(5)
    total = sum(t.numel() * 4 for t in trainer.values())
    plan = SyncPlan("object_store", 8192, verify=True, delta="sparse", full_every=3)
    record, transport = HeldWeights(), _Counting()

    def sync(version: int, held: int | None):
        return send_weights(_Export(trainer), transport, plan, ["e0"], version, rank=0, record=record, held=held)

    first = sync(1, held=None)
    assert (first["delta"], first["bytes"]) == (False, total) and (record.version, record.full_version) == (1, 1)
    assert len(transport.buckets) == len(list(buckets(list(trainer.items()), 8192))) == len(trainer) == 5
    engine = {name: tensor.clone() for bucket in transport.buckets for name, tensor in bucket}
    changed = _perturb(trainer, 0.01, gen)
    second = sync(2, held=1)
    assert (second["delta"], second["bytes"]) == (True, changed * 8)
    assert changed * 8 < 8192 and len(transport.buckets) == 1, "the export buckets' small deltas go in one call"
    _apply(engine, transport.buckets[0])
    assert all(torch.equal(engine[n], trainer[n]) for n in trainer)
    assert second["fingerprints"] == fingerprints(trainer.items())
    unchanged = sync(3, held=2)
    assert (unchanged["delta"], unchanged["bytes"], transport.buckets) == (True, 0, [])
    assert unchanged["fingerprints"] == fingerprints(trainer.items())
    assert (sync(4, held=3)["delta"], record.full_version) == (False, 4), "3 versions since the last full one"
    assert sync(5, held=3)["delta"] is False, "the engines hold another version than the record"
    assert sync(6, held=None)["delta"] is False, "the engines' version is unknown (replaced)"
    assert sync(7, held=6)["delta"] is True
    with pytest.raises(ValueError, match="needs the rank's record"):
        send_weights(_Export(trainer), transport, plan, ["e0"], 8, rank=0)


def test_a_sync_that_fails_half_way_leaves_the_record_unknown():
    """The transport raised: what the engines hold is unknown, so the next sync is a full one."""

    class Failing(_Counting):
        def send(self, buckets, version):
            next(iter(buckets))
            raise RuntimeError("server lost")

    trainer = _weights(torch.float32)
    plan = SyncPlan("object_store", 8192, delta="sparse", full_every=8)
    record = HeldWeights()
    send_weights(_Export(trainer), _Counting(), plan, [], 1, rank=0, record=record, held=None)
    _perturb(trainer, 0.01, torch.Generator().manual_seed(7))
    with pytest.raises(RuntimeError, match="server lost"):
        send_weights(_Export(trainer), Failing(), plan, [], 2, rank=0, record=record, held=1)
    assert record.version is None
    assert send_weights(_Export(trainer), _Counting(), plan, [], 3, rank=0, record=record, held=1)["delta"] is False


def test_an_fp8_embedded_engine_fed_deltas_equals_one_fed_full_syncs(tiny_checkpoint):
    """Two FP8 embedded engines (linear weights rounded through block e4m3, their FP8 copies and the
    fused query/key/value refreshed at the end of each update), one given full syncs and one deltas
    of the trainer's rounded weights through ``update_weights`` (what every embedded transport
    ends in): after 4 small updates and one empty one they hold the same bytes, fused experts
    (``gate_up_proj``) and the decode step's stacked qkv included."""
    from bpo_megatron.rollout.hf.engine import HFEngine
    from bpo_megatron.weights.fp8 import SyncQuantization

    path = tiny_checkpoint("tiny_qwen3_moe", seed=0)
    full_engine, delta_engine = (HFEngine(path, capture_routing=False, quantization="fp8") for _ in range(2))
    trainer = {name: view.clone() for name, view in full_engine.named_hf_weights()}
    form = SyncQuantization("fp8").tensors
    record, gen = HeldWeights(), torch.Generator().manual_seed(6)

    def update(engine, bucket, version):
        engine.begin_weight_update(version)
        engine.update_weights(bucket)
        engine.end_weight_update()

    for version in range(1, 7):
        if 1 < version < 6:
            _perturb(trainer, 0.01, gen)
        held_form = [pair for name, tensor in trainer.items() for pair in form(name, tensor)]
        update(full_engine, held_form, version)
        if version == 1:
            record.keep(held_form)
            update(delta_engine, held_form, version)
            continue
        sent = [pair for bucket in buckets(held_form, 8192) for pair in encode(bucket, record, "sparse").tensors]
        assert (sent == []) == (version == 6)
        if version < 6:  # a moved block scale changes its whole block: some buckets go whole, the rest sparse
            assert any(name.endswith(INDICES) for name, _ in sent)
            assert sum(t.numel() * t.element_size() for _, t in sent) < sum(
                t.numel() * t.element_size() for _, t in held_form)
        update(delta_engine, sent, version)
        full, delta = dict(full_engine.named_hf_weights()), dict(delta_engine.named_hf_weights())
        assert all(torch.equal(full[n], delta[n]) for n in full), version
    for a, b in zip(full_engine.model.modules(), delta_engine.model.modules()):
        if hasattr(a, "fused_qkv"):
            assert torch.equal(a.fused_qkv.weight, b.fused_qkv.weight)
    experts = [m for m in delta_engine.model.modules() if hasattr(m, "gate_up_proj")]
    assert experts and torch.equal(experts[0].gate_up_proj, next(
        m for m in full_engine.model.modules() if hasattr(m, "gate_up_proj")).gate_up_proj)


def test_the_plan_takes_delta_from_weight_sync_and_its_form_from_the_engine_and_bad_values_stop_the_check(capsys):
    """``weight_sync.delta`` on: the embedded engine takes sparse pieces, SGLang changed tensors whole
    (its NCCL broadcast and this project's IPC path load whole tensors), with ``full_every``; off,
    every sync is full. A bad ``full_every`` stops ``train`` with exit 2, naming the field."""
    from pathlib import Path

    from bpo_megatron.cli import main
    from bpo_megatron.experiment import load_experiment

    demo = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml")
    on = ["weight_sync.delta=true", "weight_sync.full_every=4"]
    hf = load_experiment(demo, on).sync_plan()
    assert (hf.delta, hf.full_every) == ("sparse", 4)
    # SGLang apart from the trainer (colocated, it drops its weights at each train phase: refused)
    sglang = load_experiment(demo, on + ["rollout.engine=sglang", "model.routing_replay=false", "cluster.colocate=false"],
                             check_model=False)
    assert sglang.sync_plan().delta == "tensors"
    assert load_experiment(demo, []).sync_plan().delta is None
    assert main(["train", demo, "weight_sync.full_every=0"]) == 2
    assert "weight_sync.full_every must be a positive integer" in capsys.readouterr().err


# ------------------------------------------------------------- every embedded transport, with Ray
SHARED_MEMORY = "bpo_megatron.rollout.hf.shared_memory:SharedMemory"
CUDA_IPC = "bpo_megatron.rollout.hf.cuda_ipc:CudaIpc"
BUCKET_BYTES = 1 << 14


@pytest.fixture(scope="module")
def group(ray_session, tiny_checkpoint):
    """Two embedded engines (fp32) started from one random checkpoint."""
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.groups import EngineGroup

    start = str(tiny_checkpoint("tiny_qwen3_moe", seed=0))
    cfg = load_experiment(None, [f"model.path={start}", "model.tokenizer=char", "rollout.engine=hf",
                                 "rollout.num_engines=2", "rollout.max_restarts=3", "data.max_prompt_tokens=16",
                                 "rollout.max_new_tokens=16"],
                          check_model=True)
    engines = EngineGroup(cfg.engine_group_spec(), start)
    yield engines
    engines.shutdown()


class _Trainer:
    """Trainer rank 0 as ``TrainWorker.push_weights`` runs it: ``send_weights`` over this rank's
    transport with its record of what the engines hold, exporting ``weights`` (changed in place
    between syncs); every report kept."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        from bpo_megatron.rollout.hf.cuda_ipc import CudaIpc
        from bpo_megatron.weights.shared_bucket import by_value

        self.weights, self.records, self.reports = weights, {}, []
        self.transports = {CUDA_IPC: CudaIpc(share=by_value)}  # the buffers by value where a GPU would map them

    def push_weights(self, plan, endpoints, version, role="rollout", held=None):
        from bpo_megatron.weight_sync import transport_class

        transport = self.transports.setdefault(plan.transport, transport_class(plan.transport)())
        record = self.records.setdefault(role, HeldWeights()) if plan.delta else None
        report = send_weights(_Export(self.weights), transport, plan, endpoints, version, rank=0, record=record,
                              held=held)
        self.reports.append({**report, "engines": [endpoint.index for endpoint in endpoints]})
        return report


def _held(group, index: int) -> dict[str, torch.Tensor]:
    import ray

    return ray.get(group.workers[index].__ray_call__.remote(
        lambda self: {name: view.clone() for name, view in self.engine.named_hf_weights()}))


def _start_weights(tiny_checkpoint, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(tiny_checkpoint("tiny_qwen3_moe", seed=seed) / "model.safetensors"))


@pytest.mark.parametrize("transport", ["object_store", SHARED_MEMORY, CUDA_IPC])
def test_every_embedded_transport_delivers_deltas_that_equal_full_syncs(group, tiny_checkpoint, transport):
    """A full sync, 4 versions of small updates (1% of every second tensor), one with no change,
    then a full sync of the same weights: the engines' weights equal the trainer's after every
    delta (and the session's fingerprint check passes), the bytes handed to the transport are
    c × (4 + 4) per sync (fp32 values, int32 indices; none for the unchanged model), and the full
    sync at the end changes nothing the deltas wrote."""
    from bpo_megatron.weight_sync.session import WeightSync

    only = [0] if transport == CUDA_IPC else None  # the stand-in trainer is one rank: engine 0 sits beside it
    engines = only or [0, 1]
    trainer = _Trainer(_start_weights(tiny_checkpoint, seed=11))
    total = sum(t.numel() * t.element_size() for t in trainer.weights.values())
    delta = WeightSync(trainer, group, SyncPlan(transport, BUCKET_BYTES, verify=True, delta="sparse", full_every=8))
    base = 100 * (1 + ["object_store", SHARED_MEMORY, CUDA_IPC].index(transport))  # versions of this test's own
    assert delta.sync(base + 1, only)["sync_bytes"] == total, "the first sync is a full one"
    gen = torch.Generator().manual_seed(12)
    for step in range(2, 7):
        changed = _perturb(trainer.weights, 0.01, gen) if step < 6 else 0
        report = delta.sync(base + step, only)
        assert trainer.reports[-1]["delta"] and report["sync_bytes"] == changed * 8, step
        for i in engines:
            held = _held(group, i)
            assert all(torch.equal(held[n], trainer.weights[n]) for n in trainer.weights), (step, i)
    assert trainer.reports[-1]["bytes"] == 0, "an unchanged model's delta hands the transport no byte"
    by_deltas = {i: _held(group, i) for i in engines}
    full = WeightSync(trainer, group, SyncPlan(transport, BUCKET_BYTES, verify=True))
    assert full.sync(base + 7, only)["sync_bytes"] == total and not trainer.reports[-1]["delta"]
    for i in engines:
        after = _held(group, i)
        assert all(torch.equal(after[n], by_deltas[i][n]) for n in after), i
    assert group.call("weight_version", only=engines) == [base + 7] * len(engines)


def test_an_engine_replaced_mid_run_gets_a_full_sync_and_its_peer_the_delta(group, tiny_checkpoint):
    """Engine 0 killed between two delta syncs: the next sync replaces it; engine 1, holding the
    trainer's last version, gets the delta (c × 8 bytes), the new engine a full sync of its own
    (the model's bytes); both then hold the trainer's weights bit for bit, and deltas go on."""
    import ray

    from bpo_megatron.weight_sync.session import WeightSync

    trainer = _Trainer(_start_weights(tiny_checkpoint, seed=13))
    total = sum(t.numel() * t.element_size() for t in trainer.weights.values())
    sync = WeightSync(trainer, group, SyncPlan(SHARED_MEMORY, BUCKET_BYTES, verify=True, delta="sparse",
                                               full_every=8)).sync
    gen = torch.Generator().manual_seed(14)
    sync(401)
    _perturb(trainer.weights, 0.01, gen)
    sync(402)
    victim = group.workers[0]
    ray.kill(victim)
    changed = _perturb(trainer.weights, 0.01, gen)
    trainer.reports.clear()
    report = sync(403)
    assert group.workers[0] is not victim
    assert [(r["engines"], r["delta"], r["bytes"]) for r in trainer.reports] == [([1], True, changed * 8),
                                                                                ([0], False, total)]
    assert report["sync_bytes"] == changed * 8 + total
    changed = _perturb(trainer.weights, 0.01, gen)
    trainer.reports.clear()
    assert sync(404)["sync_bytes"] == changed * 8
    assert [(r["engines"], r["delta"]) for r in trainer.reports] == [([0, 1], True)]
    for i in (0, 1):
        held = _held(group, i)
        assert all(torch.equal(held[n], trainer.weights[n]) for n in trainer.weights), i
    # drift: an engine whose bytes differ from the record where no delta writes is caught by the
    # fingerprints after the next delta, naming the tensor, not carried on silently
    from bpo_megatron.weights.checksums import WeightMismatch

    name = "model.norm.weight"
    ray.get(group.workers[1].__ray_call__.remote(
        lambda self: dict(self.engine.named_hf_weights())[name].add_(1.0).sum().item()))
    _perturb(trainer.weights, 0.01, gen, names=["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(WeightMismatch, match=r"rollout engine 1.*model\.norm\.weight"):
        sync(405)


def test_an_sglang_server_that_released_its_weights_holds_no_version_a_delta_could_build_on(monkeypatch):
    """Colocated, an SGLang server hands its weights' memory back at every train phase and keeps no
    copy (no --enable-weights-cpu-backup): resumed, those bytes are gone. It must not report the
    version it held before, else the next sync is a delta against weights it no longer has (the
    session lets engines holding version >= 1 take a delta)."""
    from bpo_megatron.rollout.sglang import SGLangConfig, SGLangEngine

    engine = SGLangEngine(SGLangConfig(model_path="/m", url="http://127.0.0.1:1", capture_routed_experts=False))
    posted = []
    monkeypatch.setattr(engine, "_post", lambda route, body: posted.append((route, body)))
    engine.weight_version = 7
    engine.released = {"kv_cache"}  # the KV cache alone released: the weights stay, and their version
    engine.resume_memory(("kv_cache",))
    assert engine.weight_version == 7
    engine.release_memory()
    assert posted[-1] == ("release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]})
    engine.resume_memory(("weights",))
    assert engine.weight_version == 0
    record = HeldWeights(version=7, full_version=7)
    assert not record.delta_from(engine.weight_version, 8, full_every=16)


def test_a_full_sync_to_a_replaced_engine_does_not_postpone_its_peers_next_full_sync():
    """Version 3 reaches engine 0 as a delta and, in a round of its own, replaced engine 1 as a
    full sync (the session's two rounds, same version). Engine 0's last full sync is still version
    1, so with full_every=3 version 4 is a full sync for it, not another delta."""
    trainer, gen = _weights(torch.float32), torch.Generator().manual_seed(11)
    plan = SyncPlan("object_store", 8192, delta="sparse", full_every=3)
    record, transport = HeldWeights(), _Counting()

    def sync(version: int, held: int | None):
        return send_weights(_Export(trainer), transport, plan, ["e"], version, rank=0, record=record, held=held)

    assert sync(1, held=None)["delta"] is False
    _perturb(trainer, 0.01, gen)
    assert sync(2, held=1)["delta"] is True
    _perturb(trainer, 0.01, gen)
    assert sync(3, held=2)["delta"] is True  # engine 0
    assert sync(3, held=None)["delta"] is False  # engine 1, replaced: full, same version
    assert record.full_version == 1, "only engine 1 got version 3 whole"
    _perturb(trainer, 0.01, gen)
    assert sync(4, held=3)["delta"] is False, "engine 0's last full sync is 3 versions back"
