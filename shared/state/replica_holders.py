"""Which run's weight follower holds each vLLM replica: the one owner of ``RedisKeys.replica_holders``
(a hash: replica URL -> JSON ``{run_id: {"trains": bool, "model": str, "until": unix s}}``).

A replica serves one policy at a time, and a run's weight follower reloads it (its base weights at
the run's start, then each of its checkpoints). Two runs on one replica where one trains would
each overwrite the other's policy, so a follower claims its replicas before it touches them.

Invariants:
- ``claim`` is one Lua call over every replica of the follower: either it holds them all, or it
  holds none it did not hold before and learns the first refusal (``Refusal``), whatever the order
  in which the followers of two runs start.
- Two runs share a replica only when neither trains and both serve the same base model (two
  assemble-mode runs read one policy, never change it). Any other pair is refused: a run that
  trains is alone on its replicas. A run's own claim (a restarted follower) is always taken.
- A claim is a lease: it counts until ``until`` (``ttl_s`` after the last claim or renewal), and
  a holder past it holds nothing (its follower died). ``ReplicaHold`` renews it every
  ``ttl_s / 3`` from a heartbeat thread (``shared.state.leases.loop_thread``); a renewal that is
  refused (the lease ran out and another run took a replica) marks the hold ``lost``.
- A ``dry`` claim applies the same rule and writes nothing: what a claim made now would get
  (``conveyor run submit`` asks it to choose a run's inference server; the follower's claim decides).
- ``release`` (the follower's clean exit, refused or not) removes only its own run's claim, so a
  stopped or finished run blocks no other run once its follower exits, or ``ttl_s`` after it died.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from shared.names import RedisKeys
from shared.state.leases import loop_thread

log = logging.getLogger(__name__)

HOLD_TTL_S = 30.0

# KEYS: the holders hash ; ARGV: run id, trains ("1"/"0"), base model, now, until, dry ("1": write
# nothing), then the replica URLs -> {} once every replica is held by the run (or would be, dry),
# else {replica, holder run id, its JSON} of the first refusal
_CLAIM = """
local holders_key = KEYS[1]
local run_id, trains, model, now, until_s, dry = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local claimed = {}
for i = 7, #ARGV do
  local replica = ARGV[i]
  local raw = redis.call('HGET', holders_key, replica)
  local holders = raw and cjson.decode(raw) or {}
  local live = {}
  for holder, held in pairs(holders) do
    if tonumber(held['until']) > tonumber(now) and holder ~= run_id then
      if trains == '1' or held['trains'] or held['model'] ~= model then
        return {replica, holder, cjson.encode(held)}
      end
      live[holder] = held
    end
  end
  live[run_id] = {trains = (trains == '1'), model = model, ['until'] = tonumber(until_s)}
  claimed[replica] = cjson.encode(live)
end
if dry == '1' then return {} end
for replica, encoded in pairs(claimed) do redis.call('HSET', holders_key, replica, encoded) end
return {}
"""

# KEYS: the holders hash ; ARGV: run id, then the replica URLs -> how many claims of the run were removed
_RELEASE = """
local holders_key = KEYS[1]
local run_id = ARGV[1]
local removed = 0
for i = 2, #ARGV do
  local replica = ARGV[i]
  local raw = redis.call('HGET', holders_key, replica)
  local holders = raw and cjson.decode(raw) or {}
  if holders[run_id] then
    holders[run_id] = nil
    removed = removed + 1
    if next(holders) == nil then redis.call('HDEL', holders_key, replica)
    else redis.call('HSET', holders_key, replica, cjson.encode(holders)) end
  end
end
return removed
"""


@dataclass(frozen=True)
class Holder:
    """A run's claim on a replica."""

    run_id: str
    trains: bool
    model: str
    until: float  # unix seconds


@dataclass(frozen=True)
class Refusal:
    """Why a run may not take a replica: another run's live claim on it."""

    replica: str
    claimant: Holder
    holder: Holder

    def why(self) -> str:
        if self.holder.trains:
            return f"run {self.holder.run_id} trains on it (a replica serves one policy; its trained weights would be replaced)"
        if self.claimant.trains:
            return (f"run {self.claimant.run_id} trains, and run {self.holder.run_id} serves its policy on it (each run's "
                    "weight syncs would replace the other's)")
        return (f"run {self.holder.run_id} serves another base model on it ({self.holder.model}, not "
                f"{self.claimant.model})")


class ReplicaHolders:
    def __init__(self, client: Any):
        self.redis = client
        self.key = RedisKeys.replica_holders
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)

    def claim(self, replicas: list[str], run_id: str, trains: bool, model: str, ttl_s: float = HOLD_TTL_S,
              dry: bool = False) -> Refusal | None:
        """Hold every replica for ``run_id`` until ``ttl_s`` from now, or none new; the refusal if
        refused. ``dry``: only the answer, nothing held (a claim made now would be refused, or not)."""
        now = time.time()
        claimant = Holder(run_id, trains, model, now + ttl_s)
        found = self._claim(keys=[self.key], args=[run_id, int(trains), model, now, now + ttl_s, int(dry), *replicas])
        if not found:
            return None
        replica, holder_id, held = found
        fields = json.loads(held)
        return Refusal(replica, claimant, Holder(holder_id, bool(fields["trains"]), fields["model"], float(fields["until"])))

    def release(self, replicas: list[str], run_id: str) -> int:
        """Drop ``run_id``'s claims on ``replicas``; returns how many it had."""
        return int(self._release(keys=[self.key], args=[run_id, *replicas]))

    def holders(self, replica: str) -> list[Holder]:
        """The live claims on ``replica``."""
        raw = self.redis.hget(self.key, replica)
        now = time.time()
        held = json.loads(raw) if raw else {}
        return [Holder(run_id, bool(h["trains"]), h["model"], float(h["until"])) for run_id, h in held.items()
                if float(h["until"]) > now]


class ReplicaHold:
    """A follower's claim on its replicas, renewed from a heartbeat thread until ``release``."""

    def __init__(self, holders: ReplicaHolders, replicas: list[str], run_id: str, trains: bool, model: str,
                 ttl_s: float = HOLD_TTL_S):
        self.holders, self.replicas, self.run_id, self.trains, self.model = holders, replicas, run_id, trains, model
        self.ttl_s = ttl_s
        self.lost: Refusal | None = None
        self._stop: threading.Event | None = None
        self._lock = threading.Lock()  # a renewal in flight never re-takes what release gave back

    def take(self) -> Refusal | None:
        """Claim the replicas and keep the claim renewed; the refusal (nothing held) if refused, or
        the one that made a renewal lose them. Once held, only the heartbeat calls Redis."""
        if self.lost is not None or self._stop is not None:
            return self.lost
        refusal = self.holders.claim(self.replicas, self.run_id, self.trains, self.model, self.ttl_s)
        if refusal is None:
            self._stop = threading.Event()
            loop_thread(f"replica-hold-{self.run_id}", self.ttl_s / 3, self.renew, self._stop)
        return refusal

    def renew(self) -> None:
        with self._lock:
            if self._stop is None:
                return
            refusal = self.holders.claim(self.replicas, self.run_id, self.trains, self.model, self.ttl_s)
        if refusal is not None and self.lost is None:
            log.error("run %s lost its hold on replica %s: %s", self.run_id, refusal.replica, refusal.why())
        self.lost = self.lost or refusal

    def release(self) -> None:
        with self._lock:
            if self._stop is not None:
                self._stop.set()
                self._stop = None
            self.holders.release(self.replicas, self.run_id)
