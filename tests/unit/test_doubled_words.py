"""No message says a word twice ("at at column 32", issue 24): not in a string literal of the
product code, and not where a message is assembled around a parser's own words."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from services.intake.datasets import BadRow, read_dataset
from services.rollout_worker.tool_calls import parse_tool_calls

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("services", "shared", "bench", "scripts")
DOUBLED = re.compile(r"\b([A-Za-z]+) \1\b", re.IGNORECASE)
# each of the decoder's messages, some of which end in a word of their own ("starting at")
BAD_JSON = ['{"a": "open', '{"a" 1}', '{"a": 1', '{"a": 1,}', "[1 2]", "{'a': 1}", '"\\q"', "[1] 2", "nul", '"a\x01"']


def doubled_words(text: str) -> list[str]:
    return [m.group(0) for m in DOUBLED.finditer(text)]


def string_literals(path: Path):
    """(line, text) of every string literal, docstrings and f-strings' constant parts included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_the_scan_finds_a_doubled_word():
    assert doubled_words("not valid JSON: starting at at column 32") == ["at at"]
    assert doubled_words("hello Hello world") == ["hello Hello"] and doubled_words("at a that") == []


def test_no_string_literal_of_the_product_code_says_a_word_twice():
    found = [f"{path.relative_to(ROOT)}:{line}: {word!r}"
             for folder in PRODUCT for path in sorted((ROOT / folder).rglob("*.py"))
             for line, text in string_literals(path) for word in doubled_words(text)]
    assert not found, "doubled words:\n" + "\n".join(found)


@pytest.mark.parametrize("line", BAD_JSON)
def test_a_bad_jsonl_row_is_named_without_a_doubled_word(tmp_path, line):
    path = tmp_path / "rows.jsonl"
    path.write_text(line + "\n")
    [row] = read_dataset(path).rows
    assert isinstance(row, BadRow) and row.reason.startswith("not valid JSON: ") and "column" in row.reason
    assert not doubled_words(row.reason), row.reason


@pytest.mark.parametrize("body", BAD_JSON)
def test_a_bad_tool_call_is_named_without_a_doubled_word(body):
    calls, error = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert calls == [] and error.startswith("tool call 1 is not valid JSON") and "column" in error
    assert not doubled_words(error), error
