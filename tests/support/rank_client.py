"""torchrun's worker where the tests fork ranks (the two nodes of `tests/test_cluster.py`,
Megatron-DeepSpeed): it asks the rank server (`harness_server.py --ranks`) to fork the rank, handing it
this process's stdin, stdout, stderr, environment (torchrun's: rank, world size, rendezvous) and working
directory, and then stands for it: torchrun's signals go to the rank, and the rank's exit is this
process's, a signal's by the same signal.

argv: the server's address, the harness file (its `main` is called with the arguments that follow), then
those arguments. It imports nothing beyond the standard library, so it starts in a few tens of
milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path


def main() -> None:
    address, harness, *args = sys.argv[1:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect("\0" + address)
    asked = {"harness": Path(harness).stem, "file": harness, "args": args, "env": dict(os.environ)}
    asked["cwd"] = os.getcwd()
    socket.send_fds(conn, [json.dumps(asked).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(4096))["pid"]

    def forward(number: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)

    # SIGUSR1: the harness's signal to write its stacks (`deepspeed_runs.STACKS_SIGNAL`).
    for forwarded in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(forwarded, forward)
    answer = conn.recv(4096)
    if not answer:
        sys.exit(f"rank_client: the rank server at {address} ended before rank {pid} did")
    code = json.loads(answer)["exit"]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
