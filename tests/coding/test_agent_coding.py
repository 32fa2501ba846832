"""``agent_coding``: an agent of its own in the sandbox, its model calls through the recording
proxy, graded by the hidden tests. Real Docker (the Python image), a real vLLM with the tiny
model, the real proxy; the agent is a standard-library script run by the sandbox's python3.

- The sandbox keeps no network: from inside, the trajectory's own proxy session is reachable
  and nothing else is (not the proxy's TCP port, not vLLM, not the host), and another
  trajectory's key is refused on this socket.
- A scripted agent that calls the model and then fixes the bug itself gets 1.0 from the hidden
  tests, and its two calls are the trajectory's turns, joined as one sequence.
- An agent that never ends is stopped at its time limit; nothing is left running.
- The files an agent leaves in its artifacts directory are stored next to the trajectory, each
  within its size limit, and its ``metrics.json`` lands in the trajectory's info.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from urllib.parse import urlparse

import pytest
from agent_support import proxy_on_served

from services.rollout_worker.agents.episode import run_agent_episode
from services.rollout_worker.agents.images import build_agent_image
from services.rollout_worker.agents.proxy import RecordingLimits
from services.rollout_worker.environments.agent_coding import AgentCodingEnv
from services.rollout_worker.episode.loop import EpisodeLimits
from shared.names import agent_artifact_key
from shared.schemas import RolloutRequest, StopReason, TaskProfile
from shared.storage import LocalStore

pytestmark = pytest.mark.slow

SERVED = "tiny"
LIMITS = EpisodeLimits(max_turns=8, max_tokens_per_turn=16, max_episode_tokens=200, max_model_len=1024, timeout_s=300)

# What an agent inside sees: each probe prints one JSON line.
PROBE = textwrap.dedent('''
    import json, os, socket, urllib.request, urllib.error
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    def call(k):
        body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(base + "/chat/completions", body, {"Authorization": "Bearer " + k, "Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=60).status
        except urllib.error.HTTPError as e:
            return e.code
    def reach(host, port):
        try:
            socket.create_connection((host, port), timeout=2).close()
            return "connected"
        except OSError as e:
            return type(e).__name__
    out = {"own": call(key), "other": call(os.environ["OTHER_KEY"]),
           "targets": {t: reach(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in os.environ["TARGETS"].split(",")},
           "agent_dir": sorted(os.listdir("/run/conveyor-agent")), "interfaces": sorted(os.listdir("/sys/class/net"))}
    try:
        open("/run/conveyor-agent/x", "w").close(); out["write"] = "written"
    except OSError as e:
        out["write"] = type(e).__name__
    print("PROBE " + json.dumps(out))
''')

# A scripted agent: asks the model twice (the second call extends the first with a tool result),
# then fixes calc itself, as a real agent would after reading the code.
SCRIPTED_AGENT = textwrap.dedent('''
    import json, os, urllib.request
    base, key, model = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"]
    def chat(messages):
        body = json.dumps({"model": model, "messages": messages, "max_tokens": 12}).encode()
        req = urllib.request.Request(base + "/chat/completions", body, {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]
    messages = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": open(os.environ["AGENT_TASK_FILE"]).read()}]
    reply = chat(messages)
    messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": open("calc/__init__.py").read()}]
    chat(messages)
    source = open("calc/__init__.py").read()
    source = source.replace("def add(a, b):\\n    return a - b", "def add(a, b):\\n    return a + b")
    source = source.replace("def mul(a, b):\\n    return a + b", "def mul(a, b):\\n    return a * b")
    open("calc/__init__.py", "w").write(source)
    print("fixed")
''')


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, served_model):
    with proxy_on_served(served_model, tmp_path_factory.mktemp("agent-coding")) as server:
        yield server


@pytest.fixture(scope="module")
def vllm(proxy):
    return proxy.vllm


@pytest.fixture
def episode(proxy, python_image, swe_task, coding_run_id, docker_client, tmp_path_factory, request):
    """``episode(agent_command, store=None, limits=LIMITS, **config)``: one agent_coding trajectory,
    run to its end (agent artifacts uploaded to ``store``, if given); afterwards no container of it
    may be left."""
    ran: list[str] = []

    def run(agent_command: str, store=None, limits: EpisodeLimits = LIMITS, **config) -> object:
        trajectory_id = f"{coding_run_id}-{request.node.name[:40]}-{len(ran)}"
        ran.append(trajectory_id)
        env = AgentCodingEnv({"image": python_image, "workspace_cache_dir": str(tmp_path_factory.getbasetemp() / "workspaces"),
                              "test_timeout_s": 60, "agent_command": agent_command, **config})
        task = TaskProfile(task_id="calc-1", env_name="agent_coding", task_data=swe_task, env_config={}, source="test")
        req = RolloutRequest(run_id=coding_run_id, group_id=0, episode_index=0, episode_seed=1, trajectory_id=trajectory_id,
                             group_size=1, task=task, policy_version=0, dispatched_at=0.0)
        return proxy.loop.run(run_agent_episode(req, env, proxy, limits, policy_version=lambda: 3, store=store))

    yield run
    for trajectory_id in ran:
        left = docker_client.api.containers(all=True, filters={"label": f"conveyor.trajectory_id={trajectory_id}"})
        assert not left, f"{trajectory_id} left containers: {[c['Names'] for c in left]}"


def test_from_inside_the_sandbox_only_its_own_proxy_session_is_reachable(episode, proxy, vllm, docker_client):
    other = proxy.loop.run(proxy.open_session("someone-else", RecordingLimits(16, 100, 1024, 4), lambda: 0, with_socket=True))
    gateway = docker_client.networks.get("bridge").attrs["IPAM"]["Config"][0].get("Gateway", "172.17.0.1")
    vllm_port = urlparse(vllm.base_url).port
    targets = [f"127.0.0.1:{proxy.port}", f"127.0.0.1:{vllm_port}", f"{gateway}:{proxy.port}", f"{gateway}:{vllm_port}",
               f"{gateway}:22", "10.0.0.1:80", "169.254.169.254:80", "1.1.1.1:443"]
    trajectory = episode(f"python3 -c {shlex.quote(PROBE)}", agent_timeout_s=120,
                         agent_env={"OTHER_KEY": other.key, "TARGETS": ",".join(targets)})
    output = trajectory.env_info["agent"]["output"]
    assert "\nPROBE " in "\n" + output, output
    probe = json.loads(("\n" + output).rsplit("\nPROBE ", 1)[1].splitlines()[0])
    print(f"\nfrom inside the sandbox: {probe}")
    assert probe["own"] == 200 and probe["other"] == 403, probe
    assert all(result != "connected" for result in probe["targets"].values()), probe["targets"]
    assert probe["agent_dir"] == ["proxy.sock"] and probe["interfaces"] == ["lo"] and probe["write"] != "written", probe
    assert len(trajectory.turns) == 1 and other.turns == []  # the refused call recorded nothing anywhere
    proxy.loop.run(proxy.close_session(other))


def test_a_scripted_agent_that_fixes_the_bug_scores_1_and_its_calls_are_the_trajectory(episode):
    trajectory = episode(f"python3 -c {shlex.quote(SCRIPTED_AGENT)}", agent_timeout_s=180)
    agent = trajectory.env_info["agent"]
    assert agent["exit_code"] == 0 and "fixed" in agent["output"], agent
    assert trajectory.env_reward == 1.0, trajectory.env_info.get("tests")
    assert trajectory.stop_reason is StopReason.done and trajectory.error is None
    assert len(trajectory.turns) == 2 and not trajectory.turns[1].segment_start
    assert [t.policy_version for t in trajectory.turns] == [3, 3]
    assert "def add" in trajectory.turns[0].observation  # the file the agent sent the model after the first reply
    flat = trajectory.flatten()
    assert sum(flat.loss_mask) == sum(len(t.sampled_token_ids) for t in trajectory.turns) > 0
    assert "calc/__init__.py" in trajectory.env_info["diff"]
    assert agent["first_call_s"] is not None and agent["calls"] == 2


def test_an_agent_that_never_ends_is_stopped_and_graded(episode):
    trajectory = episode("sleep 1000", agent_timeout_s=3)
    assert trajectory.stop_reason is StopReason.timeout
    assert trajectory.env_info["agent"]["timed_out"] is True and trajectory.turns == []
    assert trajectory.env_reward == 0.0


def test_an_agents_artifacts_are_stored_within_their_limits(episode, tmp_path):
    store = LocalStore(tmp_path / "objects")
    leave = ('mkdir -p "$AGENT_ARTIFACTS_DIR" && cd "$AGENT_ARTIFACTS_DIR" && echo "{\\"steps\\": 3, \\"budget\\": $AGENT_TIMEOUT_S}" > metrics.json'
             ' && echo notes > notes.txt && head -c 5000 /dev/zero > big.bin && mkdir sub && echo x > sub/nested.txt')
    trajectory = episode(leave, store=store,
                         agent_timeout_s=30, agent_artifacts_dir="/tmp/out", agent_artifact_bytes=1000)
    agent, request = trajectory.env_info["agent"], trajectory.request
    assert agent["exit_code"] == 0, agent["output"]
    assert agent["metrics"] == {"steps": 3, "budget": 30}
    assert agent["artifacts"] == {name: agent_artifact_key(request.run_id, request.trajectory_id, name)
                                  for name in ("metrics.json", "notes.txt")}
    assert list(agent["artifacts_skipped"]) == ["big.bin"] and "5000 bytes" in agent["artifacts_skipped"]["big.bin"]
    assert store.get_bytes(agent["artifacts"]["notes.txt"]) == b"notes\n"


@pytest.fixture(scope="module")
def mini_swe_agent_image(python_image, docker_client) -> str:
    """mini-swe-agent from PyPI on the Python image (built once, ~30 s; reused by its tag)."""
    try:
        return build_agent_image(docker_client, "mini-swe-agent", python_image)
    except RuntimeError as exc:
        if "pip could not install" in str(exc) and "Could not find a version" in str(exc):
            pytest.skip(f"the package registry is not reachable: {exc}")
        raise


# mini-swe-agent's own prompts are longer than the tiny model's context: shorter ones, same agent
MINI_SWE_AGENT = ("python3 -m minisweagent.run.mini -m openai/$OPENAI_MODEL --agent-class default -c mini.yaml "
                  "-c agent.step_limit=3 -c 'agent.instance_template=Solve this issue: {{task}}' "
                  "-c 'model.format_error_template=Call the bash tool.' "
                  '-l 0 --exit-immediately -o /tmp/mini.traj.json -t "$(cat $AGENT_TASK_FILE)"')


def test_mini_swe_agent_from_pypi_works_the_task_through_the_proxy(episode, proxy, mini_swe_agent_image):
    """A real agent from a package registry, unchanged: its litellm client talks to the proxy with
    tools, the tiny model's nonsense earns format errors until the step limit, and every call
    it made is a recorded turn (the reward is 0: nothing was fixed)."""
    trajectory = episode(MINI_SWE_AGENT, image=mini_swe_agent_image, agent_timeout_s=240)
    agent = trajectory.env_info["agent"]
    print(f"\nmini-swe-agent: exit {agent['exit_code']}, {agent['calls']} calls, first call after {agent['first_call_s']} s, "
          f"{agent['duration_s']} s; output tail:\n{agent['output'][-1500:]}")
    assert not agent["timed_out"] and agent["calls_refused"] == 0, agent
    assert len(trajectory.turns) == 3, agent  # its step limit: every step is one call
    # mini-swe-agent drops a reply with no tool call from its history and sends only its format
    # error: that is a rewritten history, so the next call starts a segment; a reply with a tool
    # call stays in the history, and the next call extends it
    turns = trajectory.turns
    assert [t.segment_start for t in turns[1:]] == [not before.tool_calls for before in turns[:-1]]
    assert len(trajectory.segments()) == 1 + sum(t.segment_start for t in turns)
    assert all(t.sampled_token_ids and len(t.logprobs) == len(t.sampled_token_ids) for t in trajectory.turns)
    opening = trajectory.turns[0]
    assert "bash" in proxy.chat.tokenizer.decode(opening.prompt_token_ids)  # its tool schema reached the model
    assert trajectory.env_reward == 0.0


# An agent that never gives up: it calls the model again whatever the answer, refusals included.
RELENTLESS_AGENT = textwrap.dedent('''
    import json, os, time, urllib.request, urllib.error
    base, key, model = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"]
    while True:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "again"}], "max_tokens": 4}).encode()
        req = urllib.request.Request(base + "/chat/completions", body, {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except urllib.error.HTTPError:
            time.sleep(0.1)
''')


def test_an_agent_that_retries_past_its_budget_is_stopped_at_once(episode, proxy):
    trajectory = episode(f"python3 -c {shlex.quote(RELENTLESS_AGENT)}", agent_timeout_s=240)
    agent = trajectory.env_info["agent"]
    assert trajectory.stop_reason is StopReason.max_turns and len(trajectory.turns) == LIMITS.max_turns, agent["output"][-3000:]
    assert not agent["timed_out"] and agent["duration_s"] < 60 and agent["calls_refused"] >= 1, agent
    assert "stopping the agent (max_turns" in agent["output"], agent["output"][-2000:]
