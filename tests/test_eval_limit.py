"""eval.limit is the number of questions an evaluation asks, never silently fewer: a procedural set
is generated at that size, a dataset file holding fewer questions is refused before anything
starts (exit 2, naming eval.limit, the dataset, its size and the fix)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bpo_megatron.cli import main
from bpo_megatron.data.tokenizer import CharTokenizer
from bpo_megatron.eval.avg_at_k import EvalResult, load_eval_sets
from bpo_megatron.experiment import load_experiment
from bpo_megatron.tasks.prompts import PromptFormat

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")
OFFPOLICY = str(ROOT / "configs" / "offpolicy_cpu.yaml")


def _sets(overrides: list[str], config: str = DEMO):
    cfg = load_experiment(config, overrides, check_model=False)
    fmt = PromptFormat(CharTokenizer(), "plain", max_prompt_tokens=cfg.data.max_prompt_tokens)
    return load_eval_sets(cfg.eval, ".", fmt, skip_bad=False)


def test_a_procedural_set_is_generated_at_the_size_eval_limit_asks():
    """256 questions where eval.procedural_count says 200: all 256 are asked, and the first 200
    are the questions of the 200-question set (one seeded sequence)."""
    [larger] = _sets(["eval.datasets=[procedural:max]", "eval.limit=256", "eval.procedural_count=200"])
    [default] = _sets(["eval.datasets=[procedural:max]", "eval.limit=null", "eval.procedural_count=200"])
    [smaller] = _sets(["eval.datasets=[procedural:max]", "eval.limit=50"])
    assert len(larger.prompts) == 256 and len(default.prompts) == 200 and len(smaller.prompts) == 50
    questions = [e.problem.problem for e in larger.prompts]
    assert questions[:200] == [e.problem.problem for e in default.prompts]
    assert questions[:50] == [e.problem.problem for e in smaller.prompts]


def test_the_off_policy_config_evaluates_the_200_questions_its_results_were_measured_on():
    [evaluated] = _sets([], OFFPOLICY)
    assert len(evaluated.prompts) == 200


def _dataset(directory: Path, questions: int) -> Path:
    path = directory / "three.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"{i}+1", "answer": str(i + 1)}) + "\n"
                            for i in range(questions)))
    return path


def test_a_limit_above_a_dataset_files_size_is_refused_before_anything_starts(tmp_path, capsys):
    data = _dataset(tmp_path, 3)
    run_dir = tmp_path / "run"
    code = main(["train", DEMO, f"eval.datasets=[{data}]", "eval.limit=5", f"logging.run_dir={run_dir}", "--check"])
    output = "".join(capsys.readouterr())
    assert code == 2, output
    assert re.search(rf"eval.limit=5 asks for more questions than eval.datasets\[0\]='{re.escape(str(data))}' "
                     r"holds \(3\): set eval.limit <= 3 \(or null: all of them\)", output), output
    assert not run_dir.exists()
    # at or below its size the file is asked exactly that many questions
    assert len(_sets([f"eval.datasets=[{data}]", "eval.limit=3"])[0].prompts) == 3
    assert len(_sets([f"eval.datasets=[{data}]", "eval.limit=2"])[0].prompts) == 2


def test_a_limit_below_one_is_refused_when_the_config_loads(capsys):
    assert main(["train", DEMO, "eval.limit=0", "--check"]) == 2
    assert "eval.limit=0 asks for no question; set it >= 1 (or null: every question)" in capsys.readouterr().err


def test_an_evaluation_records_the_counts_of_its_even_and_odd_questions():
    result = EvalResult(20, {"a": (5, 12)}, {"a": {"even": (4, 8), "odd": (1, 4)}})
    assert result.metrics(4) == {"eval/a_avg@4": 5 / 12, "eval/mean_avg@4": 5 / 12,
                                 "eval/a_correct_even": 4, "eval/a_responses_even": 8,
                                 "eval/a_correct_odd": 1, "eval/a_responses_odd": 4}
