"""Lua scripts run many to a round trip.

A batch of script calls goes out as one pipeline of EVALSHAs, without redis-py's pipeline
pre-flight (SCRIPT EXISTS / SCRIPT LOAD, one more round trip, and no help anyway: a Redis
restarted after it, or a connection that dropped and was retried on the restarted server,
still answers NoScriptError, because the script cache does not survive a restart even when
the data does).

Invariant: a call answered NoScriptError did not run, so it is run again, alone, through
``Script.__call__``, which loads the script and runs it. Every other reply, and every other
error, is returned or raised as the pipeline gave it: no call ever runs twice because of this.
A single call is run through ``Script.__call__`` directly.

On a Redis Cluster (``shared.redis_clients``) the pipeline sends each call to the node of its
keys' slot; every call's keys are of one run, so of one slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError


@dataclass(frozen=True)
class ScriptCall:
    script: Script
    keys: list[str]
    args: list[Any]


def run_pipelined(client: redis.Redis, calls: list[ScriptCall]) -> list[Any]:
    """The replies of ``calls``, in order, sent in one pipeline (no MULTI: each call is atomic
    on its own). Raises the first error other than NoScriptError, as a pipeline would."""
    if len(calls) <= 1:
        return [call.script(keys=call.keys, args=call.args) for call in calls]
    pipe = client.pipeline(transaction=False)
    for call in calls:
        # EVALSHA by name: a cluster's pipeline refuses ``evalsha``, and routes this by its keys
        pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    replies = pipe.execute(raise_on_error=False)
    for index, (call, reply) in enumerate(zip(calls, replies)):
        if isinstance(reply, NoScriptError):
            replies[index] = call.script(keys=call.keys, args=call.args)
    first_error = next((reply for reply in replies if isinstance(reply, Exception)), None)
    if first_error is not None:
        raise first_error
    return replies
