"""The GPU check of issue 25 on CPU: ``bench/gpu_check.py --device cpu --tiny`` runs every check
of the GPU run on tiny models in under a minute, its JSON holds real figures within their
bounds, and a check fails when what it checks is switched off. ``scripts/gpu_wheels.sh`` lists
the packages the trainer path imports beyond the GPU host's, and only those, with
pyproject.toml's bounds; given a Python 3.12 without pydantic, the bundle supplies them."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata as md
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from transformers import PreTrainedModel

import services.trainer.step as step

ROOT = Path(__file__).resolve().parents[2]
# what the GPU host has (issue 25), with everything they require
GPU_HOST_PACKAGES = ("torch", "transformers", "peft", "accelerate", "safetensors", "numpy")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tiny", "--threads", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    results["stdout"] = proc.stdout
    return results


@pytest.mark.timeout(240)
def test_the_tiny_check_runs_every_check_in_under_a_minute_and_prints_its_table(tiny_run):
    assert set(tiny_run["checks"]) == {"bf16", "speed", "checkpointing", "lora", "fsdp", "export", "levers", "delta"}
    assert not [name for name, r in tiny_run["checks"].items() if "error" in r]
    assert tiny_run["total_s"] < 60
    assert tiny_run["wheels"] == "host"  # this venv has every package; the GPU host unpacks wheels/gpu
    last_line = tiny_run["stdout"].strip().splitlines()[-1]
    assert last_line == "bf16=ok  speed=-  checkpointing=ok  lora=ok  fsdp=ok  levers=ok  delta=ok  export=ok"


@pytest.mark.timeout(240)
def test_bf16_against_fp32_is_within_bf16_tolerance_and_the_alarm_holds(tiny_run):
    r = tiny_run["checks"]["bf16"]
    assert 0 < r["loss_rel_err"] <= 1e-2 and 0 < r["grad_norm_rel_err"] <= 1e-2  # above 0: bf16 took effect
    assert r["alarm_fp32"] == 0 and r["alarm_bf16"] == 0
    assert r["logprob_mad_fp32"] <= r["alarm_thresholds"]["fp32"]
    assert r["logprob_mad_fp32"] < r["logprob_mad_bf16"] <= r["alarm_thresholds"]["bf16"]


@pytest.mark.timeout(240)
def test_speed_reports_tokens_per_second_and_no_mfu_without_a_known_peak(tiny_run):
    r = tiny_run["checks"]["speed"]
    assert r["tokens"] == r["sequences"] * tiny_run["scale"]["seq_len"]  # equal lengths: packed without padding
    assert r["median_step_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["median_step_s"])
    assert r["micro_batches"] > 1  # accumulation over token-budget micro-batches
    assert r["mfu"] is None and r["peak_source"] == "no peak FLOP/s is known for a CPU"


@pytest.mark.timeout(240)
def test_checkpointing_keeps_the_loss_and_lowers_saved_activations(tiny_run):
    r = tiny_run["checks"]["checkpointing"]
    assert r["loss_rel_diff"] <= 1e-3
    # on a CPU torch keeps no allocator peak: reported as null, with the note, never made up
    assert r["without"]["peak_memory_bytes"] is None and r["with"]["peak_memory_bytes"] is None
    assert "no allocator peak" in r["memory_note"] and r["compared"] == "saved_activation_peak_bytes"
    assert 0 < r["with"]["saved_activation_peak_bytes"] < r["without"]["saved_activation_peak_bytes"]


@pytest.mark.timeout(240)
def test_lora_trains_fewer_parameters_than_full_fine_tuning(tiny_run):
    r = tiny_run["checks"]["lora"]
    full, lora, large = r["full_ft"], r["lora_ft"], r["large_lora_checkpointed"]
    assert 0 < lora["trainable_params"] < full["trainable_params"] == full["total_params"]
    assert 0 < large["trainable_params"] < large["total_params"]
    assert all(run["median_step_s"] > 0 and run["saved_activation_peak_bytes"] > 0 for run in (full, lora, large))
    assert all(run["peak_memory_bytes"] is None for run in (full, lora, large))  # CPU: see above


@pytest.mark.timeout(240)
def test_a_one_rank_fully_shard_step_equals_the_unsharded_step(tiny_run):
    r = tiny_run["checks"]["fsdp"]
    assert r["backend"] == "gloo" and r["same_parameter_names"]
    assert set(r["unsharded_vs_itself"].values()) == {0.0}  # on a CPU the step is deterministic
    diff = r["sharded_vs_unsharded"]
    assert diff["loss"] <= 1e-6 and diff["grad_norm"] <= 1e-6 and diff["max_weight"] <= 1e-7
    assert diff["update_rel"] <= 1e-6


@pytest.mark.timeout(240)
def test_the_exported_checkpoint_reads_back_as_the_model(tiny_run):
    r = tiny_run["checks"]["export"]
    assert r["mismatched_weights"] == [] and r["weights_compared"] > 0
    assert r["weight_bytes"] > 0 and r["trainer_state_bytes"] > 0


@pytest.mark.timeout(240)
def test_the_delta_check_encodes_and_resolves_a_step_bit_for_bit(tiny_run):
    r = tiny_run["checks"]["delta"]
    assert r["passed"] and r["mismatched"] == [] and r["ops"] == ["grouped"] and r["resolve_on"] == "cpu"
    assert 0.01 < r["changed_fraction"] < 0.1  # an fp32-master step at lr 1e-6 moves a few percent of bf16 values
    assert 0 < r["payload_bytes"] < r["bf16_bytes"] / 10
    assert r["encode_s"] > 0 and r["encode_gb_per_s"] == pytest.approx(r["bf16_bytes"] / r["encode_s"] / 1e9)


# ---------------------------------------------------------------- the wheel bundle


def wheel_requirements() -> list[Requirement]:
    text = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    block = re.search(r"^REQUIREMENTS=\(\n(.*?)^\)", text, re.M | re.S)
    assert block, "scripts/gpu_wheels.sh has no REQUIREMENTS=( ... ) block"
    return [Requirement(line.strip().strip('"')) for line in block.group(1).splitlines() if line.strip()]


def host_closure(names: tuple[str, ...]) -> set[str]:
    """The packages named and every package they require (no extras), as installed here:
    an approximation of the GPU host's packages: its versions of them may require others."""
    env = default_environment() | {"extra": ""}
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for spec in md.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return seen


def trainer_path_imports() -> set[str]:
    """Top-level imports of every Conveyor module bench/gpu_check.py loads (a fresh process)."""
    code = ("import runpy, sys; runpy.run_path('bench/gpu_check.py', run_name='gpu_check'); "
            "print('\\n'.join(getattr(m, '__file__', None) or '' for n, m in list(sys.modules.items()) "
            "if n.split('.')[0] in ('services', 'shared')))")
    files = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           timeout=120).stdout.split()
    names = {"bench/gpu_check.py", "bench/gpu_bootstrap.py"} | set(files)
    tops: set[str] = set()
    for file in names:
        for node in ast.parse((ROOT / file).read_text() if not Path(file).is_absolute() else Path(file).read_text()).body:
            if isinstance(node, ast.Import):
                tops |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
    local = {path.stem for path in (ROOT / "bench").glob("*.py")}  # bench/'s own modules
    return tops - set(sys.stdlib_module_names) - local - {"services", "shared", "__future__"}


@pytest.mark.timeout(180)
def test_the_wheel_list_is_what_the_trainer_path_needs_beyond_the_gpu_host():
    distributions = md.packages_distributions()
    needed = {canonicalize_name(d) for top in trainer_path_imports() for d in distributions[top]}
    listed = {canonicalize_name(r.name) for r in wheel_requirements()}
    # every import the host's packages do not bring is listed, and nothing the trainer path does not import;
    # the closure here is of this venv's versions (e.g. transformers -> typer -> pydantic), and the issue
    # says the host lacks pydantic, so the packages the host may have are listed too when imported
    assert needed - host_closure(GPU_HOST_PACKAGES) <= listed <= needed
    assert "pydantic" in listed
    # gpu_check.py probes the same packages before it unpacks the wheels
    source = (ROOT / "bench" / "gpu_bootstrap.py").read_text()
    probed = ast.literal_eval(re.search(r"^NEEDED_IMPORTS = (\(.*?\))", source, re.M).group(1))
    assert {canonicalize_name(d) for top in probed for d in distributions[top]} == listed


def test_the_wheel_list_has_pyproject_bounds_and_the_bundle_is_not_in_git():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {canonicalize_name(r.name): r for r in map(Requirement, pyproject["project"]["dependencies"])}
    for req in wheel_requirements():
        name = canonicalize_name(req.name)
        if name in declared:
            assert req.specifier == declared[name].specifier, (req, declared[name])
        else:  # not declared by Conveyor: a requirement of a declared package, unbounded here
            assert not req.specifier, req
            assert any(canonicalize_name(Requirement(spec).name) == name
                       for dep in declared for spec in md.requires(dep) or []), req
    ignored = subprocess.run(["git", "check-ignore", "-q", "wheels/gpu/x.whl"], cwd=ROOT)
    assert ignored.returncode == 0, "wheels/ must be git-ignored"


@pytest.mark.timeout(240)
def test_the_logprob_levers_keep_the_loss_and_hold_fewer_activations(tiny_run):
    r = tiny_run["checks"]["levers"]
    every, needed, chunked = r["every_position"], r["needed_positions"], r["needed_chunked"]
    assert r["compared"] == "saved_activation_peak_bytes" and every["peak_memory_bytes"] is None  # CPU
    assert needed["loss_rel_diff"] <= 1e-3 and chunked["loss_rel_diff"] <= 1e-3
    # a quarter of each sequence is prompt: no logits there; chunks: one chunk of float32 logits at a time
    assert 0 < chunked["saved_activation_peak_bytes"] < needed["saved_activation_peak_bytes"] \
        < every["saved_activation_peak_bytes"]


def python312_without_pydantic() -> str | None:
    """A Python 3.12 here that lacks pydantic, as the GPU host does (``GPU_CHECK_PYTHON312``, else
    ``python3.12`` on PATH), or None."""
    found = os.environ.get("GPU_CHECK_PYTHON312") or shutil.which("python3.12")
    if found is None:
        return None
    real = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    if real.returncode != 0:  # e.g. a pyenv shim with no 3.12 selected
        return None
    python = real.stdout.strip()
    lacks = subprocess.run([python, "-c", "import pydantic"], capture_output=True, env={"PATH": "/usr/bin:/bin"})
    return python if lacks.returncode != 0 else None


@pytest.mark.skipif(not list((ROOT / "wheels" / "gpu").glob("*.whl")), reason="no wheels/gpu: run scripts/gpu_wheels.sh")
@pytest.mark.skipif(python312_without_pydantic() is None, reason="needs a Python 3.12 without pydantic: GPU_CHECK_PYTHON312 or python3.12 on PATH")
def test_the_bundle_gives_python_3_12_the_trainer_paths_packages(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from gpu_bootstrap import ensure_trainer_imports; "
            "print(ensure_trainer_imports()); import pydantic, pydantic_core; "
            "print(pydantic.TypeAdapter(int).validate_python('3'), pydantic_core.__file__)")
    proc = subprocess.run([python312_without_pydantic(), "-c", code, str(ROOT / "bench")], capture_output=True,
                          text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    source, validated = proc.stdout.splitlines()
    assert source.startswith("wheels/gpu (")
    assert validated.startswith("3 ") and "conveyor-gpu-site-" in validated  # the binary wheel, unpacked


@pytest.mark.timeout(120)
def test_the_checks_fail_when_what_they_check_is_off(monkeypatch):
    """No check that cannot fail: bf16 without autocast, checkpointing that does nothing,
    sharding that loses the gradient of the embedding (tied to the output head), and a delta
    resolve one bit off."""
    gpu_check = runpy.run_path(str(ROOT / "bench" / "gpu_check.py"), run_name="gpu_check")
    scale, cpu = gpu_check["TINY_SCALE"], gpu_check["torch"].device("cpu")
    monkeypatch.setattr(step, "compute_precision", lambda device, dtype: contextlib.nullcontext())
    bf16 = gpu_check["check_bf16"](scale, cpu)
    assert bf16["passed"] is False and bf16["loss_rel_err"] == 0
    monkeypatch.undo()
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", lambda self, **kwargs: None)
    checkpointing = gpu_check["check_checkpointing"](scale, cpu)
    assert checkpointing["passed"] is False
    assert checkpointing["with"]["saved_activation_peak_bytes"] == checkpointing["without"]["saved_activation_peak_bytes"]
    real_shard = gpu_check["shard_policy"]

    def shard_losing_a_gradient(model):  # noqa: ANN001, ANN202
        model.get_input_embeddings().weight.requires_grad_(False)
        return real_shard(model)

    # run_path returns a copy of the script's globals; its functions read the originals
    monkeypatch.setitem(gpu_check["check_fsdp"].__globals__, "shard_policy", shard_losing_a_gradient)
    fsdp = gpu_check["check_fsdp"](scale, cpu)
    assert fsdp["passed"] is False and fsdp["sharded_vs_unsharded"]["update_rel"] > 0.1
    device_order = gpu_check["delta_order_device"]
    real_resolve = device_order.resolve

    def resolve_one_bit_off(old, positions, zigzag):  # noqa: ANN001, ANN202
        index, bits = real_resolve(old, positions, zigzag)
        return index, bits ^ 1

    monkeypatch.setattr(device_order, "resolve", resolve_one_bit_off)
    delta = gpu_check["check_delta"](scale, cpu)
    assert delta["passed"] is False and delta["mismatched"]
