"""Language profiles: the language -> profile mapping, content-hash tags, and one real build (c)."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest

from services.rollout_worker.sandbox_profiles import (
    PROFILES,
    build_profile_image,
    dockerfile_path,
    profile_for_language,
    profile_tag,
)


@pytest.mark.parametrize(("language", "profile"), [
    ("python", "python"), ("Python", "python"), ("PYTHON3", "python"),
    ("javascript", "node"), ("JavaScript", "node"), ("typescript", "node"), ("TypeScript", "node"),
    ("node", "node"), ("nodejs", "node"),
    ("rust", "rust"), ("Rust", "rust"),
    ("go", "go"), ("Go", "go"), ("golang", "go"),
    ("c", "c"), ("C", "c"), ("c++", "c"), ("C++", "c"), ("cpp", "c"), ("CPP", "c"),
    (" python ", "python"),
    ("haskell", "dev-base"), ("", "dev-base"), (None, "dev-base"), ("dev-base", "dev-base"),
])
def test_profile_for_language(language, profile):
    assert profile_for_language(language) == profile


def test_every_profile_has_a_dockerfile_from_a_base_build_arg():
    for profile in PROFILES:
        text = dockerfile_path(profile).read_text()
        assert "ARG BASE\nFROM ${BASE}\n" in text, profile
        assert "USER 1000:1000" in text, profile
    # the extra CA bundle is installed once, in dev-base, which every other profile builds on
    base = dockerfile_path("dev-base").read_text()
    assert "EXTRA_CA_PEM" in base and "update-ca-certificates" in base
    with pytest.raises(ValueError):
        dockerfile_path("cobol")


# -- real Docker ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def docker_client():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - no daemon, no socket, no permission
        pytest.skip(f"needs a running Docker daemon (docker.from_env().ping() failed: {exc})")
    return client


@pytest.fixture(scope="module")
def python_base(docker_client) -> str:
    """The debootstrap python base the profiles build on: reused by its content tag, built
    here (about a minute, from Debian's mirror) on a machine that has none yet."""
    from services.rollout_worker.sandbox.images import build_python_base_image

    return build_python_base_image(docker_client)


@pytest.mark.docker
def test_profile_tag_is_a_content_hash(docker_client, python_base):
    plain = profile_tag(docker_client, "c", python_base)
    assert plain == profile_tag(docker_client, "c", python_base)
    assert plain.startswith("conveyor/profile-c:")
    pem = b"-----BEGIN CERTIFICATE-----\nconveyor-test\n-----END CERTIFICATE-----\n"
    assert profile_tag(docker_client, "c", python_base, ca_bundle=pem) != plain
    assert profile_tag(docker_client, "go", python_base) != plain
    with pytest.raises(ValueError):
        profile_tag(docker_client, "c", python_base, ca_bundle=b"not a pem")
    with pytest.raises(RuntimeError, match="not present locally"):
        profile_tag(docker_client, "c", "conveyor/no-such-base:" + uuid.uuid4().hex[:8])


def _debian_mirror_reachable() -> bool:
    try:
        socket.create_connection(("deb.debian.org", 80), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.docker
@pytest.mark.slow  # first build: apt-get of gcc/g++/make/git from the Debian mirror, ~1-3 min here
@pytest.mark.timeout(900)
def test_c_profile_builds_from_the_local_base_and_compiles_as_nobody(docker_client, python_base):
    from services.rollout_worker.sandbox import Sandbox, SandboxLabels, SandboxSpec

    tag = profile_tag(docker_client, "c", python_base)
    if not docker_client.images.list(name=tag) and not _debian_mirror_reachable():
        pytest.skip("deb.debian.org is unreachable; the c profile installs gcc from it")
    assert build_profile_image(docker_client, "c", python_base) == tag

    start = time.monotonic()
    assert build_profile_image(docker_client, "c", python_base) == tag  # present: reused, not rebuilt
    assert time.monotonic() - start < 2

    run_id = "proftest-" + uuid.uuid4().hex[:8]
    spec = SandboxSpec(image=tag, labels=SandboxLabels(run_id=run_id, group_id="g0", trajectory_id=f"{run_id}_c"))

    async def scenario():
        async with await Sandbox.provision(spec, client=docker_client) as sandbox:  # user 65534:65534
            version = await sandbox.exec("gcc --version", timeout_s=30)
            who = await sandbox.exec("id -u", timeout_s=10)
            await sandbox.write_file("hello.c", '#include <stdio.h>\nint main(void){puts("hi from c");return 0;}\n')
            compiled = await sandbox.exec("gcc -O0 -o hello hello.c && ./hello", timeout_s=60)
            return version, who, compiled

    try:
        version, who, compiled = asyncio.run(scenario())
    finally:
        for info in docker_client.api.containers(all=True, filters={"label": f"conveyor.run_id={run_id}"}):
            docker_client.api.remove_container(info["Id"], force=True, v=True)
    assert version.exit_code == 0 and "gcc" in version.output, version
    assert who.output.strip() == "65534", who
    assert compiled.exit_code == 0 and compiled.output.strip() == "hi from c", compiled
    assert not docker_client.api.containers(all=True, filters={"label": f"conveyor.run_id={run_id}"})
