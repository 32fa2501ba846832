"""Pipelined Lua calls after Redis lost its script cache (a restart keeps the data, not the
scripts): each call runs exactly once, whatever the cache held (real Redis)."""

import pytest
from redis.exceptions import ResponseError

from shared.state.redis_scripts import ScriptCall, run_pipelined

COUNT_ONCE = "return redis.call('INCR', KEYS[1])"
APPEND_ARG = "redis.call('RPUSH', KEYS[1], ARGV[1]); return redis.call('LLEN', KEYS[1])"


def test_a_batch_after_the_script_cache_was_flushed_runs_each_call_once(redis_client):
    count, append = redis_client.register_script(COUNT_ONCE), redis_client.register_script(APPEND_ARG)
    redis_client.script_load(COUNT_ONCE)
    redis_client.script_flush()  # what a restart does to the cache
    calls = [ScriptCall(count, ["n"], []), ScriptCall(append, ["log"], ["a"]), ScriptCall(count, ["n"], [])]
    assert run_pipelined(redis_client, calls) == [1, 1, 2]
    assert redis_client.get("n") == "2" and redis_client.lrange("log", 0, -1) == ["a"]


def test_with_only_some_scripts_cached_the_cached_calls_are_not_run_again(redis_client):
    count, append = redis_client.register_script(COUNT_ONCE), redis_client.register_script(APPEND_ARG)
    redis_client.script_flush()
    redis_client.script_load(COUNT_ONCE)  # another client loaded one of the two again
    calls = [ScriptCall(count, ["n"], []), ScriptCall(append, ["log"], ["a"]), ScriptCall(append, ["log"], ["b"])]
    assert run_pipelined(redis_client, calls) == [1, 1, 2]
    assert redis_client.get("n") == "1" and redis_client.lrange("log", 0, -1) == ["a", "b"]


def test_an_error_other_than_a_missing_script_is_raised_after_every_call_ran(redis_client):
    count = redis_client.register_script(COUNT_ONCE)
    redis_client.set("text", "not a number")
    with pytest.raises(ResponseError, match="not an integer"):
        run_pipelined(redis_client, [ScriptCall(count, ["text"], []), ScriptCall(count, ["n"], [])])
    assert redis_client.get("n") == "1"

