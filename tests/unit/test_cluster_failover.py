"""A master of the Redis Cluster killed with SIGKILL mid-run (its replica takes over): the
ledger's client waits the failover out (``shared.redis_clients.OutageCluster``), the run goes
on through it, and nothing the master had replicated is lost.

The cluster replicates asynchronously: a write acknowledged but not yet on the replica can be
lost in a failover, as the last second of writes is lost by a standalone Redis that crashes
(``appendfsync everysec``). The ledger's dispatch deadlines send such a message again
(``shared.state.ledger``); this test waits for the replica to hold every write first, and
checks that the failover itself loses none."""

from __future__ import annotations

import time

from redis_cluster import running_cluster
from test_ledger import assert_counts_consistent, requests_for, scored_event, stream_events

from shared.names import RedisKeys
from shared.redis_clients import redis_for
from shared.settings import OutageSettings
from shared.state.ledger import SCORING, Ledger

SIZE = 16


def test_a_master_failover_mid_run_is_waited_out_and_loses_nothing_replicated(tmp_path, run_id):
    with running_cluster(tmp_path) as cluster:
        client = redis_for(cluster.url, OutageSettings(limit_s=60))
        ledger = Ledger(client)
        tids = [r.trajectory_id for r in requests_for(run_id, size=SIZE)]
        ledger.register(requests_for(run_id, size=SIZE))
        assert all(ok for ok, _ in ledger.claim_many([(t, f"k-{t}", "") for t in tids], 60))
        half = tids[: SIZE // 2]
        assert all(r.ok for r in ledger.mark_uploaded_many([(t, f"k-{t}", "{}") for t in half], 5.0))
        master = client.get_node_from_key(RedisKeys.states(run_id))
        assert client.execute_command("WAIT", 1, 5000, target_nodes=master) == 1  # on its replica
        cluster.kill(master.port)
        started = time.monotonic()
        assert ledger.counts(run_id)["uploaded"] == SIZE // 2  # waits for the replica to take over
        failover_s = time.monotonic() - started
        assert client.get_node_from_key(RedisKeys.states(run_id)).port != master.port
        assert all(r.ok for r in ledger.mark_uploaded_many([(t, f"k-{t}", "{}") for t in tids[SIZE // 2:]], 5.0))
        for tid in tids:
            assert ledger.claim(tid, f"s-{tid}", 60, SCORING)[0]
            assert ledger.mark_scored(tid, scored_event(tid, run_id), token=f"s-{tid}").ok
        assert all(r.ok for r in ledger.mark_consumed_many(tids))
        assert sorted(e.trajectory_id for e in stream_events(client, run_id)) == sorted(tids)  # each once
        assert_counts_consistent(ledger, run_id, SIZE)
        assert ledger.counts(run_id)["consumed"] == SIZE
    print(f"failover waited out in {failover_s:.1f} s")
    assert failover_s < 30
