"""The loop's speed in one run (issue 28, item 1): both ratios the issue names.

1. **Sync step against TRL.** Conveyor at ``max_off_policy_steps = 0`` against TRL's GRPOTrainer on
   the toy digit task, with ``bench/training.py --vs-trl``'s matched settings (``TRL_MATCHED``, the
   same tiny model, prompts, reward, 4 x 8 completions of at most 24 tokens, lr 5e-3, AdamW) and
   the same torch thread count on both sides (``--threads``, printed). Median seconds per step of
   each and their ratio, then Conveyor's step taken apart. The hops come from the run's own
   records, read while its stack is still up: each trajectory's dispatch time and episode timings
   (its ``Trajectory`` object), its upload and scoring times and scoring end (``ScoredTrajectory``),
   each group's completion (the trainer's ``metrics.jsonl``), and the trainer's step spans
   (``step_time_s``, ``checkpoint_s``, ``weight_sync_s`` with its download, reload and probe parts,
   ``services.trainer.loop``). Per step, the critical path is followed through the step's last
   trajectory to be scored: admission, the rollout hop (Celery: dispatch to episode start), the
   episode, the upload (an S3 object), the scoring hop (Celery: uploaded to scorer start), scoring,
   scored to group assembled, the trainer's pickup, then forward/backward, checkpoint, weight sync.
   ``--weight-sync s3,gloo`` runs Conveyor once per weight path before TRL runs once: ``s3`` (the
   checkpoint, then the follower's download and reload) and ``gloo`` (``inference.weight_sync:
   {mode: nccl, backend: gloo}``: the trainer broadcasts from its memory to the co-located
   replica, and the checkpoint is written in the background; its publish is broken down instead).
   ``--trajectories objects,inline`` runs Conveyor once per trajectory path (with each weight
   path): ``objects`` (an S3 object each, ``ledger.inline_max_bytes: 0``) and ``inline`` (the small
   ones carried in the ledger's Redis, ``shared.inline_trajectories``); with ``--skip-trl`` only
   these runs, and their ratio to the first.
   ``--scoring scorer,worker`` runs Conveyor once per place of scoring (for each weight path):
   ``scorer`` (the scorer service, over its Celery hop: ``rewards.in_worker: never``) and
   ``worker`` (the rollout worker scores what it uploaded: ``rewards.in_worker: auto``; the
   digit task's one reward, ``verifier``, is declared cheap).
   ``--reward-curve in_step,behind`` runs Conveyor once per ``trainer.reward_curve``: the PNG
   drawn in the trainer's thread after each step, or in a thread of its own (the default).
   ``--assembly new,old`` runs Conveyor once per trainer assembly (``ASSEMBLY``): ``new`` (the
   groups one read completes assembled side by side, the batches handed to the step in memory),
   ``serial`` (in memory, one group after another: the defaults) or ``s3`` (side by side, read
   back), ``old`` (neither: one group after another, the batches read back from S3).
   "Scored to group assembled" is taken apart with the group's metrics line: the scored bundle
   and ledger move (to the stream entry's Redis time), the trainer's wake-up (to its read), the
   entries read before it, the assembly.
2. **Async against sync on agentic episodes.** The same task, every environment step (one per
   episode: a single-turn task) waiting a tool latency drawn from a seeded lognormal (median
   ``--tool-p50`` 1 s, p99 ``--tool-p99`` 20 s: ``EnvConfig.step_latency_p99_s``), so wall time
   is tool time, not CPU. Time to N steps (from the first group's dispatch to the trainer's N-th
   step; also from intake's start, ``LearningRun.wall_s``, which adds intake's own start-up) at
   k = 0 (sync) and each of ``--ks``, each step training exactly ``groups_per_step`` groups
   (zero-variance groups kept, no extra groups), and the share of finished groups discarded as
   stale (``filtered_stale``). ``--stale-at-use N`` sets ``trainer.max_staleness_at_use`` on the
   async runs (k > 0; sync runs as before): admission stays bounded by k, and a group up to N
   steps behind is trained instead of discarded. ``--corrections tis,icepop`` runs each async k once
   per ``trainer.loss.correction``; every agentic run prints its mean reward per step and the time
   from the first dispatch to the first step whose mean reward reaches ``--reward-threshold``, so
   learning per second is compared, not only steps per second. vLLM runs eager there (it starts in a third of the time; decoding
   speed hardly matters when tools take the time).

Every figure is printed with the 1-minute load average around it. ``--out`` keeps every run's
step logs and ``loop_speed.json``.

    .venv/bin/python bench/loop_speed.py [--steps 12] [--agentic-steps 10] [--ks 1,2,4] [--threads 1]
        [--worker-slots 8] [--stale-at-use N] [--corrections none,tis,icepop] [--reward-threshold 0.5]
        [--weight-sync s3,gloo] [--trajectories objects,inline] [--scoring scorer,worker]
        [--reward-curve in_step,behind] [--assembly default,new,old,serial,s3] [--conveyor-only]
        [--skip-trl] [--skip-agentic] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.training import TRL_MATCHED, TRL_VERSION, conveyor_breakdown, run_trl  # noqa: E402
from services.cli.learning_demo import run_learning  # noqa: E402
from services.cli.local_stack import LocalStack, free_port  # noqa: E402
from shared.inline_trajectories import is_inline_ref, read_trajectories  # noqa: E402
from shared.schemas import ScoredTrajectory  # noqa: E402
from shared.settings import load_settings  # noqa: E402
from shared.storage import get_models_under, open_store  # noqa: E402

AGENTIC = {"CONVEYOR_TRAINER__ZERO_VARIANCE_GROUPS": "keep", "CONVEYOR_TRAINER__MAX_EXTRA_GROUPS_PER_STEP": "0",
           "CONVEYOR_INFERENCE__EAGER": "true"}


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5-min {five:.2f})"


def trajectory_hops(stack: LocalStack) -> list[dict]:
    """Each scored trajectory of the run as absolute timestamps of its hops (the stack is up)."""
    with mock.patch.dict(os.environ, stack.env):
        settings = load_settings()
    store = open_store(settings.storage)
    rows = []
    every = get_models_under(store, f"scored/{settings.run_id}/", ScoredTrajectory)
    for scored, trajectory in zip(every, read_trajectories(store, stack.redis_client(), [s.trajectory_key for s in every])):
        request, t = trajectory.request, scored.timings
        start = request.dispatched_at + t["queue_wait"]
        uploaded = start + t["episode"] + t["upload"]
        rows.append({"group_id": scored.group_id, "json_bytes": len(trajectory.model_dump_json().encode()),
                     "inline": is_inline_ref(scored.trajectory_key), "dispatched": request.dispatched_at, "start": start,
                     "episode_s": t["episode"], "upload_s": t["upload"], "uploaded": uploaded,
                     "scoring_s": t["scoring"], "scoring_start": scored.scored_at - t["scoring"], "scored": scored.scored_at})
    return rows


def hop_breakdown(steps: list[dict], groups: list[dict], trajectories: list[dict]) -> dict[str, list[float]]:
    """Per step after the first (k = 0): the critical path through the step's last trajectory
    scored, and the weight sync's parts (the sync that ran before this step's rollouts)."""
    parts: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        if value == value:  # NaN: never measured (no sync yet)
            parts.setdefault(name, []).append(value)

    for prev, cur in zip(steps, steps[1:]):
        done = {g["group_id"]: g for g in groups if g["status"] == "accepted" and prev["time"] < g["time"] <= cur["time"]}
        members = [t for t in trajectories if t["group_id"] in done]
        if not members:
            continue
        last = max(members, key=lambda t: t["scored"])
        started = cur["time"] - cur["step_time_s"] - cur.get("checkpoint_s", 0.0)
        broadcast = "broadcast_sync_s" in cur  # the trainer served the version itself, before logging the step
        sync = {key: float("nan") if broadcast else cur.get(f"weight_sync_{key}", float("nan"))
                for key in ("s", "download_s", "reload_s", "probe_s")}
        admission = last["dispatched"] - prev["time"]
        add("weight sync (follower), before the dispatch", sync["s"])
        add("  download of the checkpoint", sync["download_s"])
        add("  replica reload", sync["reload_s"])
        add("  probe", sync["probe_s"])
        add("admission after the sync (intake's wake-up, dispatch)",
            max(0.0, admission) - (sync["s"] if sync["s"] == sync["s"] else 0.0))
        # trainer.admit_before_served: dispatched while the step synced; from the step's end on, it waited for the version
        add("rollout hop: dispatch (or the step's end) to episode start (Celery)", last["start"] - max(last["dispatched"], prev["time"]))
        if admission < 0:
            add("  dispatched before the step's end by (trainer.admit_before_served)", -admission)
        add("episode: inference + environment", last["episode_s"])
        add("trajectory upload (S3 object; none when inline)", last["upload_s"])
        add("scoring hop: uploaded to scoring start (Celery; none when scored in the worker)", last["scoring_start"] - last["uploaded"])
        add("scoring: trajectory read + reward", last["scoring_s"])
        group = done[last["group_id"]]
        add("scored to group assembled (stream, S3 bundle)", group["time"] - last["scored"])
        for name, value in assembly_hops(last, group).items():
            add(name, value)
        add("last group assembled to step start (pickup)", started - max(g["time"] for g in done.values()))
        add("forward/backward + optimizer", cur["step_time_s"])
        if broadcast:  # checkpoint_s is the publish: snapshot, then the sync; the S3 checkpoint is written behind
            add("publish: CPU snapshot + logprob probe (trainer)", cur["snapshot_s"])
            add("publish: broadcast sync (pause, send, probe, label)", cur["broadcast_sync_s"])
            add("  the tensors' broadcast", cur["broadcast_s"])
        else:
            add("checkpoint (S3 objects, announce)", cur.get("checkpoint_s", 0.0))
    return parts


def assembly_hops(last: dict, group: dict) -> dict[str, float]:
    """"Scored to group assembled" taken apart (``services.trainer.consumer``'s group line): the
    scored bundle and the ledger's move (to the stream entry that completed the group: its id is
    Redis's clock in ms, against the scorer's wall clock), the trainer's wake-up (to the read that
    returned it), the entries read before it, and the group's assembly (reads, batch, record, spill)."""
    added = int(group["completed_by"].split("-")[0]) / 1000 if "completed_by" in group else float("nan")
    read_at, started = group.get("read_at", float("nan")), group.get("assembly_started_at", float("nan"))
    return {"  scored bundle + ledger move, to the trainer stream": added - last["scored"],
            "  on the stream to read by the trainer (its wake-up)": read_at - added,
            "  read to assembly start (entries read before it)": started - read_at,
            "  the trainer's assembly (reads, batch, record, spill)": group.get("assembly_s", float("nan"))}


def post_step_waits(workdir: Path, steps: list[dict], groups: list[dict]) -> dict[str, float]:
    """Medians over the steps between the first and the last: the trainer's lines from a step's
    metrics line to its log line (``services.trainer.loop.TrainingLoop.train_once``: the step's record and the
    reward curve, when drawn in its thread), and how long the next step's first group waited on
    the trainer stream (added, by its entry id, to read)."""
    logged = {}
    for line in (workdir / "stack" / "logs" / "trainer.log").read_text(errors="replace").splitlines():
        if match := re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO services\.trainer\.loop: step (\d+): ", line):
            at = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")  # the log's local time
            logged[int(match.group(2))] = at.astimezone().timestamp()
    post, waits = [], []
    for step in steps[1:-1]:
        later = [g for g in groups if g["time"] > step["time"] and "read_at" in g]
        if int(step["step"]) not in logged or not later:
            continue
        first = min(later, key=lambda g: g["time"])
        post.append(logged[int(step["step"])] - step["time"])
        waits.append(first["read_at"] - int(first["completed_by"].split("-")[0]) / 1000)
    return {"post_step_s": statistics.median(post) if post else float("nan"),
            "first_group_wait_s": statistics.median(waits) if waits else float("nan")}


def print_parts(parts: dict[str, list[float]], wall: float) -> None:
    print(f"    {'':52s} median   mean    share of the median step")
    for name, values in parts.items():
        med = statistics.median(values)
        print(f"    {name:52s} {med:6.3f}  {statistics.fmean(values):6.3f}   {med / wall:6.1%}")


def weight_sync_env(mode: str) -> dict[str, str]:
    """``s3``: the checkpoint, then the follower's download and reload (the default). ``gloo``: the
    trainer broadcasts from its memory to the co-located replica and writes the checkpoint behind;
    ``gloo:N``: and only every N-th version's (``checkpoint_every``); ``gloo@M`` (or ``gloo:N@M``):
    broadcasts of at most M MiB (``bucket_mib``; 0: one per tensor)."""
    if mode == "s3":
        return {}
    mode, _, bucket = mode.partition("@")
    backend, _, every = mode.partition(":")
    return {"CONVEYOR_INFERENCE__WEIGHT_SYNC__MODE": "nccl", "CONVEYOR_INFERENCE__WEIGHT_SYNC__BACKEND": backend,
            "CONVEYOR_INFERENCE__WEIGHT_SYNC__PORT": str(free_port()),
            "CONVEYOR_INFERENCE__WEIGHT_SYNC__CHECKPOINT_EVERY": every or "1",
            **({"CONVEYOR_INFERENCE__WEIGHT_SYNC__BUCKET_MIB": bucket} if bucket else {})}


def trajectories_env(mode: str) -> dict[str, str]:
    """``default``: as configured (``ledger.inline_max_bytes``'s default). ``objects``: every
    trajectory an S3 object (inline off). ``inline``: the small ones inline (at most
    16 KiB; the setting is opt-in, default 0); ``inline:N``: at most N bytes."""
    if mode == "default":
        return {}
    if mode == "objects":
        return {"CONVEYOR_LEDGER__INLINE_MAX_BYTES": "0"}
    kind, _, limit = mode.partition(":")
    if kind != "inline":
        raise SystemExit(f"--trajectories: {mode!r} is not default, objects, inline or inline:N")
    return {"CONVEYOR_LEDGER__INLINE_MAX_BYTES": limit or "16384"}


def count_lines(log: Path, needle: str) -> int:
    """Lines of a service's log that hold ``needle`` (0 without the log)."""
    return sum(needle in line for line in log.read_text(errors="replace").splitlines()) if log.exists() else 0


SCORING_IN_WORKER = {"scorer": "never", "worker": "auto"}  # --scoring -> rewards.in_worker
# --assembly -> the trainer's assembly levers: sibling groups side by side (trainer.assembly_threads)
# and the step's batches handed over in memory (trainer.batches_in_memory); "default" as configured
ASSEMBLY = {"default": {}, **{name: {"CONVEYOR_TRAINER__ASSEMBLY_THREADS": threads, "CONVEYOR_TRAINER__BATCHES_IN_MEMORY": kept}
                                for name, threads, kept in [("new", "8", "64"), ("serial", "1", "64"), ("s3", "8", "0"),
                                                            ("old", "1", "0")]}}


# --storage -> the stack's object store: moto's S3 server over HTTP (the learning demo's), or the
# filesystem backend (``conveyor demo``'s durable default)
STORAGE = {"s3": "moto S3 over HTTP", "local": "the filesystem backend"}
# --admit -> trainer.admit_before_served
ADMIT = {"served": "false", "begun": "true"}


def conveyor_sync_run(out: Path, steps: int, threads: int, layout: str, weight_sync: str,
                      trajectories_mode: str = "default", scoring: str = "scorer", reward_curve: str = "behind",
                      repeat: int = 0, assembly: str = "default", storage: str = "s3", burst: str = "default",
                      admit: str = "default") -> dict:
    """One Conveyor run at k = 0: its median step, and the step's hops (critical path)."""
    trajectories: list[dict] = []
    overrides = {**TRL_MATCHED, "CONVEYOR_TRAINER__TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
                 **weight_sync_env(weight_sync), **trajectories_env(trajectories_mode),
                 "CONVEYOR_REWARDS__IN_WORKER": SCORING_IN_WORKER[scoring], "CONVEYOR_TRAINER__REWARD_CURVE": reward_curve,
                 **ASSEMBLY[assembly], **({} if burst == "default" else {"CONVEYOR_INTAKE__PUBLISH_BURST": burst}),
                 **({} if admit == "default" else {"CONVEYOR_TRAINER__ADMIT_BEFORE_SERVED": ADMIT[admit]})}
    before = load()
    name = "-".join([weight_sync.replace(":", "-"), *([] if trajectories_mode == "default" else [trajectories_mode.replace(":", "-")]),
                     scoring, *([] if reward_curve == "behind" else [f"curve-{reward_curve}"]),
                     *([] if assembly == "default" else [f"assembly-{assembly}"]),
                     *([] if storage == "s3" else [f"storage-{storage}"]), *([] if burst == "default" else [f"burst-{burst}"]),
                     *([] if admit == "default" else [f"admit-{admit}"]), *([str(repeat + 1)] if repeat else [])])
    run = run_learning(out / f"vs-trl-{name}", steps, 0, overrides=overrides, layout=layout, storage=storage,
                       inspect=lambda stack: trajectories.extend(trajectory_hops(stack)))
    (run.workdir / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajectories))
    groups = [json.loads(line) for line in (run.workdir / "stack" / "metrics.jsonl").read_text().splitlines() if line]
    median = statistics.median(conveyor_breakdown(run.steps, groups)["wall"])
    parts = hop_breakdown(run.steps, groups, trajectories)
    print(f"  Conveyor, weight sync {weight_sync}, trajectories {trajectories_mode}, scoring on the {scoring}, "
          f"reward curve drawn {reward_curve}, assembly {assembly}, storage {STORAGE[storage]}, publish burst {burst}, "
          f"admission {admit}: median "
          f"{median:.3f} s/step ({before} before, {load()} after); "
          f"critical path through the step's last trajectory scored ({len(trajectories)} trajectories):", flush=True)
    print_parts(parts, median)
    waits = post_step_waits(run.workdir, run.steps, groups)
    print(f"    after each step (median): the trainer's lines from its metrics line to its log line {waits['post_step_s']:.3f} s; "
          f"the next step's first group on the trainer stream before it was read {waits['first_group_wait_s']:.3f} s")
    sizes = sorted(t["json_bytes"] for t in trajectories)
    inline = sum(t["inline"] for t in trajectories)
    print(f"    trajectories' JSON: median {sizes[len(sizes) // 2]} B, max {sizes[-1]} B; {inline} of {len(sizes)} carried inline")
    logs = run.workdir / "stack" / "logs"
    where = {"in the worker": count_lines(logs / "worker-rollout.log", " in the worker: scored"),
             "on the scorer": count_lines(logs / "worker-scoring.log", ": scored")}
    print(f"    trajectories scored {where['in the worker']} in the rollout worker, {where['on the scorer']} on the scorer",
          flush=True)
    return {"s_per_step": median, "load_before": before, "trajectories": len(trajectories), "inline": inline,
            **waits, "json_bytes_median": sizes[len(sizes) // 2], "json_bytes_max": sizes[-1], "scored": where,
            "parts_median": {k: statistics.median(v) for k, v in parts.items()},
            "parts_mean": {k: statistics.fmean(v) for k, v in parts.items()}}


def sync_vs_trl(out: Path, steps: int, threads: int, layout: str, weight_syncs: list[str],
                trajectories_modes: tuple[str, ...] = ("default",), scorings: tuple[str, ...] = ("scorer",),
                skip_trl: bool = False, reward_curves: tuple[str, ...] = ("behind",),
                assemblies: tuple[str, ...] = ("default",), storages: tuple[str, ...] = ("s3",),
                bursts: tuple[str, ...] = ("default",), admits: tuple[str, ...] = ("default",)) -> dict:
    against = "(no TRL run)" if skip_trl else f"against TRL {TRL_VERSION} GRPOTrainer"
    print(f"## sync step: Conveyor (k=0; weight sync {', '.join(weight_syncs)}; trajectories "
          f"{', '.join(trajectories_modes)}; scoring on the {', '.join(scorings)}; reward curve drawn "
          f"{', '.join(reward_curves)}; assembly {', '.join(assemblies)}; storage "
          f"{', '.join(STORAGE[s] for s in storages)}) {against}, "
          f"layout {layout}, {steps} steps, torch threads {threads} on both sides (Conveyor's trainer and "
          f"workers: CONVEYOR_TRAINER__TORCH_THREADS and OMP_NUM_THREADS; vLLM its own)", flush=True)
    conveyor: dict[str, dict] = {}
    for mode in weight_syncs:
        for kept in trajectories_modes:
            for scoring in scorings:
                # a value given twice runs twice (A, B, A, B: the drift of the load shows)
                for curve, assembly, storage, burst, admit in itertools.product(reward_curves, assemblies, storages, bursts,
                                                                                admits):
                    key = "/".join([mode, *([] if kept == "default" else [kept]), *([] if scoring == "scorer" else [scoring]),
                                    *([] if curve == "behind" else [f"curve {curve}"]),
                                    *([] if assembly == "default" else [f"assembly {assembly}"]),
                                    *([] if storage == "s3" else [f"storage {storage}"]),
                                    *([] if burst == "default" else [f"burst {burst}"]),
                                    *([] if admit == "default" else [f"admit {admit}"])])
                    repeat = sum(k.split(" #")[0] == key for k in conveyor)
                    key += f" #{repeat + 1}" if repeat else ""
                    conveyor[key] = conveyor_sync_run(out, steps, threads, layout, mode, kept, scoring, curve, repeat,
                                                      assembly, storage, burst, admit)
    between = load()
    if len(conveyor) > 1:
        first, *others = conveyor
        for other in others:
            print(f"  median s/step, steps 2..N: {other} {conveyor[other]['s_per_step']:.3f} against {first} "
                  f"{conveyor[first]['s_per_step']:.3f}: ratio {conveyor[other]['s_per_step'] / conveyor[first]['s_per_step']:.3f}")
    if skip_trl:
        return {"conveyor": conveyor, "threads": threads}
    (out / "vs-trl").mkdir(parents=True, exist_ok=True)
    trl = run_trl(out / "vs-trl", steps, layout, threads)
    after = load()
    trl_med = statistics.median([s["step_wall_s"] for s in trl][1:])
    print(f"  machine: before TRL {between}; after TRL {after}")
    for mode, run in conveyor.items():
        run["ratio"] = run["s_per_step"] / trl_med
        print(f"  median s/step, steps 2..N: Conveyor ({mode}) {run['s_per_step']:.3f}, TRL {trl_med:.3f}; "
              f"ratio Conveyor / TRL {run['ratio']:.2f}x (target <= 3x)")
    return {"conveyor": conveyor, "trl_s_per_step": trl_med, "threads": threads, "load_trl": [between, after]}


def stale_share(steps: list[dict]) -> float:
    """Groups discarded as stale over groups trained or discarded as stale, over the run."""
    stale = steps[-1].get("filtered_stale", 0.0) if steps else 0.0
    trained = sum(s.get("groups_trained", 0.0) for s in steps)
    return stale / (stale + trained) if stale + trained else 0.0


def first_step_reaching(steps: list[dict], threshold: float) -> dict | None:
    """The first step whose mean reward is at least ``threshold``; None when none is."""
    return next((s for s in steps if s["reward_mean"] >= threshold), None)


def agentic(out: Path, steps: int, ks: list[int], p50: float, p99: float, worker_slots: int,
            stale_at_use: int | None = None, corrections: tuple[str, ...] = ("none",),
            reward_threshold: float = 0.5) -> dict:
    """Sync (k = 0), then each k of ``ks`` once per loss correction of ``corrections``
    (``trainer.loss.correction``; sync keeps the default, none: its tokens are on-policy). Keyed
    ``"0"``, ``"<k>"`` (correction none) or ``"<k>-<correction>"``."""
    at_use = "" if stale_at_use is None else f"; async runs train groups up to {stale_at_use} steps behind"
    print(f"## async against sync on agentic episodes: {steps} steps of 4 groups x 8, every environment step waits a "
          f"lognormal tool latency (p50 {p50} s, p99 {p99} s, seeded per trajectory); one rollout worker with "
          f"{worker_slots} slots{at_use}; async loss corrections {', '.join(corrections)}; reward threshold "
          f"{reward_threshold}", flush=True)
    runs = {}
    for k, correction in [(0, "none"), *[(k, c) for k in ks for c in corrections]]:
        key = str(k) if correction == "none" else f"{k}-{correction}"
        before = load()
        overrides = {**AGENTIC, "CONVEYOR_TRAINER__LOSS__CORRECTION": correction}
        if k > 0 and stale_at_use is not None:
            overrides["CONVEYOR_TRAINER__MAX_STALENESS_AT_USE"] = str(stale_at_use)
        run = run_learning(out / f"agentic-k{key}", steps, k, overrides=overrides,
                           task_config={"step_latency_s": p50, "step_latency_p99_s": p99}, worker_slots=worker_slots)
        groups = [json.loads(line) for line in (run.workdir / "stack" / "metrics.jsonl").read_text().splitlines() if line]
        first_dispatch = min(g["time"] - g["group_latency_s"] for g in groups)
        reached = first_step_reaching(run.steps, reward_threshold)
        runs[key] = {"k": k, "correction": correction, "wall_s": run.wall_s,
                     "from_first_dispatch_s": run.steps[-1]["time"] - first_dispatch,
                     "steps": len(run.steps), "stale_share": stale_share(run.steps), "load": [before, load()],
                     "max_staleness_at_use": overrides.get("CONVEYOR_TRAINER__MAX_STALENESS_AT_USE"),
                     "rewards": [round(r, 4) for r in run.rewards],
                     "threshold_step": reached and int(reached["step"]),
                     "to_threshold_s": reached and reached["time"] - first_dispatch}
        to_threshold = (f"reward >= {reward_threshold} first at step {runs[key]['threshold_step']}, "
                        f"{runs[key]['to_threshold_s']:.1f} s from the first dispatch" if reached
                        else f"reward never reached {reward_threshold}")
        print(f"  k={k} correction {correction}: {runs[key]['from_first_dispatch_s']:.1f} s from the first dispatch to "
              f"step {len(run.steps)} ({run.wall_s:.1f} s from intake's start), stale {runs[key]['stale_share']:.1%}; "
              f"{to_threshold}; reward per step {runs[key]['rewards']} ({before} before, {runs[key]['load'][1]} after)",
              flush=True)
    sync = runs["0"]
    for key, figures in runs.items():
        if key == "0":
            continue
        figures["speedup"] = sync["from_first_dispatch_s"] / figures["from_first_dispatch_s"]
        if figures["to_threshold_s"] and sync["to_threshold_s"]:
            figures["threshold_speedup"] = sync["to_threshold_s"] / figures["to_threshold_s"]
        to_threshold = (f"{figures['threshold_speedup']:.2f}x to reward {reward_threshold}" if "threshold_speedup" in figures
                        else f"no time-to-threshold ratio (sync step {sync['threshold_step']}, "
                             f"async step {figures['threshold_step']})")
        print(f"  async k={figures['k']} ({figures['correction']}) over sync: {figures['speedup']:.2f}x from the first dispatch "
              f"({sync['wall_s'] / figures['wall_s']:.2f}x from intake's start; target >= 3x), groups discarded as stale "
              f"{figures['stale_share']:.1%} (target <= 5%); {to_threshold}; reward at step {figures['steps']} "
              f"{figures['rewards'][-1]:.3f} against sync's {sync['rewards'][-1]:.3f}")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="steps of the sync-vs-TRL comparison")
    parser.add_argument("--agentic-steps", type=int, default=10, help="N: steps of each agentic run")
    parser.add_argument("--ks", default="1,2,4", help="async staleness bounds to time against k=0")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument("--layout", default="llama", help="tiny-model layout of the TRL comparison")
    parser.add_argument("--tool-p50", type=float, default=1.0)
    parser.add_argument("--tool-p99", type=float, default=20.0)
    parser.add_argument("--worker-slots", type=int, default=8,
                        help="the rollout worker's episodes at once in the agentic runs (tool waits cost no CPU)")
    parser.add_argument("--stale-at-use", type=int, default=None,
                        help="trainer.max_staleness_at_use of the async agentic runs (>= each k); default: k")
    parser.add_argument("--corrections", default="none", help="comma list of trainer.loss.correction values, "
                        "each run once per async k (none, tis, icepop, seq_mask); sync keeps none")
    parser.add_argument("--reward-threshold", type=float, default=0.5,
                        help="the agentic runs' time to the first step whose mean reward reaches this")
    parser.add_argument("--weight-sync", default="s3", help="comma list of the sync-vs-TRL runs' weight paths: "
                        "s3 (checkpoint, then the follower) and/or gloo (broadcast from the trainer's memory)")
    parser.add_argument("--trajectories", default="default", help="comma list of the sync-vs-TRL runs' trajectory "
                        "paths, each run with each weight path: objects (an S3 object each), inline (the small ones in "
                        "the ledger's Redis; inline:N at most N bytes), default (as configured)")
    parser.add_argument("--scoring", default="scorer", help="comma list of the sync-vs-TRL runs' places of scoring: "
                        "scorer (the scorer service, its Celery hop) and/or worker (in the rollout worker: rewards.in_worker auto)")
    parser.add_argument("--reward-curve", default="behind", help="comma list of the sync-vs-TRL runs' "
                        "trainer.reward_curve: behind (drawn in a thread of its own, the default) and/or in_step "
                        "(drawn in the trainer's thread before it reads the next groups, as before)")
    parser.add_argument("--assembly", default="default", help="comma list of the sync-vs-TRL runs' trainer assembly: "
                        "default (as configured), new (sibling groups side by side: trainer.assembly_threads 8, batches "
                        "handed over in memory: trainer.batches_in_memory 64), serial (assembly_threads 1, in memory: the "
                        "defaults), s3 (8 threads, batches read back from S3), old (1 thread, from S3)")
    parser.add_argument("--storage", default="s3", help="comma list of the sync-vs-TRL runs' object store: s3 "
                        "(moto's S3 server over HTTP, as the learning demo) and/or local (the filesystem backend, "
                        "conveyor demo's durable default)")
    parser.add_argument("--publish-burst", default="default", help="comma list of the sync-vs-TRL runs' "
                        "intake.publish_burst: 1 (each group published as soon as it is admitted) and/or N (the groups "
                        "one admission lets in registered, then published together, at most N); default as configured")
    parser.add_argument("--admit", default="default", help="comma list of the sync-vs-TRL runs' admission: "
                        "served (a step's groups admitted once its weights are served) and/or begun (admitted once "
                        "the trainer begins a step, their first turn waiting in the worker for the weights: "
                        "trainer.admit_before_served); default as configured")
    parser.add_argument("--conveyor-only", action="store_true",
                        help="the sync step's Conveyor runs (--weight-sync x --trajectories x --scoring) without the TRL run")
    parser.add_argument("--skip-trl", action="store_true",
                        help="no TRL run; the sync step's Conveyor runs still run when more than one is asked for")
    parser.add_argument("--skip-agentic", action="store_true")
    parser.add_argument("--out", type=Path, help="default: a temp dir")
    args = parser.parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="conveyor-loop-speed-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"# loop speed: {os.cpu_count()} CPUs, {load()}; out {out}", flush=True)
    results: dict = {}
    modes, scorings = args.trajectories.split(","), args.scoring.split(",")
    if unknown := set(scorings) - set(SCORING_IN_WORKER):
        parser.error(f"--scoring: {sorted(unknown)} not among {sorted(SCORING_IN_WORKER)}")
    curves, assemblies = args.reward_curve.split(","), args.assembly.split(",")
    if unknown := set(assemblies) - set(ASSEMBLY):
        parser.error(f"--assembly: {sorted(unknown)} not among {sorted(ASSEMBLY)}")
    storages = args.storage.split(",")
    if unknown := set(storages) - set(STORAGE):
        parser.error(f"--storage: {sorted(unknown)} not among {sorted(STORAGE)}")
    bursts, admits = args.publish_burst.split(","), args.admit.split(",")
    if unknown := set(admits) - set(ADMIT) - {"default"}:
        parser.error(f"--admit: {sorted(unknown)} not among {sorted(ADMIT)}")
    variants = (len(modes) * len(scorings) * len(args.weight_sync.split(",")) * len(curves) * len(assemblies) * len(storages)
                * len(bursts) * len(admits))
    if args.conveyor_only or not args.skip_trl or variants > 1:
        results["sync_vs_trl"] = sync_vs_trl(out, args.steps, args.threads, args.layout, args.weight_sync.split(","),
                                             tuple(modes), tuple(scorings), args.skip_trl or args.conveyor_only,
                                             tuple(curves), tuple(assemblies), tuple(storages), tuple(bursts), tuple(admits))
        (out / "loop_speed.json").write_text(json.dumps(results, indent=1))
    if not args.skip_agentic:
        results["agentic"] = agentic(out, args.agentic_steps, [int(k) for k in args.ks.split(",")],
                                     args.tool_p50, args.tool_p99, args.worker_slots, args.stale_at_use,
                                     tuple(args.corrections.split(",")), args.reward_threshold)
        (out / "loop_speed.json").write_text(json.dumps(results, indent=1))
    print(f"figures: {out / 'loop_speed.json'}")


if __name__ == "__main__":
    main()
