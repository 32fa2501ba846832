"""``agent_coding``: any agent that takes an OpenAI base URL works on a coding task in the sandbox.

The coding environment (workspace, image, hidden-test verifier) with the tool loop handed to an
agent: ``run_agent`` runs ``agent_command`` in the trajectory's sandbox with

- ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE``: ``http://127.0.0.1:<agent_port>/v1``, a forwarder on
  the container's loopback to the trajectory's proxy socket (``agents.proxy.forward``);
- ``OPENAI_API_KEY``: the trajectory's proxy session key; ``OPENAI_MODEL``: the served model;
- ``AGENT_TASK_FILE``: the problem statement, also in the workspace's parent as ``task.md``;
- ``AGENT_TIMEOUT_S``: ``agent_timeout_s``, so an agent can end cleanly before it is killed;
- ``AGENT_ARTIFACTS_DIR``: ``agent_artifacts_dir``, when set: the files the agent leaves there
  are read back after it ends (``agent_artifacts.collect``) and kept with the trajectory.

The model calls the agent makes are the trajectory (``agents.episode``); the reward is the
hidden tests' verdict on the final workspace, as for ``coding``.

Invariants:
- The sandbox keeps ``network_mode=none``: the agent's only way out is its own session's socket,
  mounted read-only; the verifier's sandbox gets no socket.
- The agent runs as the sandbox's non-root user, under the sandbox's limits, in a process group
  of its own. It is stopped at ``agent_timeout_s`` (the episode then ends ``timeout`` and is
  still graded), and as soon as its session's budget is used up or its inference server is out
  past ``outage.limit_s`` (the proxy's ``stop`` file appears in the mounted directory): SIGTERM
  to the group, SIGKILL 2 s later.
- The image must have ``python3`` (the forwarder is a standard-library script).
- Artifacts are read after the agent has ended or been stopped, each file bounded by
  ``agent_artifact_bytes``; reading them never fails the episode.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from services.rollout_worker.agents import artifacts as agent_artifacts
from services.rollout_worker.agents.artifacts import AgentArtifacts
from services.rollout_worker.agents.proxy import forward
from services.rollout_worker.environments.coding.config import CodingConfig
from services.rollout_worker.environments.coding.env import CodingEnv
from services.rollout_worker.sandbox import SandboxSpec
from services.rollout_worker.agents.proxy.server import STOP_FILE
from services.rollout_worker.sandbox.protocol import AGENT_DIR, AGENT_SOCKET
from shared.environments import AgentDrivenEnvironment, EnvironmentError_
from shared.required import required

FORWARDER_PATH = "/tmp/.conveyor-forward.py"
TASK_PATH = "/tmp/task.md"


class AgentCodingConfig(CodingConfig):
    agent_command: str = Field(min_length=1)  # a shell command line, run in the workspace
    agent_timeout_s: float = Field(600.0, gt=0)
    agent_port: int = Field(4000, ge=1024, le=65535)  # the forwarder's port on the container's loopback
    agent_env: dict[str, str] = Field(default_factory=dict)  # more environment for the agent
    agent_output_bytes: int = Field(16384, gt=0)  # the agent's output kept in env_info
    agent_artifacts_dir: str | None = None  # absolute, in the sandbox (e.g. under /tmp): kept files
    agent_artifact_files: int = Field(16, gt=0)
    agent_artifact_bytes: int = Field(4 << 20, gt=0)  # per file; a larger one is skipped


@dataclass(frozen=True)
class AgentEndpoint:
    """What the episode runner gives the environment before ``reset``: the trajectory's session."""

    socket_dir: Path  # holds proxy.sock, and nothing else
    key: str
    model: str


@dataclass(frozen=True)
class AgentRun:
    exit_code: int | None
    timed_out: bool
    duration_s: float
    output: str  # the tail, at most agent_output_bytes
    artifacts: AgentArtifacts = field(default_factory=AgentArtifacts)


class AgentCodingEnv(CodingEnv, AgentDrivenEnvironment):
    name = "agent_coding"
    Config = AgentCodingConfig
    config: AgentCodingConfig

    def __init__(self, env_config: dict[str, Any] | AgentCodingConfig | None = None):
        super().__init__(env_config)
        self.endpoint: AgentEndpoint | None = None
        self._mount_agent = False

    def attach_agent(self, endpoint: AgentEndpoint) -> None:
        self.endpoint = endpoint

    def _spec(self, *, command_s: float, episode_s: float) -> SandboxSpec:
        spec = super()._spec(command_s=command_s, episode_s=episode_s)
        if not self._mount_agent:
            return spec  # the verifier's sandbox: no way out
        endpoint = required(self.endpoint, "the agent's proxy session (attach_agent)")
        return spec.model_copy(update={"agent_socket_dir": str(endpoint.socket_dir)})

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        if self.endpoint is None:
            raise EnvironmentError_("agent_coding needs its proxy session (attach_agent) before reset")
        self._mount_agent = True
        try:
            return await super().reset(task_data, seed)
        finally:
            self._mount_agent = False

    async def run_agent(self) -> AgentRun:
        """Start the forwarder and the agent; return when the agent exits or is stopped."""
        cfg, sandbox = self.config, self._agent_sandbox()
        endpoint = required(self.endpoint, "the agent's proxy session (attach_agent)")
        await sandbox.write_file(FORWARDER_PATH, Path(forward.__file__).read_text())
        await sandbox.write_file(TASK_PATH, required(self.task, "the task (reset sets it)").problem_statement)
        url = f"http://127.0.0.1:{cfg.agent_port}/v1"
        env = {"OPENAI_BASE_URL": url, "OPENAI_API_BASE": url, "OPENAI_API_KEY": endpoint.key,
               "OPENAI_MODEL": endpoint.model, "AGENT_TASK_FILE": TASK_PATH, "AGENT_TIMEOUT_S": f"{cfg.agent_timeout_s:g}",
               **({"AGENT_ARTIFACTS_DIR": cfg.agent_artifacts_dir} if cfg.agent_artifacts_dir else {}), **cfg.agent_env}
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        stop = f"{AGENT_DIR}/{STOP_FILE}"
        script = (
            f"python3 {FORWARDER_PATH} {cfg.agent_port} {AGENT_SOCKET} > /tmp/.forward.log 2>&1 & fwd=$!\n"
            "for _ in $(seq 1 100); do grep -q ready /tmp/.forward.log 2>/dev/null && break; sleep 0.05; done\n"
            f"setsid env {exports} sh -c {shlex.quote(cfg.agent_command)} & agent=$!\n"
            "while kill -0 $agent 2>/dev/null; do\n"
            f"  if [ -e {stop} ]; then\n"
            f"    echo \"[conveyor] stopping the agent ($(cat {stop})): its budget is used up or its inference server is out\"\n"
            "    kill -TERM -$agent 2>/dev/null; sleep 2; kill -KILL -$agent 2>/dev/null; break\n"
            "  fi\n"
            "  sleep 0.2\n"
            "done\n"
            "wait $agent; code=$?\n"
            "kill $fwd 2>/dev/null; exit $code\n"
        )
        result = await sandbox.exec(script, timeout_s=cfg.agent_timeout_s, max_output_bytes=cfg.agent_output_bytes)
        found = AgentArtifacts()
        if cfg.agent_artifacts_dir:
            found = await agent_artifacts.collect(sandbox, cfg.agent_artifacts_dir, cfg.agent_artifact_files,
                                                  cfg.agent_artifact_bytes)
        return AgentRun(result.exit_code, result.timed_out, result.duration_s, result.output, found)
