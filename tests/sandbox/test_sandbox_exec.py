"""Commands and files in a real sandbox: exit codes, timeouts, output caps, files, workspace diff."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.rollout_worker.sandbox import EpisodeTimeout, Sandbox, SandboxFileError, Timeouts

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def run(coro):
    return asyncio.run(coro)


def test_exec_gives_exit_code_merged_output_and_keeps_the_working_directory(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec()) as sandbox:
            first = await sandbox.exec("echo out; echo err >&2; exit 3")
            assert (first.exit_code, first.output, first.timed_out, first.truncated) == (3, "out\nerr\n", False, False)
            assert (await sandbox.exec("mkdir -p sub && cd sub && exec true")).ok  # `exec`/`exit` end the command only
            assert (await sandbox.exec("pwd")).output == "/workspace\n"  # ... the cd happened in the exited subshell
            await sandbox.exec("cd sub")
            assert (await sandbox.exec("pwd")).output == "/workspace/sub\n"
            assert (await sandbox.exec("if then")).exit_code == 2  # a syntax error is the command's, not the session's
            assert (await sandbox.exec("id -u; echo $HOME")).output == "65534\n/tmp\n"
    run(scenario())


def test_command_timeout_kills_the_command_and_its_children(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec()) as sandbox:
            start = time.monotonic()
            result = await sandbox.exec("sleep 300 & sleep 300; echo never", timeout_s=1)
            assert result.timed_out and result.exit_code is None
            assert "never" not in result.output
            assert time.monotonic() - start < 4
            assert (await sandbox.exec("echo still here")).output == "still here\n"
            leftovers = await sandbox.exec("ps -o comm | grep -c sleep")
            assert leftovers.output.strip() == "0", leftovers.output
            busy = await sandbox.exec("while :; do :; done", timeout_s=0.5)  # a loop of builtins, no child process
            assert busy.timed_out
            assert (await sandbox.exec("echo ok")).ok
    run(scenario())


def test_output_cap_keeps_the_head_and_counts_everything(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec()) as sandbox:
            result = await sandbox.exec("yes abcdefgh | head -c 1000000", max_output_bytes=1000)
            assert result.exit_code == 0 and result.truncated
            assert len(result.output) == 1000 and result.output.startswith("abcdefgh\n")
            assert result.output_bytes == 1_000_000
            assert (await sandbox.exec("echo next")).output == "next\n"
    run(scenario())


def test_output_flood_is_killed_long_before_the_timeout(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec(output_flood_bytes=4 << 20)) as sandbox:
            result = await sandbox.exec("cat /dev/zero", timeout_s=60, max_output_bytes=100)
            assert result.exit_code is None and result.truncated and not result.timed_out
            assert result.duration_s < 30 and result.output_bytes > 4 << 20
            assert (await sandbox.exec("echo next")).output == "next\n"
    run(scenario())


def test_cancelled_command_output_never_reaches_the_next_command(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec()) as sandbox:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sandbox.exec("sleep 1; echo stale"), 0.2)
            assert (await sandbox.exec("echo fresh")).output == "fresh\n"
            await asyncio.sleep(1.2)
            assert (await sandbox.exec("echo fresh again")).output == "fresh again\n"
    run(scenario())


def test_episode_deadline_bounds_commands_then_refuses_them(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec(timeouts=Timeouts(episode_s=1.5))) as sandbox:
            result = await sandbox.exec("sleep 30", timeout_s=30)
            assert result.timed_out and result.duration_s < 4
            with pytest.raises(EpisodeTimeout):
                await sandbox.exec("echo too late")
    run(scenario())


def test_files_read_write_list_and_diff(make_spec, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("print('hi')\n")
    (tmp_path / "README").write_text("readme\n")
    (tmp_path / "old.txt").write_text("to delete\n")

    async def scenario():
        async with await Sandbox.provision(make_spec(), workspace=tmp_path) as sandbox:
            assert await sandbox.list_files() == ["README", "old.txt", "src/"]
            assert await sandbox.list_files(recursive=True) == ["README", "old.txt", "src/", "src/main.py"]
            assert await sandbox.read_file("src/main.py") == b"print('hi')\n"
            assert (await sandbox.exec("stat -c %u src/main.py")).output == "65534\n"
            assert (await sandbox.diff()).empty

            blob = bytes(range(256)) * 2000  # binary, and more than one write chunk
            await sandbox.write_file("new/dir/blob.bin", blob)
            assert await sandbox.read_file("/workspace/new/dir/blob.bin", max_bytes=len(blob)) == blob
            await sandbox.write_file("README", "changed\n")
            await sandbox.exec("rm old.txt")
            diff = await sandbox.diff()
            assert diff.added == ("new/dir/blob.bin",)
            assert diff.modified == ("README",)
            assert diff.deleted == ("old.txt",)

            with pytest.raises(SandboxFileError, match="not a readable regular file"):
                await sandbox.read_file("missing.txt")
            with pytest.raises(SandboxFileError, match="more than 100"):
                await sandbox.read_file("new/dir/blob.bin", max_bytes=100)
            with pytest.raises(SandboxFileError):
                await sandbox.write_file("/etc/passwd", "root::0:0::/:/bin/sh\n")
    run(scenario())


def test_exec_run_fallback_has_the_same_contract(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec(session=False)) as sandbox:
            result = await sandbox.exec("echo out; echo err >&2; exit 4")
            assert (result.exit_code, sorted(result.output.split())) == (4, ["err", "out"])
            timed = await sandbox.exec("sleep 300", timeout_s=1)
            assert timed.timed_out and timed.exit_code is None and timed.duration_s < 5
            capped = await sandbox.exec("yes | head -c 100000", max_output_bytes=10)
            assert capped.truncated and len(capped.output) == 10 and capped.output_bytes == 100000
            await sandbox.write_file("f.txt", "via exec\n")
            assert await sandbox.read_file("f.txt") == b"via exec\n"
    run(scenario())
