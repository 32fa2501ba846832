"""Row adapters, dataset readers and run_intake (real Redis, recording publish callback)."""

from __future__ import annotations

import json
import os

import pytest

from services.intake.adapters import RowRejected, adapt_row
from services.intake.datasets import BadRow, DatasetError, Row, read_rows
from services.intake.publisher import run_intake, select_rows
from shared import ids
from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.schemas import GroupRegistration, RolloutRequest, TaskProfile
from shared.settings import Settings

# --- adapt_row: good rows -----------------------------------------------------------------


def test_task_data_row():
    row = {"id": 7, "task_data": {"low": 1, "high": 10, "target": 3}, "env_config": {"max_turns": 2}}
    task = adapt_row(row, "guess_number", "f.jsonl:1")
    assert isinstance(task, TaskProfile)
    assert task == TaskProfile(task_id="7", env_name="guess_number", task_data={"low": 1, "high": 10, "target": 3},
                               env_config={"max_turns": 2}, source="f.jsonl:1")


def test_flat_guess_number_row_keeps_only_the_task_fields():
    task = adapt_row({"task_id": "g-1", "low": 0, "high": 5, "target": 5, "note": "x"}, "guess_number")
    assert task.task_id == "g-1"
    assert task.task_data == {"low": 0, "high": 5, "target": 5}
    assert task.env_config == {}


@pytest.mark.parametrize("key", ["question", "prompt"])
def test_question_answer_rows(key):
    task = adapt_row({key: "What is 2+2?", "answer": 4}, "qa")
    assert task.env_name == "qa"
    assert task.task_data == {"question": "What is 2+2?", "answer": "4"}


def test_env_key_row_overrides_the_default_environment():
    row = {"task_key": "qa-17", "env_key": "qa", "task_data": {"question": "Capital of France?", "answer": "Paris"}}
    task = adapt_row(row, "guess_number")
    assert (task.task_id, task.env_name) == ("qa-17", "qa")
    assert task.task_data == {"question": "Capital of France?", "answer": "Paris"}
    flat = adapt_row({"task_key": "g-2", "env_key": "guess_number", "low": 1, "high": 3, "target": 2}, "qa")
    assert (flat.task_id, flat.env_name) == ("g-2", "guess_number")
    assert adapt_row({"env_name": "qa", "question": "q", "answer": "a"}, "guess_number").env_name == "qa"


def test_task_id_without_an_id_field_is_a_stable_content_hash():
    row = {"low": 1, "high": 10, "target": 3}
    first = adapt_row(row, "guess_number").task_id
    assert first == adapt_row({"target": 3, "high": 10, "low": 1}, "guess_number").task_id  # key order does not matter
    assert first != adapt_row({"low": 1, "high": 10, "target": 4}, "guess_number").task_id
    assert len(first) == 16


# --- adapt_row: bad rows ------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, env, reason",
    [
        ([1, 2, 3], "guess_number", "row must be a JSON object, got list"),
        ("text", "qa", "row must be a JSON object, got str"),
        (None, "qa", "got NoneType"),
        ({"low": 1, "high": 10}, "guess_number", "'target' must be an integer, got None"),
        ({"low": 1, "high": "10", "target": 3}, "guess_number", "'high' must be an integer, got '10'"),
        ({"low": 1, "high": 10, "target": 3.0}, "guess_number", "'target' must be an integer"),
        ({"low": 1, "high": 10, "target": True}, "guess_number", "'target' must be an integer, got True"),
        ({"low": 1, "high": 10, "target": 11}, "guess_number", "target 11 is outside [1, 10]"),
        ({"low": 5, "high": 1, "target": 3}, "guess_number", "outside [5, 1]"),
        ({"answer": "a"}, "qa", "'question' (or 'prompt')"),
        ({"question": "   ", "answer": "a"}, "qa", "non-empty string"),
        ({"question": 3, "answer": "a"}, "qa", "non-empty string"),
        ({"question": "q"}, "qa", "'answer' is missing"),
        ({"question": "q", "answer": ""}, "qa", "'answer' is missing"),
        ({"env_key": "chess", "task_data": {}}, "qa", "unknown environment 'chess'"),
        ({"question": "q", "answer": "a"}, "nope", "unknown environment 'nope'"),
        ({"task_data": [1, 2]}, "guess_number", "'task_data' must be an object"),
        ({"task_data": {"question": "q", "answer": "a"}, "env_config": [1]}, "qa", "'env_config' must be an object"),
    ],
)
def test_bad_rows_are_rejected_with_a_reason(row, env, reason):
    with pytest.raises(RowRejected) as info:
        adapt_row(row, env)
    assert reason in str(info.value)


@pytest.mark.parametrize("row", [{"env_key": ["qa"], "question": "q", "answer": "a"}, {"env_name": {"n": 1}, "question": "q", "answer": "a"}])
def test_non_string_env_key_is_rejected_not_a_crash(row):
    with pytest.raises(RowRejected, match="environment"):
        adapt_row(row, "qa")


# found by the fuzz (tests/unit/test_adapters_fuzz.py): each once raised something else than RowRejected
SWE_AGENT = {"repo_name": "o/r", "repo_url": "https://example.invalid/r.git",
             "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "fix it"}]}
SWE_BENCH = {"repo": "o/r", "base_commit": "abcdef1", "problem_statement": "p", "test_patch": "d", "FAIL_TO_PASS": ["t::a"]}


@pytest.mark.parametrize("row, reason", [
    ({**SWE_AGENT, "reward": 10**400}, "label field 'reward' must be a finite number"),  # was OverflowError
    ({**SWE_BENCH, "env_config": {"image": False}}, r"environment .coding. \(CodingConfig\): env_config.image: Input should be a valid string"),  # was ValidationError
])
def test_values_no_settings_model_or_float_can_hold_reject_the_row(row, reason):
    with pytest.raises(RowRejected, match=reason):
        adapt_row(row, "coding", "f.jsonl:1", {"intake_checks": False})


# --- dataset readers ----------------------------------------------------------------------


def test_jsonl_lines_python_cannot_read_are_bad_rows_not_a_crash(tmp_path):
    """Valid JSON that Python's json refuses: an integer of 5000 digits, 100000 nested arrays."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"low": 1, "high": 5, "target": ' + "1" * 5000 + "}\n" + "[" * 100_000 + "]" * 100_000 + "\n"
                    + json.dumps({"low": 1, "high": 3, "target": 2}) + "\n")
    rows = read_rows(path)
    assert [type(r) for r in rows] == [BadRow, BadRow, Row]
    assert "Exceeds the limit (4300 digits)" in rows[0].reason and rows[1].reason == "not readable JSON: nested too deeply"


def test_jsonl_reader_reports_bad_lines_with_their_line_number(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        json.dumps({"low": 1, "high": 3, "target": 2}) + "\n"
        "\n"  # blank lines are skipped but still counted
        "{not json\n"
        + json.dumps([1, 2]) + "\n"
        + json.dumps({"question": "q", "answer": "a"}) + "\n"
    )
    rows = read_rows(path)
    assert [type(r) for r in rows] == [Row, BadRow, Row, Row]
    assert rows[0] == Row(f"{path}:1", {"low": 1, "high": 3, "target": 2})
    bad = rows[1]
    assert bad.source == f"{path}:3"
    assert bad.reason.startswith("not valid JSON") and "column 2" in bad.reason
    assert rows[2] == Row(f"{path}:4", [1, 2])  # valid JSON; the adapter rejects it
    assert rows[3].source == f"{path}:5"


def test_missing_or_unreadable_dataset_raises_naming_the_path(tmp_path):
    with pytest.raises(DatasetError, match=f"dataset {tmp_path / 'missing.jsonl'} does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "not-a-dataset").mkdir()
    with pytest.raises(DatasetError, match="not-a-dataset"):
        read_rows(tmp_path / "not-a-dataset")


def test_saved_hf_dataset_is_read_back(tmp_path):
    import datasets

    target = tmp_path / "hf"
    datasets.Dataset.from_list([{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}]).save_to_disk(str(target))
    rows = read_rows(target)
    assert rows == [
        Row(f"{target}[train][0]", {"question": "2+2?", "answer": "4"}),
        Row(f"{target}[train][1]", {"question": "3+3?", "answer": "6"}),
    ]
    tasks = [adapt_row(r.value, "qa", r.source) for r in rows]
    assert [t.task_data["answer"] for t in tasks] == ["4", "6"]
    assert tasks[1].source == f"{target}[train][1]"


def test_saved_hf_dataset_dict_reads_the_requested_split(tmp_path):
    import datasets

    target = tmp_path / "hfdict"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"id": "a", "task_data": {"low": 1, "high": 9, "target": 4}}]),
        "test": datasets.Dataset.from_list([{"id": "b", "task_data": {"low": 1, "high": 9, "target": 7}}]),
    }).save_to_disk(str(target))
    (row,) = read_rows(target, "test")
    assert row.source == f"{target}[test][0]"
    assert adapt_row(row.value, "guess_number").task_data == {"low": 1, "high": 9, "target": 7}
    with pytest.raises(DatasetError, match="no split 'validation'"):
        read_rows(target, "validation")


def test_hf_dataset_mixing_question_and_prompt_rows(tmp_path):
    import datasets

    target = tmp_path / "mixed"
    datasets.Dataset.from_dict({"question": ["q1", None], "prompt": [None, "p2"], "answer": ["a", "b"]}).save_to_disk(str(target))
    tasks = [adapt_row(r.value, "qa", r.source) for r in read_rows(target)]
    assert [t.task_data["question"] for t in tasks] == ["q1", "p2"]


# --- run_intake ---------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)


def make_settings(run_id: str, **intake) -> Settings:
    return Settings(run_id=run_id, rollout={"group_size": 3},
                    intake={"env_name": "guess_number", "base_seed": 1000, **intake})


class Recorder:
    def __init__(self):
        self.calls: list[list[RolloutRequest]] = []

    def __call__(self, requests: list[RolloutRequest]) -> None:
        self.calls.append(list(requests))

    @property
    def trajectory_ids(self) -> list[str]:
        return [r.trajectory_id for call in self.calls for r in call]


def write_dataset(tmp_path) -> list:
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps({"id": "t0", "low": 1, "high": 10, "target": 4}),
        "{broken",
        json.dumps({"id": "t2", "low": 1, "high": 10, "target": 40}),
        json.dumps({"id": "t3", "env_key": "qa", "question": "2+2?", "answer": "4"}),
        json.dumps("just a string"),
        json.dumps({"id": "t5", "task_data": {"low": 0, "high": 2, "target": 0}}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return read_rows(path)


def test_traversal_intake_rejects_bad_rows_and_goes_on(clean_env, redis_client, run_id, tmp_path):
    rows = write_dataset(tmp_path)
    settings = make_settings(run_id, mode="traversal")
    ledger = Ledger(redis_client)
    publish = Recorder()
    seen_groups: list[int] = []
    report = run_intake(settings, rows, redis_client, publish, on_group=seen_groups.append)

    # the group id is the row's position in the dataset
    assert [call[0].group_id for call in publish.calls] == [0, 3, 5] == seen_groups
    assert (report.groups, report.trajectories, report.already_known) == (3, 9, 0)
    for call in publish.calls:
        assert len(call) == 3
        g = call[0].group_id
        for i, req in enumerate(call):
            seed = ids.episode_seed(1000, g, i)
            assert (req.episode_index, req.episode_seed, req.members_dispatched) == (i, seed, 3)
            assert req.trajectory_id == ids.trajectory_id(run_id, g, i, seed)
            # registered in the ledger before it was published
            assert ledger.state(req.trajectory_id) == "queued"
            assert ledger.request(req.trajectory_id) == req
    assert publish.calls[1][0].task.env_name == "qa"

    sources = [r["source"] for r in report.rejected]
    path = tmp_path / "data.jsonl"
    assert sources == [f"{path}:2", f"{path}:3", f"{path}:5"]
    assert "not valid JSON" in report.rejected[0]["reason"]
    assert "target 40 is outside [1, 10]" in report.rejected[1]["reason"]
    assert "must be a JSON object" in report.rejected[2]["reason"]
    stored = [json.loads(x) for x in redis_client.lrange(RedisKeys.rejected_rows(run_id), 0, -1)]
    assert stored == report.rejected

    regs = {int(k): GroupRegistration.model_validate_json(v) for k, v in redis_client.hgetall(RedisKeys.groups(run_id)).items()}
    assert sorted(regs) == [0, 3, 5]
    assert regs[3].expected_size == 3 and regs[3].task_id == "t3"
    assert redis_client.get(RedisKeys.intake_done(run_id)) == "1"
    assert ledger.counts(run_id)["queued"] == 9


def test_rerunning_intake_publishes_nothing_already_known(clean_env, redis_client, run_id, tmp_path):
    rows = write_dataset(tmp_path)
    settings = make_settings(run_id, mode="traversal")
    ledger = Ledger(redis_client)
    first = Recorder()
    run_intake(settings, rows, redis_client, first)
    second = Recorder()
    report = run_intake(settings, rows, redis_client, second)
    assert second.calls == []
    assert (report.groups, report.trajectories, report.already_known) == (0, 0, 3)
    assert ledger.counts(run_id)["queued"] == 9

    # a dataset that grew: only the new row is published, with the same ids as before for the old rows
    extra = rows + [Row("extra:1", {"id": "t6", "low": 1, "high": 2, "target": 2})]
    third = Recorder()
    report = run_intake(settings, extra, redis_client, third)
    assert [c[0].group_id for c in third.calls] == [6]
    assert report.already_known == 3


def test_policy_version_from_redis_is_stamped_on_requests(clean_env, redis_client, run_id):
    redis_client.set(RedisKeys.policy_version(run_id), 7)
    publish = Recorder()
    run_intake(make_settings(run_id), [Row("m:1", {"low": 1, "high": 2, "target": 1})], redis_client, publish)
    assert {r.policy_version for r in publish.calls[0]} == {7}


def test_sample_mode_is_deterministic_for_a_seed(clean_env, redis_url, run_id):
    import redis

    rows = [Row(f"m:{i}", {"id": f"t{i}", "low": 0, "high": 100, "target": i}) for i in range(20)]
    results = []
    for _attempt in range(2):
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        client.flushall()  # a fresh Redis each time: the choice depends only on the seed
        settings = make_settings(run_id, mode="sample", num_groups=6, base_seed=42)
        publish = Recorder()
        report = run_intake(settings, rows, client, publish)
        assert report.groups == 6
        results.append([(c[0].group_id, c[0].task.task_id, [r.trajectory_id for r in c]) for c in publish.calls])
    assert results[0] == results[1]
    assert [g for g, _, _ in results[0]] == list(range(6))  # group id is the ordinal
    expected_rows = [ids.sample_row_index(42, g, 20) for g in range(6)]
    assert [t for _, t, _ in results[0]] == [f"t{i}" for i in expected_rows]

    other = make_settings(run_id, mode="sample", num_groups=6, base_seed=43)
    picks_other = [row.source for _, row in select_rows(other, rows)]
    picks_42 = [row.source for _, row in select_rows(make_settings(run_id, mode="sample", num_groups=6, base_seed=42), rows)]
    assert picks_other != picks_42


def test_sample_mode_rejects_a_sampled_bad_row_and_goes_on(clean_env, redis_client, run_id):
    rows = [BadRow("f:1", "not valid JSON: boom"), Row("f:2", {"id": "ok", "low": 1, "high": 3, "target": 2})]
    settings = make_settings(run_id, mode="sample", num_groups=8, base_seed=5)
    picks = [ids.sample_row_index(5, g, 2) for g in range(8)]
    assert 0 in picks and 1 in picks  # the seed draws both rows
    publish = Recorder()
    report = run_intake(settings, rows, redis_client, publish)
    assert [c[0].group_id for c in publish.calls] == [g for g, p in enumerate(picks) if p == 1]
    assert len(report.rejected) == picks.count(0)
    assert all(r == {"source": "f:1", "reason": "not valid JSON: boom"} for r in report.rejected)
    assert redis_client.llen(RedisKeys.rejected_rows(run_id)) == picks.count(0)


def test_intake_goes_on_after_a_row_with_a_non_string_env_key(clean_env, redis_client, run_id):
    rows = [Row("f:1", {"env_key": ["qa"], "question": "q", "answer": "a"}), Row("f:2", {"low": 1, "high": 3, "target": 2})]
    publish = Recorder()
    report = run_intake(make_settings(run_id), rows, redis_client, publish)
    assert len(report.rejected) == 1 and [c[0].group_id for c in publish.calls] == [1]
