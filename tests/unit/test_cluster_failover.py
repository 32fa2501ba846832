"""A master of the Redis Cluster killed with SIGKILL mid-run (its replica takes over): the
ledger's client waits the failover out (``shared.redis_clients.OutageCluster``), the run goes
on through it, and nothing acknowledged is lost.

The cluster replicates asynchronously: a write a master answered may not be on its replica when
the master dies. The ledger acknowledges its critical writes only once the replica confirms them
(``shared.state.replica_ack``), so the second test cuts the replica off (SIGSTOP, its link
killed), writes, kills the master while the ledger still waits for the confirmation, and checks
that a plain write acknowledged meanwhile is lost while the ledger's writes are not."""

from __future__ import annotations

import signal
import threading
import time

import redis
from redis_cluster import running_cluster
from test_ledger import assert_counts_consistent, requests_for, scored_event, stream_events

from shared.names import RedisKeys
from shared.redis_clients import redis_for
from shared.settings import OutageSettings
from shared.state.ledger import SCORING, Ledger, TransitionResult

SIZE = 16


def test_a_master_failover_mid_run_is_waited_out_and_loses_nothing_replicated(tmp_path, run_id):
    with running_cluster(tmp_path) as cluster:
        client = redis_for(cluster.url, OutageSettings(limit_s=60))
        ledger = Ledger(client)
        tids = _registered_and_claimed(ledger, run_id)
        half = tids[: SIZE // 2]
        assert all(r.ok for r in ledger.mark_uploaded_many([(t, f"k-{t}", "{}") for t in half], 5.0))
        master = client.get_node_from_key(RedisKeys.states(run_id))
        cluster.kill(master.port)  # the ledger acknowledged the uploads once the replica held them
        started = time.monotonic()
        assert ledger.counts(run_id)["uploaded"] == SIZE // 2  # waits for the replica to take over
        failover_s = time.monotonic() - started
        assert client.get_node_from_key(RedisKeys.states(run_id)).port != master.port
        assert all(r.ok for r in ledger.mark_uploaded_many([(t, f"k-{t}", "{}") for t in tids[SIZE // 2:]], 5.0))
        _finish_exactly_once(client, ledger, run_id, tids)
    print(f"failover waited out in {failover_s:.1f} s")
    assert failover_s < 30


def test_writes_the_replica_never_received_are_not_lost_in_a_failover(tmp_path, run_id):
    with running_cluster(tmp_path) as cluster:
        client = redis_for(cluster.url, OutageSettings(limit_s=60))
        ledger = Ledger(client)
        tids = _registered_and_claimed(ledger, run_id)
        master = client.get_node_from_key(RedisKeys.states(run_id))
        direct = redis.Redis(port=master.port, decode_responses=True)
        replica = _replica_port(direct)
        cluster.procs[replica].send_signal(signal.SIGSTOP)
        direct.execute_command("CLIENT", "KILL", "TYPE", "replica")  # nothing written from now on reaches it
        probe = f"conveyor:{{{run_id}}}:probe"  # the run's slot, written without the ledger
        client.set(probe, "acknowledged by the master alone")
        replies: list[TransitionResult] = []
        writer = threading.Thread(target=lambda: replies.extend(
            ledger.mark_uploaded_many([(t, f"k-{t}", "{}") for t in tids], 5.0)))
        writer.start()
        deadline = time.monotonic() + 10
        while direct.hget(RedisKeys.states(run_id), tids[-1]) != "uploaded":  # the master ran the writes
            assert time.monotonic() < deadline, "the master never ran the uploads"
            time.sleep(0.01)
        time.sleep(0.5)
        assert writer.is_alive()  # not acknowledged: no replica confirmed them
        cluster.kill(master.port)
        killed = time.monotonic()
        cluster.procs[replica].send_signal(signal.SIGCONT)  # it takes over without the writes
        writer.join(60)
        acknowledged_s = time.monotonic() - killed
        assert not writer.is_alive() and len(replies) == SIZE and all(r.ok for r in replies)
        assert client.get_node_from_key(RedisKeys.states(run_id)).port == replica
        assert client.get(probe) is None  # the failover lost the write only the master held
        assert ledger.counts(run_id)["uploaded"] == SIZE  # the ledger ran its writes again on the replica
        _finish_exactly_once(client, ledger, run_id, tids)
    print(f"uploads acknowledged {acknowledged_s:.1f} s after the master was killed, on its replica")


def _registered_and_claimed(ledger: Ledger, run_id: str) -> list[str]:
    tids = [r.trajectory_id for r in requests_for(run_id, size=SIZE)]
    ledger.register(requests_for(run_id, size=SIZE))
    assert all(ok for ok, _ in ledger.claim_many([(t, f"k-{t}", "") for t in tids], 60))
    return tids


def _finish_exactly_once(client: redis.Redis, ledger: Ledger, run_id: str, tids: list[str]) -> None:
    for tid in tids:
        assert ledger.claim(tid, f"s-{tid}", 60, SCORING)[0]
        assert ledger.mark_scored(tid, scored_event(tid, run_id), token=f"s-{tid}").ok
    assert all(r.ok for r in ledger.mark_consumed_many(tids))
    assert sorted(e.trajectory_id for e in stream_events(client, run_id)) == sorted(tids)  # each once
    assert_counts_consistent(ledger, run_id, SIZE)
    assert ledger.counts(run_id)["consumed"] == SIZE


def _replica_port(master: redis.Redis) -> int:
    """The port of the master's one replica, from the cluster's view (``ip:port@bus``)."""
    (line,) = master.execute_command("CLUSTER", "REPLICAS", master.execute_command("CLUSTER", "MYID"))
    return int(line.split()[1].split("@")[0].rpartition(":")[2])
