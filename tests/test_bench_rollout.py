"""The rollout benchmark runs end to end at a tiny size and its numbers are sane."""

from bpo_megatron.bench.rollout import GENERATION_METHODS, SYNC_METHODS, BenchConfig, format_table, run


def test_rollout_benchmark_runs_and_reports_every_method(tmp_path):
    cfg = BenchConfig(prompts=3, new_tokens=5, repeats=1, sync_model="tiny", bucket_mb=1)
    result = run(cfg, tmp_path)
    assert [r.method for r in result.generation] == list(GENERATION_METHODS)
    for row in result.generation:
        assert row.tokens == 3 * 5, row  # no end-of-sequence token: every row runs to the limit
        assert 0 < row.median_tokens_per_s <= row.best_tokens_per_s
    assert [r.method for r in result.sync] == list(SYNC_METHODS)
    bytes_sent = {r.bytes for r in result.sync}
    assert len(bytes_sent) == 1 and bytes_sent.pop() > 0  # every method moves the same bytes
    for row in result.sync:
        assert 0 < row.best_s <= row.median_s and row.bytes_per_s > 0
    assert result.engine_matches, "after the benchmark's syncs the engine must hold the trainer's weights"
    assert result.sync_tensors == 45  # the tiny MoE: 2 layers x (4 experts x 3 + 9) + embedding, final norm, head
    table = format_table(result, cfg)
    assert "| hf-engine+capture |" in table and "| sync: object_store → engine actor |" in table
