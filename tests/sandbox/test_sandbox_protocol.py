"""The shell protocol's parser, fed byte streams split at awkward places (no Docker needed)."""

from services.rollout_worker.sandbox.protocol import CommandStream

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
    stream = feed_in_pieces(b"sh: can't fork\n<conveyor: session shell restarted> \nlate", 7)
    assert stream.done and stream.restarted and stream.exit_code is None
    assert bytes(stream.output) == b"sh: can't fork\n" and stream.leftover == b" \nlate"
