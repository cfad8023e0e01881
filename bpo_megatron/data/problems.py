"""Prompt datasets: JSONL/Parquet files of ``{id, problem, answer}``, by path or by name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str
    source: str = ""


# Names resolved under ``data.root`` (the files the project ships with in ../shared/data).
NAMED_FILES = {
    "gsm8k_train": "gsm8k_train.jsonl",
    "gsm8k_test": "gsm8k_test.jsonl",
    "math500": "math500.jsonl",
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "aime26": "aime26.jsonl",
}
_REQUIRED = ("id", "problem", "answer")


def resolve(spec: str, root: str | Path) -> Path:
    """A dataset file from a path or a known name (looked up under ``root``)."""
    if spec in NAMED_FILES:
        path = Path(root) / NAMED_FILES[spec]
        if not path.is_file():
            raise FileNotFoundError(f"dataset {spec!r} is expected at {path}; set data.root to the directory "
                                    f"holding {NAMED_FILES[spec]}")
        return path
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {spec!r} is neither a known name ({', '.join(sorted(NAMED_FILES))}) "
                                "nor an existing .jsonl/.parquet file")
    return path


def _check(record: dict, where: str) -> Problem:
    for field in _REQUIRED:
        value = record.get(field)
        if not isinstance(value, (str, int)) or (isinstance(value, str) and not value.strip() and field != "id"):
            raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return Problem(id=str(record["id"]), problem=str(record["problem"]), answer=str(record["answer"]),
                   source=str(record.get("source", "")))


HF_PREFIX = "hf:"


def _load_hf_dataset(spec: str) -> list[Problem]:
    """``hf:<name or local dir>[:split]`` through the ``datasets`` library, when installed."""
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError(f"dataset {spec!r} needs the datasets package (pip install datasets), or "
                           "export it to .jsonl/.parquet with fields id, problem, answer") from exc
    name, _, split = spec[len(HF_PREFIX):].partition(":")
    rows = datasets.load_dataset(name, split=split or "train")
    return [_check(dict(row), f"{spec} row {i}") for i, row in enumerate(rows)]


def load_problems(spec: str, root: str | Path = ".") -> list[Problem]:
    """Every record of a dataset; a malformed record names its file, line and field."""
    if spec.startswith(HF_PREFIX):
        return _load_hf_dataset(spec)
    path = resolve(spec, root)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise RuntimeError(f"reading {path} needs pyarrow (pip install pyarrow)") from exc
        rows = pq.read_table(path).to_pylist()
        problems = [_check(row, f"{path} row {i}") for i, row in enumerate(rows)]
    else:
        problems = []
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
                problems.append(_check(record, f"{path}:{number}"))
    if not problems:
        raise ValueError(f"{path} holds no problems")
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate ids (e.g. {next(i for i in ids if ids.count(i) > 1)!r})")
    return problems
