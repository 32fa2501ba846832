"""Shell one-liners for file operations and the workspace manifest, and parsers of their output.

Pure: each builder returns a command for ``Sandbox.exec``; only POSIX sh, ``base64``, ``find``,
``md5sum``, ``printf``, ``wc`` and ``dirname`` are assumed (busybox and Debian both have them). File
contents travel base64-encoded, so binary files are safe on a text protocol.

Invariant: a file name cannot forge entries. Listings are NUL-separated (the one byte no name
holds); the manifest takes names with a newline or backslash (which md5sum would print on
several lines, or escape) through a slower NUL-separated path; a path holding NUL is refused.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import shlex

from .errors import SandboxFileError

NOT_A_FILE = 66
TOO_LARGE = 67
WRITE_CHUNK = 72 << 10  # raw bytes per write command: 96 KiB of base64, under the 128 KiB argv string limit


_ODD_NAME = "'*[\n\\\\]*'"  # a find -path pattern: a newline or a backslash anywhere in the path


def resolve(path: str, workspace_dir: str) -> str:
    if "\0" in path:
        raise SandboxFileError(f"a path cannot contain a NUL byte: {path!r}")
    return posixpath.normpath(posixpath.join(workspace_dir, path))


def read_command(path: str, max_bytes: int) -> str:
    q = shlex.quote(path)
    return (
        f"[ -f {q} ] || {{ echo 'not a readable regular file: '{q}; exit {NOT_A_FILE}; }}; "
        f"s=$(wc -c < {q}) || exit 1; "
        f"[ \"$s\" -le {max_bytes} ] || {{ echo \"file has $s bytes, more than {max_bytes}\"; exit {TOO_LARGE}; }}; "
        f"base64 {q}"
    )


def read_output_cap(max_bytes: int) -> int:
    encoded = 4 * ((max_bytes + 2) // 3)
    return encoded + encoded // 60 + 4096  # line breaks and error messages


def decode_read(path: str, exit_code: int | None, output: bytes) -> bytes:
    if exit_code != 0:
        raise SandboxFileError(f"read_file({path!r}): {output.decode(errors='replace').strip() or f'exit {exit_code}'}")
    try:
        return base64.b64decode(output)
    except binascii.Error as exc:
        raise SandboxFileError(f"read_file({path!r}): undecodable output: {exc}") from None


def write_commands(path: str, data: bytes) -> list[str]:
    q = shlex.quote(path)
    commands = [f"mkdir -p \"$(dirname {q})\" && : > {q}"]
    for offset in range(0, len(data), WRITE_CHUNK):
        chunk = base64.b64encode(data[offset : offset + WRITE_CHUNK]).decode()
        commands.append(f"printf '%s' '{chunk}' | base64 -d >> {q}")
    return commands


def list_command(path: str, *, recursive: bool) -> str:
    depth = "" if recursive else "-maxdepth 1"
    q = shlex.quote(path)
    return (
        f"cd {q} || exit {NOT_A_FILE}; "
        f"find . -mindepth 1 {depth} -type d -exec printf '%s/\\0' {{}} +; "
        f"find . -mindepth 1 {depth} ! -type d -exec printf '%s\\0' {{}} +"
    )


def parse_list(output: str) -> list[str]:
    return sorted(entry[2:] for entry in output.split("\0") if entry.startswith("./"))


def manifest_command(workspace_dir: str) -> str:
    """``md5sum`` lines for ordinary names, a NUL, then ``<md5> <path>\\0`` records for odd names."""
    odd = "for f; do h=$(md5sum < \"$f\") || exit 1; printf '%s %s\\0' \"${h%% *}\" \"$f\"; done"
    return (f"cd {shlex.quote(workspace_dir)} && find . -type f ! -path {_ODD_NAME} -exec md5sum {{}} + && "
            f"printf '\\0' && find . -type f -path {_ODD_NAME} -exec sh -c {shlex.quote(odd)} sh {{}} +")


def parse_manifest(output: str) -> dict[str, str]:
    ordinary, _, odd = output.partition("\0")
    manifest = {}
    for line in ordinary.splitlines():
        digest, sep, path = line.partition("  ./")
        if sep:
            manifest[path] = digest
    for record in odd.split("\0"):
        digest, sep, path = record.partition(" ./")
        if sep:
            manifest[path] = digest
    return manifest
