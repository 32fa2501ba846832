"""A sandbox abusing the recording proxy it shares with the worker's other trajectories: huge
bodies, many connections, slow heads, giant prompts, calls after the stop or the close. Each
test does it over real sockets to a real proxy (the tiny model's tokenizer; vLLM stood in for by
``StubInference``) and asserts the bound held (``AgentProxySettings``, ``agents.proxy.bounds``)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from agent_support import proxy_on_stub

from services.rollout_worker.agents.proxy import RecordingLimits
from services.rollout_worker.agents.proxy.server import STOP_FILE
from shared.settings import AgentProxySettings

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024
BOUNDS = AgentProxySettings(max_body_bytes=2 * MiB, session_bytes_in_flight=3 * MiB, session_connections=4,
                            header_timeout_s=1.5, idle_timeout_s=1.0, max_prompt_chars=1_000_000)
ROOMY = RecordingLimits(max_tokens_per_turn=8, max_episode_tokens=10**6, max_model_len=10**7, max_turns=1000)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    with proxy_on_stub(tmp_path_factory.mktemp("abuse"), BOUNDS) as server:
        yield server


@pytest.fixture
def session(proxy):
    opened = proxy.loop.run(proxy.open_session("traj-abuser", ROOMY, lambda: 0, with_socket=True))
    yield opened
    proxy.loop.run(proxy.close_session(opened))


def _connect(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def _head(key: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n").encode()


def _status(sock: socket.socket) -> int:
    """The answer's status, or 0 when the proxy closed the connection without one."""
    seen = b""
    while b"\r\n" not in seen:
        try:
            data = sock.recv(4096)
        except ConnectionResetError:
            return 0
        if not data:
            return 0
        seen += data
    return int(seen.split(b" ", 2)[1])


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the proxy closed the connection (None: still open after ``seconds``)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def _call(session, messages, timeout=60) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(session.socket_path)), base_url="http://proxy", timeout=timeout) as client:
        return client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages},
                           headers={"Authorization": f"Bearer {session.key}"})


HI = [{"role": "user", "content": "hi"}]


def test_a_declared_body_over_the_limit_gets_413_before_a_byte_of_it_is_read(session):
    sock = _connect(session.socket_path)
    sock.sendall(_head(session.key, BOUNDS.max_body_bytes + 1))  # the head only: the proxy must not wait for the body
    assert _status(sock) == 413
    assert _closed_within(sock, 5) is not None  # the rest of the body is never read
    assert session.in_flight.held == 0 and session.turns == []


def test_a_chunked_body_is_cut_as_soon_as_it_passes_the_limit(session):
    sock = _connect(session.socket_path)
    sock.sendall(_head(session.key, None))
    chunk = b"x" * (256 * 1024)
    sent = 0
    try:
        for _ in range(40):  # 10 MiB offered, 2 MiB allowed
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert _status(sock) in (413, 0)
    assert sent < 10 * 1024 * 1024 or _closed_within(sock, 5) is not None
    assert session.in_flight.held == 0 and session.turns == []


def test_a_sessions_bodies_in_flight_are_bounded(session):
    first = _connect(session.socket_path)
    first.sendall(_head(session.key, 2 * MiB))
    first.sendall(b"x" * (2 * MiB - 10))  # held: the body is not finished
    deadline = time.monotonic() + 10
    while session.in_flight.held < 2 * MiB - 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert session.in_flight.held == 2 * MiB - 10
    second = _connect(session.socket_path)
    second.sendall(_head(session.key, 2 * MiB))  # 2 + 2 MiB > 3 MiB: refused before it is read
    assert _status(second) == 429
    first.close()
    deadline = time.monotonic() + 5
    while session.in_flight.held and time.monotonic() < deadline:
        time.sleep(0.02)
    assert session.in_flight.held == 0
    assert _call(session, HI).status_code == 200  # the session works again once its bytes are released


def test_a_sessions_connection_past_the_limit_is_closed_at_once(proxy, session):
    held = [_connect(session.socket_path) for _ in range(BOUNDS.session_connections)]
    deadline = time.monotonic() + 5
    while session._site.live < BOUNDS.session_connections and time.monotonic() < deadline:
        time.sleep(0.01)
    extra = _connect(session.socket_path)
    assert _closed_within(extra, 1.0) is not None
    assert session._site.live == BOUNDS.session_connections
    other = proxy.loop.run(proxy.open_session("traj-bystander", ROOMY, lambda: 0, with_socket=True))
    try:
        assert _call(other, HI).status_code == 200  # another session is not affected
    finally:
        proxy.loop.run(proxy.close_session(other))
    for sock in held:
        sock.close()
    deadline = time.monotonic() + 5
    while session._site.live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _call(session, HI).status_code == 200


def test_a_slow_request_head_is_cut_at_the_header_timeout(session):
    sock = _connect(session.socket_path)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n")
    started = time.monotonic()
    cut = None
    for n in range(40):  # a header line every 0.1 s, never the blank line that ends the head
        try:
            sock.sendall(b"X-Slow-%d: 1\r\n" % n)
        except (BrokenPipeError, ConnectionResetError):
            cut = time.monotonic() - started
            break
        if _closed_within(sock, 0.1) is not None:
            cut = time.monotonic() - started
            break
    assert cut is not None and BOUNDS.header_timeout_s - 0.2 <= cut <= BOUNDS.header_timeout_s + 1.0, cut


def test_a_stalled_body_is_dropped_at_the_idle_timeout(session):
    sock = _connect(session.socket_path)
    sock.sendall(_head(session.key, 1000) + b'{"messages": ')
    started = time.monotonic()
    assert _status(sock) == 408
    assert BOUNDS.idle_timeout_s - 0.2 <= time.monotonic() - started <= BOUNDS.idle_timeout_s + 1.0
    assert session.in_flight.held == 0 and session.turns == []


def _max_loop_lag(loop: asyncio.AbstractEventLoop, stop: threading.Event) -> float:
    async def measure() -> float:
        worst = 0.0
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(0.005)
            worst = max(worst, loop.time() - before - 0.005)
        return worst
    return asyncio.run_coroutine_threadsafe(measure(), loop)


def test_the_event_loop_stays_responsive_while_a_near_limit_prompt_tokenizes(proxy, session):
    text = "word " * ((BOUNDS.max_prompt_chars - 100) // 5)
    stop = threading.Event()
    lag = _max_loop_lag(proxy.loop.loop, stop)
    started = time.monotonic()
    answer = _call(session, [{"role": "user", "content": text}])
    took = time.monotonic() - started
    stop.set()
    worst = lag.result(10)
    assert answer.status_code == 200 and len(session.turns) == 1
    assert len(session.turns[0].prompt_token_ids) > 100_000  # it was tokenized, and that took a while ...
    assert took > 0.3, took
    # ... off the event loop: on it, the loop would stall for most of the call (a busy machine
    # stretches both, so the bound is relative)
    assert worst < took / 4, (worst, took)


def test_a_prompt_over_the_limit_is_refused_before_it_is_tokenized(proxy, session):
    keys_before = proxy.chat.cached_bytes
    answer = _call(session, [{"role": "user", "content": "word " * (BOUNDS.max_prompt_chars // 5 + 10)}])
    assert answer.status_code == 400 and "not tokenized" in answer.json()["error"]["message"]
    assert session.turns == [] and not session.recording.prompt_keys and proxy.chat.cached_bytes == keys_before


def test_a_sessions_prompts_leave_the_cache_when_it_closes(proxy):
    baseline = proxy.chat.cached_bytes
    small = RecordingLimits(max_tokens_per_turn=8, max_episode_tokens=100, max_model_len=64, max_turns=10)
    session = proxy.loop.run(proxy.open_session("traj-cache", small, lambda: 0, with_socket=True))
    refused = _call(session, [{"role": "user", "content": "word " * 100_000}])
    assert refused.status_code == 400 and "context" in refused.json()["error"]["message"]
    assert proxy.chat.cached_bytes > baseline + 500_000  # the refused prompt was rendered and kept
    proxy.loop.run(proxy.close_session(session))
    assert proxy.chat.cached_bytes == baseline


def test_a_body_that_arrives_after_close_is_refused_and_not_recorded(proxy):
    session = proxy.loop.run(proxy.open_session("traj-late", ROOMY, lambda: 0))
    body = json.dumps({"model": "tiny", "messages": HI}).encode()
    sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer %s\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (session.key.encode(), len(body)))
    time.sleep(0.2)  # the head is in: the call is bound to the session
    proxy.loop.run(proxy.close_session(session))
    sock.sendall(body)
    assert _status(sock) == 401
    assert session.turns == []


def test_an_answer_that_arrives_after_close_is_dropped(proxy):
    session = proxy.loop.run(proxy.open_session("traj-slow", ROOMY, lambda: 0))
    calls, proxy.client.delay_s = proxy.client.calls, 1.0  # vLLM still sampling when the episode ends
    answers = []
    try:
        caller = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{proxy.url}/chat/completions", json={"model": "tiny", "messages": HI},
            headers={"Authorization": f"Bearer {session.key}"}, timeout=30)))
        caller.start()
        deadline = time.monotonic() + 10
        while proxy.client.calls == calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.client.calls == calls + 1  # the call reached inference before the close
        proxy.loop.run(proxy.close_session(session))
        caller.join(30)
    finally:
        proxy.client.delay_s = 0.02
    assert answers[0].status_code == 401 and "closed" in answers[0].json()["error"]["message"]
    assert session.turns == []


def test_no_call_is_recorded_after_the_budget_stop(proxy):
    small = RecordingLimits(max_tokens_per_turn=8, max_episode_tokens=100, max_model_len=200, max_turns=10)
    session = proxy.loop.run(proxy.open_session("traj-stopped", small, lambda: 0, with_socket=True))
    try:
        refused = _call(session, [{"role": "user", "content": "word " * 500}])  # past the context: the stop
        assert refused.status_code == 400 and session.recording.exhausted is not None
        assert session.socket_path.with_name(STOP_FILE).exists()  # the agent's wrapper kills its process group
        after = _call(session, HI)  # would fit, but the episode has stopped
        assert after.status_code == 400 and "stopped" in after.json()["error"]["message"]
        assert session.turns == []
    finally:
        proxy.loop.run(proxy.close_session(session))
