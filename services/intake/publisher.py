"""Intake: dataset rows -> task profiles -> GRPO groups of rollout requests on queue ``rollouts``.

Invariants:
- Ids and seeds follow ``shared.ids``. In traversal mode a group's id is its row's position in
  the dataset; in sample mode it is the group's ordinal and the row is drawn from its seed.
  Either way, running intake twice over the same data yields the same ids, and the ledger
  ``groups_published`` set makes the second run publish nothing already published (and
  publish what a crash left registered but unpublished).
- With ``rollout.redundancy = k`` a group goes out with ``group_size + k`` members and its
  registration says to keep the first ``group_size`` scored (``keep``, ``members``).
- A group is registered (Redis) and its trajectories recorded as queued in the ledger before
  its rollout task is published, so a worker never sees a trajectory the ledger does not know.
- Groups are published in bursts (``PublishBurst``, ``intake.publish_burst`` groups at most; 1, the
  default, publishes each as it is admitted): each admitted group is registered at once, and
  the registered ones go out together, before intake waits on the staleness bound or the
  queue share, before it stops for a stopped run, every ``intake.publish_burst`` groups, and
  at the end. A crash in between leaves them registered and unpublished: a re-run publishes them.
- With a staleness bound configured, a group is published only once ``StalenessBudget``
  admits it: intake waits instead of running too far ahead of the trainer. With
  ``trainer.admit_before_served`` each of its requests carries the earliest version the
  admission gave it (``generate_from_version``), which the rollout worker waits for; a group
  registered by a crashed intake and published by a re-run carries 0 (its staleness is still
  checked at use).
- A bad row is rejected with its location and reason, recorded in Redis and counted;
  intake goes on with the next row. Rows pass the same admission ``conveyor data validate``
  uses (``adapters.admit_row``).
- Sample mode with ``intake.env_weights`` draws each group's environment by weight from its
  seed, then a row of it (``shared.ids.weighted_row_index``): the mix is a pure function of
  the seed too. Rows that cannot be admitted are never drawn.
- With ``intake.splits.role`` train or eval, only the rows of that split are published
  (``splits``: hash-based, stratified by environment); group ids number the rows of the split.
  Publish an eval split under a run id of its own.
- Every task carries the dataset version it came from (``label@content-hash``), and the run
  records the versions it published from; the trainer writes them into each checkpoint.
- Intake opens the run (``shared.state.run_marker``) before it registers anything, and refuses with
  ``RedisDataLost`` a run the object store knows but Redis lost; every later registration
  requires the run's marker in the same Lua call, and so does each admission by the staleness
  bound; intake's other writes of the run (group registrations and publications, its records) are
  ``RunMarker.guarded``. So a Redis that lost its data mid-intake is never filled again with
  part of the run, not even by a write that waited out the restart.
- An outage of Redis (or of the S3 server, for the marker) is waited out by the ledger client
  and the publisher (``shared.outage``); a wait on the staleness bound is logged with its
  reasons (``admission_wait``). Intake never waits silently.
- ``run_intake`` itself resumes a run: what Redis holds of it (``run_history``) is skipped and
  counted. Refusing to reuse a run id unasked is the command's part (``conveyor intake
  --resume``), checked before the run's marker is opened, so a refused intake writes nothing.
- With ``intake.max_queued_groups`` set, a group is published only while the run has fewer
  than that many groups' trajectories waiting unclaimed in the rollout queue
  (``queue_share``): runs that share the workers share the queue fairly.
- A stopped run (``shared.state.run_stop``) gets no group after the stop: intake checks it before
  each group (after any wait on the staleness bound, which a stop ends) and stops publishing
  with one line. The command refuses to resume a stopped run.
- With ``inference.own_server`` every request names the run's own inference server
  (``RolloutRequest.inference``, from the run's inference settings); without it, none, and the
  rollout workers call the server their own settings name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable

import redis

from services.intake.adapters import RowRejected, admit_row
from services.intake.admission_wait import AdmissionWait
from services.intake.limits import PromptLimit
from services.intake.queue_share import QueueShare
from services.intake.splits import assign_splits
from services.intake.datasets import BadRow, Row
from shared import ids
from shared.environments import check_startup, registry_for
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.state.policy_version import PolicyVersion
from shared.state.run_marker import INTAKE_STOPS, RunMarker
from shared.state.run_records import RunRecords
from shared.state.run_stop import stop_of
from shared.schemas import GroupRegistration, InferenceTarget, RejectedRow, RolloutRequest, TaskProfile
from shared.settings import Settings, SplitSettings
from shared.state.staleness import budget_of
from shared.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class IntakeReport:
    groups: int = 0
    trajectories: int = 0
    already_known: int = 0
    rejected: list[dict[str, str]] = field(default_factory=list)
    stopped: str = ""  # who stopped the run, when and why (``conveyor run stop``); "": intake ran to its end


@dataclass(frozen=True)
class RunHistory:
    """What Redis already holds of a run, before an intake publishes into it."""

    opened: bool  # the run's marker is in Redis (shared.state.run_marker)
    groups: int  # registered
    published: int
    trajectories: dict[str, int]  # ledger state -> count

    @property
    def started(self) -> bool:
        return self.opened or self.groups > 0 or any(self.trajectories.values())

    def describe(self) -> str:
        states = ", ".join(f"{count} {state}" for state, count in self.trajectories.items() if count) or "none"
        return f"{self.groups} groups ({self.published} published), trajectories: {states}"


def run_history(client: redis.Redis, run_id: str) -> RunHistory:
    groups = GroupRegistry(client, run_id)
    return RunHistory(RunMarker(client, run_id).in_redis(), groups.registered_count(),
                      groups.published_count(), Ledger(client).counts(run_id))


def build_group(settings: Settings, group_id: int, task: TaskProfile, policy_version: int = 0,
                generate_from_version: int = 0) -> list[RolloutRequest]:
    now = time.time()
    dispatched = settings.rollout.group_size + settings.rollout.redundancy  # kept: rollout.group_size
    inference = inference_target(settings)
    requests = []
    for index in range(dispatched):
        seed = ids.episode_seed(settings.intake.base_seed, group_id, index)
        requests.append(
            RolloutRequest(
                run_id=settings.run_id, group_id=group_id, episode_index=index, episode_seed=seed,
                trajectory_id=ids.trajectory_id(settings.run_id, group_id, index, seed), members_dispatched=dispatched,
                task=task, policy_version=policy_version, dispatched_at=now, inference=inference,
                generate_from_version=generate_from_version,
            )
        )
    return requests


def inference_target(settings: Settings) -> InferenceTarget | None:
    """The run's own inference server, as its requests name it (``inference.own_server``), or None."""
    inference = settings.inference
    if not inference.own_server:
        return None
    return InferenceTarget(base_url=inference.base_url, model=inference.model, model_path=str(inference.model_path),
                           max_model_len=inference.max_model_len,
                           lora_adapters=settings.trainer.lora.served_rank is not None)


def queue_share_of(client: redis.Redis, settings: Settings) -> QueueShare | None:
    """The run's share of the rollout queue (``intake.max_queued_groups``), or None: no share."""
    if settings.intake.max_queued_groups is None:
        return None
    return QueueShare(client, settings.run_id, settings.intake.max_queued_groups,
                      settings.rollout.group_size + settings.rollout.redundancy, settings.intake.wait_log_every_s)


def _redundancy(settings: Settings, requests: list[RolloutRequest]) -> dict:
    """Registration fields of a redundant group: keep the first group_size scored of these members."""
    if not settings.rollout.redundancy:
        return {}
    return {"keep": settings.rollout.group_size, "members": [r.trajectory_id for r in requests]}


def rows_of_role(splits: SplitSettings, rows: list[Row | BadRow], admit: Callable[[Row], TaskProfile]) -> list[Row | BadRow]:
    """The rows of the split this intake publishes (``intake.splits.role``), in dataset order;
    rows that cannot be admitted stay, so the publishing pass rejects and records them once."""
    if splits.role == "all":
        return rows
    admitted: list[tuple[int, TaskProfile]] = []
    for position, row in enumerate(rows):
        if isinstance(row, BadRow):
            continue
        try:
            admitted.append((position, admit(row)))
        except (RowRejected, ValueError):
            continue
    assigned = assign_splits([task for _, task in admitted], splits)
    other = {position for (position, _), split in zip(admitted, assigned) if split != splits.role}
    return [row for position, row in enumerate(rows) if position not in other]


def _env_of(row: Row | BadRow, admit: Callable[[Row], TaskProfile]) -> str | None:
    if isinstance(row, BadRow):
        return None
    try:
        return admit(row).env_name
    except (RowRejected, ValueError):
        return None


def select_rows(settings: Settings, rows: list[Row | BadRow],
                row_envs: list[str | None] | None = None) -> Iterable[tuple[int, Row | BadRow]]:
    """(group id, row) pairs for the configured mode. ``row_envs``: each row's environment
    (None: not admissible), needed by sample mode with ``intake.env_weights``."""
    if settings.intake.mode == "traversal":
        yield from enumerate(rows)
        return
    seed, n = settings.intake.base_seed, len(rows)
    if n == 0:
        raise ValueError("cannot sample from an empty dataset")
    if settings.intake.env_weights:
        if row_envs is None:
            raise ValueError("intake.env_weights needs each row's environment")
        rows_by_env: dict[str, list[int]] = {}
        for position, env in enumerate(row_envs):
            if env is not None:
                rows_by_env.setdefault(env, []).append(position)
        for group_id in range(settings.intake.num_groups):
            yield group_id, rows[ids.weighted_row_index(seed, group_id, rows_by_env, settings.intake.env_weights)]
        return
    if settings.intake.sample_order == "shuffled_epochs":
        order: list[int] = []
        for group_id in range(settings.intake.num_groups):
            epoch, position = divmod(group_id, n)
            if position == 0 or not order:  # one epoch's permutation at a time, as ids.epoch_row_index
                order = ids.epoch_permutation(seed, epoch, n)
            yield group_id, rows[order[position]]
        return
    for group_id in range(settings.intake.num_groups):
        yield group_id, rows[ids.sample_row_index(seed, group_id, n)]


def run_intake(
    settings: Settings,
    rows: list[Row | BadRow],
    client: redis.Redis,
    publish: Callable[[list[RolloutRequest]], None],
    on_group: Callable[[int], None] | None = None,
    store: ObjectStore | None = None,
    dataset_version: str = "",
    prompt_limit: PromptLimit | None = None,
) -> IntakeReport:
    """``client``: the Redis that holds the run (its ledger, marker, groups, budget, records and
    stop). ``store``: where the run's marker outlives Redis (None: Redis only). ``dataset_version``
    is stamped on every task and recorded for the run; ``prompt_limit`` rejects prompts that
    cannot fit the model's context."""
    report = IntakeReport()
    run = settings.run_id
    environments = registry_for(settings.environments)
    # an unknown environment or a bad intake.env_config stops intake before anything is published
    check_startup(environments, settings.intake.env_name, settings.intake.env_config, settings.environments)
    marker = RunMarker(client, run, store)
    marker.open()

    def write(fill: Callable[[Any], object]) -> None:  # never into a Redis that lost the run (module invariants)
        marker.guarded(fill, INTAKE_STOPS)

    ledger = Ledger(client, settings.ledger.dispatch_ttl_s)
    budget = budget_of(client, run, settings.trainer)  # mode train: admission waits for the trainer's steps
    admission = None if budget is None else AdmissionWait(budget, client, settings.intake.wait_log_every_s,
                                                           marker=marker)
    share = queue_share_of(client, settings)  # fair share of the rollout queue between runs, if set
    groups, served, records = GroupRegistry(client, run), PolicyVersion(client, run), RunRecords(client, run)
    if dataset_version:
        write(lambda tx: records.add_dataset_version(dataset_version, transaction=tx))
    def admit(row: Row) -> TaskProfile:
        return admit_row(row.value, row.source, settings.intake.env_name, settings.intake.env_config, environments,
                         dataset_version, prompt_limit)

    burst = PublishBurst(publish, groups, report, on_group, settings.intake.publish_burst, write)
    rows = rows_of_role(settings.intake.splits, rows, admit)
    row_envs = [_env_of(row, admit) for row in rows] if settings.intake.env_weights and settings.intake.mode == "sample" else None
    for group_id, row in select_rows(settings, rows, row_envs):
        try:
            if isinstance(row, BadRow):
                raise RowRejected(row.reason)
            task = admit(row)
        except (RowRejected, ValueError) as exc:  # ValueError: the row broke a schema
            rejection = RejectedRow(source=row.source, reason=str(exc))
            report.rejected.append(rejection.model_dump())
            write(partial(records.reject_row, rejection))
            log.warning("rejected row %s: %s", row.source, exc)
            continue
        if groups.is_published(group_id):
            report.already_known += 1  # a re-run of intake: this group went out before
            continue
        first_version = 0  # the earliest policy version this group's rollouts may start on
        if admission is not None and not groups.is_registered(group_id):
            admitted = admission.try_now()
            if admitted is None:
                burst.publish()  # what the bound admitted goes out before intake waits
                admitted = admission.admit()  # wait for the trainer rather than run too far ahead of it, saying why
            first_version = admitted if admission.budget.admit_before_served else 0  # else: served already
        if share is not None and not groups.is_registered(group_id):
            burst.publish()  # the share counts published groups
            share.wait_for_room()  # leave the queue to other runs' groups too, saying why
        stop = stop_of(client, run)
        if stop is not None:
            burst.publish()  # admitted before the stop was seen, as they would have gone out one by one
            report.stopped = stop.describe()
            log.warning("intake of run %s: the run was %s; publishing no more groups", run, report.stopped)
            break
        policy_version = served.get()
        requests = build_group(settings, group_id, task, policy_version, first_version)
        registration = GroupRegistration(
            run_id=run, group_id=group_id, expected_size=len(requests), task_id=task.task_id,
            policy_version=policy_version, dispatched_at=requests[0].dispatched_at, env_name=task.env_name,
            **_redundancy(settings, requests),
        )
        write(partial(groups.register, registration))  # the first registration stays: a re-run keeps it
        ledger.register(requests, require_marker=True)  # idempotent: a group left unpublished by a crash goes out now
        burst.add(group_id, requests)
    burst.publish()
    write(lambda tx: records.mark_intake_done(transaction=tx))
    return report


@dataclass
class PublishBurst:
    """Registered groups whose rollout tasks go out together: the groups the bound admits at one
    time are registered first, then published back to back, so none waits behind the CPU its
    siblings' rollouts take (on 2 cores a step's groups went out one by one over up to 70 ms)."""

    publish_requests: Callable[[list[RolloutRequest]], None]
    groups: GroupRegistry
    report: IntakeReport
    on_group: Callable[[int], None] | None
    most: int  # intake.publish_burst
    write: Callable[[Callable[[Any], object]], None]  # the run's writes, guarded (run_intake's ``write``)
    pending: list[tuple[int, list[RolloutRequest]]] = field(default_factory=list)

    def add(self, group_id: int, requests: list[RolloutRequest]) -> None:
        self.pending.append((group_id, requests))
        if len(self.pending) >= self.most:
            self.publish()

    def publish(self) -> None:
        for group_id, requests in self.pending:
            self.publish_requests(requests)  # duplicates of a message are harmless: the ledger claim runs it once
            self.write(partial(self.groups.mark_published, group_id))
            self.report.groups += 1
            self.report.trajectories += len(requests)
            if self.on_group:
                self.on_group(group_id)
        self.pending.clear()
