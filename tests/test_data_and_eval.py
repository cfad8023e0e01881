"""Datasets, procedural tasks, tokenizers and stop tokens, rewards, the prompt stream, Avg@k, the
best-checkpoint rule (and pruning that spares it), metrics and plots."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from bpo_megatron.data.config import DataConfig
from bpo_megatron.data.problems import Problem, load_problems
from bpo_megatron.data.procedural import generate
from bpo_megatron.data.rewards import MathVerifier, final_answer, reward_fn
from bpo_megatron.data.tokenizer import CharTokenizer, HFTokenizer
from bpo_megatron.eval.avg_at_k import BestCheckpoint, EvalResult, avg_at_k, evaluate, load_eval_sets
from bpo_megatron.eval.config import EvalConfig
from bpo_megatron.experiment import load_experiment
from bpo_megatron.loop.run_dir import RunState
from bpo_megatron.rollout import Sample
from bpo_megatron.tasks.prompts import PromptFormat, stop_tokens
from bpo_megatron.tasks.scoring import score
from bpo_megatron.tasks.stream import PromptStream
from bpo_megatron.trainer import checkpoint
from bpo_megatron.observability.metrics import MetricsWriter, read_metrics, summary_line
from bpo_megatron.observability.plot import plot_runs

DEMO = Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml"
PLAIN = PromptFormat(CharTokenizer(), "plain", max_prompt_tokens=64)


@pytest.mark.parametrize("name, count", [("aime24", 30), ("aime25", 30), ("aime26", 30), ("math500", 500),
                                         ("gsm8k_test", 1319), ("gsm8k_train", 7473)])
def test_the_shipped_datasets_load_by_name(name, count):
    """The named sets ship with the package: they load with ``data.root`` left at its default,
    whatever lies beside the checkout, and each file's bytes are the ones its README lists."""
    import hashlib
    import re

    from bpo_megatron.data.problems import NAMED_FILES, SHIPPED_SETS

    from bpo_megatron.data.problems import shipped_checksums

    problems = load_problems(name)
    assert len(problems) == count and all(p.problem and p.answer for p in problems)
    listed = dict(re.findall(r"\| `([\w.]+\.jsonl)` \| \d+ \| `([0-9a-f]{64})` \|",
                             (SHIPPED_SETS / "README.md").read_text()))
    digest = hashlib.sha256((SHIPPED_SETS / NAMED_FILES[name]).read_bytes()).hexdigest()
    assert digest == listed[NAMED_FILES[name]] == shipped_checksums()[NAMED_FILES[name]]


def test_a_shipped_set_whose_bytes_changed_is_refused_at_load_naming_both_checksums(tmp_path, monkeypatch, capsys):
    """GSM8K's test set cut to 1,000 of its 1,319 records (or one answer edited) among the shipped
    sets: reading it by name is refused, naming the file, the sha256 it has, the one recorded and
    the fix; ``train --check`` evaluating on it exits 2 before anything starts. The same edited
    file under a ``data.root`` of one's own is the user's data and loads."""
    import hashlib
    import shutil

    from bpo_megatron.cli import main
    from bpo_megatron.data import problems as problems_module
    from bpo_megatron.data.problems import DamagedDataset, shipped_checksums

    shipped = tmp_path / "sets"
    shutil.copytree(problems_module.SHIPPED_SETS, shipped)
    monkeypatch.setattr(problems_module, "SHIPPED_SETS", shipped)
    assert len(load_problems("gsm8k_test")) == 1319  # the copy is the shipped bytes
    recorded = shipped_checksums()["gsm8k_test.jsonl"]
    cut = shipped / "gsm8k_test.jsonl"
    cut.write_text("".join(cut.read_text().splitlines(keepends=True)[:1000]))
    actual = hashlib.sha256(cut.read_bytes()).hexdigest()
    assert actual != recorded
    with pytest.raises(DamagedDataset) as refused:
        load_problems("gsm8k_test")
    message = str(refused.value)
    assert message.startswith(f"{cut} is not the file that ships with the package: its sha256 is {actual}, "
                              f"{shipped / 'SHA256SUMS'} records {recorded}; it was edited or cut short. Restore it")
    assert "name it by path, or set data.root to its directory" in message
    edited = shipped / "aime24.jsonl"  # one answer changed, same length
    edited.write_text(edited.read_text().replace('"answer": "204"', '"answer": "205"', 1))
    with pytest.raises(DamagedDataset, match="aime24.jsonl is not the file that ships"):
        load_problems("aime24")
    own = tmp_path / "own"
    own.mkdir()
    shutil.copy(cut, own / "gsm8k_test.jsonl")
    assert len(load_problems("gsm8k_test", own)) == 1000
    run_dir = tmp_path / "run"
    code = main(["train", str(DEMO), "eval.datasets=[gsm8k_test]", "eval.limit=8", "data.template=math-boxed",
                 f"logging.run_dir={run_dir}", "--check"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"eval.datasets[0]='gsm8k_test': {cut} is not the file that ships with the package" in err
    assert not run_dir.exists()


def test_a_root_of_ones_own_replaces_the_shipped_sets(tmp_path):
    (tmp_path / "aime24.jsonl").write_text(json.dumps({"id": "mine", "problem": "1+1", "answer": "2"}) + "\n")
    assert [p.id for p in load_problems("aime24", tmp_path)] == ["mine"]
    with pytest.raises(FileNotFoundError, match=r"'math500' is expected at .*math500.jsonl; set data.root to the "
                                                r"directory holding math500.jsonl, or leave it empty"):
        load_problems("math500", tmp_path)


def test_every_recipe_resolves_its_datasets():
    """What the shipped recipes train and evaluate on resolves on a fresh clone (the training file
    of a cluster recipe is a placeholder path the user overrides, so only names are checked)."""
    from bpo_megatron.data.problems import NAMED_FILES, resolve

    recipes = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    named = 0
    for recipe in recipes:
        cfg = load_experiment(recipe)
        for spec in (*cfg.eval.datasets, cfg.data.train):
            if spec in NAMED_FILES:
                assert resolve(spec, cfg.data.root).is_file(), (recipe.name, spec)
                named += 1
    assert named >= 9  # the paper's recipes evaluate on AIME 2024-2026


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


def test_a_mixture_of_procedural_tasks_draws_each_problem_from_one_of_them():
    import random

    from bpo_megatron.data.config import check_procedural
    from bpo_megatron.data.procedural import TASKS

    mixed = generate("add+max+sort", 300, seed=5)
    assert mixed == generate("add+max+sort", 300, seed=5) and mixed != generate("add+max+sort", 300, seed=6)
    kinds = {"+": 0, "max": 0, "sort": 0}
    for p in mixed:
        if p.problem.startswith("max "):
            kinds["max"] += 1
            assert int(p.answer) == max(map(int, p.problem.split()[1:]))
        elif p.problem.startswith("sort "):
            kinds["sort"] += 1
            assert p.answer == "".join(sorted(p.problem.split()[1:]))
        else:
            kinds["+"] += 1
            assert sum(map(int, p.problem.split("+"))) == int(p.answer)
    assert min(kinds.values()) > 60  # uniform over the three: 100 each expected
    # the generator draws the task, then the task's problem: replayed by hand
    rng, first = random.Random(5), None
    first = rng.choice([TASKS["add"], TASKS["max"], TASKS["sort"]])(rng)
    assert (mixed[0].problem, mixed[0].answer) == first
    with pytest.raises(ValueError, match=r"data.train='procedural:add\+mul': procedural task 'mul' is unknown; "
                                         r"choose one of .* \(or several joined by '\+'"):
        check_procedural("procedural:add+mul", "data.train")
    with pytest.raises(ValueError, match="procedural task 'mul' \\(of 'add\\+mul'\\) is unknown"):
        generate("add+mul", 3, seed=1)


def test_the_longer_variants_of_procedural_tasks_answer_correctly():
    for name, low, high in (("max5", 5, 6), ("sort6", 6, 7), ("reverse6", 6, 7)):
        for p in generate(name, 100, seed=2):
            words = p.problem.split()[1:]
            if name == "reverse6":
                assert low <= len(words[0]) <= high and p.answer == words[0][::-1]
            else:
                assert low <= len(words) <= high
                assert p.answer == (str(max(map(int, words))) if name == "max5" else "".join(sorted(words)))
    for p in generate("sum3", 50, seed=2):
        assert sum(map(int, p.problem.split("+"))) == int(p.answer)


def test_procedural_sets_stay_the_ones_committed_results_were_measured_on():
    """Tier B's base model was trained and its runs evaluated on these sequences: a change to a
    task's generator would silently make the committed CSVs unreproducible."""
    pinned = {"max5": [("max 14 0 11 74 4 85", "85"), ("max 12 98 45 30 2", "98")],
              "max": [("max 14 0 11", "14"), ("max 4 85 88 10", "88")],
              "sort": [("sort 1 0 1 9", "0119"), ("sort 1 1 5", "115")],
              "reverse": [("rev baba", "abab"), ("rev bbfda", "adfbb")]}
    for name, problems in pinned.items():
        assert [(p.problem, p.answer) for p in generate(name, 2, seed=1234)] == problems, name


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
    assert scores == [1.0, 0.0, 0.0, 0.0]  # "the answer is 0.5" has no final-answer marker
    with pytest.raises(ValueError, match="data.reward='nope' is unknown"):
        reward_fn("nope")


def _square_unless_negative(x: int) -> int:
    """A scoring call for the pool's test: hangs on a negative number, raises on 13."""
    import time

    if x < 0:
        time.sleep(600)
    if x == 13:
        raise ArithmeticError("thirteen")
    return x * x


def test_a_hung_scoring_call_costs_its_pool_not_the_calls_behind_it():
    """Two workers, a call that never returns: it times out, its pool is replaced, and every
    other call (queued behind it or not) is computed, in order; an exception is reported."""
    import time

    from bpo_megatron.data.scoring_pool import TimedPool

    pool = TimedPool(workers=2, timeout_s=1.0)
    try:
        start = time.monotonic()
        results = pool.run(_square_unless_negative, [(i,) for i in (1, -1, 2, 3, 13, 4, 5, 6)])
        assert time.monotonic() - start < 20
        assert [r.value for r in results] == [1, None, 4, 9, None, 16, 25, 36]
        assert [r.timed_out for r in results] == [False, True] + [False] * 6
        assert results[4].error == "ArithmeticError: thirteen" and not results[4].ok
        assert pool.replaced == 1
        # the fresh pool serves the next batch
        assert [r.value for r in pool.run(_square_unless_negative, [(7,), (8,)])] == [49, 64]
    finally:
        pool.close()


def test_a_pool_ends_without_a_stack_dump_whatever_sigterm_handler_the_driver_has(tmp_path):
    """Ray's core installs a stack-dumping SIGTERM handler in the driver; workers forked from it
    inherit it, and ending the pool (SIGTERM) printed one dump per worker after a run's last line.
    Here the driver's handler is faulthandler's (a C-level handler as Ray's), and a pool that
    timed a call out (its workers terminated) and one closed at the end print nothing."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent("""
        import faulthandler, signal, time
        faulthandler.register(signal.SIGTERM, chain=True)  # dumps every thread's stack on SIGTERM
        from bpo_megatron.data.scoring_pool import TimedPool

        def _square_unless_negative(x):
            if x < 0:
                time.sleep(600)
            return x * x

        pool = TimedPool(workers=2, timeout_s=1.0)
        print([r.value for r in pool.run(_square_unless_negative, [(2,), (-1,), (3,)])], pool.replaced)
        pool.close()
        print("done", flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[4, None, 9] 1", "done"]
    assert "most recent call first" not in done.stderr and "SIGTERM" not in done.stderr, done.stderr


def test_math_verify_scores_after_a_call_that_timed_out(monkeypatch):
    """A math-verify call past the timeout scores 0 and is counted; the answers after it are
    still verified (before, its worker stayed busy and every later call timed out as well)."""
    from bpo_megatron.data import rewards

    monkeypatch.setattr(rewards, "_math_verify_one", _hang_on_seven)  # the pool calls the module's function
    verifier = MathVerifier(workers=1, timeout_s=2.0)
    try:
        scores = verifier(["\\boxed{7}", "\\boxed{4}", "\\boxed{5}", "none"], ["7", "4", "6", "1"])
        assert scores == [0.0, 1.0, 0.0, 0.0] and verifier.timeouts == 1
        assert verifier(["\\boxed{3}"], ["3"]) == [1.0]
    finally:
        verifier.close()


def _hang_on_seven(args: tuple[str, str]) -> float:
    """math-verify's stand-in: exact comparison, but it never returns on the answer 7."""
    import time

    if args[0] == "7":
        time.sleep(600)
    return float(args[0] == args[1])


def test_scoring_workers_follow_the_drivers_cpus(tmp_path, monkeypatch):
    import os

    from bpo_megatron.data import rewards

    # all CPUs but the driver's 2, at least 1, at most 32
    assert [rewards.scoring_workers(n) for n in (1, 2, 3, 16, 34, 35, 224)] == [1, 1, 1, 14, 32, 32, 32]
    # the CPUs the driver may run on: its affinity, not the machine's count ...
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    monkeypatch.setattr(os, "cpu_count", lambda: 224)
    no_cgroup = tmp_path / "absent"
    assert rewards.available_cpus(no_cgroup) == 12
    # ... and no more than a CPU quota (a Kubernetes limit of 3.5 CPUs: 4 CPUs' worth of processes)
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("350000 100000\n")
    assert rewards.available_cpus(cpu_max) == 4
    cpu_max.write_text("max 100000\n")
    assert rewards.available_cpus(cpu_max) == 12
    monkeypatch.setattr(rewards, "CGROUP_CPU_MAX", no_cgroup)
    verifier = MathVerifier(timeout_s=20)
    try:
        assert verifier.workers == 10 and verifier._pool.workers == 10
        assert verifier(["\\boxed{4}"], ["4"]) == [1.0]
    finally:
        verifier.close()
    with pytest.raises(ValueError, match="at least 1 worker process, got workers=0"):
        MathVerifier(workers=0)


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{1}\\boxed{2}", "2"),  # two answers, the last one counts; never merged into 12
    ("so \\boxed{\\frac{1}{\\sqrt{2}}}.", "\\frac{1}{\\sqrt{2}}"),  # nested braces
    ("\\boxed{x \\fbox{2} + 1}", "x \\fbox{2} + 1"),  # a box inside the last top-level one is its content
    ("\\fbox{7}", "7"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are content
    ("Let me think.\nAnswer: 42.\n", "42"),  # a sentence's period is not part of the answer
    ("answer: 1\nANSWER: $\\frac{1}{2}$", "$\\frac{1}{2}$"),  # the last Answer: line, any case
    ("**Answer:** 42", "42"),
    ("Answer: 5\nWait, it is \\boxed{6}", "6"),  # a box wins over an Answer: line
    ("so 6 x 7 = 42", None),  # the last number is no answer
    ("The answer: 42", None),  # "Answer:" must start its line
    ("Final answer: 42", None),
    ("Answer:", None),
    ("\\boxed{3} or rather \\boxed{4", None),  # the last box is never closed: no finished answer
])
def test_final_answer_is_read_only_from_its_marker(response, answer):
    assert final_answer(response) == answer


def test_math_reward_false_positives_and_negatives():
    verifier = MathVerifier(workers=1, timeout_s=20)
    try:
        scores = verifier(
            ["6 times 7 is 42",  # no marker, though its last number is the answer
             "\\boxed{1}\\boxed{2}",  # read as 12 when the boxes were merged
             "\\boxed{1}\\boxed{2}",  # the last box is the answer
             "First 40, then 2 more.\nAnswer: 42",
             "Answer: 41\nHmm, 42? No.",  # a later number does not replace the answer line
             "**Answer:** $\\frac{1}{2}$",
             "\\boxed{\\frac{1}{\\sqrt{2}}}",  # nested braces, equivalent form
             "Answer: 5\nso \\boxed{6}",
             "Answer: 5\nso \\boxed{6}"],
            ["42", "12", "2", "42", "42", "0.5", "\\frac{\\sqrt{2}}{2}", "6", "5"])
    finally:
        verifier.close()
    assert scores == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def _sample(text: str, finish_reason: str, tokenizer=CharTokenizer()) -> Sample:
    tokens = torch.tensor(tokenizer.encode(text) + ([1] if finish_reason == "stop" else []))
    return Sample("r", 0, torch.tensor([5, 6]), tokens, torch.zeros(tokens.numel()), finish_reason)


def test_a_truncated_response_scores_the_setting_whatever_it_ends_with():
    samples = [_sample("6 x 7 is 42", "length"),  # cut off mid-derivation, ending in the gold number
               _sample("so \\boxed{42}", "length"),  # even a complete box: the response never finished
               _sample("so \\boxed{42}", "stop"),
               _sample("so \\boxed{42}", "abort"),  # aborted by an engine, not cut by the limit: verified
               _sample("6 x 7 is 42", "stop")]
    problems = [Problem(f"q{i}", "6 x 7", "42") for i in range(5)]
    verifier = MathVerifier(workers=1, timeout_s=20)
    try:
        scored = score(samples, problems, CharTokenizer(), verifier, truncated_reward=DataConfig().truncated_reward)
        assert scored.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
        penalised = score(samples, problems, CharTokenizer(), verifier, truncated_reward=-0.5)
        assert penalised.tolist() == [-0.5, -0.5, 1.0, 1.0, 0.0]
    finally:
        verifier.close()
    assert DataConfig().truncated_reward == 0.0
    assert DataConfig(truncated_reward=-1).truncated_reward == -1
    with pytest.raises(ValueError, match=r"data.truncated_reward must be a finite number .* got nan"):
        DataConfig(truncated_reward=float("nan"))


def test_evaluation_counts_a_truncated_response_wrong_whatever_the_training_reward():
    cfg = load_experiment(DEMO, ["data.truncated_reward=1.0", "eval.k=2", "eval.limit=2"])
    fmt = PromptFormat(CharTokenizer(), "plain", max_prompt_tokens=16)
    sets = load_eval_sets(cfg.eval, ".", fmt, skip_bad=False)
    answers = [e.problem.answer for e in sets[0].prompts]

    def generate(requests):  # per question: one right answer that stopped, one cut off
        return [_sample(answers[q], reason) for q in range(len(requests)) for reason in ("stop", "length")]

    result = evaluate(generate, sets, CharTokenizer(), reward_fn("exact"), cfg, step=3)
    assert result.counts == {"procedural:add": (2, 4)} and result.scores == {"procedural:add": 0.5}
    assert result.metrics(2) == {"eval/procedural:add_avg@2": 0.5, "eval/mean_avg@2": 0.5,
                                 # the counts of the questions at even and at odd positions
                                 "eval/procedural:add_correct_even": 1, "eval/procedural:add_responses_even": 2,
                                 "eval/procedural:add_correct_odd": 1, "eval/procedural:add_responses_odd": 2}


def test_evaluation_generates_every_dataset_at_once_and_scores_each_apart():
    """One generation over all evaluation sets (engines never idle at one set's tail); each set's
    samples are scored against its own answers, in its own order."""
    cfg = load_experiment(DEMO, ["eval.k=2", "eval.limit=3", "eval.datasets=[procedural:add,procedural:max]"])
    fmt = PromptFormat(CharTokenizer(), "plain", max_prompt_tokens=16)
    sets = load_eval_sets(cfg.eval, ".", fmt, skip_bad=False)
    add_answers = [e.problem.answer for e in sets[0].prompts]
    calls = []

    def generate(requests):  # right on every question of the first set, wrong on the second
        calls.append([r.request_id for r in requests])
        out = []
        for r in requests:
            tag, question = r.request_id.rsplit("-", 1)
            text = add_answers[int(question)] if tag.endswith("procedural:add") else "wrong"
            out += [_sample(text, "stop") for _ in range(r.sampling.n)]
        return out

    result = evaluate(generate, sets, CharTokenizer(), reward_fn("exact"), cfg, step=1)
    assert [len(c) for c in calls] == [6], "both sets' 3 questions in one call"
    assert result.counts == {"procedural:add": (6, 6), "procedural:max": (0, 6)}


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
    for step, right in [(0, 8), (10, 20), (20, 20), (30, 16)]:
        best.update(EvalResult(step, {"a": (right, 40), "b": (right, 40)}))
    assert best.step == 10 and best.mean == 0.5  # the earlier step wins a tie


AIME = 30 * 32  # responses of one AIME set at Avg@32


def test_the_best_checkpoint_is_decided_on_exact_counts():
    earlier = EvalResult(10, {"aime24": (0, AIME), "aime25": (0, AIME), "aime26": (30, AIME)})
    later = EvalResult(20, {"aime24": (6, AIME), "aime25": (23, AIME), "aime26": (1, AIME)})
    # 30 of 2880 correct both times: a tie. Averaged as floats, the later one comes out ahead in
    # the last bit, and a rule on float means would pick it.
    assert sum(later.scores.values()) / 3 > sum(earlier.scores.values()) / 3
    assert earlier.exact_mean == later.exact_mean == Fraction(30, 2880)
    best = BestCheckpoint()
    assert best.update(earlier) and not best.update(later)
    assert best.step == 10 and best.best_counts() == earlier.counts
    one_more = EvalResult(30, {"aime24": (6, AIME), "aime25": (23, AIME), "aime26": (2, AIME)})
    assert best.update(one_more) and best.step == 30 and best.mean == 31 / 2880
    # datasets of different sizes: the paper's mean of per-set Avg@k, not the pooled fraction
    small = EvalResult(40, {"a": (1, 2), "b": (0, 100)})  # mean 1/4 (pooled it would be 1/102)
    assert small.exact_mean == Fraction(1, 4) and small.mean == 0.25


def test_the_best_checkpoint_survives_a_resume_and_reads_old_state():
    best = BestCheckpoint()
    best.update(EvalResult(10, {"a": (5, 8), "b": (3, 8)}))
    best.update(EvalResult(20, {"a": (4, 8), "b": (3, 8)}))
    state = RunState(step=20, best_step=best.step, best_mean=best.mean, eval_history=best.history)
    restored = RunState.from_checkpoint(json.loads(json.dumps(state.to_dict())))  # as trainer_state.json holds it
    resumed = BestCheckpoint(restored.best_step, restored.best_mean, list(restored.eval_history))
    assert resumed.step == 10 and resumed.best_counts() == {"a": (5, 8), "b": (3, 8)}
    assert not resumed.update(EvalResult(30, {"a": (3, 8), "b": (5, 8)}))  # a tie: step 10 stays
    assert resumed.update(EvalResult(40, {"a": (6, 8), "b": (3, 8)})) and resumed.step == 40
    # a checkpoint saved before counts were kept: (step, mean) entries, compared by the mean
    old = RunState.from_checkpoint({"rl_step": 20, "data_cursor": 0, "sft_done": True, "best_step": 10,
                                    "best_mean": 0.5, "eval_history": [[0, 0.25], [10, 0.5], [20, 0.375]]})
    legacy = BestCheckpoint(old.best_step, old.best_mean, list(old.eval_history))
    assert legacy.best_counts() is None
    assert not legacy.update(EvalResult(30, {"a": (4, 8), "b": (4, 8)})) and legacy.step == 10
    assert legacy.update(EvalResult(40, {"a": (5, 8), "b": (4, 8)})) and legacy.step == 40
    assert legacy.best_counts() == {"a": (5, 8), "b": (4, 8)}  # exact from here on


def test_a_resume_from_state_without_counts_says_how_the_best_is_decided(tmp_path):
    from bpo_megatron.loop.preflight import resume_point

    cfg = load_experiment(DEMO, [f"logging.run_dir={tmp_path / 'run'}"])
    step = tmp_path / "run" / "checkpoints" / checkpoint.step_dir_name(20)
    step.mkdir(parents=True)
    (step / checkpoint.STATE_FILE).write_text(json.dumps(
        {"step": 20, "rl_step": 20, "data_cursor": 80, "sft_done": True, "best_step": 10, "best_mean": 0.5,
         "eval_history": [[10, 0.5], [20, 0.375]]}))
    state, _, notes = resume_point(cfg, cfg.hf_config())
    assert (state.best_step, state.eval_history) == (10, [(10, 0.5), (20, 0.375)])
    assert any("records its evaluations as means without their counts" in note for note in notes), notes


def _checkpoints(root: Path, best_step_of: dict[int, int | None]) -> None:
    for step, best_step in best_step_of.items():
        directory = root / checkpoint.step_dir_name(step)
        directory.mkdir(parents=True)
        (directory / checkpoint.STATE_FILE).write_text(json.dumps({"step": step, "best_step": best_step}))


def _steps(root: Path) -> list[int]:
    return [checkpoint.step_of(p) for p in checkpoint.step_dirs(root)]


def test_keep_last_never_prunes_the_best_checkpoint(tmp_path):
    _checkpoints(tmp_path, {10: 10, 20: 20, 30: 20, 40: 20})  # the newest state names the best
    checkpoint._prune(tmp_path, keep_last=2)
    assert _steps(tmp_path) == [20, 30, 40]
    _checkpoints(tmp_path, {50: 20})
    checkpoint._prune(tmp_path, keep_last=1)
    assert _steps(tmp_path) == [20, 50]
    _checkpoints(tmp_path, {60: 60})  # a later step beat it: the old best goes like any other
    checkpoint._prune(tmp_path, keep_last=1)
    assert _steps(tmp_path) == [60]
    _checkpoints(tmp_path, {70: None, 80: 0})  # none yet, or the initial policy (no checkpoint of its own)
    checkpoint._prune(tmp_path, keep_last=2)
    assert _steps(tmp_path) == [70, 80]


def test_eval_template_defaults_to_the_training_template():
    class Recording(CharTokenizer):  # renders the template's name, so the prompts show which one was used
        def render_prompt(self, problem: str, template: str) -> str:
            return f"[{template}] {problem}="

    fmt = PromptFormat(Recording(), "plain", max_prompt_tokens=64)
    tok = Recording()
    for template, expected in [(None, "plain"), ("math-boxed", "math-boxed")]:
        ev = EvalConfig(datasets=("procedural:add",), limit=1, template=template)
        prompt = load_eval_sets(ev, ".", fmt, skip_bad=False)[0].prompts[0]
        assert tok.decode(list(prompt.prompt_tokens)).startswith(f"[{expected}] ")
    with pytest.raises(ValueError, match=r"eval.template='nope' is unknown; choose one of .*math-boxed"):
        EvalConfig(template="nope")
    cfg = load_experiment(DEMO, ["data.template=plain", "eval.template=math-answer-line"])
    assert (cfg.data.template, cfg.eval.template) == ("plain", "math-answer-line")


def _chat_tokenizer(directory: Path, *, chat: bool) -> HFTokenizer:
    """A Qwen-shaped Hugging Face tokenizer, written offline: <|endoftext|> ends a sequence and,
    with ``chat``, a chat template whose turns end with <|im_end|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "1+1"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|endoftext|>",
                            additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                            chat_template=template if chat else None).save_pretrained(directory)
    return HFTokenizer(str(directory))


def test_stop_tokens_include_the_chat_templates_end_of_turn(tmp_path):
    chat = _chat_tokenizer(tmp_path / "chat", chat=True)
    assert (chat.eos_token_ids, chat.end_of_turn_ids) == ((1,), (3,))  # <|endoftext|>, <|im_end|>
    assert stop_tokens(chat) == (1, 3) and stop_tokens(chat, (5,)) == (1, 3, 5)
    plain = _chat_tokenizer(tmp_path / "plain", chat=False)
    assert plain.end_of_turn_ids == () and stop_tokens(plain) == (1,)
    assert stop_tokens(CharTokenizer(), (7,)) == (1, 7)


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


def test_column_addition_writes_its_scratchpad_and_is_scored_on_the_sum():
    from bpo_megatron.data.procedural import scratchpad_sum

    assert scratchpad_sum(4817, 2965) == "7+5=12c1;1+6+1=8c0;8+9=17c1;4+2+1=7c0;=7782"
    assert scratchpad_sum(99, 1) == "9+1=10c1;9+0+1=10c1;=100"
    for name, low, high in (("addpad", 2, 4), ("addpad56", 5, 6)):
        for p in generate(name, 200, seed=3):
            a, b = map(int, p.problem.split("+"))
            assert low <= len(str(a)) <= high and low <= len(str(b)) <= high
            assert p.answer == scratchpad_sum(a, b) and p.answer.endswith(f"={a + b}")
    score_of = reward_fn("worked-sum")
    # the sum after the last "=" decides, whatever the columns say
    assert score_of(["7+5=12c1;=7782", "7+5=13c1;=7782", "=7781", "7782"],
                    ["7+5=12c1;1+6+1=8c0;8+9=17c1;4+2+1=7c0;=7782"] * 4) == [1.0, 1.0, 0.0, 1.0]


def test_a_record_holding_a_line_separator_is_one_record(tmp_path):
    """U+2028 may stand unescaped inside a JSON string (GSM8K's training set has it): only a
    newline ends a JSON Lines record."""
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "a", "problem": "two\u2028lines", "answer": "1"}, ensure_ascii=False) + "\n"
                    + json.dumps({"id": "b", "problem": "x", "answer": "2"}) + "\n", encoding="utf-8")
    assert [(p.id, p.problem) for p in load_problems(str(path))] == [("a", "two\u2028lines"), ("b", "x")]
