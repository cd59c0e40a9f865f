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
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = [
    "GradsFinal",
    "UpdateInFlight",
    "update_thread",
]


def update_thread() -> ThreadPoolExecutor:
    """The one thread an engine's updates run on, one after another, for the engine's life (a thread per
    step would come and go under the process's feet), started now rather than at the first update."""
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlp-offload-update")
    thread.submit(lambda: None).result()
    return thread


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

    def is_done(self, subgroup: int) -> bool:
        """Whether `subgroup`'s parameters are final, without waiting (False where the update failed
        before it: `wait_for` raises that)."""
        return self._updated[subgroup]

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


class GradsFinal:
    """When each chunk's gradient became final in the backward that ends an accumulation boundary: once
    DeepSpeed has reduced the gradient of every parameter with elements in the chunk on this rank into
    its host buffer (`final`, from its per-parameter boundary hook), the chunk could be updated, while
    the rest of backward runs. What the update could hide in backward follows from these times.

    `chunks`: `(subgroup, first element, count)` per chunk; `params`: `(parameter id, subgroup, offset in
    the subgroup's partition, count)` of every parameter with elements on this rank."""

    def __init__(
        self, chunks: Sequence[tuple[int, int, int]], params: Iterable[tuple[Hashable, int, int, int]]
    ) -> None:
        of_subgroup: dict[int, list[int]] = {}
        for c, (i, _, _) in enumerate(chunks):
            of_subgroup.setdefault(i, []).append(c)
        self._chunks_of: dict[Hashable, list[int]] = {}
        self._params_of: list[list[Hashable]] = [[] for _ in chunks]
        self._expected = [0] * len(chunks)
        # Held while the counts change; waited on by `wait`.
        self._cond = threading.Condition()
        for pid, i, offset, count in params:
            # Chunks of a subgroup cover its partition in order, so the overlap is a range of them.
            overlapping = [
                c
                for c in of_subgroup.get(i, [])
                if chunks[c][1] < offset + count and offset < chunks[c][1] + chunks[c][2]
            ]
            self._chunks_of[pid] = overlapping
            for c in overlapping:
                self._expected[c] += 1
                self._params_of[c].append(pid)
        self.reset()

    def reset(self) -> None:
        """Forgets the last boundary's gradients (after the step used them)."""
        with self._cond:
            self._left = list(self._expected)
            self._seen: set[Hashable] = set()
            self._final_at: list[float | None] = [None] * len(self._expected)
            # Chunks a gradient changed in after they were final (a parameter reduced twice).
            self.changed: set[int] = set()

    def chunks_of(self, pid: Hashable) -> list[int]:
        """The chunks parameter `pid` has elements in."""
        return self._chunks_of.get(pid, [])

    def params_of(self, chunk: int) -> list[Hashable]:
        """The parameters with elements in chunk `chunk`."""
        return self._params_of[chunk]

    def final(self, pid: Hashable, at: float | None = None) -> None:
        """Parameter `pid`'s gradient is final (reduced into the host buffer) at `at` (now by default).
        Its first time counts; a second one means its gradient changed after that, and its chunks are
        `changed`."""
        at = time.perf_counter() if at is None else at
        with self._cond:
            if pid in self._seen:
                self.changed.update(self._chunks_of.get(pid, ()))
                return
            self._seen.add(pid)
            for c in self._chunks_of.get(pid, ()):
                self._left[c] -= 1
                if self._left[c] == 0:
                    self._final_at[c] = at
            self._cond.notify_all()

    def end(self, at: float | None = None) -> None:
        """Backward is over: every chunk's gradient is what the step will use, final now if not before
        (a parameter that got no gradient)."""
        at = time.perf_counter() if at is None else at
        with self._cond:
            self._final_at = [at if t is None else t for t in self._final_at]
            self._cond.notify_all()

    def wait(self, chunk: int, timeout: float) -> bool:
        """Whether chunk `chunk`'s gradient is final, waiting up to `timeout` seconds for it."""
        with self._cond:
            return self._cond.wait_for(lambda: self._final_at[chunk] is not None, timeout)

    def leads(self, backward_end: float) -> list[float]:
        """Per chunk, how long before `backward_end` its gradient was final: 0 for a chunk final only at
        the end (or after it, or never: a parameter that got no gradient)."""
        with self._cond:
            return [0.0 if t is None else max(0.0, backward_end - t) for t in self._final_at]
