"""The trainer group as the driver uses it (2 ranks of the demo trainer, data-parallel size 2):
a batch is checked on the driver once, each data-parallel share enters Ray's object store once and
only its ranks read it, and each share's results come back from one rank."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from bpo_megatron.testing import make_samples, random_routing

ray = pytest.importorskip("ray")
# the rank function below travels to the Ray workers by value (the workers cannot import tests)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def group(ray_session, small_run, tmp_path_factory):
    from bpo_megatron.orchestration.groups import TrainerGroup

    cfg = small_run(tmp_path_factory.mktemp("run"))
    trainer = TrainerGroup(cfg.trainer_spec(), cfg.cluster)
    yield trainer, cfg.hf_config()
    trainer.shutdown()


def _long_samples(hf, count: int, *, length: int = 400) -> list:
    """Samples whose tensors outweigh pickling's per-tensor overhead; routing as engines send it
    (uint8 expert ids)."""
    from bpo_megatron.trainer.samples import TrainSample

    gen = torch.Generator().manual_seed(5)
    return [TrainSample(tokens=torch.randint(0, hf.vocab_size, (length,), generator=gen), response_start=8,
                        rollout_logprobs=-torch.rand(length - 8, generator=gen) - 0.1, advantage=(-1.0) ** i,
                        routed_experts=random_routing(length - 1, hf, gen).to(torch.uint8))
            for i in range(count)]


def _payload(samples) -> int:
    """The bytes of every tensor the samples carry."""
    return sum(value.numel() * value.element_size() for s in samples for value in vars(s).values()
               if isinstance(value, torch.Tensor))


def _whole_batch_on_every_rank(worker, samples):  # the path before: every rank got everything
    return worker.actor.compute_logprobs(samples)


@pytest.mark.timeout(300)
def test_a_batch_enters_the_object_store_once_split_by_data_parallel_rank(group):
    trainer, hf = group
    samples = _long_samples(hf, 8)
    assert trainer.dp_size == 2 and sorted(dp for dp, _, _ in trainer.layout) == [0, 1]
    trainer.take_sent_bytes()

    scored = trainer.compute_logprobs(samples)
    sent = trainer.take_sent_bytes()
    payload = _payload(samples)
    # one copy of the batch (and pickling's ≈ 1.5 KB a sample); every rank getting the whole batch
    # by value wrote 2 copies here, 32 at the paper's 32 trainer ranks
    assert payload <= sent <= payload + 2048 * len(samples) < 1.5 * payload, (sent, payload)

    reference = trainer.on_every_rank(_whole_batch_on_every_rank, samples)[-1]
    assert len(scored.logprobs) == len(samples)
    for got, want, sample in zip(scored.logprobs, reference.logprobs, samples):
        assert got.device.type == "cpu" and got.shape == (sample.num_response_tokens,)
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    metrics = trainer.train_step(samples)
    sent = trainer.take_sent_bytes()
    assert payload <= sent <= payload + 2048 * len(samples)
    assert metrics["num_micro_batches"] == 1.0  # 4 samples per rank, micro-batches of 4: its share only
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_a_bad_batch_is_refused_on_the_driver_before_anything_is_sent(group):
    trainer, hf = group
    samples = make_samples(4, seed=4, routing=True, hf=hf)
    trainer.take_sent_bytes()
    bad = dataclasses.replace(samples[1], tokens=samples[1].tokens.clone().fill_(hf.vocab_size))
    with pytest.raises(ValueError, match="vocab"):
        trainer.train_step([samples[0], bad, *samples[2:]])
    with pytest.raises(ValueError, match="cannot be split evenly over 2 data-parallel ranks"):
        trainer.compute_logprobs(samples[:3])
    assert trainer.take_sent_bytes() == 0


def test_every_worker_method_refuses_to_return_device_tensors():
    """The driver may have no GPU: every public method of both workers searches its result, and a
    device tensor (here on the meta device, which a CPU machine can make) raises in the worker,
    naming the method and the value's path, instead of failing at deserialisation on the driver."""
    import inspect
    from types import SimpleNamespace

    from bpo_megatron.orchestration.host_values import DeviceTensorReturned, is_checked
    from bpo_megatron.orchestration.workers import EngineWorker, TrainWorker
    from bpo_megatron.trainer.actor import ScoredSamples

    for cls in (TrainWorker, EngineWorker):
        public = [name for name, member in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")]
        assert public and all(is_checked(getattr(cls, name)) for name in public), cls

    worker = TrainWorker.__new__(TrainWorker)
    scored = ScoredSamples(logprobs=[torch.zeros(3), torch.zeros(2, device="meta")], entropies=[torch.zeros(3)] * 2)
    worker.actor = SimpleNamespace(logprobs_of_share=lambda share, record_routing: scored, returns_share_results=True)
    with pytest.raises(DeviceTensorReturned, match=r"TrainWorker.logprobs_of_share .*logprobs\.1 \(meta\)"):
        worker.logprobs_of_share(None)
    scored.logprobs[1] = torch.zeros(2)
    assert worker.logprobs_of_share(None) is scored
