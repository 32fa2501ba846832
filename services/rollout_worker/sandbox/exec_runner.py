"""Commands as one ``docker exec`` each: the fallback when no shell session is attached.

Used when the spec asks for it (``session=False``), when the daemon's socket cannot be used
asynchronously, and by the benchmark as the baseline. Slower (one exec,
~50 ms, per command) and the working directory does not carry over between commands.

Invariant: same contract as ``ShellSession.run``: bounded kept output, and a call returns within
``timeout_s + kill_grace_s`` or raises ``SandboxLost``. The kill is ``kill -9 -1`` run by a second
exec, which kills every process of the sandbox user except PID 1; when even that exec cannot
start (a fork bomb holds every pid), the sandbox is lost.
"""

from __future__ import annotations

import asyncio
import time

from docker import APIClient

from .blocking import run_blocking, submit
from .errors import SandboxLost
from .protocol import drop_definition, parse_user, probe_command
from .results import ExecResult

_KILL_ALL = ["sh", "-c", "kill -9 -1"]


class ExecRunner:
    def __init__(self, api: APIClient, container_id: str, *, user: str | None, env: dict[str, str], workdir: str,
                 kill_grace_s: float, flood_bytes: int):
        self._api, self._cid = api, container_id
        self._user, self._env, self._workdir = user or "", env, workdir
        self._grace, self._flood = kill_grace_s, flood_bytes

    async def run(self, command: str, *, timeout_s: float, max_output_bytes: int, as_root: bool = False) -> ExecResult:
        start = time.monotonic()
        if as_root:  # the session's root-shell helper, the tool probed on the spot (a fallback path)
            uid, gid = parse_user(self._user)
            command = f"__cv_tool=$({probe_command(uid)}); {drop_definition(uid, gid)}{command}"
        argv = ["sh", "-c", 'exec 2>&1 </dev/null; eval "$1"', "sh", command]
        job = submit(self._exec_capped, argv, max_output_bytes, "0:0" if as_root else self._user)
        timed_out = False
        try:
            finished = asyncio.shield(asyncio.wrap_future(job))
            exit_code, output, total, flooded = await asyncio.wait_for(finished, timeout_s)
        except TimeoutError:
            timed_out = True
            await run_blocking(self._kill_all)
            try:
                _, output, total, _ = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), self._grace)
            except TimeoutError:
                raise SandboxLost(f"a command outlived its timeout by {self._grace:.1f}s after `kill -9 -1`") from None
            exit_code, flooded = None, False
        return ExecResult(
            exit_code=None if flooded else exit_code,
            output=output.decode("utf-8", errors="replace"),
            truncated=total > len(output),
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
            output_bytes=total,
            raw=output,
        )

    async def close(self) -> None:
        return None

    def _exec_capped(self, argv: list[str], max_output: int, user: str) -> tuple[int | None, bytes, int, bool]:
        exec_id = self._api.exec_create(self._cid, argv, user=user, environment=self._env,
                                        workdir=self._workdir)["Id"]
        kept, total, flooded = bytearray(), 0, False
        chunks = self._api.exec_start(exec_id, stream=True)
        for chunk in chunks:
            total += len(chunk)
            room = max_output - len(kept)
            if room > 0:
                kept += chunk[:room]
            if total > self._flood:
                flooded = True
                self._kill_all()
                break
        chunks.close()
        exit_code = self._api.exec_inspect(exec_id)["ExitCode"]
        return exit_code, bytes(kept), total, flooded

    def _kill_all(self) -> None:
        try:
            exec_id = self._api.exec_create(self._cid, _KILL_ALL, user=self._user)["Id"]
            self._api.exec_start(exec_id)
        except Exception:  # no pid left to start the kill: the caller's grace period decides
            pass
