"""One sandbox doing its worst to the recording proxy, and what another trajectory on the same
worker sees: the latency of its calls alone and during the abuse, and the worker's RSS.

The proxy is the real one (``AgentProxySettings`` defaults, the tiny model's tokenizer) on its
event loop in this process; vLLM is stood in for by ``StubInference`` (answers after 20 ms), so
what is measured is the proxy's own share. The victim calls its session's socket from this
process, one call at a time; the abuser is another process (``--abuser``) on its own session's
socket, until told to stop, in two rounds (held connections would keep its own bodies out):

- ``connections``: as many connections as it can open (up to 3,000), held;
- ``payloads``, all at once: heads declaring 48 MiB, then as many bytes as the proxy takes; a
  chunked 48 MiB body; calls with a message that nearly fills the context (tokenized, and
  recorded until the episode's ``max_turns``: the most tokenizing a session can make the
  worker do) and with a giant 8 MiB message; each in a loop. (A message near
  ``max_prompt_chars``, past the context, is tokenized once and stops the episode:
  ``tests/security/test_proxy_abuse.py`` measures the loop's lag during it.)

    .venv/bin/python bench/agent_proxy_abuse.py [--calls 60] [--abuse-s 20]

Prints the victim's median and p95 latency alone and under each round, their ratios (the bound:
2x), and the worker's RSS before, at its peak during the abuse, and after.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from agent_support import proxy_on_stub  # noqa: E402

from services.rollout_worker.agents.proxy import RecordingLimits  # noqa: E402
from shared.settings import AgentProxySettings  # noqa: E402

MiB = 1024 * 1024
# an agent episode's budget as a worker would give it (Cline's context; turns as in its configs)
LIMITS = RecordingLimits(max_tokens_per_turn=8, max_episode_tokens=10**6, max_model_len=40960, max_turns=200)
VICTIM = RecordingLimits(max_tokens_per_turn=8, max_episode_tokens=10**6, max_model_len=40960, max_turns=10**6)  # calls a lot
NEAR_CONTEXT = "word " * 13_000  # about 39,000 of the tiny model's tokens: tokenized, and recorded until max_turns
HEAD = ("POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\n{framing}\r\n\r\n")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# --- the abuser (its own process) ---------------------------------------------------------
def _unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def _flood_body(path: str, key: str, chunked: bool, stop: threading.Event) -> None:
    piece = b"x" * MiB
    while not stop.is_set():
        try:
            sock = _unix(path)
            framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {48 * MiB}"
            sock.sendall(HEAD.format(key=key, framing=framing).encode())
            for _ in range(48):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sock.close()
        except OSError:
            time.sleep(0.01)


def _hold_connections(path: str, stop: threading.Event) -> None:
    held: list[socket.socket] = []
    while not stop.is_set():
        held = [s for s in held if s.fileno() != -1]
        try:
            while len(held) < 3000 and not stop.is_set():
                held.append(_unix(path))
        except OSError:
            time.sleep(0.01)
    for sock in held:
        sock.close()


def _giant_messages(path: str, key: str, stop: threading.Event) -> None:
    transport = httpx.HTTPTransport(uds=path)
    with httpx.Client(transport=transport, base_url="http://proxy", timeout=120) as client:
        for text in _alternating(NEAR_CONTEXT, "x" * (8 * MiB), stop):
            try:
                client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": text}]},
                            headers={"Authorization": f"Bearer {key}"})
            except httpx.HTTPError:
                time.sleep(0.01)


def _alternating(a: str, b: str, stop: threading.Event):
    while not stop.is_set():
        yield a
        yield b


def abuser(mode: str, path: str, key: str) -> None:
    stop = threading.Event()
    workers = ([threading.Thread(target=_hold_connections, args=(path, stop))] if mode == "connections" else
               [threading.Thread(target=_flood_body, args=(path, key, False, stop)),
                threading.Thread(target=_flood_body, args=(path, key, True, stop)),
                threading.Thread(target=_giant_messages, args=(path, key, stop))])
    for worker in workers:
        worker.start()
    sys.stdin.readline()  # the bench says when to stop
    stop.set()
    for worker in workers:
        worker.join(30)


# --- the worker and the victim --------------------------------------------------------------
def victim_latencies(session, calls: int) -> list[float]:
    transport = httpx.HTTPTransport(uds=str(session.socket_path))
    latencies = []
    with httpx.Client(transport=transport, base_url="http://proxy", timeout=120) as client:
        for n in range(calls):
            started = time.perf_counter()
            answer = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {session.key}"},
                                 json={"model": "tiny", "messages": [{"role": "user", "content": f"call {n}: the next step?"}]})
            assert answer.status_code == 200, answer.text
            latencies.append(time.perf_counter() - started)
    return latencies


class PeakRss:
    def __init__(self):
        self.peak, self._stop = rss_mib(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mib())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()


def _summary(name: str, latencies: list[float]) -> tuple[float, float]:
    median, p95 = statistics.median(latencies), statistics.quantiles(latencies, n=20)[-1]
    print(f"{name:>12}: median {1000 * median:7.1f} ms   p95 {1000 * p95:7.1f} ms   ({len(latencies)} calls)")
    return median, p95


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--abuse-s", type=float, default=20.0, help="at least this long under each round of abuse")
    args = parser.parse_args()
    bounds = AgentProxySettings()
    with tempfile.TemporaryDirectory(prefix="abuse-") as root, proxy_on_stub(Path(root), bounds) as proxy:
        victim = proxy.loop.run(proxy.open_session("victim", VICTIM, lambda: 0, with_socket=True))
        attacker = proxy.loop.run(proxy.open_session("abuser", LIMITS, lambda: 0, with_socket=True))
        victim_latencies(victim, 10)  # warm up
        rss_before = rss_mib()
        alone = victim_latencies(victim, args.calls)
        with PeakRss() as peak:
            rounds = {mode: abused_round(mode, proxy, victim, attacker, bounds, args) for mode in ("connections", "payloads")}
        proxy.loop.run(proxy.close_session(attacker))
        time.sleep(1.0)
        rss_after = rss_mib()
        print(json.dumps({"bounds": bounds.model_dump()}))
        median_alone, p95_alone = _summary("alone", alone)
        for mode, (abused, held) in rounds.items():
            median, p95 = _summary(mode, abused)
            print(f"{'':>12}  ratio to alone: median {median / median_alone:.2f}x, p95 {p95 / p95_alone:.2f}x (bound 2x); "
                  f"abuser's connections open: {held} (bound {bounds.session_connections})")
        recorded_ids = sum(len(t.prompt_token_ids) + len(t.sampled_token_ids) for t in attacker.turns)
        print(f"abuser's calls refused: {attacker.refused}, recorded: {len(attacker.turns)} ({recorded_ids} token ids, "
              f"about {recorded_ids * 36 / MiB:.0f} MiB as Python ints: its trajectory, bounded by max_turns x max_model_len)")
        print(f"worker RSS: before {rss_before:.0f} MiB, peak under abuse {peak.peak:.0f} MiB "
              f"(+{peak.peak - rss_before:.0f}), after {rss_after:.0f} MiB")


def abused_round(mode: str, proxy, victim, attacker, bounds: AgentProxySettings, args) -> tuple[list[float], int]:
    """The victim's latencies while the abuser runs ``mode``, and the abuser's open connections."""
    process = subprocess.Popen([sys.executable, __file__, "--abuser", mode, str(attacker.socket_path), attacker.key],
                               stdin=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)  # the abuse is under way
        abused, deadline = [], time.monotonic() + args.abuse_s
        while time.monotonic() < deadline or len(abused) < args.calls:
            abused += victim_latencies(victim, 10)
        return abused, attacker._site.live
    finally:
        process.communicate("stop\n", timeout=60)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--abuser":
        abuser(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
