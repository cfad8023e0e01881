"""Sharded ``*.safetensors`` checkpoints: read tensors (or slices of them) by name, write with an
index.

Reading memory-maps the files: a slice of a tensor reads only those bytes, so a rank that needs
one TP shard of a weight never loads the rest. Writing keeps at most one output shard in memory:
tensors are buffered until the next one would push the shard over ``max_shard_bytes``, then the
shard is written and freed. Names follow transformers (``model-00001-of-00003.safetensors`` and
``model.safetensors.index.json``), so ``from_pretrained`` loads the directory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default "5GB"

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a plain number of bytes."""
    if isinstance(text, int):
        size = text
    else:
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        unit = found.group(2).upper() if found else None
        if found is None or unit not in _SIZE_UNITS:
            raise ValueError(f"size {text!r}: expected a number of bytes or e.g. '5GB', '500MB'")
        size = int(float(found.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise ValueError(f"size {text!r} must be positive")
    return size


class HFWeightsReader:
    """The tensors of a Hugging Face checkpoint directory, read lazily by name.

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else every
    ``*.safetensors`` file in the directory. Use as a context manager (or call :meth:`close`).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"Hugging Face checkpoint directory {self.directory} does not exist")
        self._files = ExitStack()
        self._open: dict[str, Any] = {}
        # each file's tensor names, read once: safe_open's keys() builds the whole list on every call,
        # which per tensor made checking a 19k-tensor checkpoint minutes of header reads
        self._names: dict[str, frozenset[str]] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = dict(json.loads(index.read_text())["weight_map"])
            for file in sorted(set(weight_map.values())):
                if not (self.directory / file).is_file():
                    raise FileNotFoundError(f"{index} lists {file}, which does not exist")
            return weight_map
        files = ([self.directory / SINGLE_FILE] if (self.directory / SINGLE_FILE).is_file()
                 else sorted(self.directory.glob("*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        return {name: file.name for file in files for name in self._names_in(file.name)}

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            path = self.directory / file
            try:
                handle = safe_open(str(path), framework="pt")
            except SafetensorError as exc:
                raise ValueError(f"{path} is not a complete safetensors file ({exc}); it is damaged or was cut "
                                 "short while copied: copy it again") from exc
            self._open[file] = self._files.enter_context(handle)
        return self._open[file]

    def _names_in(self, file: str) -> frozenset[str]:
        if file not in self._names:
            self._names[file] = frozenset(self._handle(file).keys())
        return self._names[file]

    def file_of(self, name: str) -> str:
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.directory} "
                             f"({len(set(self.weight_map.values()))} safetensors file(s) searched)")
        return self.weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        file = self.file_of(name)
        if name not in self._names_in(file):
            raise ValueError(f"tensor {name!r} is not in {self.directory / file}, although the index "
                             f"lists it there")
        return tuple(self._handle(file).get_slice(name).get_shape())

    def slice(self, name: str, expected_shape: tuple[int, ...] | None = None) -> Any:
        """The lazily read tensor ``name``, after checking its shape."""
        shape = self.shape(name)
        if expected_shape is not None and shape != tuple(expected_shape):
            raise ValueError(f"tensor {name!r} in {self.directory / self.file_of(name)} has shape "
                             f"{list(shape)}; the config implies {list(expected_shape)}")
        return self._handle(self.file_of(name)).get_slice(name)

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Raise one ValueError listing every missing tensor and every wrong shape (a file that
        cannot be read at all raises first, naming it)."""
        for file in sorted(set(self.weight_map.values())):
            self._handle(file)
        problems = []
        for name, shape in expected.items():
            try:
                self.slice(name, shape)
            except ValueError as error:
                problems.append(str(error))
        if problems:
            raise ValueError("the Hugging Face checkpoint does not match its config.json:\n  "
                             + "\n  ".join(problems))

    def dtype_of(self, name: str) -> str:
        return self._handle(self.file_of(name)).get_slice(name).get_dtype()

    def close(self) -> None:
        self._files.close()
        self._open.clear()
        self._names.clear()

    def __enter__(self) -> HFWeightsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShardedSafetensorsWriter:
    """Writes named tensors into size-bounded shards plus ``model.safetensors.index.json``."""

    def __init__(self, directory: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self._total_bytes = 0
        self._seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"tensor {name!r} was written twice")
        self._seen.add(name)
        # A contiguous CPU copy that owns its storage: safetensors refuses views of shared memory.
        tensor = tensor.detach().to("cpu", copy=True).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor
        self._buffer_bytes += size
        self._total_bytes += size

    def _pending_name(self, index: int) -> Path:
        return self.directory / f".pending-{index:05d}.safetensors"

    def _flush(self) -> None:
        save_file(self._buffer, str(self._pending_name(len(self._shards))), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> dict[str, Any]:
        """Write the last shard, give every shard its final name and write the index."""
        if self._buffer or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self._pending_name(i), self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return index
