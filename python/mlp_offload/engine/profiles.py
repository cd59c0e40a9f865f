"""Saved path profiles: what `mlp-offload probe` measured, kept per host and reused until stale.

One probe per node: `load_or_probe` holds a lock per host (`<hostname>.lock` beside the profiles, an
exclusive `flock` the kernel releases if the holder dies) while it decides and probes, so when every
rank of a node starts at once, the first probes and the others wait, then read what it saved. Ranks
probing the same devices at once would each measure the others' load.

Location: `$MLP_OFFLOAD_PROFILE_DIR/<hostname>.json`, by default `$XDG_CACHE_HOME/mlp-offload/profiles`
(`~/.cache/mlp-offload/profiles`). A file holds one entry per set of paths probed together, because
what paths give each other when used at once belongs to the set, and per probe options: a job's ranks on
the node are among them, so jobs of other sizes on the same paths (a 1-rank resume of an 8-rank run)
each keep theirs instead of probing again at every switch. An entry is stale when it is older than
`max_age_s` or when any path now sits on another device or file system.

A shared path (a network or parallel file system every node mounts, `locality` `"shared"`) gives each
node only its part of what the file system serves all of them. One node's probe cannot see that:
`measure_across_nodes`, run by every rank of a job of several nodes, measures each shared path from
every node alone and then from all of them at once, and keeps the figures in each node's profile
(`across_nodes`) for `node_share` to plan with.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlp_offload import _core

# 2: each path's probe has `pages` (host buffers of either page size) and the device's own view.
# 3: and its `locality` (node-local or shared) and the mount's type, FUSE clients told apart.
FORMAT = 3
DEFAULT_MAX_AGE_S = 7 * 24 * 3600
# The store's request size when the config does not say (`chunk_size`).
DEFAULT_CHUNK_SIZE = 4 << 20
# The measurement of a shared path across nodes: seconds per window of each node alone (the probe
# options' `together_secs` when set), and its file per node when they do not set `sustained_bytes`.
ACROSS_NODES_SECS = 3.0
ACROSS_NODES_WORKING_BYTES = 1 << 30
# The window of all nodes at once, in windows alone.
TOGETHER_WINDOWS = 3


def profile_dir() -> Path:
    if explicit := os.environ.get("MLP_OFFLOAD_PROFILE_DIR"):
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "mlp-offload" / "profiles"


def profile_file() -> Path:
    return profile_dir() / f"{socket.gethostname()}.json"


@dataclass(frozen=True)
class ProbeOptions:
    """The probe's knobs; `None` means the runtime's default."""

    bytes: int | None = None
    sustained_bytes: int | None = None
    chunk_sizes: list[int] | None = None
    depths: list[int] | None = None
    engine: str = "auto"
    together_secs: float | None = None
    # Ranks of the node: above 1, each device's sharing among them is measured too.
    ranks: int = 1


@dataclass
class Profile:
    paths: list[str]
    probes: list[dict[str, Any]]
    probed_at: float
    options: dict[str, Any] = field(default_factory=dict)
    source: str = "probed"  # or "saved"

    @property
    def devices(self) -> dict[str, list[int]]:
        """Each device under these paths, with the indices of the paths on it: paths on one device share
        its bandwidth and its node-wide in-flight limit."""
        devices: dict[str, list[int]] = {}
        for i, p in enumerate(self.probes):
            devices.setdefault(p["device_id"], []).append(i)
        return devices

    def store_inflight(self, request: int) -> int | None:
        """The requests in flight per path at which the probe moved the most with requests of `request`
        bytes (the store's), reads and writes of equal bytes together; the largest over the paths, which
        share one per-path limit. None when the probe took no samples at that size."""
        best: list[int] = []
        for p in self.probes:
            rates: dict[int, dict[str, float]] = {}
            for s in p.get("samples", []):
                if s["chunk_size"] == request:
                    rates.setdefault(s["max_inflight"], {})[s["op"]] = s["bytes_per_s"]
            # Time per byte moved one way and back: the slower way counts as much as it takes.
            both = {d: 2 / (1 / r["read"] + 1 / r["write"]) for d, r in rates.items() if len(r) == 2}
            if both:
                best.append(max(both, key=lambda d: (both[d], -d)))
        return max(best) if best else None

    def model_inputs(self, request: int = DEFAULT_CHUNK_SIZE) -> list[dict[str, Any]]:
        """What the performance model reads from each path's probe. The plan's in-flight count is what
        the store runs with requests of `request` bytes (`store_inflight`), else the probe's best for
        reads."""
        inflight = self.store_inflight(request)
        return [
            {
                "device_id": p["device_id"],
                "read_bytes_per_s": p["read_bytes_per_s"],
                "write_bytes_per_s": p["write_bytes_per_s"],
                "mixed_bytes_per_s": p["mixed_bytes_per_s"],
                "concurrent_bytes_per_s": p["concurrent_bytes_per_s"],
                "best_inflight": inflight or p["best_read"]["max_inflight"],
            }
            for p in self.probes
        ]

    def rank_share(self, ranks: int, ways: Sequence[str] | None = None) -> list[float]:
        """Per path, the fraction of what one rank alone measured on it that each of the node's `ranks`
        gets when they all update at once: the device's total for that many ranks (the probe's `sharing`
        figure for `ways[i]`, how the ranks share path i's device: `"free"`, no node-wide limit,
        `"shared"` or `"turns"`; by default the way `"auto"` picks) divided among them, over what one
        rank moved on the device's paths together; at most 1. 1 for one rank, and where the probe did not
        measure sharing (the model then plans each rank as owning the device, as before)."""
        share = [1.0] * len(self.probes)
        if ranks <= 1:
            return share
        for indices in self.devices.values():
            sharing = self.probes[indices[0]].get("sharing")
            way = ways[indices[0]] if ways is not None else auto_way(sharing)
            total = (sharing or {}).get(f"{way}_bytes_per_s")
            # All paths at once where the probe measured that (several paths), else the path's mixed figure.
            alone = sum(
                self.probes[i]["concurrent_bytes_per_s"] or self.probes[i]["mixed_bytes_per_s"]
                for i in indices
            )
            if total and alone > 0:
                for i in indices:
                    share[i] = min(1.0, total / ranks / alone)
        return share

    def localities(self, configured: Sequence[str] | None = None) -> list[str]:
        """Per path, `"node-local"` or `"shared"`: `configured` (the config's `path_locality`) where
        given, else what the probe found from the file system's type."""
        if configured is not None:
            return list(configured)
        return [p["locality"] for p in self.probes]

    def node_share(
        self, nodes: int, localities: Sequence[str] | None = None, host: str | None = None
    ) -> list[float]:
        """Per path, the fraction of this node's probed figures that it gets when `nodes` nodes update at
        once: 1 for a node-local path. A shared path's nodes share equally the aggregate measured with
        all nodes at once (`measure_across_nodes`; the measurement `across_nodes` picks), each getting
        at most what it moved alone in that measurement (`host`, this machine's name by default; a host
        it did not measure: at most its own mixed figure); without a measurement, the aggregate is taken
        as one node's figure, a lower bound (`across_nodes_note` says so)."""
        share = [1.0] * len(self.probes)
        if nodes <= 1:
            return share
        host = socket.gethostname() if host is None else host
        for i, locality in enumerate(localities or self.localities()):
            if locality != "shared":
                continue
            measured = across_nodes(self.probes[i], nodes)
            if measured is None:
                share[i] = 1 / nodes
                continue
            # Over this node's own mixed figure, which the plan scales. The nodes' probes at start-up
            # run at once, so on a shared path that figure may be well below what the node moves
            # alone: the cap is its own window of the same measurement, and the share may exceed 1.
            mixed = self.probes[i]["mixed_bytes_per_s"]
            hosts = list(measured["hosts"])
            alone = measured["alone_bytes_per_s"][hosts.index(host)] if host in hosts else mixed
            share[i] = min(alone, sum(measured["together_bytes_per_s"]) / nodes) / mixed
        return share

    def plan_subgroups(
        self,
        *,
        subgroups: int,
        bytes_per_subgroup: int,
        host_memory: int,
        measured_bytes_per_s: Sequence[float] | None = None,
        share: Sequence[float] | None = None,
        request: int = DEFAULT_CHUNK_SIZE,
        **model_options: Any,
    ) -> dict[str, Any]:
        """The performance model's plan for `subgroups` objects of `bytes_per_subgroup`, each read and
        written whole per update (see `_core.plan_update` for `model_options`). `share`, one per path,
        scales the probe's figures to one rank's part of a device the node's ranks share (`rank_share`).
        `measured_bytes_per_s`, one per path, replaces the concurrent figures with what this rank's
        paths gave while running (already its part). `request`: the store's request size."""
        inputs = self.model_inputs(request)
        if share is not None:
            for path, part in zip(inputs, share, strict=True):
                for key in (
                    "read_bytes_per_s",
                    "write_bytes_per_s",
                    "mixed_bytes_per_s",
                    "concurrent_bytes_per_s",
                ):
                    # The concurrent figure is None for a path probed alone.
                    if path[key] is not None:
                        path[key] *= part
        if measured_bytes_per_s is not None:
            for path, bytes_per_s in zip(inputs, measured_bytes_per_s, strict=True):
                path["concurrent_bytes_per_s"] = bytes_per_s
        return _core.plan_update(
            inputs,
            subgroups=subgroups,
            read_bytes_per_subgroup=bytes_per_subgroup,
            write_bytes_per_subgroup=bytes_per_subgroup,
            host_bytes_per_subgroup=bytes_per_subgroup,
            host_memory=host_memory,
            **model_options,
        )

    def plan_stream(
        self,
        sizes: Sequence[int],
        buffer_count: int,
        cache_slots: int,
        *,
        adam_secs_per_chunk: float = 0.0,
        measured_bytes_per_s: Sequence[float] | None = None,
        **model_options: Any,
    ) -> dict[str, Any]:
        """The plan for the streaming update: chunks of `sizes` bytes (the model takes their mean), each
        read and written once per step unless cached, `cache_slots` of `buffer_count` buffers caching
        (the others, if any, are the model's pipeline buffers: written behind at the end of a step)."""
        mean = sum(sizes) // len(sizes)
        return self.plan_subgroups(
            subgroups=len(sizes),
            bytes_per_subgroup=mean,
            host_memory=buffer_count * mean,
            pipeline_buffers=buffer_count - cache_slots,
            adam_secs_per_subgroup=adam_secs_per_chunk,
            measured_bytes_per_s=measured_bytes_per_s,
            **model_options,
        )


# A node-wide limit must beat the ranks' own limits (no admission) by this much to be used, and turns
# must beat sharing request by request by as much to be chosen: without a limit and request by request,
# every rank's requests keep flowing, which keeps the ranks' update times together.
TURNS_MARGIN = 1.05
ADMISSION_MARGIN = 1.05


def sharing_choice(sharing: dict[str, Any] | None) -> str:
    """How the node's ranks should share a device under a node-wide limit, from the probe's `sharing`
    figures: `"turns"` when the whole limit by turns moved more than `TURNS_MARGIN` times what request
    by request did, else `"shared"` (also without figures)."""
    if not sharing:
        return "shared"
    return (
        "turns" if sharing["turns_bytes_per_s"] > TURNS_MARGIN * sharing["shared_bytes_per_s"] else "shared"
    )


def admission_helps(sharing: dict[str, Any] | None) -> bool:
    """Whether a node-wide limit moved more on the device than the ranks did at their own limits alone
    (by `ADMISSION_MARGIN`), from the probe's `sharing` figures. True without them (a profile saved
    before they were measured): bounding the node is the safe default."""
    if not sharing or "free_bytes_per_s" not in sharing:
        return True
    limited = max(sharing["shared_bytes_per_s"], sharing["turns_bytes_per_s"])
    return limited > ADMISSION_MARGIN * sharing["free_bytes_per_s"]


def auto_way(sharing: dict[str, Any] | None) -> str:
    """How the node's ranks share a device with `device_inflight` and `device_sharing` both `"auto"`:
    `"free"` (each rank at its own limit) unless a node-wide limit helps, then its `sharing_choice`."""
    return sharing_choice(sharing) if admission_helps(sharing) else "free"


def _key(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    return [os.path.realpath(p) for p in paths]


def _identity(info: dict[str, Any]) -> tuple[str | None, str]:
    """What a path sits on, from `_core.probe_directory` or a probe: its file system's type, and its
    device, or for a shared file system its mount's source (its device number is new at every mount)."""
    if info.get("locality") == "shared" and info.get("mount_source"):
        return info["fs_type"], info["mount_source"]
    return info.get("fs_type"), info["device_id"]


def _read_entries(file: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        # An unreadable cache is only a cache: measure again and replace it.
        return []
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return []
    return list(data.get("entries", []))


def saved_profile(
    paths: Sequence[str | os.PathLike[str]], options: ProbeOptions, max_age_s: float = DEFAULT_MAX_AGE_S
) -> tuple[Profile | None, str]:
    """The saved profile of exactly these paths, measured with these options, if it is fresh, else None
    and why not."""
    key = _key(paths)
    entries = [e for e in _read_entries(profile_file()) if e.get("paths") == key]
    if not entries:
        return None, "no saved profile for these paths"
    entry = next((e for e in entries if e.get("options") == asdict(options)), None)
    if entry is None:
        return None, "the saved profile was measured with other probe options"
    age = time.time() - float(entry.get("probed_at", 0))
    if age > max_age_s:
        return None, f"the saved profile is {age / 3600:.0f} h old (limit {max_age_s / 3600:.0f} h)"
    for path, probe in zip(key, entry["probes"], strict=True):
        if _identity(_core.probe_directory(path)) != _identity(probe):
            return None, f"{path} is now on another device or file system"
    return Profile(key, entry["probes"], float(entry["probed_at"]), entry["options"], "saved"), ""


def save_profile(profile: Profile) -> Path:
    """Adds or replaces the entry for the profile's paths and options; the file is replaced atomically."""
    file = profile_file()
    file.parent.mkdir(parents=True, exist_ok=True)
    same = (profile.paths, profile.options)
    entries = [e for e in _read_entries(file) if (e.get("paths"), e.get("options")) != same]
    entries.append(
        {
            "paths": profile.paths,
            "probed_at": profile.probed_at,
            "options": profile.options,
            "devices": profile.devices,
            "probes": profile.probes,
        }
    )
    tmp = file.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=2))
    os.replace(tmp, file)
    return file


def probe(
    paths: Sequence[str | os.PathLike[str]],
    options: ProbeOptions = ProbeOptions(),
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Measures the paths now (see `_core.probe_bandwidth`)."""
    key = _key(paths)
    probes = _core.probe_bandwidth(key, progress=progress, **asdict(options))
    for p in probes:
        p["path"] = str(p["path"])
    return Profile(key, probes, time.time(), asdict(options))


def load_or_probe(
    paths: Sequence[str | os.PathLike[str]],
    options: ProbeOptions = ProbeOptions(),
    *,
    reprobe: bool = False,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    progress: Callable[[str], None] | None = None,
) -> tuple[Profile, str]:
    """The saved profile when fresh, else a new probe (saved). Also returns a line saying which. Holds the
    node's probe lock throughout: one process of the node probes, the others wait and reuse its profile."""
    with node_probe_lock():
        return _load_or_probe(paths, options, reprobe=reprobe, max_age_s=max_age_s, progress=progress)


@contextlib.contextmanager
def node_probe_lock() -> Iterator[None]:
    """The host's probe lock (see the module docs)."""
    file = profile_dir() / f"{socket.gethostname()}.lock"
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "a") as f:
        while True:
            try:
                _flock_without_signals(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            _flock_without_signals(f.fileno(), fcntl.LOCK_UN)


# How often a rank waiting for the node's probe tries its lock again.
LOCK_POLL_S = 0.05


def _flock_without_signals(fd: int, operation: int) -> None:
    """`flock` with every signal blocked in this thread, so never interrupted while the file system
    answers: on a GlusterFS mount two interrupted lock requests hang its client for good (the store's
    lock in the Rust core says how). A waiting rank therefore polls a non-blocking lock rather than
    blocking with signals held off, and Ctrl-C still ends it between tries."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        fcntl.flock(fd, operation)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _load_or_probe(
    paths: Sequence[str | os.PathLike[str]],
    options: ProbeOptions,
    *,
    reprobe: bool,
    max_age_s: float,
    progress: Callable[[str], None] | None,
) -> tuple[Profile, str]:
    if not reprobe:
        saved, why_not = saved_profile(paths, options, max_age_s)
        if saved is not None:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(saved.probed_at))
            return (
                saved,
                f"using the profile measured {when}, saved in {profile_file()} (--reprobe to measure again)",
            )
    else:
        why_not = "a new probe was asked for"
    profile = probe(paths, options, progress)
    file = save_profile(profile)
    return profile, f"probed now ({why_not}); saved in {file}"


def _mib_s(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 2**20:,.0f} MiB/s"


def across_nodes_note(probe: dict[str, Any], nodes: int) -> str:
    """Where a path's share among `nodes` nodes comes from (its probe's `across_nodes`), in words."""
    measured = across_nodes(probe, nodes)
    if measured is None:
        return (
            "not measured across nodes: each node is planned with 1/N of one node's figure, a lower "
            "bound (run `mlp-offload probe` on every node at once, under torchrun, to measure it)"
        )
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(measured["probed_at"]))
    rates = ", ".join(_mib_s(r) for r in measured["together_bytes_per_s"])
    alone = ", ".join(_mib_s(r) for r in measured["alone_bytes_per_s"])
    return (
        f"measured {when} on {len(measured['hosts'])} nodes at once: {rates} (alone {alone}); "
        f"{_mib_s(sum(measured['together_bytes_per_s']))} together"
    )


def across_nodes(probe: dict[str, Any], nodes: int) -> dict[str, Any] | None:
    """The path's measurement across nodes that `nodes` nodes plan with: of exactly that many, else of
    the most nodes below, else of the fewest above; None without one."""
    measured = probe.get("across_nodes") or {}
    if not measured:
        return None
    counts = sorted(int(n) for n in measured)
    fewer = [n for n in counts if n <= nodes]
    return dict(measured[str(fewer[-1] if fewer else counts[0])])


class AcrossNodesError(RuntimeError):
    """A node's measurement of a shared path across nodes failed; every rank raises it, naming the node
    and its error."""


@dataclass
class _AcrossNodesJob:
    """`measure_across_nodes`'s ranks, as this one sees them: the job's size, this rank's host, the
    nodes' hosts in rank order, whether this rank measures for its node (`leader`), a window's seconds,
    the file's bytes and the I/O engine."""

    world: int
    host: str
    hosts: list[str]
    leader: bool
    secs: float
    working_bytes: int
    engine: str

    def gather(self, path: str, said: Any) -> list[Any]:
        """Every collective of the measurement is an all-gather of (host, what this rank has to say), so
        that a node whose measurement fails tells the others at the next one and every rank raises
        there, instead of the others waiting in a barrier until the process group times out."""
        import torch.distributed as dist

        heard: list[Any] = [None] * self.world
        dist.all_gather_object(heard, (self.host, said))
        failed = [f"{h}: {s['error']}" for h, s in heard if isinstance(s, dict) and "error" in s]
        if failed:
            raise AcrossNodesError(f"measuring {path} across nodes failed on {'; '.join(failed)}")
        return heard

    def window(self, path: str, k: int) -> float | None:
        """Window `k`'s seconds for this node (None: it sits out). Windows 0..nodes-1: node k alone;
        window `nodes`, longer: all of them, whose aggregate the plan divides (on a network file system
        a short window is noisy)."""
        self.gather(path, None)
        nodes = len(self.hosts)
        if k == nodes:
            return TOGETHER_WINDOWS * self.secs
        return self.secs if self.hosts[k] == self.host else None

    def measure(self, path: str, p: dict[str, Any]) -> dict[str, Any]:
        """One shared path (its probe `p`) measured from every node: alone in turn, then together."""
        nodes = len(self.hosts)
        rates = None
        try:
            if self.leader:
                rates = _core.probe_shared_path(
                    path,
                    chunk_size=p["best_read"]["chunk_size"],
                    max_inflight=p["best_read"]["max_inflight"],
                    pages=p["pages"]["chosen"],
                    expected_bytes_per_s=p["mixed_bytes_per_s"],
                    working_bytes=self.working_bytes,
                    steps=nodes + 1,
                    step=functools.partial(self.window, path),
                    engine=self.engine,
                )
            else:
                for k in range(nodes + 1):
                    self.window(path, k)
        except AcrossNodesError:
            raise
        except Exception as e:
            # This node failed between two collectives: the others wait in the next one; say why there.
            with contextlib.suppress(AcrossNodesError):
                self.gather(path, {"error": f"{type(e).__name__}: {e}"})
            raise
        by_host = {h: r for h, r in self.gather(path, rates) if r is not None}
        return {
            "hosts": self.hosts,
            "alone_bytes_per_s": [by_host[h][k] for k, h in enumerate(self.hosts)],
            "together_bytes_per_s": [by_host[h][nodes] for h in self.hosts],
            "secs": self.secs,
            "together_secs": TOGETHER_WINDOWS * self.secs,
            "probed_at": time.time(),
        }


def measure_across_nodes(
    profile: Profile,
    options: ProbeOptions,
    localities: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    save: bool = True,
) -> int:
    """Measures each shared path of the profile from every node of the job at once; collective: every
    rank of the job calls it, with torch.distributed initialized. The first rank of each node measures:
    each node alone in turn for the options' `together_secs` (3 s), then all nodes at once for
    `TOGETHER_WINDOWS` times as long, at the node's best read settings, over a file of the options'
    `sustained_bytes` (1 GiB). Every rank keeps the figures in its profile (`across_nodes`, by node
    count), and with `save` the first rank of each node saves them in the node's profile file. Paths
    measured before for this many nodes are skipped, unless another rank's profile lacks them. Returns
    the number of nodes (1 without torch.distributed). A node whose measurement fails makes every rank
    raise `AcrossNodesError` naming it, at the next collective."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 1
    world, rank, host = dist.get_world_size(), dist.get_rank(), socket.gethostname()
    shared = [i for i, loc in enumerate(profile.localities(localities)) if loc == "shared"]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (host, shared))
    hosts = list(dict.fromkeys(h for h, _ in everyone))
    nodes = len(hosts)
    if nodes < 2:
        return nodes
    # Paths any rank takes as shared and lacks a measurement of this many nodes for.
    wanted = sorted({i for _, indices in everyone for i in indices})
    missing = [i for i in wanted if str(nodes) not in (profile.probes[i].get("across_nodes") or {})]
    votes: list[Any] = [None] * world
    dist.all_gather_object(votes, missing)
    todo = sorted({i for v in votes for i in v})
    leader = rank == next(r for r, (h, _) in enumerate(everyone) if h == host)
    job = _AcrossNodesJob(
        world,
        host,
        hosts,
        leader,
        options.together_secs or ACROSS_NODES_SECS,
        options.sustained_bytes or ACROSS_NODES_WORKING_BYTES,
        options.engine,
    )
    for i in todo:
        p, path = profile.probes[i], profile.paths[i]
        p.setdefault("across_nodes", {})[str(nodes)] = job.measure(path, p)
        if progress is not None:
            progress(f"{path}: shared by {nodes} nodes: {across_nodes_note(p, nodes)}")
    if todo and leader and save:
        with node_probe_lock():
            save_profile(profile)
    return nodes
