"""Two nodes on one machine, and a network file system they share, for the tests that run across nodes.

Each node is a network namespace with its own address, joined by a veth pair to a third namespace, the
file server's, whose bridge is the switch between them. Every command a node runs also gets, from
`unshare`, its own hostname, its own System V IPC and mount namespaces, and in them its own `/dev/shm` (a
private tmpfs), its node-local directory bound at one path (`node_local`, as a cluster's nodes each have
their own disk at /local), and the shared volume mounted at `shared`. So each node has its own node-wide
admission semaphores and key files, its own probe lock and profile (named by hostname), and its own
local directory. torchrun launches each node's ranks there (`--nnodes 2 --node-rank k`), its rendezvous
on node 0's address, gloo on the node's veth.

The shared tier is a GlusterFS volume (Debian's `glusterfs-server`): one brick, served from the file
server's namespace, mounted with the FUSE client on each node, so every byte a node writes to it crosses
the network (the veths and the bridge), and a node can die without taking the file system with it.
GlusterFS because this kernel has FUSE and no NFS client, and among Debian's network file systems it is
the one a single brick serves (MooseFS needs a master, a chunkserver and a metalogger; Ceph a monitor, a
manager and OSDs).

Root only. Both classes are context managers that remove what they made, and kill whatever still runs
in the namespaces, also when the test fails.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Node k's address on the veth pair: 10.77.<net>.<k + 1>/24.
SUBNET = "10.77"


def cluster_unavailable() -> str | None:
    """Why two nodes and a shared volume cannot be made here, or None."""
    for tool in ("ip", "unshare", "glusterd", "gluster", "mount.glusterfs"):
        if shutil.which(tool) is None and not Path("/sbin", tool).exists():
            return (
                f"{tool} not found (scripts/bootstrap.sh installs iproute2, util-linux and glusterfs-server)"
            )
    if not Path("/dev/fuse").exists():
        return "/dev/fuse is missing (the GlusterFS client is a FUSE file system)"
    return None


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    veth: str
    address: str
    hostname: str
    local_dir: Path


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip() or done.stdout}"
        )


def _pids_in(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


class TwoNodeCluster:
    """Two nodes (`nodes[0]`, `nodes[1]`) with their directories under `root`; `tag` (a few letters and
    digits, unique among the clusters alive at once) names their namespaces and links."""

    def __init__(self, root: Path, tag: str) -> None:
        net = sum(map(ord, tag)) % 250 + 1
        self.root = root
        self.tag = tag
        # Where each node sees its own local directory, and the shared volume once one is mounted.
        self.node_local = root / "node-local"
        self.shared = root / "shared"
        self.shared_brick: Path | None = None
        self._mount: str | None = None
        self.nodes = [
            Node(
                index=k,
                netns=f"mlpo-{tag}-n{k}",
                veth=f"mlpo{tag[:6]}{k}",
                address=f"{SUBNET}.{net}.{k + 1}",
                hostname=f"node{k}-{tag}",
                local_dir=root / f"node{k}-local",
            )
            for k in range(2)
        ]
        # The file server's namespace, which is also the switch: each node's veth ends on its bridge.
        self.server_netns = f"mlpo-{tag}-fs"
        self.server_address = f"{SUBNET}.{net}.3"
        self._bridge = f"mlpo{tag[:6]}br"

    def __enter__(self) -> TwoNodeCluster:
        fs = self.server_netns
        # A run killed before its exit left namespaces of these names (and their processes): gone first.
        self.__exit__(None, None, None)
        try:
            self.node_local.mkdir(parents=True, exist_ok=True)
            self.shared.mkdir(parents=True, exist_ok=True)
            for netns in (*(node.netns for node in self.nodes), fs):
                _run("ip", "netns", "add", netns)
                _run("ip", "-n", netns, "link", "set", "lo", "up")
            _run("ip", "-n", fs, "link", "add", self._bridge, "type", "bridge")
            _run("ip", "-n", fs, "addr", "add", f"{self.server_address}/24", "dev", self._bridge)
            _run("ip", "-n", fs, "link", "set", self._bridge, "up")
            for node in self.nodes:
                node.local_dir.mkdir(parents=True, exist_ok=True)
                port = f"{node.veth}s"
                _run(
                    "ip",
                    "link",
                    "add",
                    node.veth,
                    "netns",
                    node.netns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    fs,
                )
                _run("ip", "-n", fs, "link", "set", port, "master", self._bridge)
                _run("ip", "-n", fs, "link", "set", port, "up")
                _run("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.veth)
                _run("ip", "-n", node.netns, "link", "set", node.veth, "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for netns in (*(node.netns for node in self.nodes), self.server_netns):
            self._kill_all(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)

    def kill_node(self, index: int) -> None:
        """SIGKILL to every process of node `index`, as when the node dies; returns once none is left."""
        self._kill_all(self.nodes[index].netns)

    @staticmethod
    def _kill_all(netns: str) -> None:
        deadline = time.monotonic() + 30
        while (pids := _pids_in(netns)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def mount_shared(self, source: str, brick: Path) -> None:
        """Makes every later command of each node mount `source` (GlusterFS's `host:/volume`) at `shared`;
        `brick` is where the volume's files lie on this machine."""
        self._mount = source
        self.shared_brick = brick

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        """`argv` as node `index` runs it: in its network namespace, with its hostname, IPC and mount
        namespaces, `/dev/shm`, local directory and the shared volume."""
        node = self.nodes[index]
        q = shlex.quote
        setup = [
            "mount -t tmpfs -o size=256m tmpfs /dev/shm",
            f"hostname {q(node.hostname)}",
            f"mount --bind {q(str(node.local_dir))} {q(str(self.node_local))}",
        ]
        if self._mount is not None:
            setup.append(f"mount -t glusterfs {q(self._mount)} {q(str(self.shared))}")
        return [
            "ip", "netns", "exec", node.netns,
            "unshare", "--uts", "--ipc", "--mount", "--propagation", "private",
            "sh", "-ec", " && ".join(setup) + ' && exec "$@"', "sh", *argv,
        ]  # fmt: skip

    def run(self, index: int, argv: Sequence[str]) -> None:
        """Runs `argv` on node `index` (see `command`) and waits; raises with its output if it fails."""
        _run(*self.command(index, argv))

    def torchrun(
        self, index: int, script: Sequence[str], port: int, ranks_per_node: int, nodes: int = 2
    ) -> list[str]:
        """torchrun on node `index` of a job of `nodes` nodes, its rendezvous on node 0 at `port`, running
        `script` (a Python file and its arguments) `ranks_per_node` times."""
        node = self.nodes[index]
        # The torchrun beside this interpreter, which runs the script with it.
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return self.command(
            index,
            [
                torchrun,
                "--nnodes", str(nodes),
                "--node-rank", str(index),
                "--nproc-per-node", str(ranks_per_node),
                "--master-addr", self.nodes[0].address,
                "--master-port", str(port),
                "--local-addr", node.address,
                "--max-restarts", "0",
                *script,
            ],
        )  # fmt: skip

    def env(self, index: int) -> dict[str, str]:
        """What node `index`'s processes need in their environment: gloo on the veth."""
        return {"GLOO_SOCKET_IFNAME": self.nodes[index].veth}


class GlusterVolume:
    """A GlusterFS volume of one brick (`brick`, a directory here), served from `cluster`'s file server
    namespace by its own glusterd, and mounted by each node's commands at `cluster.shared`."""

    def __init__(self, cluster: TwoNodeCluster, brick: Path) -> None:
        self.cluster = cluster
        self.brick = brick
        self.name = f"mlpo-{cluster.tag}"
        self._glusterd: subprocess.Popen[bytes] | None = None
        self._log = cluster.root / "glusterd.log"

    def _gluster(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.cluster.server_netns, "gluster", "--mode=script", *args)

    def __enter__(self) -> GlusterVolume:
        server = self.cluster.server_netns
        address = self.cluster.server_address
        self.brick.mkdir(parents=True, exist_ok=True)
        # A run killed before its exit left its volume's definition: glusterd would bring it back, and
        # the create below would find the name taken.
        shutil.rmtree(Path("/var/lib/glusterd/vols", self.name), ignore_errors=True)
        try:
            with self._log.open("w") as log:
                self._glusterd = subprocess.Popen(
                    ["ip", "netns", "exec", server, "glusterd", "-N", "--log-file", str(self._log)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + 30
            while True:
                try:
                    self._gluster("volume", "list")
                    break
                except RuntimeError:
                    if self._glusterd.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"glusterd did not start: {self._log.read_text()[-3000:]}"
                        ) from None
                    time.sleep(0.2)
            # A brick on the root file system needs `force`.
            self._gluster("volume", "create", self.name, f"{address}:{self.brick}", "force")
            self._gluster("volume", "start", self.name)
            self.cluster.mount_shared(f"{address}:/{self.name}", self.brick)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def mountpoint(self) -> Path:
        return self.cluster.shared

    def __exit__(self, *exc: object) -> None:
        for args in (("volume", "stop", self.name, "force"), ("volume", "delete", self.name)):
            try:
                self._gluster(*args)
            except RuntimeError:
                pass
        if self._glusterd is not None:
            self._glusterd.kill()
            self._glusterd.wait()
        # What a volume glusterd could not delete would come back with the next glusterd.
        shutil.rmtree(Path("/var/lib/glusterd/vols", self.name), ignore_errors=True)
