"""``CodingEnv``: an agent edits a repository in its own sandbox; hidden tests grade the result.

Lifecycle: ``reset`` prepares the workspace (``repo``), picks the image (``images``; with
``snapshot`` a per-repo image holding the workspace and its setup) and provisions the agent's
sandbox; ``step`` runs tool calls there (``tools``); ``verify`` takes the final diff
from the agent's sandbox and grades it in a fresh one (``verifier``); ``close`` tears down.

Invariants:
- Bad model output never raises: malformed, unknown or ill-typed tool calls, missing files,
  failing or timed-out commands are error observations. A sandbox the agent made unusable
  (killed, out of time) ends the episode and scores 0. Only a broken environment raises
  (the daemon, a missing image, a repo or commit that cannot be fetched, a broken test patch).
- The hidden tests never enter the agent's sandbox, and the reward depends only on the agent's
  diff as the verifier applies it (see ``verifier`` and ``grading``).
- Every sandbox this environment provisions carries the trajectory's labels and is torn down by
  ``close`` (which the episode runner calls in ``finally``), or earlier by ``verify``.
- A sandbox that fails to tear down never changes the verdict nor makes ``verify`` raise: the
  failure is logged (and named in the info), and the janitor removes the container after its TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, ClassVar

from shared.environments import (AgentAction, ArtifactWriter, Environment, EnvironmentError_, SandboxedEnvironment,
                                 StepResult, VerifyResult)
from services.rollout_worker.sandbox import (EpisodeTimeout, Limits, Sandbox, SandboxClosed, SandboxFileError,
                                             SandboxLabels, SandboxLost, SandboxSpec, Timeouts, provision_with_retry)
from services.rollout_worker.sandbox.providers import provider_for_environment
from shared.required import required
from shared.schemas import ToolCall
from shared.storage import ObjectStore

from . import grading
from .artifacts import write_artifacts
from .config import CodingConfig
from .images import resolve_image
from .prompts import system_prompt
from .repo import Workspace, prepare_workspace
from .snapshot import build_snapshot, populate_command
from .task import CodingTask, coding_task
from .tools import ToolError, bash_observation, check_call, clip, replace_once
from .verifier import run_hidden_tests

_SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "GIT_TERMINAL_PROMPT": "0", "PAGER": "cat", "GIT_PAGER": "cat",
                "TERM": "dumb", "LANG": "C.UTF-8"}
_STOPPED = (SandboxLost, EpisodeTimeout, SandboxClosed)
log = logging.getLogger(__name__)


class CodingEnv(Environment, SandboxedEnvironment, ArtifactWriter):
    name = "coding"
    Config: ClassVar[type[CodingConfig]] = CodingConfig
    config: CodingConfig

    @classmethod
    def task_from_row(cls, data: dict[str, Any]) -> dict[str, Any]:
        """SWE-bench and swe-agent-13k rows (``task.coding_task``)."""
        return coding_task(data)

    @classmethod
    def check_task(cls, task_data: dict[str, Any], config: CodingConfig) -> dict[str, Any]:
        """Rejects a row whose repository, commit or test patch cannot grade (fetches the repo)."""
        from .gradable import check_gradable

        return check_gradable(task_data, config)

    def __init__(self, env_config: dict[str, Any] | CodingConfig | None = None):
        super().__init__(env_config)
        self.labels = SandboxLabels(run_id="unbound", group_id="unbound",
                                    trajectory_id=f"coding-{uuid.uuid4().hex[:12]}")
        self.task: CodingTask | None = None
        self.workspace: Workspace | None = None
        self.image: str | None = None
        self.snapshot = False  # the image is a per-repo snapshot holding the workspace
        self.sandbox: Sandbox | None = None
        self._verifier: Sandbox | None = None
        self.command_log: list[dict[str, Any]] = []
        self.ended: str | None = None  # "submitted", or why the agent's sandbox stopped
        self._turn = 0

    def bind_trajectory(self, *, run_id: str, group_id: str | int, trajectory_id: str) -> None:
        """Label this trajectory's sandboxes (for the janitor and leak checks); call before ``reset``."""
        self.labels = SandboxLabels(run_id=run_id, group_id=str(group_id), trajectory_id=trajectory_id)

    def write_artifacts(self, store: ObjectStore, run_id: str, trajectory_id: str, info: dict[str, Any]) -> dict[str, str]:
        """The diff, test output and command log (``artifacts``); nothing when ``verify`` never ran."""
        if "diff" not in info:
            return {}
        return write_artifacts(store, run_id, trajectory_id, info)

    def _agent_sandbox(self) -> Sandbox:
        return required(self.sandbox, f"{self.name}'s agent sandbox (reset starts it)")

    async def _provision(self, spec: SandboxSpec) -> Sandbox:
        """A sandbox with the task's workspace: streamed in, or copied from the snapshot image; on
        this environment's provider (``sandbox.environments``, else ``sandbox.provider``)."""
        provider = provider_for_environment(self.name)
        if not self.snapshot:
            workspace = required(self.workspace, "the workspace (reset prepares it)").archive
            return await provision_with_retry(spec, workspace=workspace, provider=provider)
        sandbox = await provision_with_retry(spec, provider=provider)
        try:
            filled = await sandbox.exec(populate_command(spec.workspace_dir), timeout_s=spec.timeouts.provision_s)
            if filled.exit_code != 0:
                raise EnvironmentError_(f"could not fill the workspace from {spec.image}: {filled.output[-500:]}")
        except BaseException:
            await sandbox.teardown()
            raise
        return sandbox

    def _spec(self, *, command_s: float, episode_s: float) -> SandboxSpec:
        cfg = self.config
        return SandboxSpec(image=self.image, labels=self.labels, user=cfg.user, env=_SANDBOX_ENV,
                           limits=Limits(**cfg.limits), session=cfg.session, max_output_bytes=cfg.max_output_bytes,
                           timeouts=Timeouts(provision_s=cfg.provision_timeout_s, command_s=command_s, episode_s=episode_s))

    # -- reset -----------------------------------------------------------------------------------

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self.task = task = CodingTask.from_data(task_data)
        self.image = await resolve_image(task.language, task.image, self.config)
        source = task.source_url(self.config.repo_url_template)
        self.workspace = await asyncio.to_thread(prepare_workspace, source, task.base_commit,
                                                 self.config.workspace_cache_dir)
        if self.config.snapshot or self.config.setup_commands:
            self.image = await asyncio.to_thread(build_snapshot, self.image, self.workspace, self.config.setup_commands,
                                                 network_mode=self.config.snapshot_network)
            self.snapshot = True
        spec = self._spec(command_s=self.config.command_timeout_s, episode_s=self.config.episode_timeout_s + 300)
        self.sandbox = await self._provision(spec)
        prompt = system_prompt(spec.workspace_dir, self.config.command_timeout_s, self.config.max_output_bytes)
        return [{"role": "system", "content": prompt}, {"role": "user", "content": task.problem_statement}]

    # -- step ------------------------------------------------------------------------------------

    async def step(self, action: AgentAction) -> StepResult:
        await self.simulate_tool_latency()
        self._turn += 1
        if self.ended is not None:
            return StepResult(f"The episode is over ({self.ended}).", done=True)
        if action.tool_call_error:
            self._record("<malformed>", {}, error=action.tool_call_error)
            return StepResult(f"Error: {action.tool_call_error}. No tool was run; fix the call and try again.",
                              done=False, info={"invalid": True})
        if not action.tool_calls:
            self._record("<none>", {}, error="no tool call")
            return StepResult('Error: no tool call. Use a tool, or finish with <tool_call>{"name": "submit", '
                              '"arguments": {}}</tool_call>.', done=False, info={"invalid": True})
        observations = []
        for number, call in enumerate(action.tool_calls, start=1):
            text = await self._run(call)
            observations.append(text if len(action.tool_calls) == 1 else f"[{number}] {call.name}:\n{text}")
            if self.ended is not None:
                break
        return StepResult("\n\n".join(observations), done=self.ended is not None)

    async def _run(self, call: ToolCall) -> str:
        checked = check_call(call)
        if isinstance(checked, ToolError):
            self._record(call.name, call.arguments, error=checked.message)
            return f"Error: {checked.message}"
        started = time.perf_counter()
        entry: dict[str, Any] = {}
        try:
            observation = await getattr(self, f"_tool_{call.name}")(entry, **checked)
        except SandboxFileError as exc:
            entry["error"] = str(exc)
            observation = f"Error: {exc}"
        except _STOPPED as exc:
            self.ended = exc.reason
            entry["error"] = f"{exc.reason}: {exc}"
            observation = f"The sandbox stopped ({exc.reason}): {exc}. The episode ends."
        self._record(call.name, checked, duration_s=time.perf_counter() - started, **entry)
        return observation

    async def _tool_bash(self, entry: dict[str, Any], command: str) -> str:
        result = await self._agent_sandbox().exec(command, timeout_s=self.config.command_timeout_s,
                                                  max_output_bytes=self.config.max_output_bytes)
        entry.update(exit_code=result.exit_code, timed_out=result.timed_out, output_bytes=result.output_bytes,
                     output=result.output)
        return bash_observation(result, self.config.command_timeout_s) or "[no output]"

    async def _tool_read_file(self, entry: dict[str, Any], path: str) -> str:
        data = await self._agent_sandbox().read_file(path, max_bytes=self.config.max_read_bytes)
        entry["bytes"] = len(data)
        return clip(data.decode(errors="replace"), self.config.max_output_bytes) if data else "[empty file]"

    async def _tool_write_file(self, entry: dict[str, Any], path: str, content: str) -> str:
        await self._agent_sandbox().write_file(path, content)
        entry["bytes"] = len(content.encode())
        return f"Wrote {entry['bytes']} bytes to {path}."

    async def _tool_str_replace(self, entry: dict[str, Any], path: str, old: str, new: str) -> str:
        data = await self._agent_sandbox().read_file(path, max_bytes=self.config.max_read_bytes)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            entry["error"] = "not UTF-8"
            return f"Error: str_replace: {path} is not a UTF-8 text file; nothing changed"
        replaced = replace_once(text, old, new, path)
        if isinstance(replaced, ToolError):
            entry["error"] = replaced.message
            return f"Error: {replaced.message}"
        await self._agent_sandbox().write_file(path, replaced)
        return f"Replaced 1 occurrence in {path}."

    async def _tool_submit(self, entry: dict[str, Any]) -> str:
        self.ended = "submitted"
        return "Submitted."

    def _record(self, tool: str, args: dict[str, Any], **fields: Any) -> None:
        limit = self.config.info_command_chars
        shown = {k: clip(v, limit) if isinstance(v, str) else v for k, v in args.items()}
        if isinstance(fields.get("output"), str):
            fields["output"] = clip(fields["output"], limit)
        if "duration_s" in fields:
            fields["duration_s"] = round(fields["duration_s"], 4)
        self.command_log.append({"turn": self._turn, "tool": tool, "args": shown, **fields})

    # -- verify ----------------------------------------------------------------------------------

    async def verify(self) -> VerifyResult:
        task = required(self.task, "the task (reset sets it)")
        info: dict[str, Any] = {"format": task.format, "repo": task.repo, "base_commit": task.base_commit,
                                "image": self.image, "ended": self.ended, "submitted": self.ended == "submitted",
                                "commands": self.command_log}
        diff, why = await self._final_diff()
        # done with the agent's sandbox: its removal runs beside the grading, and whatever the
        # agent left there (a /tmp full of hard links...) cannot fail the verdict or make it a retry
        removal = asyncio.ensure_future(self._remove_agent_sandbox(info)) if self.sandbox is not None else None
        try:
            return await self._verdict(task, diff, why, info)
        finally:
            if removal is not None:
                await removal

    async def _remove_agent_sandbox(self, info: dict[str, Any]) -> None:
        try:
            await self._agent_sandbox().teardown()
        except Exception as exc:  # the janitor removes it after its TTL
            log.warning("could not tear down the agent's sandbox %s: %s", self._agent_sandbox().name, exc)
            info["agent_teardown_error"] = f"{type(exc).__name__}: {exc}"

    async def _verdict(self, task: CodingTask, diff: bytes | None, why: str | None, info: dict[str, Any]) -> VerifyResult:
        text = (diff or b"").decode(errors="replace")
        cut = len(text) > self.config.info_diff_bytes  # a cut diff is no patch: artifacts keep it apart
        info.update(diff=text[: self.config.info_diff_bytes], diff_truncated=cut, diff_bytes=len(diff or b""))
        if not task.has_tests:
            info["verifier"] = "label" if task.label_reward is not None else "none"
            if task.label_reward is None:
                info["note"] = "no verifier: the row has no tests and no reward label"
            return VerifyResult(task.label_reward or 0.0, info)
        if diff is None:
            info.update(verifier="tests", verifier_error=why)
            return VerifyResult(0.0, info)
        spec = self._spec(command_s=self.config.test_timeout_s, episode_s=self.config.test_timeout_s + 600)
        reward, verdict = await run_hidden_tests(lambda: self._provision(spec), diff, task, self.config,
                                                 self._track_verifier)
        info.update(verdict)
        return VerifyResult(reward, info)

    def _track_verifier(self, sandbox: Sandbox | None) -> None:
        self._verifier = sandbox

    async def _final_diff(self) -> tuple[bytes | None, str | None]:
        """The agent's changes against the base commit, or (None, why) when they cannot be had."""
        sandbox = self.sandbox
        if sandbox is None or not sandbox.alive:
            return None, f"the agent's sandbox is gone ({self.ended})"
        workspace = required(self.workspace, "the workspace (reset prepares it)")
        try:
            result = await sandbox.exec(grading.diff_command(sandbox.spec.workspace_dir, workspace.base_sha),
                                        timeout_s=120, max_output_bytes=4096)
            if result.exit_code != 0:
                return None, f"git diff failed in the agent's sandbox: {result.output[-500:] or result.exit_code}"
            return await sandbox.read_file(grading.AGENT_PATCH, max_bytes=self.config.max_diff_bytes), None
        except SandboxFileError as exc:
            return None, f"the final diff could not be read (larger than {self.config.max_diff_bytes} bytes?): {exc}"
        except _STOPPED as exc:
            return None, f"the agent's sandbox stopped ({exc.reason}): {exc}"

    # -- close -----------------------------------------------------------------------------------

    async def close(self) -> None:
        sandboxes = [s for s in (self.sandbox, self._verifier) if s is not None]
        self._verifier = None
        results = await asyncio.gather(*(s.teardown() for s in sandboxes), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
