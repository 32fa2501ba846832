"""Bounded staleness against a real Redis: the admission bound, filtering, the step, and intake waiting."""

from __future__ import annotations

import threading
import time

import pytest

from services.intake.admission_wait import AdmissionWait
from services.intake.datasets import Row
from services.intake.publisher import run_intake
from shared.names import RedisKeys
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.state.policy_version import PolicyVersion
from shared.state.staleness import StalenessBudget
from shared.settings import Settings


def test_admission_follows_the_formula(redis_client, run_id):
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=1, groups_per_step=2)
    # (1 + 0 + 1) * 2 = 4 groups may be in flight or accepted at trainer step 0
    assert [budget.try_admit() for _ in range(5)] == [True, True, True, True, False]
    budget.filtered(1)  # a dropped group frees its slot
    assert budget.try_admit() and not budget.try_admit()
    budget.advance_step(1)  # a trained step raises the bound by groups_per_step...
    assert not budget.try_admit()  # ...once the inference service serves its weights
    redis_client.set(RedisKeys.policy_version(run_id), 1)
    assert [budget.try_admit() for _ in range(3)] == [True, True, False]
    assert budget.state().admitted == 7 and budget.state().filtered == 1


def test_synchronous_mode_admits_one_step_at_a_time(redis_client, run_id):
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=0, groups_per_step=3)
    assert sum(budget.try_admit() for _ in range(10)) == 3
    budget.advance_step(1)
    redis_client.set(RedisKeys.policy_version(run_id), 1)
    assert sum(budget.try_admit() for _ in range(10)) == 3


def test_each_group_is_told_the_first_version_it_may_start_on(redis_client, run_id):
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=1, groups_per_step=2)
    # (1 + 0 + 1) * 2: the first two groups belong to step 0's bound with k = 1 (version 0), as do the next two
    assert [budget.admit_for() for _ in range(5)] == [0, 0, 0, 0, None]
    budget.advance_step(1)
    redis_client.set(RedisKeys.policy_version(run_id), 1)
    assert [budget.admit_for() for _ in range(3)] == [1, 1, None]  # admitted at step 1: version 1 at the earliest
    budget.filtered(1)
    assert budget.admit_for() == 1  # a filtered group's slot: the same step


def test_admitted_before_served_starts_on_the_trained_version(redis_client, run_id):
    """trainer.admit_before_served: a synchronous step's next groups are admitted once the
    trainer begins the step, and told to start on its version, which is not served yet."""
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=0, groups_per_step=2, admit_before_served=True)
    assert [budget.admit_for() for _ in range(3)] == [0, 0, None]
    budget.begin_step(1)  # the trainer began step 1; its weights are not served yet
    assert [budget.admit_for() for _ in range(3)] == [1, 1, None]
    assert budget.terms().step == 1 and budget.terms().served_version == 0
    budget.begin_step(2)  # never more than one version past the served one
    assert budget.admit_for() is None
    redis_client.set(RedisKeys.policy_version(run_id), 1)
    budget.advance_step(1)
    assert [budget.admit_for() for _ in range(3)] == [2, 2, None]
    # without the setting the same hash admits on the served version only, and begin_step() writes nothing
    plain = StalenessBudget(redis_client, run_id + "-plain", 0, 2)
    plain.begin_step(1)
    assert [plain.admit_for() for _ in range(3)] == [0, 0, None]
    assert "begun_step" not in redis_client.hgetall(RedisKeys.staleness(run_id + "-plain"))


def test_step_never_goes_back(redis_client, run_id):
    budget = StalenessBudget(redis_client, run_id, 1, 1)
    assert budget.advance_step(3) == 3
    assert budget.advance_step(2) == 3


def test_stale_means_more_than_the_bound_behind(redis_client, run_id):
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=1, groups_per_step=1)
    assert not budget.is_stale(oldest_policy_version=4, trainer_step=5)
    assert budget.is_stale(oldest_policy_version=3, trainer_step=5)


def test_the_bound_at_use_is_never_below_the_admission_bound(redis_client, run_id):
    with pytest.raises(ValueError, match="must be >= max_off_policy_steps"):
        Settings(trainer={"max_off_policy_steps": 2, "max_staleness_at_use": 1})
    with pytest.raises(ValueError, match="must be >= max_off_policy_steps"):
        StalenessBudget(redis_client, run_id, 2, 1, max_staleness_at_use=1)
    budget = StalenessBudget(redis_client, run_id, 2, 1, max_staleness_at_use=2)  # equal: the default's meaning
    assert budget.is_stale(oldest_policy_version=2, trainer_step=5) and not budget.is_stale(3, 5)
    assert [budget.try_admit() for _ in range(4)] == [True, True, True, False]  # admission: (2 + 0 + 1) * 1


def test_intake_waits_for_the_trainer_instead_of_over_admitting(redis_client, redis_url, run_id):
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2},
                        trainer={"max_off_policy_steps": 0, "groups_per_step": 2})
    rows = [Row(f"mem:{i}", {"task_data": {"low": 1, "high": 9, "target": 5}}) for i in range(4)]
    published: list[int] = []
    worker = threading.Thread(target=run_intake, args=(settings, rows, redis_client, lambda reqs: published.append(reqs[0].group_id)))
    worker.start()
    time.sleep(1.0)
    assert published == [0, 1]  # the bound: (0 + 0 + 1) * 2 groups before the first step
    StalenessBudget(redis_client, run_id, 0, 2).advance_step(1)
    time.sleep(0.6)
    assert published == [0, 1]  # trained, but not yet served: rollouts would start stale
    redis_client.set(RedisKeys.policy_version(run_id), 1)
    worker.join(10)
    assert published == [0, 1, 2, 3]


@pytest.mark.parametrize("burst", [16, 1])
def test_the_groups_one_admission_lets_in_go_out_together_once_all_are_registered(redis_client, redis_url, run_id,
                                                                                   burst):
    """A step's groups are registered before the first is published (``intake.publish_burst``
    16), and published before intake waits on the bound; with 1, each goes out as admitted."""
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2},
                        trainer={"max_off_policy_steps": 0, "groups_per_step": 3}, intake={"publish_burst": burst})
    rows = [Row(f"mem:{i}", {"task_data": {"low": 1, "high": 9, "target": 5}}) for i in range(6)]
    ledger, registry = Ledger(redis_client), GroupRegistry(redis_client, run_id)
    seen: list[tuple[int, int]] = []  # (group published, trajectories the ledger knew then)

    def publish(requests):
        seen.append((requests[0].group_id, sum(ledger.counts(run_id).values())))

    worker = threading.Thread(target=run_intake, args=(settings, rows, redis_client, publish), daemon=True)
    worker.start()
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert [g for g, _ in seen] == [0, 1, 2]  # the bound: 3 groups before the first step, all published
    assert [known for _, known in seen] == ([6, 6, 6] if burst > 1 else [2, 4, 6])
    assert registry.published_count() == 3
    StalenessBudget(redis_client, run_id, 0, 3).advance_step(1)
    PolicyVersion(redis_client, run_id).advance(1)
    worker.join(10)
    assert [g for g, _ in seen] == list(range(6)) and not worker.is_alive()


def test_intake_admitting_before_served_tells_each_request_its_first_version(redis_client, redis_url, run_id):
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2},
                        trainer={"max_off_policy_steps": 0, "groups_per_step": 2, "admit_before_served": True})
    rows = [Row(f"mem:{i}", {"task_data": {"low": 1, "high": 9, "target": 5}}) for i in range(4)]
    published: list[list] = []
    worker = threading.Thread(target=run_intake, args=(settings, rows, redis_client, published.append), daemon=True)
    worker.start()
    deadline = time.monotonic() + 10
    while len(published) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    budget = StalenessBudget(redis_client, run_id, 0, 2, admit_before_served=True)
    budget.begin_step(1)  # the trainer began step 1: the next groups go out before version 1 is served
    worker.join(10)
    assert not worker.is_alive() and PolicyVersion(redis_client, run_id).get() == 0
    assert [[r.generate_from_version for r in group] for group in published] == [[0, 0], [0, 0], [1, 1], [1, 1]]
    first, later = published[0][0], published[2][0]
    assert "generate_from_version" not in first.model_dump() and later.model_dump()["generate_from_version"] == 1
    assert type(later).model_validate_json(later.model_dump_json()) == later


def test_intake_publishes_a_group_a_crash_left_registered_but_unpublished(redis_client, redis_url, run_id):
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2})
    rows = [Row("mem:0", {"task_data": {"low": 1, "high": 9, "target": 5}})]

    def crash(requests):
        raise ConnectionError("broker went away")

    with pytest.raises(ConnectionError):
        run_intake(settings, rows, redis_client, crash)
    published = []
    report = run_intake(settings, rows, redis_client, published.append)
    assert report.groups == 1 and len(published) == 1
    assert run_intake(settings, rows, redis_client, published.append).already_known == 1
    assert len(published) == 1


def _admit_in_thread(wait) -> tuple[threading.Thread, list[float]]:
    done: list[float] = []
    thread = threading.Thread(target=lambda: (wait.admit(), done.append(time.monotonic())), daemon=True)
    thread.start()
    return thread, done


@pytest.mark.parametrize("redis_topology_url", ["standalone", "cluster"], indirect=True)
@pytest.mark.parametrize("writer", ["trainer_step_then_served_version", "filtered_group"])
def test_a_waiting_intake_wakes_when_the_bound_moves_not_at_its_next_poll(redis_client, run_id, writer):
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=0, groups_per_step=1)
    assert budget.try_admit() and not budget.try_admit()
    wait = AdmissionWait(budget, redis_client, log_every_s=60, poll_s=30)  # a poll would take 30 s
    thread, done = _admit_in_thread(wait)
    time.sleep(0.5)
    assert not done
    moved = time.monotonic()
    if writer == "filtered_group":
        budget.filtered(1)
    else:
        budget.advance_step(1)
        time.sleep(0.3)
        assert not done  # the served version still holds the bound
        moved = time.monotonic()
        PolicyVersion(redis_client, run_id).advance(1)
    thread.join(timeout=5)
    assert done and done[0] - moved < 1.0, "the wait did not end on the announcement"


def test_a_lost_announcement_costs_one_poll_and_admits_nothing_early(redis_client, run_id):
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=0, groups_per_step=1)
    assert budget.try_admit()
    wait = AdmissionWait(budget, redis_client, log_every_s=60, poll_s=0.5)
    thread, done = _admit_in_thread(wait)
    time.sleep(0.3)
    redis_client.hincrby(RedisKeys.staleness(run_id), StalenessBudget.FILTERED, 1)  # a write nobody announced
    moved = time.monotonic()
    thread.join(timeout=5)
    assert done and done[0] - moved < 1.5
    assert budget.state().admitted == 2 and not budget.try_admit()
