"""Environments that need the main thread run there, without the user saying so.

Episodes run on the worker's event-loop thread (``services.rollout_worker.event_loop``), and
Python lets only a process's main thread set a signal handler: a package that times its work
with ``signal.signal``/``signal.alarm`` (verifiers, math graders) raises
``ValueError: signal only works in main thread`` there. Making such calls harmless would
silently drop the package's timeouts, so the environment is moved instead.

``on_main_thread(env)`` wraps the worker's environment:
- Its calls run in place until one raises that error. The environment's class is then
  remembered (for this worker process) as needing the main thread, and the episode moves to a
  host process (``hosted.POOL``) whose main thread runs the environment's coroutines in an
  event loop of its own (``EnvironmentDriver``); a ``HostedEnv`` whose driver ran on a thread
  moves to ``isolation: process``. The new instance is reset with the same task data and seed
  and given the episode's actions so far again (same seed and actions, same task: the group
  seed invariant of ``shared.environments.protocol``), then the failed call is made again.
- Later episodes of that class start in a host process.
- An environment that still fails on the main thread fails as before: the move happens once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from services.rollout_worker.environments.hosted import HostedConfig, HostedEnv
from shared.environments import AgentAction, Environment, StepResult, VerifyResult
from shared.import_path import import_callable

log = logging.getLogger(__name__)

SIGNAL_ERROR = "signal only works in main thread"
_needs_main_thread: set[type[Environment]] = set()
_lock = threading.Lock()


def needs_main_thread(exc: BaseException) -> bool:
    """Whether a call failed for running off the main thread (raised as is, or named by a host)."""
    return SIGNAL_ERROR in str(exc)


def on_main_thread(env: Environment) -> Environment:
    """The episode's environment: ``env`` itself, moved to a host's main thread when it needs one."""
    with _lock:
        known = type(env) in _needs_main_thread
    return MainThreadFallback(env, moved=known)


def _main_thread_twin(env: Environment) -> Environment:
    """A fresh ``env`` whose calls run on a host process's main thread."""
    if isinstance(env, HostedEnv):
        return type(env)(env.config.model_copy(update={"isolation": "process"}))
    return HostedEnvironment(type(env), env.config.model_dump(exclude_unset=True))


class MainThreadFallback(Environment):
    """``env`` in place until it needs the main thread, then its twin on a host's main thread."""

    def __init__(self, env: Environment, moved: bool = False):
        self.inner = _main_thread_twin(env) if moved else env
        self.moved = moved
        self.name = env.name
        self.config, self.env_config = env.config, env.env_config
        self._role = env.role_of_observations()
        self._opening: tuple[dict[str, Any], int] | None = None
        self._actions: list[AgentAction] = []

    def role_of_observations(self) -> str:
        return self._role

    def seed_tool_latency(self, seed: int | str) -> None:
        self.inner.seed_tool_latency(seed)  # the wrapped environment sleeps, so it draws

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self._opening, self._actions = (task_data, seed), []
        return await self._call("reset", task_data, seed)

    async def step(self, action: AgentAction) -> StepResult:
        result = await self._call("step", action)
        self._actions.append(action)
        return result

    async def verify(self) -> VerifyResult:
        return await self._call("verify")

    async def close(self) -> None:
        await self.inner.close()

    async def _call(self, op: str, *args: Any) -> Any:
        try:
            return await getattr(self.inner, op)(*args)
        except Exception as exc:
            if self.moved or not needs_main_thread(exc):
                raise
        await self._move(replay=op != "reset")
        return await getattr(self.inner, op)(*args)

    async def _move(self, replay: bool) -> None:
        old, self.moved = self.inner, True
        with _lock:
            _needs_main_thread.add(type(old))
        log.warning("environment %r needs the main thread (%s): its episodes run in a host process from now on",
                    self.name, SIGNAL_ERROR)
        try:
            await old.close()
        except Exception:  # the instance that failed may not close cleanly; its twin takes over
            log.debug("closing %r after its move failed", self.name, exc_info=True)
        self.inner = _main_thread_twin(old)
        if replay and self._opening is not None:
            await self.inner.reset(*self._opening)
            for action in self._actions:
                await self.inner.step(action)


class HostedEnvironment(HostedEnv):
    """Any environment, run whole in a host process: its coroutines on that process's main thread."""

    name = "on_main_thread"
    Config = HostedConfig
    driver_path = "services.rollout_worker.environments.main_thread:EnvironmentDriver"

    def __init__(self, env_type: type[Environment], env_config: dict[str, Any]):
        super().__init__(HostedConfig())
        self.target = {"env_path": f"{env_type.__module__}:{env_type.__qualname__}", "env_config": env_config}

    def driver_options(self) -> dict[str, Any]:
        return dict(self.target)

    async def step(self, action: AgentAction) -> StepResult:
        return await self._call("step", (action,))

    async def verify(self) -> VerifyResult:
        return await self._call("verify", ())


class EnvironmentDriver:
    """In the host process: the environment and an event loop of its own, on the main thread."""

    def __init__(self, env_path: str, env_config: dict[str, Any]):
        self.loop = asyncio.new_event_loop()
        self.env: Environment = import_callable(env_path, "environment")(env_config)

    def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        return self.loop.run_until_complete(self.env.reset(task_data, seed))

    def step(self, action: AgentAction) -> StepResult:
        return self.loop.run_until_complete(self.env.step(action))

    def verify(self) -> VerifyResult:
        return self.loop.run_until_complete(self.env.verify())

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.env.close())
        finally:
            self.loop.close()
