"""Plain results returned by sandbox operations. No behaviour, no docker types."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome.

    ``exit_code`` is None when the sandbox stopped the command (``timed_out``, or it printed more
    than the flood limit) or could not start it (e.g. no pid left to fork). ``output`` holds
    stdout and stderr interleaved, at most the requested cap; ``truncated`` says more was printed.
    """

    exit_code: int | None
    output: str
    truncated: bool
    timed_out: bool
    duration_s: float
    output_bytes: int = 0  # everything the command printed, kept or not
    raw: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class WorkspaceDiff:
    """Files of the workspace that differ from what was there right after provisioning."""

    added: tuple[str, ...] = ()
    modified: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.modified or self.deleted)
