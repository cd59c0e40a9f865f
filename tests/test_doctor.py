"""`mlp-offload doctor`, run as a user would (a subprocess) on real directories: the work disk, a tmpfs, a
ramfs (no O_DIRECT), a path that does not exist, with io_uring refused by a seccomp filter and with
RLIMIT_MEMLOCK lowered; each row's status and the troubleshooting entry its fix links. Then each check's
decisions over inputs this machine does not have (another DeepSpeed, an old torch, a scalar CPU, no huge
pages), fed to the same functions."""

from __future__ import annotations

import ast
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

import mlp_offload
import seccomp
from conftest import mounted_tmpfs
from mlp_offload.adapter import compat, troubleshooting
from mlp_offload.adapter.troubleshooting import met
from mlp_offload.app import doctor
from mlp_offload.engine import profiles

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "troubleshooting.md").read_text()
DOCTOR = [sys.executable, "-m", "mlp_offload.app.cli", "doctor"]


def run_doctor(*args: str, prelude: str | None = None) -> tuple[int, list[dict[str, Any]], str]:
    """Doctor's exit status, rows (`--json`) and stderr; with `prelude`, Python source run first in the
    child (a seccomp filter, a lowered limit) before the command line's `main`."""
    if prelude is None:
        command = [*DOCTOR, *args, "--json"]
    else:
        script = f"{prelude}\nfrom mlp_offload.app.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        command = [sys.executable, "-c", script, "doctor", *args, "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)["checks"], out.stderr


def row(rows: list[dict[str, Any]], check: str, status: str, entry: str | None, says: str) -> dict[str, Any]:
    """The row `check`, asserted to have `status`, to link troubleshooting entry `entry` (an anchor of the
    page; a warning or a failure always links one) and to find `says`."""
    [found] = [r for r in rows if r["check"] == check]
    assert (found["status"], found["entry"]) == (status, entry), found
    assert says in found["found"], found
    if status != doctor.OK or entry is not None:
        assert entry is not None and found["link"] == f"docs/troubleshooting.md#{entry}", found
        assert f'<a id="{entry}"></a>' in PAGE, f"no entry {entry} on the page"
        assert found["fix"] == troubleshooting.BY_NAME[entry].fix, found
    return found


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_on_the_work_disk_it_reads_the_machine_and_writes_nothing(
    work_dirs: list[Path], profile_dir: Path
) -> None:
    """Two directories of the work disk: O_DIRECT, the space against a model's state, one device for
    both (a warning naming the fix), no saved profile; in well under a second, nothing written."""
    paths = [str(d) for d in work_dirs[:2]]
    started = time.monotonic()
    status, rows, _ = run_doctor(*paths, "--model-size", "1e6")
    took = time.monotonic() - started
    assert took < 30, f"doctor took {took:.1f} s"  # about 0.2 s here, the interpreter's start included
    assert status == 0
    for path in paths:
        row(rows, f"path {path}", "ok", None, "; O_DIRECT, ")
        row(rows, f"space {path}", "ok", None, "the state needs 11.4 MiB: 2 of 2 paths' equal shares")
    devices = row(rows, "devices", "warn", "same-device", "are on one device")
    assert met("same-device", devices["found"])
    row(rows, "profile", "ok", None, "no saved profile for these paths")
    uring = mlp_offload.io_uring_unavailable_reason()
    if uring is None:
        row(rows, "io engine", "ok", None, "io_uring on every path")
    else:
        row(rows, "io engine", "warn", "io-uring-fallback", uring)
    if doctor.installed("deepspeed") in TESTED:
        row(rows, "deepspeed", "ok", None, f"tested: {', '.join(TESTED)}")
    elif doctor.installed("deepspeed") is None:
        row(rows, "deepspeed", "warn", "deepspeed-missing", "not installed")
    row(rows, "mlp-offload", "ok", None, mlp_offload._core.__version__)
    assert all(tree(d) == [] for d in work_dirs), "doctor left files in the paths"
    assert not profile_dir.exists(), "doctor saved something"


def figureless(text: str) -> str:
    return re.sub(r"\d[\d.,]*", "#", text)


def test_the_table_and_the_json_have_the_same_rows(work_dirs: list[Path]) -> None:
    paths = [str(work_dirs[0]), str(work_dirs[0] / "missing")]
    status, rows, _ = run_doctor(*paths)
    table = subprocess.run([*DOCTOR, *paths], capture_output=True, text=True, timeout=120)
    assert status == table.returncode == 1, "a check failed"
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["check", "status", "found", "what", "to", "do"]
    assert len(lines) == 2 + len(rows) + 1 and lines[-1].startswith(f"{len(rows)} checks: 1 failed")
    for line, r in zip(lines[2:], rows, strict=False):
        assert line.startswith(f"{r['check']}  ") and f"  {r['status']}  " in line, (line, r)
        # Free memory and space move between the two runs: their figures are left out.
        assert figureless(r["found"]) in figureless(line) and (r["link"] or "") in line, (line, r)
    assert {r["check"] for r in rows} >= {"python", "torch", "deepspeed", "update kernel", "pinned memory"}


def test_a_path_that_does_not_exist_fails_naming_it_and_its_errno(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    status, rows, stderr = run_doctor(missing, "--probe", "-q")
    assert status == 1 and "Traceback" not in stderr
    path = row(rows, f"path {missing}", "fail", "missing-path", f"ENOENT: open storage directory {missing}: ")
    assert met("missing-path", path["found"])
    assert not any(r["check"] in (f"space {missing}", "profile") for r in rows)
    assert f"not probed: [Errno 2] open storage directory {missing}" in stderr


def _kernel() -> tuple[int, int]:
    major, minor = re.findall(r"\d+", platform.release())[:2]
    return int(major), int(minor)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs."""
    yield from mounted_tmpfs(tmp_path / "tmpfs", "64m")


def test_a_tmpfs_is_memory_with_o_direct_from_linux_6_6(tmpfs: Path) -> None:
    _, rows, _ = run_doctor(str(tmpfs), "--model-size", "1e7")
    if _kernel() >= (6, 6):
        row(rows, f"path {tmpfs}", "ok", None, "tmpfs (in memory) from tmpfs")
    else:
        row(rows, f"path {tmpfs}", "warn", "o-direct-refused", "tmpfs (in memory) from tmpfs")
    # 1e7 parameters' state (114 MiB) does not fit in 64 MiB: the space row fails, naming ENOSPC's fix.
    row(rows, f"space {tmpfs}", "fail", "enospc", "64.0 MiB free of 64.0 MiB; the state needs 114.4 MiB")
    assert tree(tmpfs) == []


def test_a_ramfs_refuses_o_direct_and_says_so(ramfs: Path) -> None:
    _, rows, _ = run_doctor(str(ramfs), "--model-size", "1e9")
    path = row(rows, f"path {ramfs}", "warn", "o-direct-refused", "ramfs (in memory) from ramfs")
    assert met("o-direct-refused", path["found"]) and "Invalid argument" in path["found"]
    row(rows, f"space {ramfs}", "ok", None, "no size reported (ramfs")
    assert tree(ramfs) == []


def test_io_uring_refused_by_seccomp_is_a_warning_naming_the_thread_pool(work_dirs: list[Path]) -> None:
    if not seccomp.supported():
        pytest.skip(f"no seccomp program for {platform.machine()}")
    _, rows, _ = run_doctor(str(work_dirs[0]), prelude=seccomp.DENY_IO_URING)
    engine = row(rows, "io engine", "warn", "io-uring-fallback", "io_uring_setup: Operation not permitted")
    assert met("io-uring-fallback", engine["found"])
    row(rows, f"path {work_dirs[0]}", "ok", None, "; O_DIRECT, ")


# Lowers RLIMIT_MEMLOCK and, as root, drops CAP_IPC_LOCK from the bounding set (PR_CAPBSET_DROP), which the
# exec that follows takes from the process; the new process locks a host buffer, then runs doctor.
LOWERED_MEMLOCK = r"""
import ctypes, os, resource, sys
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(24, 14, 0, 0, 0):
    sys.exit(77)
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
"""
LOCK_A_BUFFER = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from mlp_offload import _core
print("locked" if _core.HostBuffer(1 << 20, lock=True).locked else "unlocked", file=sys.stderr)
"""


def test_a_low_memlock_limit_is_a_warning_and_leaves_the_buffers_unlocked() -> None:
    script = f"{LOCK_A_BUFFER}\nfrom mlp_offload.app.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    out = subprocess.run(
        [sys.executable, "-c", LOWERED_MEMLOCK, script, "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode == 77:
        pytest.skip("root without CAP_SETPCAP: CAP_IPC_LOCK cannot be dropped")
    assert out.returncode == 0, out.stderr
    assert met("mlock-refused", out.stderr) and "unlocked" in out.stderr, out.stderr
    rows = json.loads(out.stdout)["checks"]
    row(
        rows,
        "pinned memory",
        "warn",
        "mlock-refused",
        "RLIMIT_MEMLOCK 64.0 KiB (hard 64.0 KiB); pin_memory locks",
    )


# A profile saved for a job of one rank, its age; doctor's --max-age-hours and --ranks; what it says
PROFILES = [
    ("fresh", 2, 168, 1, "h old (reused up to 168 h)"),
    ("stale", 200, 168, 1, "the saved profile is 200 h old (limit 168 h)"),
    ("stale at a shorter limit", 2, 1, 1, "the saved profile is 2 h old (limit 1 h)"),
    ("another job's (4 ranks)", 2, 168, 4, "the saved profile was measured with other probe options"),
]


@pytest.mark.parametrize(
    ("age_h", "max_age_h", "ranks", "says"), [p[1:] for p in PROFILES], ids=[p[0] for p in PROFILES]
)
def test_a_saved_profile_and_its_age(
    work_dirs: list[Path], age_h: float, max_age_h: float, ranks: int, says: str
) -> None:
    """A profile saved for a path as a job of one rank saves it (the probe's figures left out: doctor
    reads only its age, options and the path's identity), found fresh, stale, or another job's."""
    path = os.path.realpath(work_dirs[0])
    probe = mlp_offload._core.probe_directory(path)
    options = asdict(doctor.probe_options(1))
    profiles.save_profile(profiles.Profile([path], [probe], time.time() - age_h * 3600, options))
    _, rows, _ = run_doctor(path, "--max-age-hours", str(max_age_h), "--ranks", str(ranks))
    row(rows, "profile", "ok", None, says)


# Each check's decision over inputs: (check, arguments, status, troubleshooting entry, what it finds).
SERIES, TESTED = compat.SUPPORTED_SERIES, compat.TESTED_DEEPSPEED
INFINITY = resource.RLIM_INFINITY
DECISIONS = [
    ("deepspeed tested", doctor.deepspeed_row, ("0.19.8", SERIES, TESTED), "ok", None, "0.19.8 (supported"),
    ("deepspeed untested", doctor.deepspeed_row, ("0.19.3", SERIES, TESTED), "warn", "deepspeed-version", ""),
    (
        "deepspeed 0.20",
        doctor.deepspeed_row,
        ("0.20.0", SERIES, TESTED),
        "fail",
        "deepspeed-series",
        "0.20.0",
    ),
    ("deepspeed 0.1.9", doctor.deepspeed_row, ("0.1.9", SERIES, TESTED), "fail", "deepspeed-series", ""),
    ("no deepspeed", doctor.deepspeed_row, (None, SERIES, TESTED), "warn", "deepspeed-missing", "training"),
    ("torch", doctor.version_row, ("torch", "2.3.0+cpu", ">=2.3"), "ok", None, "(supported: >=2.3)"),
    (
        "old torch",
        doctor.version_row,
        ("torch", "2.1.2", ">=2.3"),
        "fail",
        "unsupported-version",
        "torch>=2.3",
    ),
    (
        "no torch",
        doctor.version_row,
        ("torch", None, ">=2.3"),
        "fail",
        "unsupported-version",
        "not installed",
    ),
    ("old python", doctor.version_row, ("python", "3.10.4", ">=3.11"), "fail", "unsupported-version", ""),
    ("no metadata", doctor.version_row, ("torch", "2.15.0", None), "ok", None, "metadata not found"),
    ("avx2", doctor.kernel_row, ("avx2", "x86_64"), "ok", None, "AVX2"),
    ("scalar x86-64", doctor.kernel_row, ("scalar", "x86_64"), "warn", "scalar-kernel", "no AVX2"),
    ("scalar aarch64", doctor.kernel_row, ("scalar", "aarch64"), "ok", None, "aarch64's pass"),
    ("no GPU", doctor.accelerator_row, (0, "3.6.0"), "ok", None, "every chunk updated on the host"),
    ("a GPU and Triton", doctor.accelerator_row, (8, "3.6.0"), "ok", None, "8 NVIDIA GPU(s), Triton 3.6.0"),
    ("a GPU without Triton", doctor.accelerator_row, (1, None), "warn", "no-triton", "ratio below 1"),
    ("thread pool", doctor.io_engine_row, ("seccomp",), "warn", "io-uring-fallback", "(seccomp)"),
    (
        "reserved pages",
        doctor.huge_pages_row,
        ("HugePages_Free:     512\nHugepagesize:       2048 kB\n", "always madvise [never]"),
        "ok",
        None,
        "512 reserved free (1.0 GiB)",
    ),
    ("transparent", doctor.huge_pages_row, ("HugePages_Free: 0\n", "[always] madvise never"), "ok", None, ""),
    (
        "no huge pages",
        doctor.huge_pages_row,
        ("HugePages_Free: 0\n", "always madvise [never]"),
        "warn",
        "huge-pages-short",
        "4 KiB pages",
    ),
    ("no THP", doctor.huge_pages_row, ("", None), "warn", "huge-pages-short", "transparent: absent"),
    ("unlimited", doctor.memlock_row, (INFINITY, INFINITY, False, 1 << 34, "x"), "ok", None, "unlimited"),
    ("enough", doctor.memlock_row, (1 << 35, 1 << 35, False, 1 << 34, "x"), "ok", None, "32.0 GiB"),
    (
        "8 MiB",
        doctor.memlock_row,
        (8 << 20, 8 << 20, False, 1 << 34, "x"),
        "warn",
        "mlock-refused",
        "8.0 MiB",
    ),
    ("CAP_IPC_LOCK", doctor.memlock_row, (8 << 20, 8 << 20, True, 1 << 34, "x"), "ok", None, "CAP_IPC_LOCK"),
]


@pytest.mark.parametrize(
    ("check", "arguments", "status", "entry", "says"),
    [d[1:] for d in DECISIONS],
    ids=[d[0] for d in DECISIONS],
)
def test_each_check_decides_and_links_its_fix(
    check: Any, arguments: tuple[Any, ...], status: str, entry: str | None, says: str
) -> None:
    found = check(*arguments).as_dict()
    row([found], found["check"], status, entry, says)
    if entry in {t.name for t in troubleshooting.FOUND_BY_DOCTOR}:
        assert met(entry, found["found"]), found


@pytest.mark.parametrize(
    ("version", "specifier", "meets"),
    [
        ("2.15.0", ">=2.3", True),
        ("2.3", ">=2.3.0", True),
        ("2.2.9", ">=2.3", False),
        ("0.19.8", ">=0.19,<0.20", True),
        ("0.20.0rc1", ">=0.19,<0.20", False),
        ("3.11.7", ">=3.11", True),
        ("2.6.0+cu124", "<2.6", False),
    ],
)
def test_versions_are_compared_by_their_release_numbers(version: str, specifier: str, meets: bool) -> None:
    assert doctor.satisfies(version, specifier) is meets


def test_the_versions_are_the_packages_own() -> None:
    """What doctor reads of the requirements is what the package says."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch{doctor.requirement("torch")}"' in pyproject
    assert f'requires-python = "{doctor.requirement("python")}"' in pyproject


def test_the_gpus_are_the_drivers_folders(tmp_path: Path) -> None:
    assert doctor.nvidia_gpus(str(tmp_path / "no driver")) == 0
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (tmp_path / bus).mkdir()
    assert doctor.nvidia_gpus(str(tmp_path)) == 2


def test_capabilities_are_read_from_the_status_file() -> None:
    assert doctor.has_cap_ipc_lock("CapEff:\t000001fffeffffff\n")
    assert not doctor.has_cap_ipc_lock("CapEff:\t0000000000000000\n") and not doctor.has_cap_ipc_lock("")


def test_every_entry_found_by_doctor_is_said_by_it() -> None:
    """Each entry of the registry's `FOUND_BY_DOCTOR` is formatted by `app/doctor.py`, and every entry it
    names by name exists (as the registry's test checks the adapter's)."""
    tree = ast.parse((ROOT / "python" / "mlp_offload" / "app" / "doctor.py").read_text())
    said = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.isupper()}
    found = {
        name for name, value in vars(troubleshooting).items() if value in troubleshooting.FOUND_BY_DOCTOR
    }
    assert found <= said, f"entries doctor does not say: {found - said}"
    named = {
        n.slice.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Subscript)
        and isinstance(n.slice, ast.Constant)
        and getattr(n.value, "attr", "") == "BY_NAME"
    }
    assert named and named <= set(troubleshooting.BY_NAME), named
