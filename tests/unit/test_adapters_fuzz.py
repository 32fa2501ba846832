"""Fuzz the intake row adapters: whatever a dataset row holds, ``adapt_row`` returns a
``TaskProfile`` that can travel in a rollout message, or raises ``RowRejected`` with a reason;
nothing else (no TypeError, OverflowError, RecursionError, pydantic error...), so intake
records the row as rejected and goes on. Examples per target: ``FUZZ_EXAMPLES`` (tests/fuzz_support.py).

Rows are drawn around each accepted shape (task_data, task-file, question/answer, prompt,
SWE-bench, swe-agent-13k, flat guess-the-number) with random and hostile values. The coding
environment's repository check is off (``intake_checks: false``): it fetches repositories,
which a fuzz must not; single_turn rows name reward functions from a fixed list, so nothing
arbitrary is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuzz_support import FUZZ, json_like, nested, numbers, text
from hypothesis import event, given, strategies as st

from services.intake.adapters import RowRejected, adapt_row
from shared.environments.registry import BUILTIN
from services.intake.datasets import BadRow, read_rows
from shared.schemas import TaskProfile

REWARD_FNS = ["services.rollout_worker.environments.toy_rewards:digit_share", "fuzz_no_such_module:fn",
              "services.rollout_worker.environments.toy_rewards:no_such_fn", "not an import path", "", ":", "a:b:c"]
ROW_KEYS = [
    "id", "task_id", "task_key", "instance_id", "env_key", "env_name", "task_data", "env_config",
    "low", "high", "target", "question", "answer", "prompt",
    "repo", "repo_url", "base_commit", "commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS",
    "language", "image", "test_command", "repo_name", "conversations", "reward", "score", "resolved", "label",
]
env_names = st.sampled_from(sorted(BUILTIN)) | text
keys = st.sampled_from(ROW_KEYS) | text
hex_commits = st.text(alphabet="0123456789abcdefABCDEF", min_size=7, max_size=40)
id_lists = st.lists(text, max_size=3) | st.lists(text, max_size=3).map(json.dumps) | text
conversations = st.lists(st.fixed_dictionaries({}, optional={"from": st.sampled_from(["human", "user", "gpt"]) | text,
                                                             "role": text, "value": text, "content": text}), max_size=3)
field_values = {  # values near each field's meaning, plus anything
    "low": numbers, "high": numbers, "target": numbers, "base_commit": hex_commits, "commit": hex_commits,
    "FAIL_TO_PASS": id_lists, "PASS_TO_PASS": id_lists, "conversations": conversations,
    "reward": numbers, "score": numbers, "resolved": st.booleans(), "label": numbers,
}
anything = json_like(keys)


def task_fields() -> st.SearchStrategy[dict]:
    optional = {name: field_values.get(name, text) | anything for name in ROW_KEYS if name not in ("task_data", "env_config")}
    return st.fixed_dictionaries({}, optional=optional) | st.dictionaries(keys, anything, max_size=6)


# one valid row of each accepted shape: a fuzzed row is one of them with a few fields replaced,
# added or dropped, so the checks after the first field are reached too
VALID_ROWS = {
    "guess_number": {"low": 1, "high": 10, "target": 3},
    "qa": {"question": "What is 2 + 2?", "answer": "4"},
    "single_turn": {"prompt": "Write some numbers."},
    "coding": {"repo": "owner/name", "base_commit": "abcdef1", "problem_statement": "fix it", "test_patch": "diff",
               "FAIL_TO_PASS": ["tests/test_a.py::test_a"], "PASS_TO_PASS": [], "language": "python"},
    "coding ": {"repo_name": "owner/name", "repo_url": "https://example.invalid/repo.git", "reward": 1,
                "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "do it"}]},
}


def near_valid() -> st.SearchStrategy[tuple[str, dict]]:
    def mutate(env: str) -> st.SearchStrategy[tuple[str, dict]]:
        valid = VALID_ROWS[env]
        replaced = st.dictionaries(st.sampled_from(sorted(valid)) | keys,
                                   st.deferred(lambda: st.one_of(*(field_values.get(k, text) for k in valid))) | anything, max_size=2)
        dropped = st.sets(st.sampled_from(sorted(valid)), max_size=1)
        return st.tuples(replaced, dropped).map(
            lambda t: (env.strip(), {k: v for k, v in {**valid, **t[0]}.items() if k not in t[1]}))
    return st.sampled_from(sorted(VALID_ROWS)).flatmap(mutate)


env_configs = st.fixed_dictionaries({}, optional={"reward_fn": st.sampled_from(REWARD_FNS) | numbers, "max_turns": numbers}) | \
    st.dictionaries(text.filter(lambda k: k not in ("reward_fn", "intake_checks", "repo_url_template")), anything, max_size=3) | anything
rows = st.one_of(
    task_fields(),
    st.fixed_dictionaries({"task_data": task_fields() | anything}, optional={"env_config": env_configs, "env_key": env_names,
                                                                             "id": text | numbers}),
    st.fixed_dictionaries({"task_key": text | anything, "env_key": env_names}, optional={"task_data": task_fields()}),
    anything,
    nested().map(lambda doc: _loads_or(doc, doc)),
)


def _loads_or(doc: str, fallback):
    try:
        return json.loads(doc)
    except (ValueError, RecursionError):
        return fallback


@FUZZ
@given(row=rows, default_env=env_names, near=st.none() | near_valid(), wrapped=st.booleans(), reward_fn=st.sampled_from(REWARD_FNS))
def test_adapt_row_returns_a_task_or_rejects_the_row(row, default_env, near, wrapped, reward_fn):
    if near is not None:  # half the time a near-valid row of some shape, flat or under task_data
        default_env, row = near
        row = {"task_data": row} if wrapped else row
    default_config = {"intake_checks": False, "reward_fn": reward_fn}
    try:
        task = adapt_row(row, default_env, "fuzz.jsonl:1", default_config)
    except RowRejected as exc:
        assert str(exc)
        event("rejected: " + " ".join(str(exc).split()[:3]))
        return
    assert isinstance(task, TaskProfile)
    TaskProfile.model_validate_json(task.model_dump_json())  # it travels in rollout messages
    event(f"accepted: {task.env_name}")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-dataset") / "rows.jsonl"


pieces = st.sampled_from(['{"', '":', "[", "]", "{", "}", ",", "1e999", "NaN", "-Infinity", "9" * 5000, '"x"', '"low"',
                          '"target"', ": 3", "\\u0000", "\\ud800"])


@FUZZ
@given(line=text | nested() | st.lists(pieces, max_size=12).map("".join))
def test_a_dataset_line_of_any_text_is_read_and_adapted_or_rejected(dataset, line):
    """The intake path for one line of a JSONL dataset: ``read_rows`` gives a row or a bad row
    (never raises), and the adapter takes the row or rejects it."""
    dataset.write_text(line.replace("\n", " ") + "\n", encoding="utf-8", errors="surrogatepass")
    for row in read_rows(str(dataset), "train"):
        if isinstance(row, BadRow):
            assert row.reason
            event("bad row: " + row.reason.split(":")[0])
            continue
        try:
            adapt_row(row.value, "guess_number", row.source, {"intake_checks": False})
            event("accepted")
        except RowRejected:
            event("rejected")
