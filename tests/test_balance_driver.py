"""The driver's side of balanced packing (2 Ray ranks of the demo trainer, data-parallel size 2,
experts split over them, with ``trainer.max_tokens_per_micro_batch``): shares chosen by cost as the
ranks would choose them, results back in sample order, the step's load imbalance in its metrics,
and a sample over the budget refused before anything is sent."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from bpo_megatron.testing import random_routing

ray = pytest.importorskip("ray")
# the rank function below travels to the Ray workers by value (the workers cannot import tests)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BUDGET = 24
POSITIONS = (18, 3, 15, 4, 5, 14, 2, 6)  # the demo's samples hold at most 16 + 4 − 1 = 19


@pytest.fixture(scope="module")
def group(ray_session, small_run, tmp_path_factory):
    from bpo_megatron.orchestration.groups import TrainerGroup

    cfg = small_run(tmp_path_factory.mktemp("run"), f"trainer.max_tokens_per_micro_batch={BUDGET}")
    trainer = TrainerGroup(cfg.trainer_spec(), cfg.cluster)
    yield trainer
    trainer.shutdown()


def _samples(hf) -> list:
    from bpo_megatron.trainer.samples import TrainSample

    gen = torch.Generator().manual_seed(23)
    return [TrainSample(tokens=torch.randint(0, hf.vocab_size, (n + 1,), generator=gen), response_start=2,
                        rollout_logprobs=-torch.rand(n - 1, generator=gen) - 0.1, advantage=(-1.0) ** i,
                        routed_experts=random_routing(n, hf, gen).to(torch.uint8))
            for i, n in enumerate(POSITIONS)]


def _whole_batch_on_every_rank(worker, samples):  # every rank given everything chooses its share itself
    return worker.actor.compute_logprobs(samples)


@pytest.mark.timeout(300)
def test_the_driver_balances_shares_as_the_ranks_do_and_returns_results_in_sample_order(group):
    from bpo_megatron.trainer.balance import data_parallel_shares, imbalance
    from bpo_megatron.trainer.samples import split

    trainer = group
    samples = _samples(trainer.hf)
    shares = data_parallel_shares(samples, trainer.dp_size, budget=BUDGET, cost=trainer.cost)
    assert shares != split(list(range(len(samples))), 2)  # the order of results depends on the map

    scored = trainer.compute_logprobs(samples)
    reference = trainer.on_every_rank(_whole_batch_on_every_rank, samples)[-1]
    for key in ("logprobs", "entropies"):
        for i, (got, want) in enumerate(zip(getattr(scored, key), getattr(reference, key), strict=True)):
            assert got.shape == (POSITIONS[i] - 1,), (key, i)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    free = trainer.compute_logprobs(samples, record_routing=True)
    assert [r.shape[0] for r in free.routed_experts] == list(POSITIONS)

    metrics = trainer.train_step(samples)
    assert metrics["num_micro_batches"] == 2.0  # ≈ 33 positions a rank in packs of ≤ 24
    assert metrics["dp_imbalance"] == pytest.approx(imbalance(samples, shares, trainer.cost))
    count_split = imbalance(samples, split(list(range(len(samples))), 2), trainer.cost)
    print(f"\ndriver: dp_imbalance {metrics['dp_imbalance']:.4f} balanced, {count_split:.4f} split by count")
    assert 1.0 <= metrics["dp_imbalance"] < count_split


def test_a_sample_over_the_budget_is_refused_on_the_driver_before_anything_is_sent(group):
    trainer = group
    samples = _samples(trainer.hf)
    trainer.take_sent_bytes()
    long = dataclasses.replace(samples[0], tokens=torch.zeros(BUDGET + 2, dtype=torch.long),
                               rollout_logprobs=-torch.ones(BUDGET), routed_experts=samples[0].routed_experts[:1]
                               .expand(BUDGET + 1, -1, -1).clone())
    with pytest.raises(ValueError, match=rf"sample 0 has {BUDGET + 1} input positions"):
        trainer.train_step([long, *samples[1:]])
    assert trainer.take_sent_bytes() == 0
