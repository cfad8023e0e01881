"""The asynchronous rollout pipeline (train.async): which weights sample which step's batch, the
staleness every consumed sample records, stale groups renewed, and the cursor a checkpoint keeps."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron.loop.rollout_pipeline import RolloutPipeline, stale_groups, staleness
from bpo_megatron.rollout import Sample

G = 2


class Prompts:
    """A prompt stream: prompt i is the integer i."""

    def __init__(self, cursor: int = 0) -> None:
        self.cursor = cursor

    def take(self, count: int) -> list[int]:
        batch = list(range(self.cursor, self.cursor + count))
        self.cursor += count
        return batch


class Engines:
    """Engines holding weights ``version``; a submitted batch is sampled by the weights held when
    it was submitted (as Ray runs an engine's calls in order: a sync waits for the generation)."""

    def __init__(self) -> None:
        self.version, self.submitted = 0, []

    def submit(self, requests):
        self.submitted.append([r[0] for r in requests])
        samples = [Sample(request_id=f"{step}-{prompt}", index=i, prompt_tokens=torch.tensor([prompt]),
                          response_tokens=torch.tensor([1]), rollout_logprobs=torch.zeros(1), finish_reason="stop",
                          weight_version=self.version)
                   for prompt, step, round_ in requests for i in range(G)]
        return type("Pending", (), {"result": lambda self: samples})()

    def generate(self, requests):
        return self.submit(requests).result()


def _pipeline(k: int, stale: str = "regenerate", last_step: int = 10, cursor: int = 0):
    engines, prompts = Engines(), Prompts(cursor)
    batch = lambda prompts_, step, round_: [(p, step, round_) for p in prompts_]  # noqa: E731
    return RolloutPipeline(engines, prompts, batch, per_step=3, group_size=G, last_step=last_step,
                           max_staleness=k, stale=stale), engines, prompts


def _run(pipeline, engines, steps):
    """The loop's order each step: settle, sync (version step − 1), plan, take, train."""
    consumed = {}
    for step in steps:
        pipeline.settle()
        engines.version = step - 1
        pipeline.plan(step)
        consumed[step] = pipeline.take(step)
    return consumed


@pytest.mark.parametrize("k", [0, 1, 2])
def test_every_consumed_sample_is_at_most_k_updates_stale_and_the_batches_run_ahead(k):
    pipeline, engines, _ = _pipeline(k)
    consumed = _run(pipeline, engines, range(1, 7))
    for step, (samples, prompts, metrics) in consumed.items():
        ages = staleness(samples, step)
        assert max(ages) <= k and set(ages) == {min(k, step - 1)}  # exactly k once the pipeline is full
        assert prompts == list(range(3 * (step - 1), 3 * step))  # the prompts in order, none skipped
        if k:
            assert metrics == {"async/staleness_mean": float(min(k, step - 1)),
                               "async/staleness_max": float(min(k, step - 1)), "async/stale_groups": 0.0,
                               "async/partial_frac": 0.0}
        else:
            assert metrics == {}  # the synchronous loop's metrics, unchanged
    # k = 0: one batch at a time; k: the first step plans k + 1 batches, then one per step
    assert [len(batch) // 3 for batch in engines.submitted] == [1] * (6 + k)
    assert len(pipeline._planned) == k


class PausingEngines(Engines):
    """Engines with partial rollouts: a batch's first token is sampled by the weights held at
    submission, the rest by those held when its result is read (the sync paused it meanwhile)."""

    def submit(self, requests):
        engines, version = self, self.version
        self.submitted.append([r[0] for r in requests])

        def result(_self):
            versions = torch.tensor([version, engines.version, engines.version])
            return [Sample(request_id=f"{step}-{prompt}", index=i, prompt_tokens=torch.tensor([prompt]),
                           response_tokens=torch.tensor([1, 1, 1]), rollout_logprobs=torch.zeros(3),
                           finish_reason="stop", weight_version=int(versions.min()), token_versions=versions)
                    for prompt, step, round_ in requests for i in range(G)]
        return type("Pending", (), {"result": result})()


@pytest.mark.parametrize("k", [1, 2])
def test_with_partial_rollouts_nothing_waits_and_a_sample_is_as_stale_as_its_oldest_token(k):
    engines, prompts = PausingEngines(), Prompts()
    batch = lambda prompts_, step, round_: [(p, step, round_) for p in prompts_]  # noqa: E731
    pipeline = RolloutPipeline(engines, prompts, batch, per_step=3, group_size=G, last_step=10, max_staleness=k,
                               stale="regenerate", partial=True)
    consumed = _run(pipeline, engines, range(1, 7))
    for step, (samples, _, metrics) in consumed.items():
        assert set(staleness(samples, step)) == {min(k, step - 1)}
        assert metrics["async/partial_frac"] == (1.0 if step > 1 else 0.0)  # later tokens: the newer weights


def test_the_last_steps_plan_nothing_beyond_the_run():
    pipeline, engines, _ = _pipeline(2, last_step=3)
    _run(pipeline, engines, range(1, 4))
    assert len(engines.submitted) == 3 and not pipeline._planned


@pytest.mark.parametrize("stale, renewed_prompt", [("regenerate", 3), ("drop", 9)])
def test_a_group_older_than_k_is_regenerated_or_replaced(stale, renewed_prompt):
    """Step 2's batch (prompts 3–5, planned at step 1 with version 0) — its second group comes back
    from a replaced engine holding version −1: 2 updates stale with k = 1."""
    pipeline, engines, prompts = _pipeline(1, stale)
    _run(pipeline, engines, [1])
    pipeline.settle()
    engines.version = 1
    pipeline.plan(2)
    planned = pipeline._planned[0]
    samples = planned.pending.result()
    for sample in samples[:G]:
        sample.weight_version = -1
    got, prompts_used, metrics = pipeline.take(2)
    assert stale_groups(samples, G, 2, 1) == [0]
    assert prompts_used[0] == renewed_prompt and prompts_used[1:] == [4, 5]
    assert [s.weight_version for s in got[:G]] == [1, 1]  # renewed with the current weights
    assert max(staleness(got, 2)) <= 1 and metrics["async/stale_groups"] == 1.0


def test_a_checkpoint_keeps_the_cursor_of_the_first_prompt_no_step_trained_on():
    pipeline, engines, prompts = _pipeline(2, cursor=30)
    _run(pipeline, engines, [1, 2])
    # steps 1 and 2 trained on prompts 30–35; the batches of steps 3 and 4 (36–41) are under way
    assert prompts.cursor == 42 and pipeline.resume_cursor() == 36
    synchronous, engines0, prompts0 = _pipeline(0, cursor=30)
    _run(synchronous, engines0, [1, 2])
    assert synchronous.resume_cursor() == prompts0.cursor == 36


def test_async_settings_are_read_as_train_async_and_checked():
    from bpo_megatron.config import ConfigError, to_dict
    from bpo_megatron.experiment import load_experiment

    demo = "configs/tiny_moe_cpu.yaml"
    cfg = load_experiment(demo, ["train.async.max_staleness=2", "train.async.stale=drop", "cluster.colocate=false"],
                          check_model=False)
    assert (cfg.train.asynchronous.max_staleness, cfg.train.asynchronous.stale) == (2, "drop")
    assert to_dict(cfg)["train"]["async"] == {"max_staleness": 2, "stale": "drop"}  # recorded under its YAML key
    with pytest.raises(ConfigError, match=r"train.async.max_staleness=1 .*cluster.colocate=false"):
        load_experiment(demo, ["train.async.max_staleness=1", "cluster.colocate=true"], check_model=False)
    with pytest.raises(ConfigError, match="train.async.max_staleness must be >= 0"):
        load_experiment(demo, ["train.async.max_staleness=-1"], check_model=False)
    with pytest.raises(ConfigError, match=r"train.async.stale='old' must be one of 'regenerate', 'drop'"):
        load_experiment(demo, ["train.async.stale=old"], check_model=False)
    with pytest.raises(ConfigError, match="unknown key train.asynchronous"):
        load_experiment(demo, ["train.asynchronous.max_staleness=1"], check_model=False)
