"""The compose stack, as users run it: images built offline, `docker-compose up` with the CPU
profile, the demo experiment end to end, two more runs beside it as docs/compose.md says (a
submitted run that trains on a vLLM of its own, and the own-dataset recipe), Flower, durable Redis and S3, and sandboxes that a
compose-run worker (in its own torch-free image) starts cut off from every service of the stack.
docs/compose.md's `scripts/stack.sh` lines for scaling, stopping and listing runs and submitting
a second run are run as written on this stack (``compose_support.run_as_written``).

One stack per module (its own compose project, volumes and published ports); it is brought
down with its volumes at the end. Needs a Docker daemon, docker-compose (1.29 or v2), and
root with debootstrap for the base image. Marked ``slow`` and ``docker``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import free_port
from services.cli.stack_images import StackImages
from shared.state.replica_holders import ReplicaHolders
from compose_support import (GUESS_RUN, HEAD_ADDRESS, ROOT, SECRETS, Stack, compose_command, doc_commands, run_as_written,
                             stack_env, write_env)

pytestmark = [pytest.mark.slow, pytest.mark.docker]

@pytest.fixture(scope="module")
def stack(images: StackImages, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    compose = compose_command()
    ports = {name: free_port() for name in ("redis", "s3", "inference", "flower", "viewer")}
    project = f"conveyortest{uuid.uuid4().hex[:6]}"
    # .env.example's demo (the digit task), shortened: 6 groups of 8 sampled, 3 steps of 2 groups
    env = stack_env(images, ports, CONVEYOR_MAX_STEPS="3", CONVEYOR_NUM_GROUPS="6", CONVEYOR_GROUPS_PER_STEP="2",
                    CONVEYOR_STACK_ID=project)
    env_file = write_env(tmp_path_factory.mktemp("compose") / "stack.env", env)
    stack = Stack(project, env_file, ports, compose)
    try:
        stack.dc("up", "-d", timeout=900)
        yield stack
    finally:
        for service in ("trainer", "inference", "rollout-worker", "scorer", "intake"):
            print(f"----- {service} -----\n{stack.logs(service)[-4000:]}")
        stack.tear_down()


def container_state(stack: Stack, service: str) -> dict:
    return json.loads(subprocess.run(["docker", "inspect", stack.container(service)], capture_output=True, text=True,
                                     check=True).stdout)[0]["State"]


def wait_for_exit(stack: Stack, service: str, timeout_s: float) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = container_state(stack, service)
        if state["Status"] == "exited":
            return int(state["ExitCode"])
        time.sleep(3)
    raise AssertionError(f"{service} still running after {timeout_s}s:\n{stack.logs(service)[-4000:]}")


def ended_consumed(trajectories: int) -> dict[str, int]:
    return {"queued": 0, "running": 0, "uploaded": 0, "scored": 0, "consumed": trajectories, "failed": 0}


class SubmitContainer:
    """The detached container of a `scripts/stack.sh submit` (its output given), followed from its
    start: it is removed once it exits (--rm)."""

    def __init__(self, submit_output: str) -> None:
        container = re.search(r"in container (\w+)", submit_output).group(1)
        self.waiting = subprocess.Popen(["docker", "wait", container], stdout=subprocess.PIPE, text=True)
        self.following = subprocess.Popen(["docker", "logs", "-f", container], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)

    def ended(self, run_id: str, timeout_s: float = 1200) -> str:
        """Its output, once it exited 0 with the run's 8 trajectories consumed."""
        output = self.following.communicate(timeout=timeout_s)[0]
        exit_code = self.waiting.communicate(timeout=60)[0].strip()
        assert exit_code == "0" and f"run {run_id} done: trajectories 8 consumed" in output, (exit_code, output[-3000:])
        return output


DEMO_TRAJECTORIES = 48  # the fixture's demo: 6 groups of 8


def _training_run_config(tmp_path: Path, run_id: str) -> None:
    """Run ``run_id``'s config, `runs/<run_id>.yaml` (the doc's names), beside a two-row dataset: a
    run that trains, two groups of 4, a step per group."""
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o755)
    runs.chmod(0o755)  # the submit container's user reads it
    dataset = write_demo_dataset(runs / f"{run_id}.jsonl", 2)
    config = runs / f"{run_id}.yaml"
    config.write_text(f"run_id: {run_id}\nintake:\n  dataset: {dataset}\n  mode: traversal\n"
                      f"inference:\n  model_path: /models/tiny\n  eager: true\n  weights_dir: /data/weights/{run_id}\n"
                      "rollout:\n  group_size: 4\n"
                      "trainer:\n  mode: train\n  max_off_policy_steps: 1\n  groups_per_step: 1\n  zero_variance_groups: keep\n"
                      f"  metrics_path: /data/{run_id}-groups.jsonl\n  step_metrics_path: /data/{run_id}-steps.jsonl\n")
    for path in (dataset, config):
        path.chmod(0o644)


def test_a_submitted_run_and_your_own_dataset_run_beside_the_training_demo_as_written_in_the_docs(
        stack: Stack, tmp_path: Path) -> None:
    """Three runs at once on the stack's workers, each from docs/compose.md's lines run by the
    shell as written, while the stack's own demo run (A) trains on the stack's vLLM, which its
    follower holds (a run that trains is alone on a replica):
    - run `second` (B), submitted with `scripts/stack.sh submit` (its config in a folder mounted
      into the submit container, its dataset beside it), trains too: seeing the stack's vLLM held,
      it launches a vLLM of its own in the submit container, the stack's workers send its
      rollouts there, and it trains its two steps; the container exits 0 and `logs` shows its
      processes;
    - run `mine`, the own-dataset recipe (two guess-the-number rows, each once: 2 groups of 8),
      with its own trainer, assembling groups of the stack's vLLM.
    Every run ends with every trajectory consumed."""
    ledger, deadline = stack.ledger(), time.time() + 1200  # A trains once vLLM serves
    while sum((demo := ledger.counts("demo")).values()) - demo["queued"] == 0 and time.time() < deadline:
        time.sleep(1)
    assert demo["consumed"] < DEMO_TRAJECTORIES and container_state(stack, "trainer")["Status"] == "running", \
        f"the demo run is not training: {demo}"
    holders = ReplicaHolders(ledger.redis)
    assert [h.run_id for h in holders.holders("http://inference:8000")] == ["demo"]

    _training_run_config(tmp_path, "second")
    submit, logs = doc_commands("scripts/stack.sh submit runs/second.yaml")
    started = time.monotonic()
    submitted = SubmitContainer(run_as_written(stack, submit, tmp_path))

    write_demo_dataset(tmp_path / "mine.jsonl", 2)
    copy, start_trainer, publish = doc_commands("CONVEYOR_RUN_ID=mine")
    run_as_written(stack, copy, tmp_path)
    trainer = run_as_written(stack, start_trainer, tmp_path).strip().splitlines()[-1]
    run_as_written(stack, publish, tmp_path)
    exit_code = subprocess.run(["docker", "wait", trainer], capture_output=True, text=True, timeout=900).stdout.strip()
    trainer_log = subprocess.run(["docker", "logs", trainer], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True).stdout
    assert exit_code == "0" and ledger.counts("mine") == ended_consumed(16), (exit_code, trainer_log[-3000:])
    assert "trainer mine: " in trainer_log, trainer_log[-3000:]  # its counters, as it exits
    print(f"run mine: {time.monotonic() - started:.0f}s from the submit of run second to its trainer's exit; demo {demo}")

    output = submitted.ended("second")
    assert "http://inference:8000 is held: run demo trains on it" in output, output[-3000:]
    url = re.search(r"its inference server (http://\S+) is up after", output).group(1)
    assert url != "http://inference:8000"
    assert ledger.counts("second") == ended_consumed(8)
    steps = stack.dc("exec", "-T", "scorer", "cat", "/data/second-steps.jsonl").stdout
    assert [json.loads(line)["step"] for line in steps.splitlines()] == [1, 2], steps
    shown = run_as_written(stack, logs, tmp_path)
    assert "[intake]" in shown and "[trainer]" in shown and "[follower]" in shown, shown[-3000:]
    print(f"run second: {time.monotonic() - started:.0f}s from the submit to its end, on its own vLLM at {url}")

    assert wait_for_exit(stack, "trainer", 1500) == 0, stack.logs("trainer")
    assert ledger.counts("demo") == ended_consumed(DEMO_TRAJECTORIES)


def test_your_own_model_goes_into_the_models_volume_as_written_in_the_docs(stack: Stack, tmp_path: Path) -> None:
    """docs/compose.md's lines that make a model folder readable and copy it (`./my-model`, here the tiny model
    generated on the host) into the `models` volume, run by the shell as written; a container of
    the stack then loads its config and tokenizer from `/models/my-model`, and every file arrived whole."""
    from services.inference.tiny_model import generate_tiny_model

    model = generate_tiny_model(tmp_path / "my-model")
    files = {f.name: f.stat().st_size for f in model.iterdir() if f.is_file()}
    readable, copy = doc_commands("/models/my-model")
    started = time.monotonic()
    run_as_written(stack, readable, tmp_path)
    run_as_written(stack, copy, tmp_path)
    check = ("import json, os, sys; from transformers import AutoConfig, AutoTokenizer; d = '/models/my-model'; "
             "AutoConfig.from_pretrained(d); AutoTokenizer.from_pretrained(d); "
             "paths = {f: os.path.join(d, f) for f in os.listdir(d)}; "
             "print(json.dumps({f: os.path.getsize(p) for f, p in paths.items() if os.path.isfile(p)}))")
    copied = stack.dc("run", "--rm", "--no-deps", "-T", "--entrypoint", "python", "model-init", "-c", check)
    assert json.loads(copied.stdout.strip().splitlines()[-1]) == files
    print(f"{copy}: {time.monotonic() - started:.1f}s with its check")


def test_the_demo_experiment_runs_end_to_end(stack: Stack) -> None:
    assert wait_for_exit(stack, "trainer", 1500) == 0, stack.logs("trainer")
    assert wait_for_exit(stack, "intake", 60) == 0, stack.logs("intake")
    trainer = stack.logs("trainer")
    # the trainer's log shows progress: step, reward and throughput
    assert "step 1: reward" in trainer and "tokens/s" in trainer and "trajectories/s" in trainer, trainer[-3000:]
    counts = json.loads(stack.conveyor("status", "--json"))["runs"]["demo"]
    assert counts == ended_consumed(DEMO_TRAJECTORIES)
    # weight sync reached the inference container: it serves a trained version
    assert "serving version 1" in stack.logs("inference")
    # the viewer, from the compose stack, shows the run and its trained steps
    viewer = f"http://127.0.0.1:{stack.ports['viewer']}"
    run_page = httpx.get(f"{viewer}/runs/demo", timeout=30).text
    assert ">48<" in run_page and "class='plot'" in run_page, run_page[-2000:]


def test_flower_shows_workers_and_queues_behind_basic_auth(stack: Stack) -> None:
    base = f"http://127.0.0.1:{stack.ports['flower']}"
    auth = (SECRETS["FLOWER_USER"], SECRETS["FLOWER_PASSWORD"])
    deadline = time.time() + 120
    workers: dict = {}
    while time.time() < deadline and not ({"rollout", "scoring"} <= {name.split("@")[0] for name in workers}):
        workers = httpx.get(f"{base}/api/workers", auth=auth, params={"refresh": "1"}, timeout=30).json()
        time.sleep(3)
    assert {"rollout", "scoring"} <= {name.split("@")[0] for name in workers}, workers
    queues = httpx.get(f"{base}/api/queues/length", auth=auth, timeout=30).json()
    assert {"rollouts", "scoring"} <= {q["name"] for q in queues["active_queues"]}, queues
    assert httpx.get(f"{base}/api/workers", timeout=30).status_code == 401
    broker = httpx.get(f"{base}/broker", auth=auth, timeout=30).text  # the Broker page lists Conveyor's queues
    assert "rollouts" in broker and "scoring" in broker


# Run inside the scorer container: scrape every service's /metrics on the stack network.
SCRAPE = """
import base64, json, sys, urllib.request
auth = base64.b64encode(sys.argv[2].encode()).decode()
out = {}
for url in json.loads(sys.argv[1]):
    request = urllib.request.Request(url, headers={"Authorization": "Basic " + auth})
    out[url] = urllib.request.urlopen(request, timeout=20).read().decode()
print(json.dumps(out))
"""


def metric_value(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) in a Prometheus text page."""
    samples = [line for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    assert samples, f"{name} not exposed"
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)


def test_every_service_exposes_prometheus_metrics(stack: Stack) -> None:
    """After the demo run: the worker's episodes, sandbox and inference latency, the scorer's
    scoring time, the weight follower's syncs and served version, queue depth and ledger states
    from each of them, vLLM's own metrics and Flower's."""
    urls = {"worker": "http://rollout-worker:9100/metrics", "scorer": "http://127.0.0.1:9100/metrics",
            "inference": "http://inference:9100/metrics", "vllm": "http://inference:8000/metrics",
            "flower": "http://flower:5555/metrics"}
    auth = f"{SECRETS['FLOWER_USER']}:{SECRETS['FLOWER_PASSWORD']}"
    pages = json.loads(stack.dc("exec", "-T", "scorer", "python", "-c", SCRAPE, json.dumps(list(urls.values())),
                                auth).stdout.strip().splitlines()[-1])
    worker, scorer, inference = pages[urls["worker"]], pages[urls["scorer"]], pages[urls["inference"]]
    assert metric_value(worker, "conveyor_rollout_episodes_in_flight") == 0  # the run is over
    assert metric_value(worker, "conveyor_inference_request_seconds_count") > 0
    metric_value(worker, "conveyor_sandbox_provision_seconds_count")  # exposed (the demo's toy env has no sandbox)
    assert metric_value(scorer, "conveyor_scoring_seconds_count") > 0
    assert metric_value(inference, "conveyor_weight_sync_seconds_count") >= 1
    assert metric_value(inference, "conveyor_served_policy_version") >= 1
    for page in (worker, scorer, inference):
        assert metric_value(page, "conveyor_ledger_trajectories") >= 48  # the demo run's trajectories, by state
        metric_value(page, "conveyor_queue_depth")
    assert "vllm:" in pages[urls["vllm"]]
    assert "flower_" in pages[urls["flower"]]


# Run inside the rollout-worker container: start a sandbox through its Docker socket, as an
# episode does, and try every address of the stack from inside it.
SANDBOX_PROBE = """
import asyncio, json, sys
from services.rollout_worker.sandbox import Sandbox, SandboxLabels, SandboxSpec
from services.rollout_worker.sandbox.client import default_client

async def main():
    labels = SandboxLabels(run_id="composetest", group_id="0", trajectory_id="composetest-probe")
    async with await Sandbox.provision(SandboxSpec(image=sys.argv[2], labels=labels)) as box:
        out = {}
        for target in json.loads(sys.argv[1]):
            host, port = target.rsplit(":", 1)
            r = await box.exec(f"nc -w 2 {host} {port} </dev/null && echo OPEN || echo CLOSED", timeout_s=15)
            out[target] = (r.output.strip().splitlines() or [""])[-1]
        labels = default_client().api.inspect_container(box.container_id)["Config"]["Labels"]
        print(json.dumps({"reached": out, "stack": labels.get("conveyor.stack")}))

asyncio.run(main())
"""


def test_sandboxes_started_by_a_compose_worker_cannot_reach_the_stack(stack: Stack) -> None:
    from services.rollout_worker.sandbox.images import build_busybox_image

    image = build_busybox_image()
    targets = []
    for service, port in (("redis", 6379), ("s3", 9000), ("inference", 8000), ("flower", 5555)):
        info = json.loads(subprocess.run(["docker", "inspect", stack.container(service)], capture_output=True,
                                         text=True, check=True).stdout)[0]
        ips = [net["IPAddress"] for net in info["NetworkSettings"]["Networks"].values() if net["IPAddress"]]
        targets += [f"{service}:{port}"] + [f"{ip}:{port}" for ip in ips]
    result = stack.dc("exec", "-T", "rollout-worker", "python", "-c", SANDBOX_PROBE, json.dumps(targets), image)
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    reached = probe["reached"]
    assert probe["stack"] == stack.project  # the worker labels its sandboxes with its stack's id
    assert set(reached) == set(targets)
    assert all(v != "OPEN" for v in reached.values()), reached


def test_redis_and_s3_keep_their_data_across_a_restart(stack: Stack) -> None:
    before = json.loads(stack.conveyor("status", "--json"))["runs"]
    objects_before = stack.dc("exec", "-T", "scorer", "python", "-c",
                              "from shared.settings import load_settings; from shared.storage import open_store; "
                              "print(len(open_store(load_settings().storage).list_keys('')))").stdout.strip()
    stack.dc("restart", "redis", "s3", timeout=300)
    deadline = time.time() + 120
    while True:
        try:
            after = json.loads(stack.conveyor("status", "--json"))["runs"]
            objects_after = stack.dc("exec", "-T", "scorer", "python", "-c",
                                     "from shared.settings import load_settings; from shared.storage import open_store; "
                                     "print(len(open_store(load_settings().storage).list_keys('')))").stdout.strip()
            break
        except (AssertionError, json.JSONDecodeError):
            if time.time() > deadline:
                raise
            time.sleep(3)
    assert after == before and before
    assert objects_after == objects_before and int(objects_before) > 0


def test_scaled_workers_are_distinct_and_a_stopped_worker_loses_nothing(stack: Stack, tmp_path: Path) -> None:
    """Two rollout workers (docs/compose.md's `scripts/stack.sh scale 2`, run as written): each has
    its own Celery name. One of them gets SIGTERM (`docker stop`, what `docker-compose stop` sends)
    while episodes run; every trajectory of the run still ends consumed."""
    [scale] = doc_commands("scripts/stack.sh scale")
    started = time.monotonic()
    run_as_written(stack, scale, tmp_path)
    print(f"{scale}: {time.monotonic() - started:.1f}s")
    workers = stack.dc("ps", "-q", "rollout-worker").stdout.split()
    assert len(workers) == 2
    base, auth = f"http://127.0.0.1:{stack.ports['flower']}", (SECRETS["FLOWER_USER"], SECRETS["FLOWER_PASSWORD"])
    deadline = time.time() + 300
    names: set[str] = set()
    while time.time() < deadline and len(names) < 2:
        listed = httpx.get(f"{base}/api/workers", auth=auth, params={"refresh": "1"}, timeout=30).json()
        names = {name for name in listed if name.startswith("rollout@")}
        time.sleep(3)
    assert len(names) == 2, names  # rollout@<container id> each
    run = ["-e", "CONVEYOR_RUN_ID=scale", "-e", "CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS=1000",
           "-e", "CONVEYOR_TRAINER__MAX_STEPS=1000", *GUESS_RUN]  # multi-turn episodes, long enough to interrupt
    trainer = stack.dc("run", "-d", *run, "trainer", "trainer", "--exit-when-done").stdout.strip().splitlines()[-1]
    stack.dc("run", "-d", *run, "intake", "intake", "--demo-tasks", "16", timeout=600)
    ledger, deadline = stack.ledger(), time.time() + 600
    while (counts := ledger.counts("scale"))["running"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert counts["running"] > 0, f"no episode was running to interrupt: {counts}"
    subprocess.run(["docker", "stop", "-t", "120", workers[0]], check=True, capture_output=True, timeout=300)
    exit_code = subprocess.run(["docker", "wait", trainer], capture_output=True, text=True, timeout=900).stdout.strip()
    counts = json.loads(stack.conveyor("status", "--json", "--run", "scale"))["runs"]["scale"]
    assert exit_code == "0" and counts == ended_consumed(64), (exit_code, counts, subprocess.run(
        ["docker", "logs", trainer], capture_output=True, text=True).stdout[-3000:])


def test_a_run_is_stopped_and_listed_as_written_in_the_docs(stack: Stack, tmp_path: Path) -> None:
    """docs/compose.md's "Stopping a run" lines, run by the shell as written, on run `long`: its
    intake (no trainer reads the run) has published and waits on the staleness bound. After the
    stop, intake exits 0, every trajectory of the run is consumed or failed, and `list` shows the
    stop with its reason."""
    run = ["-e", "CONVEYOR_RUN_ID=long", *GUESS_RUN]
    intake = stack.dc("run", "-d", *run, "intake", "intake", "--demo-tasks", "200").stdout.strip().splitlines()[-1]
    ledger, deadline = stack.ledger(), time.time() + 300
    while sum(ledger.counts("long").values()) == 0 and time.time() < deadline:
        time.sleep(0.5)
    stop, listing = doc_commands("scripts/stack.sh stop long")
    started = time.monotonic()
    assert "run long stopped" in run_as_written(stack, stop, tmp_path)
    exit_code = subprocess.run(["docker", "wait", intake], capture_output=True, text=True, timeout=300).stdout.strip()
    intake_log = subprocess.run(["docker", "logs", intake], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True).stdout
    assert exit_code == "0", intake_log[-3000:]
    deadline = time.time() + 120  # a running episode is cut at its worker's next heartbeat
    while any((counts := ledger.counts("long"))[state] for state in ("queued", "running", "uploaded", "scored")):
        assert time.time() < deadline, counts
        time.sleep(1)
    assert counts["failed"] > 0, counts
    listed = run_as_written(stack, listing, tmp_path)  # a table, its cells wrapped to the terminal's width
    assert "long" in listed and "diverged" in listed, listed
    [summary] = json.loads(stack.conveyor("run", "list", "--json", "--run", "long"))["runs"]
    assert summary["stopped"].endswith(": diverged at step 40") and summary["trajectories"] == counts, summary
    print(f"run long: {time.monotonic() - started:.0f}s from the stop to its listing; {counts}")


def test_a_worker_on_another_host_joins_through_published_ports(stack: Stack, tmp_path: Path) -> None:
    """docs/compose.md's `worker-host` line, run by the shell as written (its example head address
    standing for the Docker bridge's gateway, which the head publishes on): a second compose
    project (its own network: a second host) runs only rollout workers, 4 of them
    (compose/worker-host.yml), pointed at the head's published Redis, S3 and inference ports.
    With the head's own workers stopped, the second host's workers do a whole run, and, at the
    same time, run `far`, submitted with the doc's line that publishes a vLLM of the run's own on
    the head's address: the second host's workers reach it only through that published port."""
    env_file = tmp_path / "worker-host.env"
    env_file.write_text(stack.env_file.read_text() + "".join(
        f"{k}={v}\n" for k, v in {"CONVEYOR_HEAD": HEAD_ADDRESS, "HEAD_REDIS_PORT": stack.ports["redis"],
                                  "HEAD_S3_PORT": stack.ports["s3"], "HEAD_INFERENCE_PORT": stack.ports["inference"]}.items()))
    remote = Stack(f"{stack.project}w", env_file, stack.ports, stack.compose, (ROOT / "compose" / "worker-host.yml",))
    try:
        [line] = doc_commands("scripts/stack.sh worker-host")
        run_as_written(remote, line, tmp_path, timeout=900, examples={"10.0.0.5": HEAD_ADDRESS})
        assert len(remote.dc("ps", "-q", "rollout-worker").stdout.split()) == 4  # the line's --scale
        stack.dc("stop", "rollout-worker", timeout=300)  # the head keeps no worker: the run is the remote's
        worker = remote.container("rollout-worker")
        networks = json.loads(subprocess.run(["docker", "inspect", worker], capture_output=True, text=True,
                                             check=True).stdout)[0]["NetworkSettings"]["Networks"]
        assert list(networks) == [f"{remote.project}_stack"], networks  # not on the head's network
        _training_run_config(tmp_path, "far")
        [submit_far] = doc_commands("RUN_INFERENCE_PUBLISH=")
        far_port = free_port()
        far = SubmitContainer(run_as_written(stack, submit_far, tmp_path,
                                             examples={"10.0.0.5": HEAD_ADDRESS, "8100": str(far_port)}))
        run = ["-e", "CONVEYOR_RUN_ID=remote", "-e", "CONVEYOR_TRAINER__MAX_STEPS=1000",
               "-e", "CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS=1000", *GUESS_RUN]
        trainer = stack.dc("run", "-d", *run, "trainer", "trainer", "--exit-when-done").stdout.strip().splitlines()[-1]
        stack.dc("run", "--rm", "-T", *run, "intake", "intake", "--demo-tasks", "4", timeout=600)
        exit_code = subprocess.run(["docker", "wait", trainer], capture_output=True, text=True, timeout=900).stdout.strip()
        assert exit_code == "0", (remote.logs("rollout-worker")[-3000:], subprocess.run(
            ["docker", "logs", trainer], capture_output=True, text=True).stdout[-3000:])
        assert stack.ledger().counts("remote") == ended_consumed(16)
        output = far.ended("far")
        assert f"its inference server http://{HEAD_ADDRESS}:{far_port} is up after" in output, output[-3000:]
        assert stack.ledger().counts("far") == ended_consumed(8)
        called = f"run far's episodes call its own inference server http://{HEAD_ADDRESS}:{far_port}"
        assert called in remote.logs("rollout-worker"), remote.logs("rollout-worker")[-3000:]
        base, auth = f"http://127.0.0.1:{stack.ports['flower']}", (SECRETS["FLOWER_USER"], SECRETS["FLOWER_PASSWORD"])
        listed = httpx.get(f"{base}/api/workers", auth=auth, params={"refresh": "1"}, timeout=30).json()
        assert f"rollout@{worker[:12]}" in listed, sorted(listed)  # the head's Flower sees the remote worker
    finally:
        remote.tear_down()
