"""The seccomp deny-list every run is locked with, compiled once to classic BPF on the host.

The filter allows by default and refuses (EPERM) the calls that reach the kernel's attack surface or
could undo isolation: tracing, mounting, namespaces, kernel modules and keyrings, BPF, perf, io_uring.
`clone3` answers ENOSYS so libc falls back to `clone`, whose namespace flags the filter can inspect.
Calls of foreign architectures (32-bit x86 via int 0x80) kill the process.
"""

from __future__ import annotations

import errno
import tempfile

import pyseccomp

from tether.sandbox.linux import Clone

DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "iopl",
    "ioperm",
    "vhangup",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "fanotify_init",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "uselib",
    "personality",
)

NAMESPACE_FLAGS = (
    Clone.NEWNS,
    Clone.NEWCGROUP,
    Clone.NEWUTS,
    Clone.NEWIPC,
    Clone.NEWUSER,
    Clone.NEWPID,
    Clone.NEWNET,
)


def build_filter() -> pyseccomp.SyscallFilter:
    deny = pyseccomp.ERRNO(errno.EPERM)
    syscall_filter = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        syscall_filter.add_rule(deny, name)
    for flag in NAMESPACE_FLAGS:
        syscall_filter.add_rule(deny, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, int(flag), int(flag)))
    syscall_filter.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    return syscall_filter


def compile_bpf() -> bytes:
    """The filter as a classic-BPF program, ready for prctl(PR_SET_SECCOMP) in a forked child."""
    with tempfile.TemporaryFile() as handle:
        build_filter().export_bpf(handle)
        handle.seek(0)
        return handle.read()
