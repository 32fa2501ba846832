"""The proxy's HTTP side: ``/v1/chat/completions`` (streaming and tool calls) and ``/v1/models``,
one session per trajectory, in the rollout worker's event loop.

Invariants:
- Every call is bound to exactly one session: the key comes from the path
  (``/s/<key>/v1/...``) or the API key (``Authorization: Bearer <key>``). An unknown or closed
  key gets 401 and nothing is recorded. Keys are 192 random bits, made per trajectory, dropped
  when its episode ends.
- A session opened with a socket also gets a Unix socket of its own, alone in a directory of
  its own (``<socket_dir>/<random>/proxy.sock``: the directory that trajectory's sandbox mounts). A call that arrives on it must carry that session's key: another
  trajectory's key gets 403. So a sandbox cannot use another trajectory's session even if it
  learns its key; the only session it can reach is its own.
- A call refused for the episode's budget (tokens, context, turns) also writes ``stop`` (the
  reason) next to the session's socket: the sandbox sees it in its mounted directory, and the
  agent's wrapper stops the agent there, so an agent that retries refusals cannot run on.
- A session takes a bounded share of the worker (``bounds``, ``AgentProxySettings``): so many
  connections on its socket, so many body bytes at once and per body (refused before they are
  read), request heads cut at ``header_timeout_s``, stalled bodies at ``idle_timeout_s``. Parsing
  and tokenizing run in threads, never on the event loop, and only for prompts within
  ``max_prompt_chars``. The connection bound holds on a session's socket (a sandbox's only way in);
  TCP callers are the worker host's own.
- Nothing is recorded for a closed session: a call whose body or answer arrives after
  ``close_session`` gets 401, and its answer is dropped. The session's prompts leave the prompt
  cache when it closes.
- Calls of one session run one at a time, in arrival order (the recording joins each call to
  the previous one).
- A session calls the inference server it was opened with (``open_session(server=...)``: its
  run's own, ``inference_targets.Served``, shared by the process's episodes of that server), else
  the proxy's (the worker's own): its client samples, its tokenizer renders the prompts and
  decodes the answers, its served name is the model ``/v1/models`` names. Another session's
  server is never called for it. The proxy alone calls the server: a sandbox reaches its session's
  socket and nothing else (``forward``), whichever server the session calls.
- Inference goes through that server's ``InferenceClient``: an outage is waited out as for the
  token loop's episodes, a rejected prompt is a 400, a failed one a 503. An outage past
  ``outage.limit_s`` is a 503 too, kept as the session's ``outage`` (the episode then fails as
  ``inference_outage``, ``agents.episode``), and writes ``stop`` as a used-up budget does. Bad
  requests are 400s that say what was wrong; the server never dies on one.
- Streaming sends the answer once vLLM has produced all of it (role, content, tool calls, the
  finish reason, usage if asked, ``[DONE]``): the proxy records exact ids and logprobs from one
  token-in/token-out call, so there is no token-by-token stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

from aiohttp import web

from services.rollout_worker.agents.proxy.bounds import BodyRefused, BytesInFlight, SessionSite, read_body, refusal
from services.rollout_worker.agents.proxy.messages import BadChatRequest, check_tools, template_messages
from services.rollout_worker.agents.proxy.recording import AgentRecording, BudgetExhausted, RecordingLimits, Reply
from services.rollout_worker.chat_tokens import ChatTokens
from services.rollout_worker.episode.loop import turn_seed
from services.rollout_worker.inference_client import InferenceClient, InferenceOutage, InferenceRejected, InferenceUnavailable
from services.rollout_worker.inference_targets import Served
from shared.required import required
from shared.settings import AgentProxySettings

log = logging.getLogger(__name__)

STOP_FILE = "stop"  # written next to a session's socket once its budget is used up, or its server is out


@dataclass
class ProxySession:
    trajectory_id: str
    key: str
    recording: AgentRecording
    policy_version: Callable[[], int]
    in_flight: BytesInFlight
    client: InferenceClient  # the server this session's calls go to (open_session)
    model_name: str  # its served name, as the agent is told it
    socket_path: Path | None = None
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    opened_at: float = field(default_factory=time.time)
    first_call_at: float | None = None
    refused: int = 0  # calls refused for a bad request or a used-up budget
    outage: InferenceOutage | None = None  # the session's server was out past outage.limit_s
    _site: SessionSite | None = None

    @property
    def turns(self):
        return self.recording.turns

    @property
    def chat(self) -> ChatTokens:
        return self.recording.chat

    def stop_agent(self, why: str) -> None:
        """Writes ``stop`` next to the session's socket: the sandbox's wrapper stops the agent (agent_coding)."""
        if self.socket_path is not None and not self.closed:
            self.socket_path.with_name(STOP_FILE).write_text(f"{why}\n")


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


class AgentProxy:
    """Start it (``await start()``) inside the event loop that runs the episodes."""

    def __init__(self, client: InferenceClient, chat: ChatTokens, model_name: str, temperature: float = 1.0,
                 top_p: float = 1.0, host: str = "127.0.0.1", port: int = 0, socket_dir: Path | None = None,
                 limits: AgentProxySettings | None = None):
        self.client, self.chat, self.model_name = client, chat, model_name
        self.limits = limits or AgentProxySettings()
        self.temperature, self.top_p = temperature, top_p
        self.host, self.port = host, port
        self.socket_dir = socket_dir
        self._by_key: dict[str, ProxySession] = {}
        self._by_socket: dict[str, ProxySession] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """The TCP base URL (``.../v1``), for agents on the worker's host."""
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        for prefix in ("", "/s/{key}"):
            app.router.add_get(f"{prefix}/v1/models", self._models)
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat)
        # aiohttp closes a connection that has no whole request head this long after it opened
        # or after its last answer (its keep-alive timeout); one answered before its body was
        # read is closed at once (no lingering: the rest of the body is not read)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.limits.header_timeout_s, lingering_time=0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # a started TCPSite holds the asyncio Server that loop.create_server gave it
        self.port = cast(asyncio.Server, site._server).sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for session in list(self._by_key.values()):
            await self.close_session(session)
        if self._runner is not None:
            await self._runner.cleanup()

    async def open_session(self, trajectory_id: str, limits: RecordingLimits, policy_version: Callable[[], int],
                           with_socket: bool = False, server: Served | None = None) -> ProxySession:
        """``server``: the inference server this trajectory's calls go to (its run's own); None: the proxy's."""
        client, chat, model_name = ((self.client, self.chat, self.model_name) if server is None
                                    else (server.client, server.chat, server.client.model))
        session = ProxySession(trajectory_id, secrets.token_urlsafe(24), AgentRecording(chat, limits), policy_version,
                               BytesInFlight(self.limits.session_bytes_in_flight), client, model_name)
        if with_socket:
            if self.socket_dir is None:
                raise ValueError("this proxy has no socket_dir: it cannot give a session a socket")
            own_dir = self.socket_dir / secrets.token_hex(6)  # one session per directory: what a sandbox mounts
            own_dir.mkdir(parents=True)
            own_dir.chmod(0o755)
            session.socket_path = own_dir / "proxy.sock"
            runner = required(self._runner, "the proxy's runner (start sets it up)")
            session._site = SessionSite(runner, str(session.socket_path), self.limits.session_connections)
            await session._site.start()
            session.socket_path.chmod(0o666)  # the sandbox's user is not the worker's
            self._by_socket[str(session.socket_path)] = session
        self._by_key[session.key] = session
        return session

    async def close_session(self, session: ProxySession) -> None:
        """The key stops working at once, and nothing more is recorded: a call still running gets
        401 and its answer is dropped. Closing a closed session does nothing."""
        session.closed = True
        self._by_key.pop(session.key, None)
        session.chat.forget(set(session.recording.prompt_keys))  # a copy: a call's thread may still add one
        site, session._site = session._site, None
        if site is not None:
            self._by_socket.pop(str(session.socket_path), None)
            await site.stop()
            site.abort()
            socket_path = cast(Path, session.socket_path)  # set with the site (open_session)
            socket_path.unlink(missing_ok=True)
            socket_path.with_name(STOP_FILE).unlink(missing_ok=True)
            try:
                socket_path.parent.rmdir()
            except OSError:  # a sandbox still has it mounted, or something else was put there
                pass

    # --- requests -------------------------------------------------------------------------
    def _session_of(self, request: web.Request) -> ProxySession | web.Response:
        key = request.match_info.get("key")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("api-key", "")
        session = self._by_key.get(key)
        if session is None:
            return _error(401, "unknown or closed proxy session: the API key is the session key of a running trajectory",
                          "authentication_error")
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        via = self._by_socket.get(sockname) if isinstance(sockname, str) and sockname else None
        if isinstance(sockname, str) and sockname and via is not session:
            return _error(403, "this socket serves another trajectory's session", "permission_error")
        return session

    async def _models(self, request: web.Request) -> web.Response:
        session = self._session_of(request)
        if isinstance(session, web.Response):
            return session
        return web.json_response({"object": "list", "data": [{"id": session.model_name, "object": "model", "owned_by": "conveyor"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session_of(request)
        if isinstance(session, web.Response):
            return session
        try:
            body = await read_body(request, session.in_flight, self.limits)
        except BodyRefused as exc:
            session.refused += 1
            return refusal(exc)
        try:
            return await self._answer(request, session, body)
        finally:
            session.in_flight.release(len(body))

    async def _answer(self, request: web.Request, session: ProxySession, raw: bytearray) -> web.StreamResponse:
        if session.closed:
            return _closed()
        try:
            body, messages, tools, max_tokens = await asyncio.to_thread(_parse_call, raw, self.limits.max_prompt_chars)
        except BadChatRequest as exc:
            session.refused += 1
            return _error(400, str(exc))
        session.first_call_at = session.first_call_at or time.time()
        async with session.lock:
            if session.closed:
                return _closed()
            try:
                version = await asyncio.to_thread(session.policy_version)
                call = await asyncio.to_thread(session.recording.prepare, messages, tools, max_tokens, version)
            except BudgetExhausted as exc:
                session.refused += 1
                session.stop_agent(f"{exc.reason.value}: {exc}")
                return _error(400, str(exc), code="context_length_exceeded")
            finally:
                if session.closed:  # closed while the prompt was tokenized: its key came after the close's forget
                    session.chat.forget(set(session.recording.prompt_keys))
            if session.closed:
                return _closed()
            try:
                completion = await session.client.complete(
                    call.context, call.max_tokens, turn_seed(session.trajectory_id, len(session.turns)), self.temperature, self.top_p,
                    policy_version=version)
            except InferenceRejected as exc:
                return _error(400, str(exc))
            except InferenceOutage as exc:
                session.outage = session.outage or exc
                session.stop_agent(f"inference_outage: {exc}")
                return _error(503, str(exc), "server_error")
            except InferenceUnavailable as exc:
                return _error(503, str(exc), "server_error")
            if session.closed:
                return _closed()
            reply = session.recording.record(call, completion, tools)
        answer = _chat_completion(reply, session.model_name, session.trajectory_id, len(call.context))
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _stream(request, answer, include_usage)
        return web.json_response(answer)


def _closed() -> web.Response:
    return _error(401, "the proxy session closed: nothing more is recorded for this trajectory", "authentication_error")


def _parse_call(raw: bytearray, max_prompt_chars: int) -> tuple[dict[str, Any], list[dict], list[dict], int | None]:
    """The body, its messages as the template sees them, its tools and max_tokens (in a thread:
    a large body takes long to parse)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadChatRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadChatRequest("the body must be a JSON object")
    messages, tools = template_messages(body.get("messages")), check_tools(body.get("tools"))
    if body.get("n", 1) != 1:
        raise BadChatRequest("n must be 1: each call is one turn of one trajectory")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0):
        raise BadChatRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    chars = len(json.dumps([messages, tools]))
    if chars > max_prompt_chars:
        raise BadChatRequest(f"the prompt's {chars} characters pass the proxy's limit of {max_prompt_chars}: "
                             "it is not tokenized (context_length_exceeded)")
    return body, messages, tools, max_tokens


def _chat_completion(reply: Reply, model: str, trajectory_id: str, prompt_tokens: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if (reply.text or not reply.tool_calls) else None}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{reply.turn.index}_{n}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for n, call in enumerate(reply.tool_calls)
        ]
    sampled = len(reply.turn.sampled_token_ids)
    return {
        "id": f"chatcmpl-{trajectory_id}-{reply.turn.index}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sampled, "total_tokens": prompt_tokens + sampled},
    }


async def _stream(request: web.Request, answer: dict[str, Any], include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    message, choice = answer["choices"][0]["message"], answer["choices"][0]
    base = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"], "model": answer["model"]}

    async def send(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    await send({"role": "assistant", "content": ""})
    if message["content"]:
        await send({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls", [])):
        await send({"tool_calls": [{"index": index, **call}]})
    await send({}, choice["finish_reason"])
    if include_usage:
        await response.write(f"data: {json.dumps({**base, 'choices': [], 'usage': answer['usage']})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
