"""Progress of long work off a terminal (a log, CI): a line every ``every_s`` with the count, then
the total and the time it took, all on stderr."""

from __future__ import annotations

from services.cli.progress import progress


def test_off_a_terminal_progress_is_periodic_lines_then_the_total(capsys):
    with progress("intake r: publishing groups", total=3, every_s=0) as advance:
        for _ in range(3):
            advance(1)
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 4
    assert all(line.startswith(f"intake r: publishing groups: {n} of 3 (") for n, line in zip((1, 2, 3), lines))
    assert lines[3].startswith("intake r: publishing groups: 3 done in ")
