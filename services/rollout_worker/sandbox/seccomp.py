"""The sandbox's seccomp profile: Docker's engine applies it to every process of the container.

Invariant: syscalls that a sandbox never needs, and that have been the kernel's recurring attack
surface, fail. io_uring, bpf, perf, userfaultfd, keyrings, module and kexec loading, mounts,
namespaces (``unshare``, ``setns``, ``clone`` with a namespace flag), ptrace,
``process_vm_readv/writev`` and ``pidfd_getfd`` (so no process can read another's memory or
take its descriptors, even under the same uid), and clock, swap, reboot and quota calls. ``clone3`` and io_uring answer ENOSYS, so libc
and runtimes fall back to the classic calls. Everything else is allowed: capabilities are
already dropped (``deployment``), so this is defence in depth, not the only wall.
"""

from __future__ import annotations

import json
from functools import lru_cache

EPERM, ENOSYS = 1, 38
DENIED = (
    "acct", "add_key", "bpf", "chroot", "clock_adjtime", "clock_settime", "delete_module", "fanotify_init",
    "finit_module", "fsconfig", "fsmount", "fsopen", "fspick", "init_module", "ioperm", "iopl", "kcmp",
    "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie", "mount", "mount_setattr", "move_mount",
    "name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree", "perf_event_open", "pidfd_getfd", "pivot_root",
    "process_vm_readv", "process_vm_writev", "ptrace", "quotactl", "reboot", "request_key", "setns",
    "settimeofday", "swapoff", "swapon", "syslog", "umount2", "unshare", "uselib", "userfaultfd", "vhangup",
)
NOT_IMPLEMENTED = ("clone3", "io_uring_enter", "io_uring_register", "io_uring_setup")
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


def profile() -> dict:
    rules = [
        {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        {"names": list(NOT_IMPLEMENTED), "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ]
    for flag in NAMESPACE_FLAGS:  # one rule per flag: clone fails if any namespace flag is set
        rules.append({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
                      "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]})
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}


@lru_cache(maxsize=1)
def security_opt() -> str:
    """The ``security_opt`` entry for the Docker API (the daemon takes the profile's JSON inline)."""
    return "seccomp=" + json.dumps(profile(), separators=(",", ":"))
