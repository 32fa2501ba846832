"""Dataset readers: JSONL files and saved Hugging Face ``datasets`` directories.

Invariants:
- Reading never stops at a bad row. A line that is not JSON, or JSON that Python will not read
  (an integer of more than 4300 digits, nesting deeper than the recursion limit), comes back
  as a ``BadRow`` with its location and the parser's message; the caller records and counts it.
- A dataset that cannot be read at all (no such file, not a saved dataset, no such split)
  raises ``DatasetError`` naming the path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class Row:
    source: str  # "path:line" or "path[split][index]"
    value: Any


@dataclass(frozen=True)
class BadRow:
    source: str
    reason: str


def read_rows(dataset: str | Path, split: str = "train") -> list[Row | BadRow]:
    path = Path(dataset)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if path.is_file():
        return list(_read_jsonl(path))
    return list(_read_hf(path, split))


def _read_jsonl(path: Path):
    with path.open(encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield Row(f"{path}:{number}", json.loads(line))
            except json.JSONDecodeError as exc:
                yield BadRow(f"{path}:{number}", f"not valid JSON: {exc.msg} at column {exc.colno}")
            except ValueError as exc:  # valid JSON Python will not read: an integer of more than 4300 digits
                yield BadRow(f"{path}:{number}", f"not readable JSON: {exc}")
            except RecursionError:
                yield BadRow(f"{path}:{number}", "not readable JSON: nested too deeply")


def _read_hf(path: Path, split: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:  # a directory that is not a saved dataset
        raise DatasetError(f"dataset {path}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"dataset {path} has no split {split!r}; it has {sorted(loaded)}")
        loaded = loaded[split]
    for index, row in enumerate(loaded):
        yield Row(f"{path}[{split}][{index}]", row)
