"""Dataset readers: JSONL files and saved Hugging Face ``datasets`` directories.

Invariants:
- Reading never stops at a bad row. A line that is not JSON, or JSON that Python will not read
  (an integer of more than 4300 digits, nesting deeper than the recursion limit), comes back
  as a ``BadRow`` with its location and the parser's message; the caller records and counts it.
- A dataset that cannot be read at all (no such file, not a saved dataset, no such split)
  raises ``DatasetError`` naming the path.
- Every row is checked before it is parsed: a row over ``max_row_bytes`` and bytes that are not
  valid UTF-8 come back as ``BadRow`` naming the size or the byte and its offset; nothing is
  silently replaced.
- ``read_dataset`` also gives the dataset's **version**: a content hash of its rows (the JSONL
  file's bytes, or a saved dataset's fingerprint) plus the user's label, ``label@hash``. The same
  rows always give the same version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.json_errors import json_problem


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


DEFAULT_MAX_ROW_BYTES = 1 << 20


@dataclass(frozen=True)
class Dataset:
    rows: list[Row | BadRow]
    content_hash: str  # sha256 of the JSONL bytes, or the saved dataset's fingerprint
    label: str = ""

    @property
    def version(self) -> str:
        short = self.content_hash[:16]
        return f"{self.label}@{short}" if self.label else short


def read_dataset(dataset: str | Path, split: str = "train", label: str = "",
                 max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Dataset:
    path = Path(dataset)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if path.is_file():
        digest = hashlib.sha256()
        rows = list(_read_jsonl(path, max_row_bytes, digest))
        return Dataset(rows, digest.hexdigest(), label)
    rows, fingerprint = _read_hf(path, split, max_row_bytes)
    return Dataset(rows, fingerprint, label)


def read_rows(dataset: str | Path, split: str = "train", max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> list[Row | BadRow]:
    return read_dataset(dataset, split, max_row_bytes=max_row_bytes).rows


def _read_jsonl(path: Path, max_row_bytes: int, digest):
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            digest.update(raw)
            if not raw.strip():
                continue
            source = f"{path}:{number}"
            if len(raw) > max_row_bytes:
                yield BadRow(source, f"row is {len(raw)} bytes, over the cap of {max_row_bytes} (intake.max_row_bytes)")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield BadRow(source, f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}")
                continue
            try:
                yield Row(source, json.loads(line))
            except json.JSONDecodeError as exc:
                yield BadRow(source, f"not valid JSON: {json_problem(exc)}")
            except ValueError as exc:  # valid JSON Python will not read: an integer of more than 4300 digits
                yield BadRow(source, f"not readable JSON: {exc}")
            except RecursionError:
                yield BadRow(source, "not readable JSON: nested too deeply")


def _read_hf(path: Path, split: str, max_row_bytes: int) -> tuple[list[Row | BadRow], str]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:  # a directory that is not a saved dataset
        raise DatasetError(f"dataset {path}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"dataset {path} has no split {split!r}; it has {sorted(loaded)}")
        loaded = loaded[split]
    rows: list[Row | BadRow] = []
    for index, row in enumerate(loaded):
        source = f"{path}[{split}][{index}]"
        size = len(json.dumps(row, default=str).encode())
        if size > max_row_bytes:
            rows.append(BadRow(source, f"row is {size} bytes, over the cap of {max_row_bytes} (intake.max_row_bytes)"))
        else:
            rows.append(Row(source, row))
    return rows, hashlib.sha256(f"{loaded._fingerprint}:{split}".encode()).hexdigest()
