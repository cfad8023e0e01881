"""Output directories that appear whole or not at all, and the tokenizer files that go with a
Hugging Face checkpoint."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Everything besides weights and config.json that transformers and serving engines read.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer*.json", "tokenizer.model", "vocab*", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
)


@contextmanager
def staged_output(out: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory of ``out``; it becomes ``out`` only if the block
    succeeds, and is removed otherwise, so a failed conversion writes nothing."""
    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.replace(staging, out)


def copy_tokenizer_files(source: str | Path, destination: str | Path) -> list[str]:
    """Copy the tokenizer and generation files found in ``source``; returns their names."""
    source, destination = Path(source), Path(destination)
    if not source.is_dir():
        raise FileNotFoundError(f"tokenizer directory {source} does not exist")
    copied = []
    for pattern in TOKENIZER_FILES:
        for file in sorted(source.glob(pattern)):
            if file.is_file() and file.name not in copied:
                shutil.copy2(file, destination / file.name)
                copied.append(file.name)
    return copied
