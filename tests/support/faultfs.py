"""A storage path that fails for real: a passthrough file system (FUSE, through mfusepy and libfuse)
over a directory, whose reads or writes fail with EIO while a switch file exists, and which disappears
(every call on it then fails with ENOTCONN, as a lost network file system does) when this process is
killed. The faults come through the kernel as a failing device's would: the store sees them as the
results of its own system calls.

    python tests/support/faultfs.py BACKING MOUNTPOINT

prints "mounted" once the mount is up. `BACKING/.fail-reads` or `BACKING/.fail-writes` switches the
faults on (the switches themselves are not in the file system's listing).
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any

import mfusepy as fuse

SWITCHES = (".fail-reads", ".fail-writes")
STAT_KEYS = (
    "st_atime",
    "st_ctime",
    "st_gid",
    "st_mode",
    "st_mtime",
    "st_nlink",
    "st_size",
    "st_uid",
    "st_blocks",
)


class FaultFS(fuse.Operations):
    """Every call passes through to `root`; reads and writes of files fail with EIO while the switch for
    them exists. Files are opened for direct I/O, so no read is served from the kernel's cache of a
    file system whose device has failed."""

    use_ns = True

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _fail_if(self, switch: str) -> None:
        if os.path.exists(os.path.join(self.root, switch)):
            raise fuse.FuseOSError(errno.EIO)

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._full(path))
        except OSError as e:
            raise fuse.FuseOSError(e.errno) from None
        return {key: getattr(st, key) for key in STAT_KEYS}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *(n for n in os.listdir(self._full(path)) if n not in SWITCHES)]

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._full(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._full(path))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._full(path), mode)

    def utimens(self, path: str, times: Any = None) -> None:
        os.utime(self._full(path), ns=times)

    def unlink(self, path: str) -> None:
        os.unlink(self._full(path))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._full(old), self._full(new))

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
        return {key: getattr(st, key) for key in (*keys, "f_frsize", "f_namemax")}

    # With `raw_fi`, the file calls get libfuse's `fuse_file_info`: the descriptor is its `fh`.
    def open(self, path: str, fi: Any) -> int:
        # The backing file is read and written with plain pread/pwrite from Python's buffers.
        fi.fh = os.open(self._full(path), fi.flags & ~os.O_DIRECT)
        fi.direct_io = 1
        return 0

    def create(self, path: str, mode: int, fi: Any) -> int:
        fi.fh = os.open(self._full(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
        fi.direct_io = 1
        return 0

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        self._fail_if(".fail-reads")
        return os.pread(fi.fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        self._fail_if(".fail-writes")
        return os.pwrite(fi.fh, data, offset)

    def truncate(self, path: str, length: int, fi: Any = None) -> None:
        os.truncate(self._full(path), length)

    def fallocate(self, path: str, mode: int, offset: int, length: int, fi: Any) -> int:
        os.posix_fallocate(fi.fh, offset, length)
        return 0

    def flush(self, path: str, fi: Any) -> None:
        pass

    def fsync(self, path: str, datasync: int, fi: Any) -> None:
        self._fail_if(".fail-writes")
        os.fsync(fi.fh)

    def release(self, path: str, fi: Any) -> None:
        os.close(fi.fh)


def main() -> None:
    backing, mountpoint = sys.argv[1], sys.argv[2]
    Path(mountpoint).mkdir(parents=True, exist_ok=True)

    def say_when_mounted() -> None:
        while not os.path.ismount(mountpoint):
            threading.Event().wait(0.02)
        print("mounted", flush=True)

    threading.Thread(target=say_when_mounted, daemon=True).start()
    fuse.FUSE(FaultFS(backing), mountpoint, foreground=True, raw_fi=True)


if __name__ == "__main__":
    main()
