"""Waiting out an outage (``shared.outage``): a call retries while its dependency is down,
the process says so once (then periodically, then when it is back), and gives up only past
``outage.limit_s``; a real Redis restarted under a waiting client; the reaper takes no lease
right after Redis came back."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.cli.local_stack import LocalStack
from shared.state.leases import LeaseKeeper, LeaseReaper, one_by_one
from shared.state.ledger import ROLLOUT, SCORING, Ledger
from shared.outage import Dependency, OutageTooLong, recoveries, redis_client
from shared.settings import OutageSettings

from unit.test_ledger import requests_for

FAST = OutageSettings(limit_s=30, backoff_max_s=0.2, log_every_s=1000)


def flaky(down_s: float, result: object = 42):
    """A call that fails as a refused connection for ``down_s``, then answers."""
    until = time.monotonic() + down_s
    calls = []

    def call() -> object:
        calls.append(1)
        if time.monotonic() < until:
            raise ConnectionRefusedError("connection refused")
        return result

    return call, calls


def connection_error(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionError)


def outage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shared.outage"]


def test_threads_wait_out_one_outage_and_the_process_says_so_once(caplog):
    caplog.set_level(logging.INFO)
    dependency = Dependency(f"thing-{time.monotonic_ns()}", FAST)
    call, calls = flaky(1.0)
    results = []
    threads = [threading.Thread(target=lambda: results.append(dependency.call(call, connection_error))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == [42] * 4 and len(calls) > 8  # retried, not failed
    time.sleep(dependency.confirm_s + 0.3)  # "back" is said once it stayed up that long
    lines = outage_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{dependency.name} is unreachable (ConnectionRefusedError: connection refused): waiting")
    assert "outage.limit_s" in lines[0]
    assert lines[1].startswith(f"{dependency.name} is back after ")
    assert dependency.recoveries == 1 and dependency.down_since is None


def test_a_dependency_that_answers_some_calls_while_it_comes_back_is_one_outage_said_once(caplog):
    """As Redis loading its dataset answers PING and INFO and ``LOADING`` to the rest: the
    successes in between do not end the outage, and its lines are one each."""
    caplog.set_level(logging.INFO)
    dependency = Dependency(f"loading-{time.monotonic_ns()}", FAST)
    started = time.monotonic()
    outcomes = []

    def call(kind: str) -> str:
        elapsed = time.monotonic() - started
        if elapsed < 0.5 or (elapsed < 2.0 and kind == "command"):  # down, then loading: PING answers, commands not
            raise ConnectionError("Redis is loading the dataset in memory")
        return kind

    def client() -> None:
        for _ in range(40):
            outcomes.append(dependency.call(lambda: call("ping"), connection_error))
            outcomes.append(dependency.call(lambda: call("command"), connection_error))
            time.sleep(0.05)

    thread = threading.Thread(target=client)
    thread.start()
    thread.join(30)
    time.sleep(dependency.confirm_s + 0.3)
    lines = outage_lines(caplog)
    assert len(lines) == 2, lines
    assert "is unreachable" in lines[0] and "is back after" in lines[1]
    back_after = float(lines[1].split("is back after ")[1].rstrip("s"))
    assert back_after >= 1.4  # the whole outage, loading included, not the first PING's answer
    assert outcomes.count("command") == 40


def test_a_long_outage_is_logged_periodically_and_given_up_past_the_limit(caplog):
    caplog.set_level(logging.INFO)
    dependency = Dependency("never-there", OutageSettings(limit_s=1.0, backoff_max_s=0.1, log_every_s=0.3))
    call, _ = flaky(3600)
    started = time.monotonic()
    with pytest.raises(OutageTooLong) as raised:
        dependency.call(call, connection_error)
    assert 1.0 <= time.monotonic() - started < 3
    assert str(raised.value).startswith("never-there has been unreachable for 1s, longer than outage.limit_s (1s): ")
    assert "\n" not in str(raised.value)
    assert sum("still waiting for never-there" in line for line in outage_lines(caplog)) >= 2


def test_an_error_that_is_not_an_outage_is_raised_at_once():
    calls = []

    def bug() -> None:
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        Dependency("bugged", FAST).call(bug, connection_error)
    assert calls == [1]


def test_a_waiting_redis_client_rides_out_a_restart_with_its_data(tmp_path):
    with LocalStack(tmp_path) as stack:
        url = stack.start_redis()  # with its append-only file
        client = redis_client(url, FAST)
        script = client.register_script("return redis.call('GET', KEYS[1])")
        client.set("k", "v")
        stack.stop_redis()
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.extend([client.get("k"), script(keys=["k"]), time.monotonic()]))
        started = time.monotonic()
        reader.start()
        time.sleep(2.0)
        assert reader.is_alive()  # waiting, not failed
        stack.start_redis(stack.redis_port)  # from this thread: its children die with the thread that started them
        reader.join(30)
        assert got[:2] == ["v", "v"]  # the data is back, and the script is loaded again
        assert 2.0 <= got[2] - started < 30 and recoveries(client) == 1


def test_the_reaper_takes_no_lease_before_redis_has_been_back_for_settle_s(tmp_path, run_id):
    with LocalStack(tmp_path) as stack:
        ledger = Ledger(redis_client(stack.start_redis(), FAST))
        live, dead = (r.trajectory_id for r in requests_for(run_id, size=2))
        ledger.register(requests_for(run_id, size=2))
        keeper = LeaseKeeper(ledger, lease_ttl_s=1.0, heartbeat_s=0.5)
        assert keeper.claim(live)[0] and ledger.claim(dead, "dead-worker", 1.0)[0]
        keeper.start()  # the live holder's heartbeat: it waits out the outage and renews after it
        sent: list[str] = []
        reaper = LeaseReaper(ledger, ROLLOUT, 3, 0.2, one_by_one(lambda tid, _payload: sent.append(tid)), settle_s=2.0)
        try:
            stack.stop_redis()
            time.sleep(1.5)  # longer than the leases: both ran out while Redis was down
            stack.start_redis(stack.redis_port)
            assert reaper.settling() and reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}
            time.sleep(2.0)
            assert not reaper.settling()
            assert reaper.sweep() == {"requeued": 1, "resent": 0, "failed": 0} and sent == [dead]  # only the dead one's
            assert ledger.state(live) == "running" and ledger.attempts(live) == 1
        finally:
            keeper.stop()


def test_a_redis_restart_sends_nothing_again_by_itself_and_a_lost_message_goes_out_at_its_deadline(tmp_path, run_id):
    """Messages that survived in the broker's queue are not copied after a restart (a restart
    multiplies no task); one that was lost with it is found by its dispatch deadline."""
    with LocalStack(tmp_path) as stack:
        ledger = Ledger(redis_client(stack.start_redis(), FAST), dispatch_ttl_s=2.0)
        requests = requests_for(run_id, size=3)
        ledger.register(requests)
        waiting, claimed, handed_on = (r.trajectory_id for r in requests)
        assert ledger.claim(claimed, "live-worker", 60)[0]
        assert ledger.claim(handed_on, "done-worker", 60)[0]
        assert ledger.mark_uploaded(handed_on, "done-worker", '{"scoring": "task"}', send_within_s=0.5).ok
        ledger.scoring_sent([handed_on])  # its batch went out: the deadline moves dispatch_ttl_s ahead
        sent: dict[str, list[tuple[str, str]]] = {"rollout": [], "scoring": []}
        reapers = [LeaseReaper(ledger, stage, 3, 1.0, one_by_one(lambda tid, payload, name=name: sent[name].append((tid, payload))),
                          settle_s=0.5) for name, stage in (("rollout", ROLLOUT), ("scoring", SCORING))]
        stack.stop_redis()
        stack.start_redis(stack.redis_port)  # its ledger is back (AOF); say its messages were lost
        time.sleep(1.1)  # settled (Redis counts its uptime in whole seconds)
        for reaper in reapers:
            reaper.sweep()
        assert sent == {"rollout": [], "scoring": []}  # nothing copied for the restart itself
        time.sleep(1.5)  # past the dispatch deadlines: nobody claimed them, the messages were lost
        for reaper in reapers:
            reaper.sweep()
        assert sent["rollout"] == [(waiting, requests[0].model_dump_json())]  # not the claimed one
        assert sent["scoring"] == [(handed_on, '{"scoring": "task"}')]
        for reaper in reapers:
            assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}  # the next deadline is further ahead
        assert ledger.attempts(waiting) == 0 and ledger.attempts(handed_on, SCORING) == 0  # no attempt was spent


def test_a_claim_sent_again_after_its_reply_was_lost_is_answered_as_the_first(ledger, run_id):
    """A waiting client sends a call again when the connection drops; a claim that did happen
    must not come back "leased" by an owner nobody knows (its lease would run out, a re-run)."""
    rollout, scoring = (r.trajectory_id for r in requests_for(run_id, size=2))
    ledger.register(requests_for(run_id, size=2))
    assert ledger.claim(rollout, "tok", 30) == (True, "1")
    assert ledger.claim(rollout, "tok", 30) == (True, "1")  # the same call again: same answer
    assert ledger.claim(rollout, "other", 30) == (False, "running")  # anyone else: still refused
    assert ledger.claim(scoring, "w", 30)[0] and ledger.mark_uploaded(scoring, "w").ok
    assert ledger.claim(scoring, "s", 30, SCORING) == (True, "1")
    assert ledger.claim(scoring, "s", 30, SCORING) == (True, "1")
    assert ledger.claim(scoring, "late", 30, SCORING) == (False, "leased")
    assert ledger.attempts(rollout) == 1 and ledger.attempts(scoring, SCORING) == 1


def test_a_lease_lost_with_a_crash_of_redis_costs_no_attempt_and_one_lost_while_redis_stayed_up_does(tmp_path, run_id):
    """A crash of everything (Redis and the holders) is not the trajectory's doing: however many
    there are, it never fails ``lease_expired``; a holder that died while Redis stayed up counts."""
    with LocalStack(tmp_path) as stack:
        # appendfsync always: the claim below is on disk before its reply, so the crash keeps it
        # (with everysec Redis may postpone the write while an fsync runs, and lose it to SIGKILL)
        ledger = Ledger(redis_client(stack.start_redis(appendfsync="always"), FAST))
        crashed, died_alone = (r.trajectory_id for r in requests_for(run_id, size=2))
        ledger.register(requests_for(run_id, size=2))
        reaper = LeaseReaper(ledger, ROLLOUT, 1, 0.2, one_by_one(lambda tid, _payload: None), settle_s=0.5, lease_ttl_s=1.0)
        assert ledger.claim(crashed, "holder-killed-with-redis", 1.0)[0]
        stack.process("redis").kill()  # SIGKILL, as with everything at once; the holder is gone too
        stack.processes.remove(stack.process("redis"))
        stack.start_redis(stack.redis_port, appendfsync="always")
        time.sleep(2.2)  # settled, and the lease has run out
        assert reaper.sweep() == {"requeued": 1, "resent": 0, "failed": 0}  # max_attempts is 1, and it is not failed
        assert ledger.state(crashed) == "queued" and ledger.attempts(crashed) == 0
        time.sleep(1.5)  # Redis has been up longer than a lease now
        assert ledger.claim(died_alone, "holder-that-died-alone", 0.5)[0]
        time.sleep(0.7)
        assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 1}  # its one attempt counted
        assert ledger.state(died_alone) == "failed"


def test_a_process_that_exits_right_after_an_outage_still_says_it_is_back(tmp_path):
    """Intake publishes and exits within a second of Redis' return: its "back" line is written at exit."""
    script = tmp_path / "short.py"
    script.write_text(
        "import logging, time\n"
        "from shared.outage import Dependency\n"
        "from shared.settings import OutageSettings\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "d = Dependency.named('short-lived', OutageSettings(limit_s=30, backoff_max_s=5, log_every_s=1000))\n"
        "until = time.monotonic() + 0.3\n"
        "def call():\n"
        "    if time.monotonic() < until:\n"
        "        raise ConnectionRefusedError('refused')\n"
        "    return 1\n"
        "d.call(call, lambda e: isinstance(e, ConnectionError))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=Path.cwd())
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stderr
    assert "short-lived is unreachable" in lines[0] and "short-lived is back after" in lines[1]
