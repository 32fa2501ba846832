"""An episode driven by an agent of its own (an ``AgentDrivenEnvironment``, declared in
``shared.environments``): the agent makes the model calls through the recording proxy, and
they are the trajectory.

    open a proxy session (with its socket) -> attach it -> reset (sandbox, socket mounted)
    -> run the agent -> close the session -> verify (the reward) -> close

Invariants:
- The trajectory's turns are exactly the calls the proxy recorded for this trajectory's session,
  in order, segments included (``agents.proxy.recording``); nothing else is sampled.
- The session calls ``server`` (the run's own inference server, ``inference_targets``: the run's
  client and tokenizer) when given one, else the proxy's (the worker's own), and the agent is told
  that server's served name; every turn's ids and logprobs are that server's, and its policy
  version is the run's (``policy_version``).
- The session is closed before ``verify``: nothing the agent left running can add a turn after
  the episode ended. It is closed, and the environment too, whatever happened.
- A call that found the server out past ``outage.limit_s`` stops the agent (the proxy's ``stop``)
  and the episode raises that ``InferenceOutage`` once its environment is closed: the runner fails
  the trajectory as ``inference_outage``, as it fails a token-loop episode's.
- Stop reason: ``timeout`` when the agent was stopped at its time limit, the recording's own
  (``max_tokens``, ``context_exhausted``, ``max_turns``) when a call was refused for its budget,
  ``done`` otherwise. An environment that raises is ``env_error``, as in the turn loop.
- ``env_info`` keeps the agent's outcome under ``agent``: exit code, duration, time from the
  episode start to the first model call, calls refused, and the tail of its output; and, when
  the environment collected agent artifacts, ``metrics`` (the agent's ``metrics.json``),
  ``artifacts`` (name -> object-store key; uploaded only when a ``store`` is given) and
  ``artifacts_skipped`` (name -> why).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from services.rollout_worker.agents import artifacts as agent_artifacts
from services.rollout_worker.agents.proxy import AgentProxy, RecordingLimits
from services.rollout_worker.environments.agent_coding import AgentEndpoint, AgentRun
from services.rollout_worker.episode.loop import EnvironmentFailure, EpisodeLimits, environment_call
from services.rollout_worker.inference_targets import Served
from shared.environments import AgentDrivenEnvironment
from shared.required import required
from shared.schemas import EpisodeTimings, RolloutRequest, StopReason, Trajectory
from shared.storage import ObjectStore


async def run_agent_episode(request: RolloutRequest, env: AgentDrivenEnvironment, proxy: AgentProxy, limits: EpisodeLimits,
                            policy_version: Callable[[], int], attempt: int = 1, worker: str = "",
                            store: ObjectStore | None = None, server: Served | None = None) -> Trajectory:
    """``server``: the inference server the agent's calls go to (``RunServers.for_request``); None: the proxy's."""
    started = time.time()
    env.bind_trajectory(run_id=request.run_id, group_id=request.group_id, trajectory_id=request.trajectory_id)
    recording_limits = RecordingLimits(limits.max_tokens_per_turn, limits.max_episode_tokens, limits.max_model_len, limits.max_turns)
    session = await proxy.open_session(request.trajectory_id, recording_limits, policy_version, with_socket=True, server=server)
    stop, error, env_reward, env_info, prompt_messages = StopReason.done, None, None, {}, []
    agent_info: dict = {}
    try:
        socket_path = required(session.socket_path, "the session's socket (opened with_socket)")
        env.attach_agent(AgentEndpoint(socket_path.parent, session.key, session.model_name))
        with environment_call("reset"):
            prompt_messages = [{"role": str(m.get("role", "")), "content": str(m.get("content", ""))}
                               for m in await env.reset(request.task.task_data, request.task_seed)]
        with environment_call("agent"):
            run: AgentRun = await env.run_agent()
        await proxy.close_session(session)
        agent_info = {"exit_code": run.exit_code, "timed_out": run.timed_out, "duration_s": round(run.duration_s, 3),
                      "first_call_s": None if session.first_call_at is None else round(session.first_call_at - started, 3),
                      "calls": len(session.turns), "calls_refused": session.refused, "output": run.output}
        found = run.artifacts
        if found.files or found.skipped:
            keys = {} if store is None else await asyncio.to_thread(
                agent_artifacts.upload, store, request.run_id, request.trajectory_id, found.files)
            agent_info.update(metrics=found.metrics(), artifacts=keys, artifacts_skipped=found.skipped)
        if run.timed_out:
            stop = StopReason.timeout
        elif session.recording.exhausted is not None:
            stop = session.recording.exhausted
        with environment_call("verify"):
            verdict = await env.verify()
        env_reward, env_info = verdict.reward, {**verdict.info, "agent": agent_info}
    except EnvironmentFailure as exc:
        stop, error = StopReason.env_error, str(exc)
    finally:
        await proxy.close_session(session)
        try:
            await env.close()
        except Exception as exc:  # a failed close must not hide the episode's outcome
            error = error or f"close: {type(exc).__name__}: {exc}"
    if session.outage is not None:
        raise session.outage
    turns = session.turns
    timings = EpisodeTimings(queue_wait_s=max(0.0, started - request.dispatched_at), episode_s=time.time() - started,
                             inference_s=sum(t.timings.inference_s for t in turns), env_s=0.0)
    return Trajectory(request=request, turns=turns, stop_reason=stop, error=error, env_reward=env_reward,
                      env_info=env_info, attempt=attempt, worker=worker, timings=timings, prompt_messages=prompt_messages)
