"""The update phase on a thread of its own, so that `step()` returns while it runs.

`step()` decides the step's outcome (overflow, norm, clipping factor) on the caller's thread, then hands
the chunk loop to an `UpdateInFlight`. DeepSpeed's next forward fetches each parameter through its
all-gather, which waits for that parameter's own subgroup (`wait_for`); everything else that reads the
parameters, the state or the gradients waits for the whole update (`result`), on every rank at the same
point of the program, so collectives keep their order.

The update thread runs no collective and takes the GIL only between chunks: the chunk's compute (the fused
pass) and its I/O run in the Rust core without it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["UpdateInFlight", "choose", "update_thread"]


def choose(setting: bool | str, fused: bool, every_chunk_cached: bool) -> tuple[bool, str]:
    """Whether the update runs behind `step()` (`MLPOffloadConfig.overlap`), and why, in words for the
    start-up line."""
    if setting is False:
        return False, "off in the config"
    if not fused:
        # The update thread must not hold the GIL while the forward runs.
        return False, "off: DeepSpeed's passes hold the GIL, the update runs inside step()"
    if setting is True:
        return True, "on (the config)"
    if every_chunk_cached:
        return True, "on: every chunk stays in host memory"
    # In chunk order the cache keeps the stream's buffers fewer chunks, and the chunks the last writes
    # left in their buffers are read again: more bytes than the next forward's compute hides, unless the
    # forward is long (docs/results.md, issue 30).
    return False, "off: the state streams (overlap: true runs it behind step() all the same)"


def update_thread() -> ThreadPoolExecutor:
    """The one thread an engine's updates run on, one after another, for the engine's life (a thread per
    step would come and go under the process's feet)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlp-offload-update")


Result = TypeVar("Result")


class UpdateInFlight(Generic[Result]):
    """Runs `run(done)` on `thread` (`update_thread()`), where `run` calls `done(subgroup)` once each
    subgroup's parameters are final. `wait_for` blocks until given subgroups are done; `result` until all
    of it is, and returns what `run` returned. Either raises what `run` raised, if it raised before what
    it waits for was done: the same exception (an `OSError` keeps its errno and file), with a note that
    says which step's update it came from."""

    def __init__(
        self, run: Callable[[Callable[[int], None]], Result], subgroups: int, step: int, thread: Executor
    ) -> None:
        self.step = step
        # Set when the subgroup is done, or when the update ended (done or not: see `_updated`).
        self._done = [threading.Event() for _ in range(subgroups)]
        self._updated = [False] * subgroups
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._result: Result | None = None
        # Seconds the caller's thread spent waiting for subgroups (the next forward's fetches).
        self.waited_secs = 0.0
        self._future = thread.submit(self._main, run)

    def _main(self, run: Callable[[Callable[[int], None]], Result]) -> None:
        try:
            self._result = run(self._mark_done)
        except BaseException as error:  # handed to the thread that waits
            self._error = error
        finally:
            self._finished.set()
            for done in self._done:
                done.set()

    def _mark_done(self, subgroup: int) -> None:
        self._updated[subgroup] = True
        self._done[subgroup].set()

    def _failed(self, what: str) -> BaseException:
        assert self._error is not None
        self._error.add_note(f"mlp_offload: raised by the update of step {self.step}, before {what}")
        return self._error

    def wait_for(self, subgroups: Iterable[int]) -> None:
        start = time.perf_counter()
        try:
            for i in subgroups:
                self._done[i].wait()
                if not self._updated[i]:
                    raise self._failed(f"subgroup {i} was updated")
        finally:
            self.waited_secs += time.perf_counter() - start

    def result(self) -> Result:
        self._finished.wait()
        self._future.result()
        if self._error is not None:
            raise self._failed("it ended")
        assert self._result is not None
        return self._result
