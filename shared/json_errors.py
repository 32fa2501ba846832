"""What a ``json.JSONDecodeError`` says, for a message of ours.

The decoder's own words can end in a preposition ("Unterminated string starting at",
"Invalid control character at"): a message that appends "at column N" to them says the
word twice.
Invariant: the place follows the decoder's words after a colon, as Python's ``str(exc)`` puts
it, so no decoder message reads twice; the line is named only when the text has more than one.
"""

from __future__ import annotations

import json


def json_problem(exc: json.JSONDecodeError) -> str:
    """``"<decoder message>: column C"``, or ``": line L column C"`` past the first line."""
    line = f"line {exc.lineno} " if exc.lineno > 1 else ""
    return f"{exc.msg}: {line}column {exc.colno}"
