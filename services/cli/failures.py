"""``conveyor status --failures RUN`` and ``conveyor retry RUN``: what failed and why, and a way
to try it again.

Invariants:
- The report reads the ledger and nothing else: the counts per failure kind
  (``shared.outcomes.kind_of``) add up to the run's ``failed`` count; each kind shows real
  trajectory ids with the first line of their reason (a bug's traceback is in ``--json``);
  rejected intake rows are listed with their source and reason.
- ``retry`` changes the ledger only through ``shared.state.ledger_retry`` (whole groups, one Lua
  call each), and says what it left alone and why.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from rich.console import Console
from rich.table import Table

from shared.state.ledger import LedgerReads
from shared.state.ledger_retry import RetryReport
from shared.state.run_records import RunRecords
from shared.outcomes import headline, kind_of

EXAMPLES = 3


def failure_report(client: Any, run_id: str, examples: int = EXAMPLES) -> dict:
    ledger = LedgerReads(client)
    states = ledger.states(run_id)
    reasons = {tid: r for tid, r in ledger.failure_reasons(run_id).items() if states.get(tid) == "failed"}
    failed = [tid for tid, state in sorted(states.items()) if state == "failed"]
    by_kind: dict[str, list[str]] = defaultdict(list)
    for tid in failed:
        by_kind[kind_of(reasons.get(tid, "unknown"))].append(tid)
    kinds = sorted(by_kind.items(), key=lambda item: (-len(item[1]), item[0]))
    rejected = [row.model_dump() for row in RunRecords(client, run_id).rejected_rows()]
    return {
        "run": run_id,
        "trajectories": len(states),
        "failed": len(failed),
        "reasons": [
            {"kind": kind, "count": len(tids), "examples": [{"trajectory_id": t, "reason": reasons.get(t, "")} for t in tids[:examples]]}
            for kind, tids in kinds
        ],
        "rejected_rows": rejected,
    }


def print_failures(report: dict, console: Console) -> None:
    console.print(f"run {report['run']}: {report['failed']} of {report['trajectories']} trajectories failed")
    if report["reasons"]:
        table = Table()
        table.add_column("reason")
        table.add_column("count", justify="right")
        table.add_column("examples")
        for entry in report["reasons"]:
            shown = "\n".join(f"{e['trajectory_id']}: {headline(e['reason'])}" for e in entry["examples"])
            table.add_row(entry["kind"], str(entry["count"]), shown)
        console.print(table)
    rejected = report["rejected_rows"]
    console.print(f"rejected intake rows: {len(rejected)}")
    for row, count in Counter((r.get("source", "?"), r.get("reason", "?")) for r in rejected).items():
        console.print(f"  {row[0]}: {row[1]}" + (f" (x{count})" if count > 1 else ""))


def retry_summary(run_id: str, report: RetryReport) -> dict:
    return {
        "run": run_id,
        "retried": len(report.retried),
        "groups": report.groups,
        "left": [{"why": why, "count": len(tids), "examples": tids[:EXAMPLES]} for why, tids in report.left.items()],
    }


def print_retry(summary: dict, console: Console) -> None:
    console.print(f"retry {summary['run']}: {summary['retried']} failed trajectories of {len(summary['groups'])} groups "
                  "queued again")
    for entry in summary["left"]:
        console.print(f"  {entry['count']} not retried: {entry['why']} (e.g. {', '.join(entry['examples'])})")
    if summary["retried"]:
        console.print(f"  rollout workers and a trainer of run {summary['run']} must be running to take them")
