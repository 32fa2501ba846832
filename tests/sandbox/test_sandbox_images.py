"""Base images built offline: content-hash tags, the extra CA bundle, and a debootstrap Python base."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time

import pytest

from services.rollout_worker.sandbox import Sandbox
from services.rollout_worker.sandbox.images import build_busybox_image, build_python_base_image

pytestmark = [pytest.mark.docker]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.timeout(120)
def test_busybox_image_is_tagged_by_content_and_carries_the_extra_ca(docker_client, busybox_image, tmp_path, make_spec):
    start = time.monotonic()
    assert build_busybox_image(docker_client) == busybox_image  # same inputs: same tag, no rebuild
    assert time.monotonic() - start < 2

    ca = tmp_path / "corp-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nconveyor-test\n-----END CERTIFICATE-----\n")
    with_ca = build_busybox_image(docker_client, ca_bundle=ca)
    assert with_ca != busybox_image and with_ca.startswith("conveyor/busybox:")

    async def scenario():
        async with await Sandbox.provision(make_spec(image=with_ca)) as sandbox:
            return await sandbox.read_file("/usr/local/share/ca-certificates/conveyor-extra.crt")

    assert run(scenario()) == ca.read_bytes()


def _debian_mirror_reachable() -> bool:
    try:
        socket.create_connection(("deb.debian.org", 80), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow  # the first build runs debootstrap: 45-150 s here, depending on the mirror
@pytest.mark.timeout(900)
def test_python_base_image_runs_python_in_a_dash_session(docker_client, make_spec):
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("building python-base needs root and debootstrap")
    if not _debian_mirror_reachable():
        pytest.skip("deb.debian.org is unreachable; python-base is built with debootstrap from it")
    # python3 only (no ca-certificates), the quickest recipe; cached by tag after the first build.
    image = build_python_base_image(docker_client, include=("python3",))

    async def scenario():
        async with await Sandbox.provision(make_spec(image=image)) as sandbox:
            shell = await sandbox.exec("readlink -f /bin/sh")
            assert shell.output.strip().endswith("dash")
            result = await sandbox.exec("python3 -c 'import sys; print(sys.version_info[:2])'")
            assert result.ok and result.output.startswith("(3, ")
            timed = await sandbox.exec("python3 -c 'import time; time.sleep(60)'", timeout_s=1)
            assert timed.timed_out and timed.exit_code is None
            await sandbox.write_file("t.py", "print(6 * 7)\n")
            assert (await sandbox.exec("python3 t.py")).output == "42\n"
            assert (await sandbox.diff()).added == ("t.py",)

    run(scenario())
