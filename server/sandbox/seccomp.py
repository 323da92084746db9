"""A seccomp filter for sandboxed commands: refuse the system calls that only widen the kernel's surface.

Sandboxed code runs without capabilities, so most dangerous calls fail anyway; this filter also
refuses those an unprivileged process may still make and that are the usual first step of a kernel
exploit: new user namespaces (``clone``/``unshare`` with ``CLONE_NEWUSER``), ``io_uring``, ``bpf``,
keyrings, ``userfaultfd``, ``perf_event_open``, the mount API, POSIX message queues (they outlive a
reset), and the 32-bit and x32 entry points
(their numbers differ and would slip past the list). ``clone3`` gets ``ENOSYS`` (its flags cannot be
inspected), so C libraries fall back to ``clone``. Built as classic BPF for ``bwrap --seccomp``;
x86-64 only (elsewhere the sandbox runs without it, and says so).
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_CLONE_NEWUSER = 0x10000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

# BPF opcodes (classic): load word absolute, jumps against a constant, return a constant.
_LD_W_ABS = 0x20
_JEQ = 0x15
_JGE = 0x35
_JSET = 0x45
_RET = 0x06

#: x86-64 system calls refused with EPERM, by number. (ptrace stays allowed: debuggers need it, and
#: it reaches only the sandbox's own processes.)
REFUSED = {
    "mount": 165, "umount2": 166, "pivot_root": 155, "swapon": 167, "swapoff": 168, "reboot": 169,
    "init_module": 175, "delete_module": 176, "finit_module": 313, "kexec_load": 246,
    "kexec_file_load": 320, "add_key": 248, "request_key": 249, "keyctl": 250, "setns": 308,
    "perf_event_open": 298, "open_by_handle_at": 304, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442,
    # POSIX message queues live in the IPC namespace, which a reset keeps, and nothing empties them
    # from outside: one trajectory's queue was read by the next. Programs rarely use them.
    "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244,
    "mq_getsetattr": 245,
}  # fmt: skip
_CLONE, _UNSHARE, _CLONE3 = 56, 272, 435


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def supported() -> bool:
    """Whether this host's architecture has a filter (x86-64)."""
    return platform.machine() in ("x86_64", "AMD64")


def build_filter() -> bytes:
    """The filter program, as the bytes ``bwrap --seccomp FD`` reads."""
    refused = sorted(REFUSED.values())
    deny = _RET_ERRNO | errno.EPERM
    program = [
        _op(_LD_W_ABS, 4),  # seccomp_data.arch
        _op(_JEQ, _AUDIT_ARCH_X86_64, jt=1),
        _op(_RET, _RET_ERRNO | errno.ENOSYS),  # 32-bit entry: refuse everything
        _op(_LD_W_ABS, 0),  # seccomp_data.nr
        _op(_JGE, _X32_BIT, jf=1),
        _op(_RET, _RET_ERRNO | errno.ENOSYS),  # x32 numbers
        _op(_JEQ, _CLONE3, jf=1),
        _op(_RET, _RET_ERRNO | errno.ENOSYS),
    ]
    # clone and unshare: refused only when asked for a new user namespace (flags are args[0]).
    for number in (_CLONE, _UNSHARE):
        program += [
            _op(_JEQ, number, jf=4),
            _op(_LD_W_ABS, 16),  # low 32 bits of args[0]
            _op(_JSET, _CLONE_NEWUSER, jf=1),
            _op(_RET, deny),
            _op(_RET, _RET_ALLOW),
        ]
    for number in refused:
        program += [_op(_JEQ, number, jf=1), _op(_RET, deny)]
    program.append(_op(_RET, _RET_ALLOW))
    return b"".join(program)
