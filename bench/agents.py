"""Agents behind the recording proxy: what the proxy costs per call, and how long an agent in a
sandbox waits for its first model call. One run; the machine is noisy, so the overhead is the
median of paired differences (each proxy call next to a direct call of the same prompt).

1. Proxy overhead: ``--calls`` pairs, interleaved. A direct call is vLLM's ``/v1/completions``
   with the token ids the proxy would send; a proxy call is ``/v1/chat/completions`` on the
   proxy (template, tokenization, recording, the OpenAI answer). Both sample ``--max-tokens``.
2. Agents in the sandbox (needs Docker and the ``conveyor/python`` image; skipped otherwise):
   ``--episodes`` ``agent_coding`` episodes of a minimal agent (python3, one model call) on a
   generated one-file repository: episode start to the first model call (the container is
   provisioned, the workspace copied in, the forwarder and the agent started) and wall time.
3. Cline in the sandbox (``--cline N``, default 0; builds or reuses ``conveyor/agent-cline`` on
   the Python image): the same figures, plus the driver's boot time (cline-host and cline-core
   up) and preparation time (configured over gRPC). Its own vLLM, with a 40,960-token context:
   Cline's system prompt is about 33,000 of the tiny model's tokens.

    .venv/bin/python bench/agents.py [--calls 60] [--max-tokens 1] [--episodes 3] [--cline 3]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from agent_support import proxy_on_tiny_vllm  # noqa: E402

from services.rollout_worker.agents.proxy import RecordingLimits  # noqa: E402

CLINE_CONTEXT = 40960
MESSAGES = [{"role": "system", "content": "You fix bugs in the repository."},
            {"role": "user", "content": "calc.add(2, 3) returns -1. Fix it."}]
MINIMAL_AGENT = (
    "import json, os, urllib.request\n"
    "body = json.dumps({'model': os.environ['OPENAI_MODEL'], 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4}).encode()\n"
    "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', body,"
    " {'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
    "urllib.request.urlopen(req, timeout=120).read()\n"
)


def _ms(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else 1000 * values[0]


def proxy_overhead(proxy, calls: int, max_tokens: int) -> None:
    limits = RecordingLimits(max_tokens, 10**6, 1024, 10**6)
    direct_s, proxied_s = [], []
    with httpx.Client(timeout=120) as http:
        for i in range(calls + 5):
            session = proxy.loop.run(proxy.open_session(f"bench-{i}", limits, lambda: 0))
            started = time.perf_counter()
            r = http.post(f"{proxy.url}/chat/completions", headers={"Authorization": f"Bearer {session.key}"},
                          json={"model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens})
            proxied = time.perf_counter() - started
            assert r.status_code == 200, r.text
            prompt = session.turns[0].prompt_token_ids
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": i,
                    "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False}
            started = time.perf_counter()
            assert http.post(f"{proxy.vllm.base_url}/v1/completions", json=body).status_code == 200
            direct = time.perf_counter() - started
            proxy.loop.run(proxy.close_session(session))
            if i >= 5:  # warm-up
                direct_s.append(direct)
                proxied_s.append(proxied)
    diffs = [p - d for p, d in zip(proxied_s, direct_s)]
    print(f"proxy overhead, {calls} paired calls of {max_tokens} sampled token(s):")
    print(f"  direct vLLM     p50 {_ms(direct_s, .5):7.2f} ms  p90 {_ms(direct_s, .9):7.2f} ms")
    print(f"  through proxy   p50 {_ms(proxied_s, .5):7.2f} ms  p90 {_ms(proxied_s, .9):7.2f} ms")
    print(f"  overhead        p50 {_ms(diffs, .5):7.2f} ms  p90 {_ms(diffs, .9):7.2f} ms  (target: p50 <= 2 ms)")
    print(f"  ratio proxy/direct (p50): {statistics.median(proxied_s) / statistics.median(direct_s):.3f}")


def _repo(root: Path) -> dict:
    repo = root / "repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["-c", "user.email=b@b", "-c", "user.name=b", "commit", "-qm", "calc"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    return {"repo_name": "bench/calc", "repo_url": f"file://{repo}", "language": "Python",
            "conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "calc.add is wrong. Fix it."}]}


def _python_image():
    try:
        import docker

        client = docker.from_env()
        return client, next(t for i in client.images.list("conveyor/python") for t in i.tags)
    except Exception as exc:  # no daemon or no image: say so
        print(f"agents in sandboxes: skipped ({type(exc).__name__}: {exc}; build images/python first)")
        return None, None


def _episodes(proxy, image: str, agent_command: str, episodes: int, root: Path, max_model_len: int = 1024, **config) -> list:
    """``episodes`` agent_coding trajectories of ``agent_command`` on the generated repository."""
    from services.rollout_worker.agents.episode import run_agent_episode
    from services.rollout_worker.environments.agent_coding import AgentCodingEnv
    from services.rollout_worker.environments.coding import coding_task
    from services.rollout_worker.episode.loop import EpisodeLimits
    from shared.schemas import RolloutRequest, TaskProfile

    task_data = coding_task(_repo(root))
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=8, max_episode_tokens=64, max_model_len=max_model_len, timeout_s=300)
    trajectories = []
    for n in range(episodes):
        env = AgentCodingEnv({"image": image, "workspace_cache_dir": str(root / "ws"), "agent_timeout_s": 120,
                              "agent_command": agent_command, **config})
        request = RolloutRequest(run_id="bench-agents", group_id=0, episode_index=n, episode_seed=n, trajectory_id=f"bench-agents-{n}",
                                 group_size=1, task=TaskProfile(task_id="calc", env_name="agent_coding", task_data=task_data,
                                                                env_config={}, source="bench"),
                                 policy_version=0, dispatched_at=time.time())
        trajectories.append(proxy.loop.run(run_agent_episode(request, env, proxy, limits, policy_version=lambda: 0)))
    return trajectories


def _first_call_and_wall(trajectories: list) -> None:
    first_call = [t.env_info["agent"]["first_call_s"] for t in trajectories]
    wall = [t.timings.episode_s for t in trajectories]
    print(f"  episode start -> first model call: median {statistics.median(first_call):.2f} s (min {min(first_call):.2f}, max {max(first_call):.2f})")
    print(f"  episode wall time (sandbox, agent, teardown): median {statistics.median(wall):.2f} s")


def agents_in_sandboxes(proxy, episodes: int, root: Path) -> None:
    _, image = _python_image()
    if image is None:
        return
    trajectories = _episodes(proxy, image, f"python3 -c {shlex.quote(MINIMAL_AGENT)}", episodes, root)
    for trajectory in trajectories:
        assert trajectory.env_info.get("agent", {}).get("calls") == 1, (trajectory.error, trajectory.env_info.get("agent"))
    print(f"agents in sandboxes, {episodes} episodes of a minimal agent ({image}):")
    _first_call_and_wall(trajectories)


def cline_in_sandboxes(episodes: int, root: Path) -> None:
    client, image = _python_image()
    if image is None:
        return
    from services.rollout_worker.agents.images import build_agent_image

    started = time.monotonic()
    cline = build_agent_image(client, "cline", image)
    print(f"Cline in sandboxes ({cline}, ready in {time.monotonic() - started:.1f} s), {episodes} episodes against the tiny model:")
    with proxy_on_tiny_vllm(root / "long", max_model_len=CLINE_CONTEXT) as proxy:
        trajectories = _episodes(proxy, cline, "python3 -m agent_drivers.cline", episodes, root, CLINE_CONTEXT,
                                 agent_artifacts_dir="/tmp/agent-artifacts")
    metrics = [t.env_info["agent"]["metrics"] for t in trajectories]
    assert all(m["boot_ok"] for m in metrics), metrics
    print(f"  driver start -> Cline booted: median {statistics.median(m['boot_s'] for m in metrics):.2f} s; "
          f"-> configured: median {statistics.median(m['prepare_s'] for m in metrics):.2f} s")
    _first_call_and_wall(trajectories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--cline", type=int, default=0, help="Cline episodes (its own long-context vLLM)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agents-", dir="/tmp") as tmp, proxy_on_tiny_vllm(Path(tmp)) as proxy:
        proxy_overhead(proxy, args.calls, args.max_tokens)
        if args.episodes > 0:
            agents_in_sandboxes(proxy, args.episodes, Path(tmp))
    if args.cline > 0:
        with tempfile.TemporaryDirectory(prefix="bench-cline-", dir="/tmp") as tmp:
            cline_in_sandboxes(args.cline, Path(tmp))


if __name__ == "__main__":
    main()
