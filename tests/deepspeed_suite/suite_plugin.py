"""The harness's pytest plugin, in the pytest process of DeepSpeed's suite (`-p suite_plugin`): names the
running case for its rank processes (in a file: those forked from DeepSpeed's forkserver keep the
environment it started with), empties the engines' store directories between cases, and writes each
case's outcome as one JSON line. With DeepSpeed's CPU accelerator it has the forkserver of the rank
processes preload torch and DeepSpeed (`suite_preload`)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from typing import Any

import pytest


def pytest_configure(config: Any) -> None:
    # Before the first case starts DeepSpeed's forkserver, which imports these once for every rank.
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        multiprocessing.set_forkserver_preload(["__main__", "suite_preload"])


def pytest_collection_finish(session: Any) -> None:
    # Collecting only: each case's node id, and whether it runs in rank processes of its own.
    if listing := os.environ.get("MLP_OFFLOAD_DS_SUITE_LISTING"):
        with open(listing, "w") as f:
            for item in session.items:
                f.write(f"{item.nodeid} {bool(getattr(item.cls, 'is_dist_test', False))}\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    with open(os.environ["MLP_OFFLOAD_DS_SUITE_CURRENT"], "w") as f:
        f.write(item.nodeid)
    stores = os.environ["MLP_OFFLOAD_DS_SUITE_STORES"]
    shutil.rmtree(stores, ignore_errors=True)
    os.makedirs(stores)


def pytest_runtest_logreport(report: Any) -> None:
    # A case's outcome: its call, or its setup when that failed or skipped.
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif report.failed:
            # The exception's own line ("E   ...") says more than the last frame's location.
            lines = report.longreprtext.strip().splitlines() or [""]
            errors = [line[1:].strip() for line in lines if line.startswith("E ")]
            reason = errors[-1] if errors else lines[-1]
        entry = {
            "case": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "reason": reason[:500],
            "seconds": round(report.duration, 2),
        }
        with open(os.environ["MLP_OFFLOAD_DS_SUITE_OUTCOMES"], "a") as f:
            f.write(json.dumps(entry) + "\n")
