"""Prompt datasets: JSONL/Parquet files of ``{id, problem, answer}``, by path or by name.

Other schemas are read through a field map from each of ``id``, ``problem``, ``answer`` to a
dotted path in the record, where numbers index lists. DAPO-Math-17k's parquet, for example:
``{"id": "extra_info.index", "problem": "prompt.0.content", "answer": "reward_model.ground_truth"}``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str
    source: str = ""
    origin: str = field(default="", compare=False)  # "file:line" of the record, for messages


# The evaluation and training sets that ship with the package (their sources and licences:
# sets/README.md; the sha256 of each file's bytes: sets/SHA256SUMS, checked whenever one is read);
# ``data.root`` names another directory holding files of these names.
SHIPPED_SETS = Path(__file__).resolve().parent / "sets"
CHECKSUMS_FILE = "SHA256SUMS"  # `sha256sum` format: "<hex digest>  <file name>" per line
NAMED_FILES = {
    "gsm8k_train": "gsm8k_train.jsonl",
    "gsm8k_test": "gsm8k_test.jsonl",
    "math500": "math500.jsonl",
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "aime26": "aime26.jsonl",
}
PROBLEM_FIELDS = ("id", "problem", "answer")
FieldMap = Mapping[str, str]  # a Problem field -> the dotted path it is read from


def resolve(spec: str, root: str | Path = "") -> Path:
    """A dataset file from a path or a known name (looked up under ``root``; empty: the sets that
    ship with the package)."""
    if spec in NAMED_FILES:
        path = (Path(root) if str(root) else SHIPPED_SETS) / NAMED_FILES[spec]
        if not path.is_file():
            raise FileNotFoundError(f"dataset {spec!r} is expected at {path}; set data.root to the directory "
                                    f"holding {NAMED_FILES[spec]}, or leave it empty for the copy that ships "
                                    "with the package")
        return path
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {spec!r} is neither a known name ({', '.join(sorted(NAMED_FILES))}) "
                                "nor an existing .jsonl/.parquet file")
    return path


class DamagedDataset(ValueError):
    """A file of the sets that ship with the package whose bytes are not the recorded ones."""


def shipped_checksums(directory: Path | None = None) -> dict[str, str]:
    """File name -> the sha256 recorded for it in ``sets/SHA256SUMS``."""
    lines = ((directory or SHIPPED_SETS) / CHECKSUMS_FILE).read_text().splitlines()
    return {name.lstrip("*"): digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}


def check_shipped(path: Path) -> None:
    """A dataset read from the package's own sets holds the bytes recorded for it: an edited or
    truncated copy would train or evaluate on other questions than the name promises (an
    evaluation on 1,000 of GSM8K's 1,319, say) without a word. Files elsewhere (a path, or
    ``data.root``) are the user's and are not checked."""
    if path.resolve().parent != SHIPPED_SETS.resolve():
        return
    recorded = shipped_checksums().get(path.name)
    if recorded is None:
        raise DamagedDataset(f"{path} lies among the sets that ship with the package but {SHIPPED_SETS / CHECKSUMS_FILE} "
                             "records no checksum for it; put a dataset of your own elsewhere and name it by path "
                             "(or set data.root to its directory)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != recorded:
        raise DamagedDataset(f"{path} is not the file that ships with the package: its sha256 is {digest}, "
                             f"{SHIPPED_SETS / CHECKSUMS_FILE} records {recorded}; it was edited or cut short. Restore "
                             f"it (git checkout -- {path.name} in {SHIPPED_SETS}, or reinstall bpo-megatron); to use a "
                             "changed copy, put it elsewhere and name it by path, or set data.root to its directory")


def check_field_map(fields: FieldMap, setting: str = "data.fields") -> None:
    for name, source in fields.items():
        if name not in PROBLEM_FIELDS:
            raise ValueError(f"{setting}.{name} is not a problem field; map any of {', '.join(PROBLEM_FIELDS)}")
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{setting}.{name}={source!r} must be a dotted path such as reward_model.ground_truth")


_MISSING = object()


def _lookup(record: object, path: str) -> object:
    """``record["a"]["b"][0]`` for ``"a.b.0"``; _MISSING when any step is absent."""
    node = record
    for part in path.split("."):
        if isinstance(node, Mapping):
            node = node.get(part, _MISSING)
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
        if node is _MISSING:
            return _MISSING
    return node


def _check(record: object, where: str, fields: FieldMap, origin: str = "") -> Problem:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a record must be an object with fields {', '.join(PROBLEM_FIELDS)}")
    values = {}
    for name in PROBLEM_FIELDS:
        source = fields.get(name, name)
        value = _lookup(record, source)
        if not isinstance(value, (str, int)) or (isinstance(value, str) and not value.strip() and name != "id"):
            origin = f" (read from {source!r}, data.fields.{name})" if source != name else ""
            hint = "" if fields or value is not _MISSING else (
                f"; the record has {', '.join(sorted(record)) or 'no fields'} (map them with data.fields)")
            shown = "nothing" if value is _MISSING else repr(value)
            raise ValueError(f"{where}: field {name!r}{origin} must be a non-empty string, got {shown}{hint}")
        values[name] = str(value)
    return Problem(**values, source=str(record.get("source", "")), origin=origin)


HF_PREFIX = "hf:"


def _load_hf_dataset(spec: str, fields: FieldMap) -> list[Problem]:
    """``hf:<name or local dir>[:split]`` through the ``datasets`` library, when installed."""
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError(f"dataset {spec!r} needs the datasets package (pip install datasets), or "
                           "export it to .jsonl/.parquet with fields id, problem, answer") from exc
    name, _, split = spec[len(HF_PREFIX):].partition(":")
    rows = datasets.load_dataset(name, split=split or "train")
    return [_check(dict(row), f"{spec} row {i}", fields) for i, row in enumerate(rows)]


@dataclass(frozen=True)
class Rejected:
    """A record that cannot be used, where it is (``file:line`` or ``file row N``) and why."""

    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def read_problems(spec: str, root: str | Path = "", fields: FieldMap | None = None
                  ) -> tuple[list[Problem], list[Rejected]]:
    """Every usable record of a dataset and every rejected one (malformed JSON, a field missing or
    empty, a repeated id), in file order. A file that is missing, unreadable or without a single
    record raises: there is nothing to skip to; so does a shipped set whose bytes are not the
    recorded ones (:func:`check_shipped`)."""
    fields = dict(fields or {})
    check_field_map(fields)
    if spec.startswith(HF_PREFIX):
        return _load_hf_dataset(spec, fields), []
    path = resolve(spec, root)
    check_shipped(path)
    problems: list[Problem] = []
    rejected: list[Rejected] = []

    def keep(record: object, where: str) -> None:
        try:
            problems.append(_check(record, where, fields, origin=where))
        except ValueError as exc:
            rejected.append(Rejected(where, str(exc).removeprefix(f"{where}: ")))

    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise RuntimeError(f"reading {path} needs pyarrow (pip install pyarrow)") from exc
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise ValueError(f"{path} is not a readable Parquet file ({exc})") from exc
        for i, row in enumerate(rows):
            keep(row, f"{path} row {i}")
    else:
        try:
            text = path.read_text()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}); is it a JSONL file?") from exc
        # JSON Lines are split at newlines only: str.splitlines would also split at the U+2028/U+2029
        # separators a JSON string may hold unescaped (GSM8K's training set has them)
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                rejected.append(Rejected(f"{path}:{number}", f"not valid JSON ({exc.msg})"))
                continue
            keep(record, f"{path}:{number}")
    if not problems and not rejected:
        raise ValueError(f"{path} holds no problems")
    seen: set[str] = set()
    unique = []
    for p in problems:
        if p.id in seen:
            rejected.append(Rejected(p.origin, f"duplicate id {p.id!r}"))
        else:
            seen.add(p.id)
            unique.append(p)
    return unique, rejected


def load_problems(spec: str, root: str | Path = "", fields: FieldMap | None = None) -> list[Problem]:
    """Every record of a dataset; a malformed record raises naming its file, line and field.
    ``fields`` maps problem fields to paths in records of another schema (see the module
    docstring)."""
    problems, rejected = read_problems(spec, root, fields)
    if rejected:
        raise ValueError(str(rejected[0]))
    return problems
