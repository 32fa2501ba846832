"""The end signals of a run's eval passes: the one owner of ``RedisKeys.eval_ends`` (a hash:
policy version -> ``EvalEnd`` JSON) and ``RedisKeys.eval_stream`` (a stream of the same ends).

Invariants:
- A version ends once: the end is written to the hash only if the version has none yet
  (HSETNX), and appended to the stream in the same Lua call, so two trainers that both evaluate
  a version send one end between them.
"""

from __future__ import annotations

from typing import Any

from shared.names import RedisKeys
from shared.schemas import EvalEnd, parse_message
from shared.state.run_marker import TRAINER_STOPS, RunMarker, run_script

# KEYS: ends, stream[, run marker: required] ; ARGV: version, end JSON -> 1 recorded / 0 ended already /
# -1 the run's marker is required and gone (shared.state.run_marker.LOST)
_END_ONCE = """
local ends, stream, marker = KEYS[1], KEYS[2], KEYS[3]
local version, end_json = ARGV[1], ARGV[2]
if marker and redis.call('EXISTS', marker) == 0 then return -1 end
if redis.call('HSETNX', ends, version, end_json) == 1 then
  redis.call('XADD', stream, '*', 'eval', end_json)
  return 1
end
return 0
"""


class EvalEnds:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.run_id = client, run_id
        self.key = RedisKeys.eval_ends(run_id)
        self._end_once = client.register_script(_END_ONCE)

    def get(self, version: int) -> EvalEnd | None:
        raw = self.redis.hget(self.key, str(version))
        return None if raw is None else parse_message(EvalEnd, raw, f"eval end of version {version}")

    def end_once(self, end: EvalEnd, marker: RunMarker | None = None) -> bool:
        """Record the end of ``end.policy_version``; False if that version had ended already. With
        the run's ``marker`` (the trainer's), never into a Redis that lost the run."""
        return bool(run_script(marker, self._end_once, [self.key, RedisKeys.eval_stream(self.run_id)],
                               [end.policy_version, end.model_dump_json()], TRAINER_STOPS))

    def all(self) -> list[EvalEnd]:
        """Every ended version's end, by version."""
        return sorted((parse_message(EvalEnd, raw) for raw in self.redis.hgetall(self.key).values()),
                      key=lambda e: e.policy_version)
