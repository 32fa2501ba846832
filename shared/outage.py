"""Riding out an outage of a dependency (Redis, the S3 server): wait with bounded exponential
backoff, say what is awaited, and give up only past ``outage.limit_s``.

Invariants:
- A call that fails with a transient error of its dependency (connection refused or reset, a
  timeout, Redis loading its data, a 5xx from S3) is retried, the wait doubling from 0.1 s up
  to ``outage.backoff_max_s``, until the dependency has been down for ``outage.limit_s``.
  An outage shorter than the limit never makes the call fail.
- An outage belongs to a dependency, per process: it starts at the first failure any thread
  saw since the last success, so the limit bounds the outage, not each call. The process logs
  one warning when the outage starts, one every ``outage.log_every_s`` while it lasts and one
  when the dependency is back, however many threads wait.
- A dependency that answers some calls and fails others (Redis loading its dataset answers
  PING and INFO, and ``LOADING`` to the rest) is not back: a failure within ``confirm_s`` of a
  success carries on the same outage, from its start, without a new line. The "back" line is
  written once the dependency has stayed up for ``confirm_s`` (``outage.backoff_max_s`` + 1 s).
- Past the limit the call raises ``OutageTooLong``: one line naming the dependency, how long
  it has been down and the setting. A service exits on it with code 2; a Celery worker process
  does so through ``exit_on_limit``, because a task cannot raise out of its worker.
- An error that is not transient (a refused password, a missing object, a bug) is raised at
  once.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, TypeVar

import redis
from redis.exceptions import AuthenticationError
from redis.retry import Retry
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential

from shared.settings import OutageSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class OutageTooLong(RuntimeError):
    """A dependency stayed down for longer than ``outage.limit_s``."""


_exit_on_limit = False


def exit_on_limit() -> None:
    """From now on, a call past the limit ends this process: its one line on stderr, exit
    code 2. For Celery worker processes, whose tasks cannot raise out of the worker."""
    global _exit_on_limit
    _exit_on_limit = True


class Dependency:
    """One dependency of this process (``Dependency.named``): its outage, if any, shared by
    every thread that calls it."""

    _known: dict[str, "Dependency"] = {}
    _known_lock = threading.Lock()

    def __init__(self, name: str, settings: OutageSettings):
        self.name, self.settings = name, settings
        self.down_since: float | None = None  # monotonic
        self.recoveries = 0  # outages that ended; a consumer can tell it reconnected
        self.recovered_at: float | None = None  # monotonic, the end of the last outage
        self._last_logged = 0.0
        self._lock = threading.Lock()
        self._unconfirmed: tuple[int, float] | None = None  # (back token, outage start) until confirmed
        self._back_token = 0

    @property
    def confirm_s(self) -> float:
        """How long the dependency must stay up before its outage is said to be over."""
        return self.settings.backoff_max_s + 1.0

    @classmethod
    def named(cls, name: str, settings: OutageSettings) -> "Dependency":
        with cls._known_lock:
            dependency = cls._known.get(name)
            if dependency is None:
                dependency = cls._known[name] = cls(name, settings)
            dependency.settings = settings
            return dependency

    def call(self, fn: Callable[[], T], transient: Callable[[BaseException], bool],
             on_failure: Callable[[BaseException], object] | None = None) -> T:
        """``fn()``, retried with backoff while it fails with a transient error, until the
        outage is older than the limit (then ``OutageTooLong``). The first attempt runs
        alone: the retry loop is built only once it fails (every Redis command passes here
        twice, its connect and itself), and replays that failure as its own first attempt."""
        try:
            result = fn()
        except Exception as exc:
            if not transient(exc):
                raise
            first_failure: list[BaseException] = [exc]
        else:
            self._succeeded()
            return result

        def attempt() -> T:
            if first_failure:
                raise first_failure.pop()
            return fn()

        return self._retry(attempt, transient, on_failure)

    def _retry(self, fn: Callable[[], T], transient: Callable[[BaseException], bool],
               on_failure: Callable[[BaseException], object] | None) -> T:
        """``call``'s retry loop, from ``fn``'s first attempt on."""

        def failed(state: RetryCallState) -> None:
            exc = _attempt_failure(state)
            if on_failure is not None:
                on_failure(exc)
            self._failed(exc)

        def give_up(state: RetryCallState) -> T:
            exc = _attempt_failure(state)
            line = (f"{self.name} has been unreachable for {self.down_for_s():.0f}s, longer than "
                    f"outage.limit_s ({self.settings.limit_s:g}s): {_brief(exc)}")
            log.error("%s", line)
            if _exit_on_limit:
                sys.stderr.write(f"error: {line}\n")
                sys.stderr.flush()
                os._exit(2)
            raise OutageTooLong(line) from exc

        retrying = Retrying(
            retry=retry_if_exception(transient),
            wait=wait_exponential(multiplier=0.1, max=self.settings.backoff_max_s),
            after=failed,
            stop=lambda _state: self.down_for_s() >= self.settings.limit_s,
            retry_error_callback=give_up,
            reraise=True,
        )
        result = retrying(fn)
        self._succeeded()
        return result

    def down_for_s(self) -> float:
        since = self.down_since
        return 0.0 if since is None else time.monotonic() - since

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            if self.down_since is None and self._unconfirmed is not None:
                _token, start = self._unconfirmed  # up for less than confirm_s: the same outage goes on
                self.down_since, self._unconfirmed = start, None
                return
            if self.down_since is None:
                self.down_since = self._last_logged = now
                log.warning("%s is unreachable (%s): waiting for it, retrying with backoff up to %gs, for at most "
                            "%gs (outage.limit_s)", self.name, _brief(exc), self.settings.backoff_max_s, self.settings.limit_s)
            elif now - self._last_logged >= self.settings.log_every_s:
                self._last_logged = now
                log.warning("still waiting for %s: down for %.0fs (%s)", self.name, now - self.down_since, _brief(exc))

    def _succeeded(self) -> None:
        if self.down_since is None:  # the common case: no lock on the hot path
            return
        with self._lock:
            if self.down_since is not None:
                self._back_token += 1
                self._unconfirmed = (self._back_token, self.down_since)
                self.down_since = None
                self.recoveries += 1
                self.recovered_at = time.monotonic()
                timer = threading.Timer(self.confirm_s, self._confirm_back, args=(self._back_token,))
                timer.daemon = True
                timer.start()

    def _confirm_back(self, token: int | None = None) -> None:
        """Up for ``confirm_s`` since the success that ended the outage (or the process exits
        first: ``token`` None): say so, once."""
        with self._lock:
            if self._unconfirmed is None or token not in (None, self._unconfirmed[0]):
                return  # it failed again meanwhile: the outage went on
            _token, start = self._unconfirmed
            self._unconfirmed = None
            ended = self.recovered_at or time.monotonic()
        log.warning("%s is back after %.1fs", self.name, ended - start)


@atexit.register
def say_back_now() -> None:
    """A process that ends within ``confirm_s`` of an outage's end (intake, a one-shot command)
    still says the dependency came back; a command that fails calls this before its error line,
    so that the error stays the last line it writes."""
    for dependency in list(Dependency._known.values()):
        dependency._confirm_back()


def _attempt_failure(state: RetryCallState) -> BaseException:
    """The exception of the attempt ``state`` reports on: tenacity calls ``after`` and
    ``retry_error_callback`` only after an attempt, and here only after a failed one (the retry
    condition is an exception's)."""
    exc = state.outcome.exception() if state.outcome is not None else None
    if exc is None:
        raise RuntimeError(f"tenacity reported attempt {state.attempt_number} with no exception")
    return exc


def _brief(exc: BaseException | None) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


# --- Redis --------------------------------------------------------------------------------------

def redact_url(url: str) -> str:
    """``redis://:secret@host:6379/0`` -> ``redis://:***@host:6379/0``."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{hostpart}"


def redis_transient(exc: BaseException) -> bool:
    """Connection lost or refused, a timeout, Redis loading its data; not a refused password."""
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)) and not isinstance(
        exc, AuthenticationError
    )


class OutageRetry(Retry):
    """redis-py's retry policy, handing every failed command (and reconnect) to the
    dependency's outage: the client waits out an outage instead of raising."""

    def __init__(self, dependency: Dependency):
        super().__init__(backoff=None, retries=1_000_000_000)  # type: ignore[arg-type]  # bounded by time instead
        self.dependency = dependency

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any], is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> T:
        failures = 0

        def on_failure(exc: BaseException) -> None:
            nonlocal failures
            failures += 1
            fail(exc, failures) if with_failure_count else fail(exc)  # closes the broken connection

        def transient(exc: BaseException) -> bool:
            return redis_transient(exc) and (is_retryable is None or is_retryable(exc))  # type: ignore[arg-type]

        return self.dependency.call(do, transient, on_failure)

    def __deepcopy__(self, memo: dict) -> "OutageRetry":
        return self  # redis-py copies the policy per connection; the outage is the process's

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__


def redis_client(url: str, outage: OutageSettings, decode_responses: bool = True) -> redis.Redis:
    """A client whose every command waits out an outage of this Redis (up to the limit). The
    socket timeout (30 s) turns a frozen server into an outage too; blocking reads must
    block for less."""
    dependency = Dependency.named(f"Redis at {redact_url(url)}", outage)
    return redis.Redis.from_url(
        url, decode_responses=decode_responses, retry=OutageRetry(dependency),
        socket_connect_timeout=5, socket_timeout=30, socket_keepalive=True, health_check_interval=15,
    )


def _dependency_of(client: redis.Redis) -> Dependency | None:
    get_retry = getattr(client, "get_retry", None)  # a cluster client has none: it does not wait out outages
    retry = get_retry() if get_retry is not None else None
    return retry.dependency if isinstance(retry, OutageRetry) else None


def recoveries(client: redis.Redis) -> int:
    """How many outages of this client's Redis ended so far in this process (0 for a client
    that does not wait them out)."""
    dependency = _dependency_of(client)
    return dependency.recoveries if dependency else 0


def seconds_since_recovery(client: redis.Redis) -> float:
    """Since this process last saw this client's Redis come back (inf: never saw it down)."""
    dependency = _dependency_of(client)
    if dependency is None or dependency.recovered_at is None:
        return float("inf")
    return time.monotonic() - dependency.recovered_at
