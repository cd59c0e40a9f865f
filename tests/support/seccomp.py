"""io_uring refused for real, as in a container: `DENY_IO_URING` is Python source that installs a
classic-BPF seccomp program making `io_uring_setup` fail with EPERM (as Docker's default profile does),
to run first in a child process (`python -c DENY_IO_URING + rest`); the child exits naming the errno if
the kernel refuses the filter (`tests/test_troubleshooting.py`, `tests/test_doctor.py`)."""

from __future__ import annotations

import platform

# The architectures the program knows (their audit arch and seccomp system call numbers).
MACHINES = ("x86_64", "aarch64")

DENY_IO_URING = r"""
import ctypes, logging, platform, struct, sys
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}[platform.machine()]
IO_URING_SETUP, EPERM = 425, 1
def ins(code, jt, jf, k):
    return struct.pack("HBBI", code, jt, jf, k)
program = b"".join([
    ins(0x20, 0, 0, 4), ins(0x15, 0, 3, AUDIT_ARCH), ins(0x20, 0, 0, 0),
    ins(0x15, 0, 1, IO_URING_SETUP), ins(0x06, 0, 0, 0x50000 | EPERM), ins(0x06, 0, 0, 0x7FFF0000),
])
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
code = ctypes.create_string_buffer(program)
libc = ctypes.CDLL(None, use_errno=True)
filter = Program(6, ctypes.addressof(code))
if libc.prctl(38, 1, 0, 0, 0) or libc.syscall(SYS_SECCOMP, 1, 0, ctypes.byref(filter)):
    sys.exit(f"seccomp: errno {ctypes.get_errno()}")
"""


def supported() -> bool:
    """Whether `DENY_IO_URING` knows this machine's architecture."""
    return platform.machine() in MACHINES
