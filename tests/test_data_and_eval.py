"""Datasets, procedural tasks, tokenizers, rewards, the prompt stream, Avg@k, metrics and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bpo_megatron.data.config import DataConfig
from bpo_megatron.data.problems import load_problems
from bpo_megatron.data.procedural import generate
from bpo_megatron.data.rewards import MathVerifier, reward_fn
from bpo_megatron.data.tokenizer import CharTokenizer
from bpo_megatron.eval.avg_at_k import BestCheckpoint, EvalResult, avg_at_k
from bpo_megatron.tasks.prompts import PromptFormat
from bpo_megatron.tasks.stream import PromptStream
from bpo_megatron.observability.metrics import MetricsWriter, read_metrics, summary_line
from bpo_megatron.observability.plot import plot_runs

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
PLAIN = PromptFormat(CharTokenizer(), "plain", max_prompt_tokens=64)


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared data directory is not next to the checkout")
@pytest.mark.parametrize("name, count", [("aime24", 30), ("aime25", 30), ("aime26", 30), ("math500", 500),
                                         ("gsm8k_test", 1319)])
def test_shared_datasets_load_by_name(name, count):
    problems = load_problems(name, SHARED)
    assert len(problems) == count and all(p.problem and p.answer for p in problems)


def test_any_path_in_the_same_format(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"q{i}", "problem": f"{i}+1", "answer": str(i + 1)}) for i in range(3)))
    assert [p.answer for p in load_problems(str(path))] == ["1", "2", "3"]


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"id": "a", "problem": "x"}'], r"mine.jsonl:1: field 'answer' must be a non-empty string"),
        (['{"id": "a", "problem": "x", "answer": "1"}', "{oops"], r"mine.jsonl:2: not valid JSON"),
        (['{"id": "a", "problem": "x", "answer": "1"}'] * 2, r"mine.jsonl:2: duplicate id 'a'"),
        (['{"id": "a", "problem": "", "answer": "1"}'], "field 'problem' must be a non-empty string"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, lines, match):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=match):
        load_problems(str(path))


def test_parquet_in_the_same_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": ["a", "b"], "problem": ["1+1", "2+2"], "answer": ["2", "4"]})
    pq.write_table(table, tmp_path / "set.parquet")
    assert [p.answer for p in load_problems(str(tmp_path / "set.parquet"))] == ["2", "4"]


def _dapo_rows():
    """Records shaped like DAPO-Math-17k's parquet (chat prompt, reward_model, extra_info)."""
    return [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": f"uuid-{i}"}} for i in range(3)]


DAPO_FIELDS = {"id": "extra_info.index", "problem": "prompt.0.content", "answer": "reward_model.ground_truth"}


def test_another_schema_is_read_through_a_field_map(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_dapo_rows()), tmp_path / "dapo.parquet")
    (tmp_path / "dapo.jsonl").write_text("\n".join(json.dumps(r) for r in _dapo_rows()))
    for name in ("dapo.parquet", "dapo.jsonl"):
        problems = load_problems(str(tmp_path / name), fields=DAPO_FIELDS)
        assert [(p.id, p.problem, p.answer) for p in problems] == [
            (f"uuid-{i}", f"What is {i}+{i}?", str(2 * i)) for i in range(3)]


def test_field_map_errors_name_the_setting(tmp_path):
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _dapo_rows()))
    # without a map, the error lists what the record has and points at data.fields
    with pytest.raises(ValueError, match=r"dapo.jsonl:1: field 'id' must be .* got nothing; the record has "
                                         r"ability, data_source, extra_info, prompt, reward_model .*data.fields"):
        load_problems(str(path))
    wrong = {**DAPO_FIELDS, "answer": "reward_model.answer"}
    with pytest.raises(ValueError, match=r"field 'answer' \(read from 'reward_model.answer', data.fields.answer\)"):
        load_problems(str(path), fields=wrong)
    with pytest.raises(ValueError, match=r"field 'problem' \(read from 'prompt.5.content'"):
        load_problems(str(path), fields={**DAPO_FIELDS, "problem": "prompt.5.content"})
    with pytest.raises(ValueError, match=r"data.fields.question is not a problem field"):
        load_problems(str(path), fields={"question": "prompt.0.content"})


def test_field_map_reaches_the_prompt_stream_from_the_config(tmp_path):
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _dapo_rows()))
    data = DataConfig(train=str(path), fields=DAPO_FIELDS)
    stream = PromptStream(data.train, data.root, PLAIN, seed=1, fields=data.fields)
    assert sorted(e.problem.answer for e in stream.take(3)) == ["0", "2", "4"]
    with pytest.raises(ValueError, match="data.fields.question is not a problem field"):
        DataConfig(fields={"question": "prompt.0.content"})


def test_unknown_dataset():
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        load_problems("no_such_set")


def test_procedural_tasks_are_deterministic_and_correct():
    a, b = generate("add", 50, seed=3), generate("add", 50, seed=3)
    assert a == b and a != generate("add", 50, seed=4)
    for p in a:
        x, y = p.problem.split("+")
        assert int(x) + int(y) == int(p.answer)


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    ids = tok.encode("7+8=15")
    assert tok.decode(ids) == "7+8=15" and tok.decode(ids + [1]) == "7+8=15"  # <eos> vanishes
    assert tok.decode([120]) == "\ufffd"  # ids past the alphabet
    with pytest.raises(ValueError, match="not in the character tokenizer"):
        tok.encode("é")


def test_rewards():
    assert reward_fn("exact")([" 15", "16"], ["15", "15"]) == [1.0, 0.0]
    verifier = MathVerifier(workers=1, timeout_s=20)
    try:
        scores = verifier(["... so \\boxed{\\frac{1}{2}}", "the answer is 0.5", "no idea", "\\boxed{"],
                          ["\\frac{1}{2}", "\\frac12", "7", "3"])
    finally:
        verifier.close()
    assert scores[0] == 1.0 and scores[2] == 0.0 and scores[3] == 0.0
    with pytest.raises(ValueError, match="data.reward='nope' is unknown"):
        reward_fn("nope")


def test_prompt_stream_resumes_exactly():
    stream = PromptStream("procedural:add", ".", PLAIN, seed=9)
    first = stream.take(5) + stream.take(7)
    resumed = PromptStream("procedural:add", ".", PLAIN, seed=9, cursor=5)
    assert resumed.take(7) == first[5:]
    assert first[0].prompt_tokens == tuple(CharTokenizer().encode(first[0].problem.problem + "="))


def test_prompt_stream_epochs_reshuffle_a_fixed_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"id": str(i), "problem": "p", "answer": "a"}) for i in range(4)))
    stream = PromptStream(str(path), ".", PLAIN, seed=1)
    epoch1, epoch2 = stream.take(4), stream.take(4)
    assert sorted(e.problem.id for e in epoch1) == sorted(e.problem.id for e in epoch2) == ["0", "1", "2", "3"]
    assert [e.problem.id for e in epoch1] != [e.problem.id for e in epoch2]


def test_avg_at_k_and_the_checkpoint_rule():
    correct = torch.tensor([1, 1, 0, 0, 1, 0, 0, 0], dtype=torch.float32)  # 2 questions × k=4
    assert avg_at_k(correct, 4) == pytest.approx((0.5 + 0.25) / 2)
    best = BestCheckpoint()
    for step, score in [(0, 0.2), (10, 0.5), (20, 0.5), (30, 0.4)]:
        best.update(EvalResult(step, {"a": score, "b": score}))
    assert best.step == 10 and best.mean == 0.5  # the earlier step wins a tie


def test_metrics_line_jsonl_and_plot(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        writer.write(step, {"reward_mean": step / 10, "loss": 0.1, "eval/mean_avg@4": step / 20})
    writer.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and records[-1]["reward_mean"] == 0.5
    line = summary_line(3, 10, {"reward_mean": 0.25, "grad_norm": 1.5, "time/train_s": 2.0})
    assert line == "step 3/10 | reward 0.250 | gnorm 1.500 | train 2.0s"
    png = plot_runs([tmp_path, tmp_path], tmp_path / "c.png", labels=["a", "b"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
