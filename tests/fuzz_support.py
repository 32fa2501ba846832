"""What every hypothesis fuzz target of the suite shares: the number of examples, and JSON-like
values with the awkward cases JSON parsers produce (huge integers, NaN and infinities, deep
nesting, odd Unicode).

Examples per target: ``FUZZ_EXAMPLES`` (default 200, for a fast CI run; ``FUZZ_EXAMPLES=10000``
locally for the issue's figure). ``SETTINGS_FUZZ_EXAMPLES``, the settings fuzz's older name, is
read when ``FUZZ_EXAMPLES`` is not set. Neither has the CONVEYOR_ prefix: the settings loader
does not see them.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings, strategies as st

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES") or os.environ.get("SETTINGS_FUZZ_EXAMPLES") or "200")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
# up to 4300 digits, the most Python's json reads (built by map: hypothesis cannot print such a bound)
big_ints = st.tuples(st.integers(18, 4299), st.sampled_from([1, -1]), st.integers(-1, 1)).map(lambda t: t[1] * 10 ** t[0] + t[2])
numbers = st.integers() | big_ints | st.floats() | st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 1e308])
scalars = st.none() | st.booleans() | numbers | text


def json_like(keys: st.SearchStrategy[str] = text, leaves: st.SearchStrategy = scalars, max_leaves: int = 12) -> st.SearchStrategy:
    """Values a JSON document can hold (and ones only Python's json makes: NaN, huge integers)."""
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
                        max_leaves=max_leaves)


def nested(depth: st.SearchStrategy[int] = st.integers(100, 5000)) -> st.SearchStrategy[str]:
    """Deeply nested JSON text: arrays or objects, closed or not."""
    return st.tuples(depth, st.sampled_from(["[", '{"a":']), st.booleans()).map(
        lambda t: t[1] * t[0] + ("1" + ("]" if t[1] == "[" else "}") * t[0] if t[2] else ""))
