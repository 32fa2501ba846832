"""The trajectory ledger in Redis: one state per trajectory, changed only by atomic Lua
transitions (``shared.state.ledger_lua``).

States: queued -> running -> uploaded -> scored -> consumed, or failed(reason) from any
non-terminal state.

Invariants, per run:
- Each trajectory has exactly one state; the per-state counters move in the same Lua call as
  the state, so ``sum(counts) == registered`` at all times and
  ``dispatched == consumed + failed + in flight``.
- A transition names the states it may start from; a redelivered or duplicated message finds
  the trajectory elsewhere and becomes a no-op. This is what makes rollout, scoring and
  consumption idempotent by trajectory id.
- Every stage that holds work holds it under a lease (a ``LeaseStage``: owner token + deadline
  in the stage's zset): rollout holds ``running`` trajectories, scoring holds ``uploaded`` ones.
  At most one attempt per stage holds a trajectory; only its owner can move it on, so a worker
  presumed dead cannot publish a second copy. Leaving the held state ends the lease in the same
  Lua call. Workers renew leases by heartbeat; the reaper (``shared.state.leases``) puts a
  trajectory whose lease ran out back where the stage claims from, to be re-dispatched, and
  fails it after ``max_attempts`` attempts of that stage. An owner that stops before its
  work is done (its worker shuts down) hands the trajectory back (``hand_back``): to the
  state its stage claims from, the lease ended and the attempt not counted, in one Lua call.
- Every state that holds work has a deadline in its stage's lease zset, written in the same Lua
  call as the state: a lease (``running``; ``uploaded`` being scored) or, for a trajectory
  waiting to be claimed (``queued``; ``uploaded`` not yet claimed by a scorer), a dispatch
  deadline with no owner. Registration, a requeue, a hand-back, an expired lease, ``conveyor
  retry`` and the upload each arm it; only a claim (which replaces it with a lease) or leaving
  the state ends it. A message that never reached a holder (its sender died before sending; the
  broker took it off its queue and its receiver died before recording the delivery; Redis
  restarted and lost the last second of writes) is therefore sent again by the stage's reaper
  once the deadline passes, whatever else was lost. The upload's deadline is short (the sender
  batches for at most ``rollout.scoring_linger_s``); once the batch is sent (``scoring_sent``) it
  moves ``dispatch_ttl_s`` ahead. A deadline that passes while the stage's broker queue still
  holds messages moves ``dispatch_ttl_s`` ahead instead, nothing sent: the message may be
  waiting there, and a copy would only join the back of the same queue. So a message only
  waiting (behind a backlog, or while an outage of Redis stalled every worker) is not copied,
  and a lost one goes out again once its queue is empty. Each re-send of an unclaimed
  trajectory doubles the next wait (up to 32x); every copy beyond the first is a no-op at the
  claim. So nothing waiting lives only in a process's memory or only in the broker.
- Registering a run's trajectories records the run's marker (``shared.state.run_marker``) in the
  same Lua call, so Redis never holds a run's trajectories without its marker.
- Hand-off to the trainer is atomic with the state change: ``mark_scored`` and ``fail`` append
  the TrainerEvent to the run's stream in the same Lua call. An event is never lost or doubled.

Its parts: ``stages`` (the states and the lease stages), ``reads`` (``LedgerReads``: what a
reader may ask, never a write) and ``transitions`` (``Ledger``: the reads, plus every write, each
one Lua call). The ledger owns its keys as a whole (``shared.names.REDIS_KEY_OWNERS``): no module
outside this package names them.
"""

from shared.state.ledger.reads import LedgerReads
from shared.state.ledger.stages import (LEASE_STAGES, ROLLOUT, SCORING, STATES, UNFINISHED, LeaseStage,
                                        TransitionResult)
from shared.state.ledger.transitions import DEFAULT_DISPATCH_TTL_S, Ledger, redis_for

__all__ = ["DEFAULT_DISPATCH_TTL_S", "LEASE_STAGES", "ROLLOUT", "SCORING", "STATES", "UNFINISHED", "LeaseStage",
           "Ledger", "LedgerReads", "TransitionResult", "redis_for"]
