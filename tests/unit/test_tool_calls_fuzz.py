"""Fuzz the tool-call parser: whatever the model writes, ``parse_tool_calls`` returns the calls
it could read and an error message or None; it never raises (its module's invariant), because
its error becomes an observation for the agent, not a failed episode. And calls written in the
documented format come back exactly. Examples per target: ``FUZZ_EXAMPLES`` (tests/fuzz_support.py).
"""

from __future__ import annotations

import json
import math

from fuzz_support import FUZZ, json_like, nested, text
from hypothesis import event, given, strategies as st

from services.rollout_worker.tool_calls import CLOSE, OPEN, parse_tool_calls
from shared.schemas import ToolCall

pieces = st.sampled_from([
    OPEN, CLOSE, OPEN[:5], CLOSE[2:], '{"name": "guess", "arguments": ', '{"name": ', '"arguments": {"n": 1}}', "}", "{", "[",
    "]", '"', ",", ":", "null", "NaN", "Infinity", "-1e999", "9" * 5000, "\\ud800", '"\\u0000"', "\n", "```json", "```",
]) | text | nested()
model_output = text | st.lists(pieces, max_size=16).map("".join)


def check(result: tuple) -> None:
    calls, error = result
    assert isinstance(calls, list) and all(isinstance(c, ToolCall) for c in calls)
    assert error is None or (isinstance(error, str) and error)


@FUZZ
@given(output=model_output)
def test_any_model_output_parses_to_calls_and_an_error_never_an_exception(output):
    calls, error = parse_tool_calls(output)
    check((calls, error))
    event(f"{len(calls)} calls, " + ("no error" if error is None else "error: " + " ".join(error.split()[:3])))


finite = st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False, allow_infinity=False) | text
arguments = st.dictionaries(text, json_like(text, finite, max_leaves=8), max_size=4)


def written(name: str, args: dict, style: int) -> str:
    body = {"name": name, "arguments": args} if args or style == 0 else {"name": name}
    return OPEN + json.dumps(body, indent=None if style < 2 else 2, ensure_ascii=style == 1) + CLOSE


@FUZZ
@given(calls=st.lists(st.tuples(text, arguments, st.integers(0, 2)), max_size=4), around=st.lists(text, min_size=5, max_size=5))
def test_calls_in_the_documented_format_come_back_exactly(calls, around):
    # the format cannot carry its closing tag inside a call (a limit of the format, not of the parser)
    calls = [(n, a, s) for n, a, s in calls if CLOSE not in json.dumps({"name": n, "arguments": a}, ensure_ascii=False)]
    prose = [p.replace(OPEN, "").replace(CLOSE, "") for p in around]
    output = prose[0] + "".join(written(n, a, s) + prose[i % 4 + 1] for i, (n, a, s) in enumerate(calls))
    parsed, error = parse_tool_calls(output)
    assert error is None
    assert [(c.name, c.arguments) for c in parsed] == [(n, a) for n, a, _ in calls]
    assert all(not isinstance(v, float) or math.isfinite(v) for c in parsed for v in c.arguments.values())
