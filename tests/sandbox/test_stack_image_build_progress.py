"""An image build of the compose stack is never silent: each Dockerfile step is printed as it
starts and a long step shows its latest line; a failed build raises with the daemon's error and
the build's last lines. A real ``docker build`` of tiny images on the busybox base."""

from __future__ import annotations

import uuid

import docker
import pytest

from services.cli import stack_images

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def test_a_build_prints_its_steps_and_a_long_steps_lines_and_a_failure_says_why(
        docker_client, busybox_image, tmp_path, capsys, monkeypatch):
    stack_id = f"progresstest-{uuid.uuid4().hex[:8]}"
    good, bad = tmp_path / "good", tmp_path / "bad"
    for context, run in ((good, "RUN for i in 1 2 3 4; do echo line-$i; sleep 1; done"),
                         (bad, "RUN echo about-to-fail && exit 3")):
        context.mkdir()
        (context / "Dockerfile").write_text(f"ARG BASE\nFROM $BASE\n{run}\n")
    tags = [f"conveyor/progresstest:{stack_id}-{name}" for name in ("good", "bad")]
    monkeypatch.setattr(stack_images, "BUILD_REPORT_EVERY_S", 0.5)
    try:
        stack_images._build(docker_client, tags[0], good, busybox_image, "progresstest", stack_id)
        out = capsys.readouterr().out
        assert "[images] progresstest" in out and ": ARG BASE" in out and ": RUN for i in" in out, out
        assert "line-3" in out or "line-4" in out, out  # within the 4 s step, its latest line at least once
        assert f"[images] {tags[0]} built in" in out

        with pytest.raises(docker.errors.BuildError, match="non-zero code: 3.*about-to-fail"):
            stack_images._build(docker_client, tags[1], bad, busybox_image, "progresstest", stack_id)
    finally:
        for image in docker_client.images.list(filters={"label": f"conveyor.stack={stack_id}"}):
            docker_client.images.remove(image.id, force=True)
