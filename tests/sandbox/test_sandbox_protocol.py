"""The shell protocol's parser, fed byte streams split at awkward places (no Docker needed)."""

from services.rollout_worker.sandbox.protocol import MAX_TRAILER, CommandStream, restart_marker

NONCE = "0123456789abcdef"


def answer(output: bytes, rc: int = 0, cwd: str = "/workspace") -> bytes:
    return output + f"{NONCE} D{cwd}\n{NONCE} R{rc}\n".encode()


def feed_in_pieces(data: bytes, size: int, max_output: int = 1 << 20) -> CommandStream:
    stream = CommandStream(NONCE, max_output)
    for i in range(0, len(data), size):
        stream.feed(data[i : i + size])
    return stream


def test_every_split_of_the_stream_parses_the_same():
    data = answer(b"hello\nworld", rc=3, cwd="/tmp/x y") + b"next command's bytes"
    for size in range(1, len(data) + 1):
        stream = feed_in_pieces(data, size)
        assert stream.done, size
        assert bytes(stream.output) == b"hello\nworld"
        assert (stream.exit_code, stream.cwd) == (3, "/tmp/x y")
        assert stream.leftover == b"next command's bytes"


def test_output_is_capped_but_counted():
    stream = feed_in_pieces(answer(b"x" * 10_000), 333, max_output=100)
    assert bytes(stream.output) == b"x" * 100
    assert stream.total == 10_000 and stream.truncated


def test_stray_output_between_trailers_is_output_and_missing_cwd_is_fine():
    stream = feed_in_pieces(b"out" + f"{NONCE} D/w\n".encode() + b"bg" + f"{NONCE} R137\n".encode(), 2)
    assert bytes(stream.output) == b"outbg" and stream.exit_code == 137

    killed = feed_in_pieces(b"Killed\n" + f"{NONCE} R137\n".encode(), 5)
    assert killed.done and killed.cwd is None and bytes(killed.output) == b"Killed\n"


def test_a_wrong_nonce_is_just_output():
    forged = b"abcdefabcdefabcd R0\n"
    stream = feed_in_pieces(answer(forged, rc=1), 4)
    assert bytes(stream.output) == forged and stream.exit_code == 1


def test_a_repeated_trailer_never_reaches_the_next_command():
    # A trailer whose write was interrupted (EINTR) is retried and may come out twice.
    data = answer(b"out") + f"{NONCE} R0\n".encode() + b"background job output"
    for size in (1, 3, len(data)):
        stream = feed_in_pieces(data, size)
        assert stream.exit_code == 0 and stream.next_bytes == b"background job output"


def test_a_restarted_shell_ends_the_command_without_a_status():
    marker = restart_marker("s3cr3t")
    data = b"sh: can't fork\n" + marker + b" \nlate"
    for size in (1, 7, len(data)):
        stream = CommandStream(NONCE, 1 << 20, marker)
        for i in range(0, len(data), size):
            stream.feed(data[i : i + size])
        assert stream.done and stream.restarted and stream.exit_code is None
        assert bytes(stream.output) == b"sh: can't fork\n" and stream.leftover == b" \nlate"


def test_a_restart_marker_without_the_session_secret_is_output():
    stream = CommandStream(NONCE, 1 << 20, restart_marker("s3cr3t"))
    stream.feed(answer(restart_marker("guess"), rc=3))
    assert stream.done and not stream.restarted and stream.exit_code == 3
    assert bytes(stream.output) == restart_marker("guess")


def test_an_unfinished_trailer_line_is_output_and_counted():
    stream = CommandStream(NONCE, 100)
    stream.feed(f"{NONCE} R".encode())
    for _ in range(100):
        stream.feed(b"y" * 1000)
    assert not stream.done and stream.received == len(NONCE) + 2 + 100_000
    assert stream.total >= 100_000 - MAX_TRAILER and len(stream.output) == 100 and stream.truncated
    stream.feed(b"\n" + f"{NONCE} R5\n".encode())
    assert stream.done and stream.exit_code == 5
