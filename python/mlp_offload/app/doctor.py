"""`mlp-offload doctor`: what this machine and these paths give a job, before it starts (DeepSpeed's
`ds_report` for mlp-offload). Each check is a small function returning rows of `(check, status, found,
what to do)`; a row that warns or fails names its fix and links its entry of the troubleshooting page
(`adapter.troubleshooting`).

Without a probe it reads and asks the kernel only: no profile saved, nothing left in the paths
(`_core.probe_directory` writes and removes one small file), in well under a second. It imports neither
torch nor DeepSpeed: their versions come from the installed packages' metadata.
"""

from __future__ import annotations

import errno
import importlib.metadata
import os
import platform
import re
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlp_offload import _core
from mlp_offload.adapter import compat, troubleshooting
from mlp_offload.adapter.troubleshooting import Trouble
from mlp_offload.app.tables import render_table
from mlp_offload.engine import memory, profiles

OK, WARN, FAIL = "ok", "warn", "fail"
PAGE = "docs/troubleshooting.md"
# The state a parameter of `--model-size` keeps in the store: fp32 master weights, exp_avg and exp_avg_sq
# (DeepSpeed's half-precision modes keep 10, 8, 6 or 4: 12 is the most).
STATE_BYTES = memory.STATE_BYTES
CAP_IPC_LOCK = 14
PACKAGE = "mlp-offload"


@dataclass(frozen=True)
class Row:
    """One line of the report: what was checked, `OK`, `WARN` or `FAIL`, what was found, and what to do
    (for a warning or a failure: the fix of troubleshooting entry `entry`, linked)."""

    check: str
    status: str
    found: str
    fix: str = ""
    entry: str | None = None

    @property
    def link(self) -> str | None:
        return None if self.entry is None else f"{PAGE}#{self.entry}"

    @property
    def what_to_do(self) -> str:
        if self.link is None:
            return self.fix or "-"
        return f"{self.fix} ({self.link})"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "link": self.link}


def trouble_row(check: str, status: str, found: str, trouble: Trouble) -> Row:
    """A warning or failure whose fix is `trouble`'s."""
    return Row(check, status, found, trouble.fix, trouble.name)


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


# Versions ------------------------------------------------------------------------------------------------


def _release(version: str) -> tuple[int, ...]:
    """`"2.15.0+cu130"` -> (2, 15, 0): the release's numbers, whatever follows them."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def satisfies(version: str, specifier: str) -> bool:
    """Whether `version` meets every clause of `specifier` (`">=2.3"`, `">=0.19,<0.20"`), comparing
    release numbers."""
    compare = {
        ">=": lambda a, b: a >= b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        "<": lambda a, b: a < b,
        "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b,
    }
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        op = next((o for o in compare if clause.startswith(o)), None)
        if op is None:
            continue
        mine, theirs = _release(version), _release(clause[len(op) :])
        width = max(len(mine), len(theirs))
        if not compare[op](mine + (0,) * (width - len(mine)), theirs + (0,) * (width - len(theirs))):
            return False
    return True


def requirement(name: str) -> str | None:
    """What mlp-offload's installed package requires of `name` (`"python"`: its `Requires-Python`), as a
    specifier; None where the package's metadata is not installed or names none."""
    try:
        if name == "python":
            return importlib.metadata.metadata(PACKAGE)["Requires-Python"]
        requires = importlib.metadata.requires(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        if ";" not in line and (match := re.fullmatch(rf"{re.escape(name)}\s*(\S*)", line.strip())):
            return match.group(1)
    return None


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_row(name: str, version: str | None, specifier: str | None) -> Row:
    """Python's or torch's row: the version against what the package requires."""
    if specifier is None:
        return Row(name, OK, f"{version or 'not installed'} (mlp-offload's package metadata not found)")
    if version is not None and satisfies(version, specifier):
        return Row(name, OK, f"{version} (supported: {specifier})")
    found = troubleshooting.UNSUPPORTED_VERSION.message(
        version=version or "not installed", name=name, needs=specifier
    )
    return trouble_row(name, FAIL, found, troubleshooting.UNSUPPORTED_VERSION)


def deepspeed_row(version: str | None, series: str, tested: Sequence[str]) -> Row:
    """DeepSpeed's row: absent (the store works without it), another series (refused at start), a
    release of the series not tested (a warning at start, naming what changed), or a tested one."""
    check = "deepspeed"
    if version is None:
        return trouble_row(
            check, WARN, troubleshooting.DEEPSPEED_MISSING.message(), troubleshooting.DEEPSPEED_MISSING
        )
    supported = f"supported: {series}x, tested: {', '.join(tested)}"
    if not version.startswith(series):
        found = troubleshooting.SERIES.message(series=series, tested=", ".join(tested), version=version)
        return trouble_row(check, FAIL, f"{found}: refused at start", troubleshooting.SERIES)
    if version not in tested:
        return trouble_row(
            check,
            WARN,
            f"{version} ({supported}): a warning at start names what changed",
            troubleshooting.BY_NAME["deepspeed-version"],
        )
    return Row(check, OK, f"{version} ({supported})")


def version_rows() -> list[Row]:
    python = ".".join(str(n) for n in sys.version_info[:3])
    series, tested = compat.SUPPORTED_SERIES, compat.TESTED_DEEPSPEED
    return [
        version_row("python", python, requirement("python")),
        version_row("torch", installed("torch"), requirement("torch")),
        deepspeed_row(installed("deepspeed"), series, tested),
        Row(
            "mlp-offload",
            OK,
            f"{_core.__version__} (core), {installed(PACKAGE) or 'not installed'} (package)",
        ),
    ]


# The update kernel ---------------------------------------------------------------------------------------

KERNELS = {
    "avx512-clmul": "AVX-512, checksums folded into the loop (the fastest pass)",
    "avx512": "AVX-512, checksums block by block beside it",
    "avx2-clmul": "AVX2, checksums folded into the loop",
    "avx2": "AVX2, checksums block by block beside it",
}


def kernel_row(simd: str, machine: str) -> Row:
    """The fused update's SIMD path on this CPU (`_core.AdamKernel.simd`) and what it means."""
    check = "update kernel"
    if simd in KERNELS:
        return Row(check, OK, f"{simd}: {KERNELS[simd]}")
    if machine in ("x86_64", "AMD64"):
        return trouble_row(
            check, WARN, troubleshooting.SCALAR_KERNEL.message(), troubleshooting.SCALAR_KERNEL
        )
    return Row(check, OK, f"{simd}: element by element, {machine}'s pass (slower than x86-64's SIMD)")


# The machine ---------------------------------------------------------------------------------------------


def io_engine_row(why_not: str | None) -> Row:
    """io_uring or the thread pool for every path (`engine: "auto"`), and why."""
    check = "io engine"
    if why_not is None:
        return Row(check, OK, 'io_uring on every path (engine "auto")')
    found = troubleshooting.BY_NAME["io-uring-fallback"].message(why=why_not)
    return trouble_row(check, WARN, found, troubleshooting.BY_NAME["io-uring-fallback"])


def _meminfo(text: str, key: str) -> int | None:
    match = re.search(rf"^{key}:\s+(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def huge_pages_row(meminfo: str, thp_enabled: str | None) -> Row:
    """Reserved huge pages free and transparent huge pages' mode (`/proc/meminfo`,
    `/sys/kernel/mm/transparent_hugepage/enabled`), and what `host_pages: "huge"` (what `"auto"` takes
    without a profile, or where the probe found them no slower) gets from them."""
    check = "huge pages"
    free, size_kb = _meminfo(meminfo, "HugePages_Free") or 0, _meminfo(meminfo, "Hugepagesize") or 2048
    mode_match = re.search(r"\[(\w+)\]", thp_enabled or "")
    mode = mode_match.group(1) if mode_match else "absent"
    reserved = f"{free} reserved free ({_size(free * size_kb * 1024)})" if free else "none reserved free"
    found = f"{reserved}; transparent: {mode}"
    if free:
        return Row(check, OK, f'{found}; host_pages "huge" takes reserved ones, then transparent ones')
    if mode in ("always", "madvise"):
        return Row(check, OK, f'{found}; host_pages "huge" gets transparent ones')
    trouble = troubleshooting.BY_NAME["huge-pages-short"]
    return trouble_row(check, WARN, f'{found}; host_pages "huge" would get 4 KiB pages', trouble)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def has_cap_ipc_lock(status: str) -> bool:
    """Whether `/proc/self/status`'s effective capabilities hold CAP_IPC_LOCK (mlock past the limit)."""
    match = re.search(r"^CapEff:\s+([0-9a-f]+)", status, re.MULTILINE)
    return match is not None and bool(int(match.group(1), 16) >> CAP_IPC_LOCK & 1)


def memlock_row(soft: int, hard: int, cap_ipc_lock: bool, need: int, need_is: str) -> Row:
    """RLIMIT_MEMLOCK against what the store locks with DeepSpeed's `pin_memory: true`: its host buffers
    (`need`, `host_memory` as `need_is` says)."""
    check = "pinned memory"

    def limit(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else _size(n)

    found = f"RLIMIT_MEMLOCK {limit(soft)} (hard {limit(hard)})"
    locks = f"pin_memory locks {_size(need)} ({need_is})"
    if soft == resource.RLIM_INFINITY or soft >= need:
        return Row(check, OK, f"{found}; {locks}")
    if cap_ipc_lock:
        return Row(check, OK, f"{found}, lifted by CAP_IPC_LOCK; {locks}")
    trouble = troubleshooting.BY_NAME["mlock-refused"]
    return trouble_row(check, WARN, f"{found}; {locks}: its buffers would stay unlocked", trouble)


def host_memory_need(model_size: int | None, ranks: int) -> tuple[int, str]:
    """What `host_memory: "auto"` comes to for one of the node's `ranks` ranks: what it can spare (the
    memory available less the margin, over the ranks), capped by its part of the whole state of
    `model_size` parameters when given."""
    spare = memory.spare_host_memory()
    per_rank = max(0, spare.available - spare.margin) // ranks
    if model_size is not None and model_size * STATE_BYTES // ranks < per_rank:
        return model_size * STATE_BYTES // ranks, 'host_memory "auto": the whole state, per rank'
    return per_rank, 'host_memory "auto": what a rank can spare'


NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def nvidia_gpus(root: str = NVIDIA_GPUS) -> int:
    """The NVIDIA GPUs the driver lists (one folder each), without importing torch: 0 without the
    driver."""
    try:
        return len(os.listdir(root))
    except OSError:
        return 0


def accelerator_row(gpus: int, triton: str | None) -> Row:
    """Whether the update can run on the GPU too (chunks beside the host's pass, `ratio`'s subgroups):
    a GPU, and Triton, which runs its kernel."""
    check = "update on the GPU"
    if gpus == 0:
        return Row(check, OK, f"no NVIDIA GPU ({NVIDIA_GPUS}): every chunk updated on the host")
    if triton is None:
        found = troubleshooting.NO_TRITON.message(gpus=gpus)
        return trouble_row(check, WARN, found, troubleshooting.NO_TRITON)
    return Row(
        check,
        OK,
        f"{gpus} NVIDIA GPU(s), Triton {triton}: chunks stream there beside the host's pass "
        "(accelerator_update_memory), its kernel checked against the host pass at each job's start",
    )


def machine_rows(model_size: int | None, ranks: int) -> list[Row]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need, need_is = host_memory_need(model_size, ranks)
    return [
        kernel_row(_core.AdamKernel(0.9, 0.999).simd, platform.machine()),
        accelerator_row(nvidia_gpus(), installed("triton")),
        io_engine_row(_core.io_uring_unavailable_reason()),
        huge_pages_row(_read("/proc/meminfo") or "", _read("/sys/kernel/mm/transparent_hugepage/enabled")),
        memlock_row(soft, hard, has_cap_ipc_lock(_read("/proc/self/status") or ""), need, need_is),
    ]


# The paths -----------------------------------------------------------------------------------------------


def path_row(path: str) -> tuple[Row, dict[str, Any] | None]:
    """The path's file system, device and locality, and O_DIRECT (`_core.probe_directory`); a path that
    cannot be probed is a failure naming its errno."""
    check = f"path {path}"
    try:
        info = _core.probe_directory(path)
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, f"errno {e.errno}")
        found = f"{code}: {e.strerror or e}"
        return trouble_row(check, FAIL, found, troubleshooting.BY_NAME["missing-path"]), None
    memory_fs = " (in memory)" if info["fs_type"] in ("tmpfs", "ramfs") else ""
    on = (
        f"{info['fs_type']}{memory_fs} from {info['mount_source']}, device {info['device_name']} "
        f"{info['device_id']}, {info['locality']}"
    )
    if not info["direct_io"]:
        trouble = troubleshooting.BY_NAME["o-direct-refused"]
        found = trouble.message(path=path, why=info["direct_io_refusal"])
        return trouble_row(check, WARN, f"{on}; {found}", trouble), info
    return Row(check, OK, f"{on}; O_DIRECT, {info['dio_offset_align']}-byte alignment"), info


def space_row(path: str, info: dict[str, Any], on_device: int, paths: int, model_size: int | None) -> Row:
    """Free space on the path's file system against the state of `model_size` parameters, split equally
    over the `paths` paths, `on_device` of which share this file system."""
    check = f"space {path}"
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if total == 0:
        return Row(check, OK, f"no size reported ({info['fs_type']}: as much as memory holds)")
    found = f"{_size(free)} free of {_size(total)}"
    if model_size is None:
        return Row(check, OK, found, "--model-size N checks it against a model's state")
    whole = model_size * STATE_BYTES
    need = whole * on_device // paths
    shares = f": {on_device} of {paths} paths' equal shares of {_size(whole)}" if paths > 1 else ""
    assumed = f"{_size(need)}{shares} ({STATE_BYTES} B a parameter)"
    if free < need:
        trouble = troubleshooting.BY_NAME["enospc"]
        return trouble_row(check, FAIL, f"{found}; the state needs {assumed}", trouble)
    return Row(check, OK, f"{found}; the state needs {assumed}")


def devices_row(paths: Sequence[str], infos: Sequence[dict[str, Any]]) -> Row:
    """Whether two of the paths share a device (a shared file system: its mount's source)."""
    by_device: dict[str, list[str]] = {}
    for path, info in zip(paths, infos, strict=True):
        shared = info["locality"] == "shared" and info["mount_source"]
        key = info["mount_source"] if shared else f"{info['device_name']} {info['device_id']}"
        by_device.setdefault(key, []).append(path)
    shared_ones = {device: on for device, on in by_device.items() if len(on) > 1}
    if not shared_ones:
        return Row("devices", OK, f"{len(paths)} paths on {len(by_device)} devices, one each")
    found = "; ".join(
        troubleshooting.SAME_DEVICE.message(paths=", ".join(on), device=device)
        for device, on in shared_ones.items()
    )
    return trouble_row("devices", WARN, found, troubleshooting.SAME_DEVICE)


def probe_options(ranks: int) -> profiles.ProbeOptions:
    """The probe's options as a job of `ranks` ranks on the node probes (`engine.planning`), so the
    profile found or saved is the one such a job on these paths reuses."""
    return profiles.ProbeOptions(ranks=ranks)


def profile_row(paths: Sequence[str], max_age_s: float, ranks: int) -> Row:
    """The saved probe profile of exactly these paths for a job of `ranks` ranks on the node, and its age
    against `max_age_s`."""
    profile, why_not = profiles.saved_profile(paths, probe_options(ranks), max_age_s)
    limit = f"reused up to {max_age_s / 3600:,.0f} h"
    if profile is None:
        return Row(
            "profile",
            OK,
            f"{why_not} ({profiles.profile_file()}; {limit})",
            'with weights "auto" the first job probes them at start (a minute or so); --probe measures '
            "them now",
        )
    age = time.time() - profile.probed_at
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(profile.probed_at))
    return Row(
        "profile", OK, f"measured {when}, {age / 3600:,.1f} h old ({limit}), in {profiles.profile_file()}"
    )


def path_rows(paths: Sequence[str], model_size: int | None, max_age_s: float, ranks: int) -> list[Row]:
    rows, found = [], []
    for path in paths:
        row, info = path_row(path)
        rows.append(row)
        if info is not None:
            found.append((path, info))
    for path, info in found:
        on_device = sum(other["device_id"] == info["device_id"] for _, other in found)
        rows.append(space_row(path, info, on_device, len(paths), model_size))
    if len(found) > 1:
        rows.append(devices_row([p for p, _ in found], [i for _, i in found]))
    if found and len(found) == len(paths):
        rows.append(profile_row(paths, max_age_s, ranks))
    return rows


def check(
    paths: Sequence[str],
    model_size: int | None = None,
    *,
    ranks: int = 1,
    max_age_s: float = profiles.DEFAULT_MAX_AGE_S,
) -> list[Row]:
    """Every row, for a job of `ranks` ranks on this node whose optimizer state of `model_size` parameters
    (all the node's) lives on `paths`: the versions, the machine, then each path (none given: a row saying
    so)."""
    rows = [*version_rows(), *machine_rows(model_size, ranks)]
    if not paths:
        return [*rows, Row("paths", OK, "none given", "name the storage directories to check them")]
    return [*rows, *path_rows(paths, model_size, max_age_s, ranks)]


def render(rows: Sequence[Row]) -> str:
    """The report as one table, and a line counting warnings and failures."""
    lines = render_table(
        ["check", "status", "found", "what to do"], [[r.check, r.status, r.found, r.what_to_do] for r in rows]
    )
    failed, warned = (sum(r.status == status for r in rows) for status in (FAIL, WARN))
    lines.append(f"{len(rows)} checks: {failed} failed, {warned} to look at")
    return "\n".join(lines)
