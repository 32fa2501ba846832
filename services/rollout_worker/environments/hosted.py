"""Synchronous third-party environments, run off the worker's event loop.

A package written for another framework (a gym-style text game, textarena, skyrl-gym) steps
synchronously, and often keeps its random state in the process (``random.seed`` in ``reset``).
``HostedEnv`` adapts such a package without changing it: a small synchronous *driver*
(``SyncDriver``) speaks the package's API, and a *host* runs the driver's calls elsewhere:

- ``isolation: process`` (the default): a host process of its own for the episode, taken from
  a per-worker pool of warm processes (a fresh interpreter, never a fork of the threaded
  worker). The package's global state (``random``, ``numpy.random``, module caches)
  belongs to that one episode: ``random`` and ``numpy.random`` are seeded with the task seed
  before ``reset``, so the same task seed gives the same game whatever ran in the process before.
- ``isolation: thread``: a thread of its own for the episode, for packages that keep their
  state in the environment object. Cheaper; not safe for packages that use global random state.

Invariants:
- The event loop never blocks on a driver call: a process host is awaited through its pipe's
  file descriptor (``loop.add_reader``), a thread host through its own single-thread executor.
  Episodes therefore overlap however long a synchronous ``step`` blocks.
- A driver that raises is an environment error naming the call and the exception; a host
  process that dies or exceeds ``call_timeout_s`` is killed and is an environment error too.
  A host process is returned to the pool only after a clean ``close``.
- Actions reach the driver as text, taken from the reply by ``action_format``: the whole reply
  (``text``), the ``action`` argument of the first Hermes tool call (``hermes_json``), or the
  body of the last ``<action>...</action>`` (``xml``). A reply without one is answered with an
  error observation; the driver is not called.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import multiprocessing.connection
import random
import re
import socket
import subprocess
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal, Protocol

from pydantic import Field

from shared.environments import AgentAction, EnvConfig, Environment, EnvironmentError_, StepResult, VerifyResult
from shared.import_path import import_callable


class SyncDriver(Protocol):
    """What a host runs: built with the environment's driver options, then called in order."""

    def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]: ...  # initial messages

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...  # observation, reward, done, info

    def verify(self) -> tuple[float, dict[str, Any]]: ...

    def close(self) -> None: ...


class HostedConfig(EnvConfig):
    isolation: Literal["process", "thread"] = "process"
    action_format: Literal["text", "hermes_json", "xml"] = "text"
    system_prompt: str | None = None  # put before the package's first observation
    call_timeout_s: float = Field(300.0, gt=0)  # one driver call; longer: the host is killed


# --- actions ------------------------------------------------------------------------------

_XML_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)


def action_text(action: AgentAction, action_format: str) -> tuple[str | None, str | None]:
    """(the action for the driver, or None with the error observation for the agent)."""
    if action_format == "text":
        return action.text, None
    if action_format == "xml":
        found = _XML_ACTION.findall(action.text)
        if not found:
            return None, "Error: no action. Put your action between <action> and </action>."
        return found[-1].strip(), None
    if action.tool_call_error:
        return None, f"Error: {action.tool_call_error}. Try again."
    if not action.tool_calls:
        return None, 'Error: no tool call. Call the "act" tool with {"action": "..."}.'
    value = action.tool_calls[0].arguments.get("action")
    if not isinstance(value, str):
        return None, 'Error: the tool call needs a string argument "action".'
    return value, None


# --- hosts ----------------------------------------------------------------------------------

def _seed_globals(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


class DriverSlot:
    """One episode's driver and the calls the environment makes on it, the same in a host
    process and a host thread. Only a process of its own extends ``sys.path`` with the
    worker's and seeds the global random state: a thread shares the worker's."""

    def __init__(self, own_process: bool):
        self.own_process = own_process
        self.driver: Any = None

    def run(self, op: str, payload: Any) -> Any:
        if op == "make":
            path, options, parent_path = payload
            if self.own_process:
                sys.path.extend(entry for entry in parent_path if entry not in sys.path)  # the worker's imports
            self.driver = import_callable(path, "driver")(**options)
            return None
        if op == "reset":
            task_data, seed = payload
            if self.own_process:
                _seed_globals(seed)
            return self.driver.reset(task_data, seed)
        if op == "close":
            driver, self.driver = self.driver, None
            return driver.close() if driver is not None else None
        return getattr(self.driver, op)(*payload)


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """A host process: builds drivers and runs their calls, one episode at a time."""
    slot = DriverSlot(own_process=True)
    while True:
        try:
            op, payload = conn.recv()
        except EOFError:
            return
        if op == "exit":
            return
        try:
            conn.send(("ok", slot.run(op, payload)))
        except BaseException as exc:  # the package's failure goes back to the episode, named
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()[-4000:]))


class ProcessHost:
    """One host process, borrowed from ``ProcessPool`` for one episode."""

    def __init__(self, process: subprocess.Popen, conn: multiprocessing.connection.Connection):
        self.process, self.conn = process, conn

    async def call(self, op: str, payload: Any, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.conn.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        try:
            self.conn.send((op, payload))
            await asyncio.wait_for(ready, timeout_s)
            reply = self.conn.recv()
        except asyncio.TimeoutError:
            self.kill()
            raise EnvironmentError_(f"{op} took longer than call_timeout_s={timeout_s}s: host process killed") from None
        except (EOFError, OSError) as exc:
            self.kill()
            raise EnvironmentError_(f"{op}: the host process died (exit code {self.process.returncode}): {exc}") from None
        finally:
            loop.remove_reader(fd)
        if reply[0] == "error":
            raise EnvironmentError_(f"{op}: {reply[1]}")
        return reply[1]

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)
        self.conn.close()


class ProcessPool:
    """Warm host processes of this worker process; at most ``max_idle`` wait between episodes.

    A host is a fresh interpreter (``python -m`` this module), not a fork of the threaded
    worker, talking over a socket pair."""

    def __init__(self, max_idle: int = 32):
        self.max_idle = max_idle
        self._idle: list[ProcessHost] = []
        self._lock = threading.Lock()

    def acquire(self) -> ProcessHost:
        with self._lock:
            while self._idle:
                host = self._idle.pop()
                if host.alive():
                    return host
                host.kill()
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                       stdin=subprocess.DEVNULL)
        return ProcessHost(process, multiprocessing.connection.Connection(ours.detach()))

    def release(self, host: ProcessHost) -> None:
        with self._lock:
            if host.alive() and len(self._idle) < self.max_idle:
                self._idle.append(host)
                return
        host.kill()

    def shutdown(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for host in idle:
            host.kill()


POOL = ProcessPool()
atexit.register(POOL.shutdown)


class ThreadHost:
    """The driver in this process, its calls on one thread of the episode's own."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-env")
        self.slot = DriverSlot(own_process=False)

    async def call(self, op: str, payload: Any, timeout_s: float) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self.executor, self.slot.run, op, payload)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise EnvironmentError_(f"{op} took longer than call_timeout_s={timeout_s}s") from None
        except EnvironmentError_:
            raise
        except Exception as exc:
            raise EnvironmentError_(f"{op}: {type(exc).__name__}: {exc}") from exc

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# --- the environment ----------------------------------------------------------------------

class HostedEnv(Environment):
    """An environment whose episode runs in a ``SyncDriver``; subclasses name the driver."""

    Config: ClassVar[type[EnvConfig]] = HostedConfig
    config: HostedConfig
    driver_path: ClassVar[str]

    def driver_options(self) -> dict[str, Any]:
        """Keyword arguments of the driver's constructor (picklable: they cross to the host)."""
        return {}

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self._host: ProcessHost | ThreadHost | None = POOL.acquire() if self.config.isolation == "process" else ThreadHost()
        self._clean = False
        self._return = 0.0
        self._done = False
        await self._call("make", (self.driver_path, self.driver_options(), list(sys.path)))
        messages = list(await self._call("reset", (task_data, seed)))
        if self.config.system_prompt:
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    async def step(self, action: AgentAction) -> StepResult:
        await self.simulate_tool_latency()
        text, error = action_text(action, self.config.action_format)
        if text is None:
            return StepResult(error or "Error: no action.", done=False, info={"invalid": True})
        observation, reward, done, info = await self._call("step", (text,))
        self._return += float(reward)
        self._done = bool(done)
        return StepResult(str(observation), done=bool(done), reward=float(reward), info=dict(info or {}))

    async def verify(self) -> VerifyResult:
        reward, info = await self._call("verify", ())
        return VerifyResult(float(reward), {"episode_return": self._return, "finished": self._done, **dict(info or {})})

    async def close(self) -> None:
        host = getattr(self, "_host", None)
        if host is None:
            return
        self._host = None
        if isinstance(host, ProcessHost) and not host.alive():
            host.kill()  # it died (the episode's error says so): nothing to close
            return
        try:
            await host.call("close", None, self.config.call_timeout_s)
            self._clean = True
        finally:
            if isinstance(host, ThreadHost):
                host.shutdown()
            elif self._clean:
                POOL.release(host)
            else:
                host.kill()

    async def _call(self, op: str, payload: Any) -> Any:
        if self._host is None:
            raise RuntimeError(f"{type(self).__name__}.{op} after close: the environment has no host")
        return await self._host.call(op, payload, self.config.call_timeout_s)


if __name__ == "__main__":  # a host process: python -m services.rollout_worker.environments.hosted FD
    _serve(multiprocessing.connection.Connection(int(sys.argv[1])))
