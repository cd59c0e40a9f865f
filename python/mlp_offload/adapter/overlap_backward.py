"""The update during backward (`overlap_backward`): chunks updated as their gradients become final, at the
outcome expected then, and kept or undone by `step()`.

At the boundary's backward, once the first gradient is final, `OverlapBackward.begin` hands the update of
the chunks the plan chose (`UpdatePlanner.backward_chunks`) to the update thread, at the outcome expected
then: no overflow, no clipping (the gradient's scale `1 / loss_scale`), the param groups as they are. Each
chunk waits for its gradient; a streamed one is written as a staged version, a cached one in place with
its state before in a kept copy in host memory. `step()` keeps the versions where the step's outcome is
the one assumed (`settle`), else forgets them and gives back the parameters and Adam steps they changed;
so does anything that reads the parameters, the state or the gradients before `step()` (`abandon`).

What this changes of `MLPOffloadStage3`, all of it, at the points it calls:
- `gradient_final` (DeepSpeed's `_offload_grad_partition_at_boundary`): begins the update, counts the
  gradients' norms so far, stops it once they rule its outcome out (not finite, or clipped);
- `backward_started`, `backward_ended` (DeepSpeed's backward hooks);
- `touched` (every all-gather of the module's parameters) and `abandon` (`_mlp_settle`);
- `take`, `boundary_ended`, `settle`, `skipped_step` (`step()`);
- the half-precision partitions and the Adam steps it writes before `step()`, which `undo` gives back;
  and the persistent parameters' own copies (`own_copies`), so that its new values
  show to no reader before `step()`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from deepspeed.accelerator import get_accelerator

from mlp_offload import _core
from mlp_offload.adapter.chunk_update import ChunkUpdater
from mlp_offload.adapter.deepspeed_view import DeepSpeedView, StepSnapshot
from mlp_offload.adapter.session import UpdateSession
from mlp_offload.engine.pipeline import KeptCopy, StepStats
from mlp_offload.engine.planning import chunks_backward_may_take, secs_per_chunk_in_backward
from mlp_offload.engine.telemetry import BackwardStep, GradsFinal

# The update during backward stops when the norms so far clip by more than this (relative): their sum
# in another order may round differently from DeepSpeed's.
CLIP_MARGIN = 1e-6
# Clipped steps in a row after which the steps leave chunk order. Each one there costs the chunks its
# smaller cache lacks, read and written; the way back to it costs one write of them and one boundary
# without the update during backward. A single clipped step (a loss spike) is not a reason to leave.
CLIPPED_STEPS_BACK = 3


@dataclass
class BackwardUpdate:
    """One boundary's update during backward, at the outcome expected when it began (`snapshot`, and the
    gradient's scale with no overflow and no clipping). Its versions are staged (in the store, or in a
    cached chunk's buffer with its state before in a kept copy) until `step()` keeps or forgets them."""

    snapshot: StepSnapshot
    grad_scale: float
    # The param groups as the fused pass takes them.
    adam_groups: list[_core.AdamGroup]
    stop: threading.Event = field(default_factory=threading.Event)
    # Held while a chunk is taken, and while a gather looks at what was taken.
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Chunks whose pass began, in order, and when each ended.
    taken: list[int] = field(default_factory=list)
    ended_at: list[float] = field(default_factory=list)
    # Chunk -> its half-precision parameters before the pass where they were not its fp32 weights
    # narrowed (so the store's old version alone could not give them back): (first element, values),
    # a block at a time, as the pass found them.
    kept_params: dict[int, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    backward_end: float | None = None
    started: float = field(default_factory=time.perf_counter)
    # When the first chunk could begin: once the chosen chunks had their second slots (set then).
    began: float = field(default_factory=time.perf_counter)
    future: Future[StepStats] | None = None
    # The chunks the plan chose, and of those, the ones with a second slot to stage into (set on the
    # update thread before the first chunk).
    planned: int = 0
    slotted: int = 0
    # Why it stopped before every chunk was taken, when the gradients' norm so far proved the step
    # clipped or not finite.
    stopped: str | None = None


@dataclass
class BoundaryEnd:
    """What `step()` learns of the boundary's backward: per chunk, how long before its end the chunk's
    gradient was final (`leads`), the record of it, whether a gradient changed after it was final, and
    why the update during backward was not tried."""

    leads: list[float]
    record: GradsFinal
    changed: bool
    skipped: str | None


@dataclass
class Settled:
    """The update during backward as `step()` settled it: its figures where it ran until then (`stats`),
    its telemetry record (None: nothing to say), and the chunks it kept (`committed`), which the step's
    update leaves out."""

    stats: StepStats | None
    record: BackwardStep | None
    committed: set[int]
    # Whether it is on and none began at this boundary (nor was undone before step()): the second slots
    # long unused go back after the step's update too (`ChunkedState.give_back_idle_slots`).
    idle: bool


class OverlapBackward:
    """The update during backward in a session (module docs): its chunks updated by `chunk_update`, over
    DeepSpeed's members in `view`."""

    def __init__(self, session: UpdateSession, view: DeepSpeedView, chunk_update: ChunkUpdater) -> None:
        self.session = session
        self.view = view
        self.chunk_update = chunk_update
        # Chosen at start (`settings.Settings.overlap_backward`).
        self.on = session.settings.overlap_backward.on
        # Whether this boundary's update began (reset by `take`), and the one running, until `step()` (or
        # a reader in between) settles it.
        self.begun = False
        self.current: BackwardUpdate | None = None
        # What a reader that undid it before step() left for step()'s record.
        self.abandoned: BackwardStep | None = None
        # Whether the last step's gradients were scaled by 1/loss_scale alone (not clipped): it assumes
        # so, and is not tried after a step that was clipped (it would be undone as long as clipping goes
        # on); an unclipped step turns it back on.
        self.likely = True
        # Steps clipped in a row since the plan went to chunk order (`_weigh_chunk_order`).
        self.clipped_in_chunk_order = 0
        # Why this boundary's update was not tried, for step()'s record.
        self.skipped: str | None = None
        # The boundary's gradient norms so far, squared and summed, to stop it once they prove the step
        # clipped or not finite; reset by each backward.
        self.norm_sq_so_far = 0.0
        # On an accelerator, where `float()` of a norm would wait for the device once per parameter: per
        # chunk whose gradient is final, an event recorded after DeepSpeed queued the copy of its last
        # gradient into the host buffer, and the norms so far squared and summed on the device then,
        # which the update thread reads before it takes the chunk; reset by each backward.
        self.device_marks: dict[int, tuple[Any, torch.Tensor]] = {}
        self.norm_sq_on_device: torch.Tensor | None = None
        # Per chunk, how long before the last boundary's backward ended its gradient was final, and how
        # long that backward took (from when it started): what the plan goes by.
        self.last_leads: list[float] | None = None
        self.last_boundary_backward = 0.0
        self.last_backward_start = 0.0

    # ----------------------------------------------------------------------------------------------
    # During backward

    def backward_started(self) -> None:
        """Norms come at the boundary's backward: each backward starts the sum afresh."""
        self.norm_sq_so_far = 0.0
        self.device_marks = {}
        self.norm_sq_on_device = None

    def backward_ended(self, end: float) -> None:
        """The boundary's backward is over: every chunk's gradient is the one the step uses."""
        if (run := self.current) is not None:
            run.backward_end = end
            self.session.grads_final.end(end)

    def gradient_final(self, pid: int, norm: torch.Tensor) -> None:
        """Parameter `pid`'s gradient of the boundary is final, its norm `norm`: marks it so for the
        update thread (`GradsFinal`), counts the norm, and begins this boundary's update with its first
        final gradient (once it was not tried, or was undone, no chunk of this backward is taken)."""
        grads_final = self.session.grads_final
        on_device = norm.device.type != "cpu"
        begins = self.on and self.current is None and not self.begun and self.likely
        if self.on and on_device and (self.current is not None or begins):
            # DeepSpeed queued the gradient's copy into the host buffer on this stream, and computed the
            # norm from it: what the update thread waits for before it reads either (before the chunk's
            # gradient is marked final, which wakes it).
            so_far = norm.double() ** 2
            if self.norm_sq_on_device is not None:
                so_far += self.norm_sq_on_device
            self.norm_sq_on_device = so_far
            event = get_accelerator().Event()
            event.record()
            for c in grads_final.chunks_of(pid):
                self.device_marks[c] = (event, so_far)
        grads_final.final(pid)
        if self.on and not on_device:
            self.norm_sq_so_far += float(norm) ** 2
            if (run := self.current) is not None and run.stopped is None:
                self.stop_if_ruled_out(run)
        if begins:
            self.begun = True
            self.begin()

    def begin(self) -> None:
        """Starts the update on the update thread with the chunks the plan chose (with `true`, every one
        it may take, in the order the gradients came in at the last boundary, the last chunk first
        before any)."""
        session = self.session
        chosen = chunks_backward_may_take(session.pipeline)
        leads = self.last_leads
        if session.settings.backward_every_chunk:
            chosen.sort(key=lambda c: (-leads[c], -c) if leads else -c)
        else:
            chosen, why_not = session.planner.backward_chunks(chosen, leads, self.last_boundary_backward)
            if not chosen:
                self.skipped = why_not
                return
        snapshot, fused, thread = self.view.snapshot(), session.fused, session.update_thread
        assert fused is not None and thread is not None, "on only with the fused pass, on the update thread"
        grad_scale = float(1.0 / self.view.loss_scale)
        run = BackwardUpdate(snapshot, grad_scale, adam_groups=fused.groups(snapshot.groups))
        run.future = thread.submit(self._run, run, chosen)
        self.current = run
        # Gradients were final before this one: their norms may already rule the outcome out.
        self.stop_if_ruled_out(run)

    def _run(self, run: BackwardUpdate, chosen: list[int]) -> StepStats:
        """On the update thread: the second slots the plan has long stopped choosing go back, and the
        chosen streamed chunks that lack one get one; the chosen cached ones get kept copies. Then each
        chunk that has one is updated once its gradient is final."""
        session = self.session
        state, pipeline = session.state, session.pipeline
        run.planned = len(chosen)
        in_buffers = set(pipeline.in_buffers)
        streamed = [c for c in chosen if c not in in_buffers]
        state.give_back_idle_slots(set(streamed))
        ready_to_stage = set(state.with_second_slots(streamed, keep_free=True))
        if pipeline.kept_limit:
            cached = [c for c in chosen if c in in_buffers]
            spare = session.spare
            ready_to_stage.update(cached[: pipeline.reserve_kept(len(cached), lambda: spare().bytes)])
        taken = [c for c in chosen if c in ready_to_stage]
        run.slotted = len(taken)
        run.began = time.perf_counter()

        def ready(chunk: int, timeout: float) -> bool | None:
            return self._ready(run, chunk, timeout)

        def update(
            chunk: int,
            state_bytes: torch.Tensor,
            read_cuts: list[int] | None,
            write_cuts: list[int] | None,
            kept: KeptCopy | None = None,
        ) -> tuple[list[int] | None, list[int] | None]:
            return self._update_chunk(run, chunk, state_bytes, read_cuts, write_cuts, kept)

        # The taken chunks' parameters are in the partitions before step() keeps or undoes them.
        with self.chunk_update.copying_to_device():
            stats = pipeline.run_step(
                update,
                only=taken,
                staged=True,
                ready=ready,
                drain=False,
                ends_step=False,
                checksums_in_update=True,
            )
        # A subgroup on NVMe (past `offload_param.max_in_cpu`) is written where it changed, as each one
        # before it was when the next was asked for: its partitions' objects are then the ones `step()`
        # keeps or `undo` writes again (the writes go on; the next read of one waits for its write).
        self.view.on_nvme.let_go()
        return stats

    def _ready(self, run: BackwardUpdate, chunk: int, timeout: float) -> bool | None:
        """Whether the chunk may be taken: its gradient final (None: not yet, within `timeout`), none of
        its parameters' update left to `step()`, and the norms so far not ruling the outcome out."""
        session = self.session
        if run.stop.is_set():
            return False
        if not session.grads_final.wait(chunk, timeout):
            return None
        # The parameter ids given to GradsFinal are DeepSpeed's (ints).
        if session.stale.pending(cast("list[int]", session.grads_final.params_of(chunk))):
            # A parameter of the chunk has no gradient of this boundary (so far) and an earlier one that
            # steps since have scaled: its update is left to step(), which knows which.
            return False
        if (mark := self.device_marks.get(chunk)) is not None:
            # On an accelerator: once the copy of the chunk's gradient into host memory has landed, the
            # norms so far as they were then may rule the outcome out.
            event, so_far = mark
            event.synchronize()
            self.norm_sq_so_far = max(self.norm_sq_so_far, float(so_far))
            self.stop_if_ruled_out(run)
            if run.stop.is_set():
                return False
        return True

    def _update_chunk(
        self,
        run: BackwardUpdate,
        chunk: int,
        state_bytes: torch.Tensor,
        read_cuts: list[int] | None,
        write_cuts: list[int] | None,
        kept: KeptCopy | None,
    ) -> tuple[list[int] | None, list[int] | None]:
        """One chunk's fused pass at the assumed outcome. The parameters before it come back from the old
        version's weights, narrowed as DeepSpeed's copy narrows them, unless they are something else (set
        apart from the weights): the pass keeps those, bit for bit (a -0.0 where the weight narrows to
        0.0 too), checking each block before it updates it."""
        i = self.session.state.chunks[chunk][0]
        with run.lock:
            run.taken.append(chunk)
        kept_params: list[tuple[int, torch.Tensor]] = []
        sums = self.chunk_update.fused(
            chunk,
            state_bytes,
            run.snapshot.steps[i] + 1,
            run.grad_scale,
            run.adam_groups,
            read_cuts,
            write_cuts,
            kept_params=kept_params,
            kept_state=kept,
        )
        if kept_params:
            run.kept_params[chunk] = kept_params
        run.ended_at.append(time.perf_counter())
        return sums

    def stop_if_ruled_out(self, run: BackwardUpdate) -> None:
        """Stops the update once the boundary's gradient norms so far prove the step's outcome another
        than it assumed: not finite (an overflow, or a skipped step), or clipped (their squares only add
        up; other ranks' only add more). It would be undone; the chunks already taken stay staged for
        `step()` to decide."""
        view = self.view
        so_far = self.norm_sq_so_far
        if not math.isfinite(so_far):
            run.stopped = "the gradients' norm so far is not finite"
        elif view.clip_grad > 0.0 and view.clip_ratio(math.sqrt(so_far)) > 1.0 + CLIP_MARGIN:
            run.stopped = (
                f"the gradients' norm so far, {math.sqrt(so_far) / view.loss_scale:.6g}, already clips at "
                f"{view.clip_grad:g}"
            )
        if run.stopped is not None:
            run.stop.set()

    # ----------------------------------------------------------------------------------------------
    # Readers before step()

    def touched(self, params: Iterable[Any]) -> None:
        """Undoes the update before `params` are gathered where that would read what it changed: after
        backward, any of them; during it, one in a chunk already taken."""
        run = self.current
        if run is None:
            return
        grads_final, view = self.session.grads_final, self.view
        if run.backward_end is None:
            with run.lock:
                taken = set(run.taken)
                if not any(c in taken for p in params for c in grads_final.chunks_of(view.param_id(p))):
                    return
        self.abandon("parameters were gathered before step()")

    def abandon(self, why: str) -> None:
        """Undoes the running update, if one runs, before something reads what it changed."""
        if (run := self.current) is not None:
            _, self.abandoned = self.finish(run, keep=False, why=why)

    # ----------------------------------------------------------------------------------------------
    # step()

    def take(self) -> BackwardUpdate | None:
        """The boundary's update, for `step()` to settle (the settling of readers would undo it)."""
        run, self.current = self.current, None
        self.begun = False
        return run

    def boundary_ended(
        self, run: BackwardUpdate | None, backward_start: float, backward_end: float
    ) -> BoundaryEnd:
        """At `step()`: every gradient is the step's now (also where DeepSpeed reduced the last ones in
        step()); each chunk's lead, kept for the next boundary's plan and for `settle`, which weighs
        chunk order where the steps do not go in it yet."""
        grads = self.session.grads_final
        if run is not None:
            grads.end()
        leads = grads.leads(backward_end)
        self.last_leads = leads
        self.last_backward_start = backward_start
        self.last_boundary_backward = max(0.0, backward_end - backward_start)
        record: GradsFinal = {
            "backward_secs": self.last_boundary_backward,
            "lead_secs": [round(t, 3) for t in leads],
        }
        skipped, self.skipped = self.skipped, None
        changed = bool(grads.changed)
        if run is None:
            grads.reset()
        return BoundaryEnd(leads, record, changed, skipped)

    def _weigh_chunk_order(self, leads: list[float], staged: bool) -> None:
        """Once this step's outcome is known, with `overlap_backward: "auto"`. Before chunk order: whether
        it pays, from this boundary's gradient times (`leads`, `UpdatePlanner.weigh_chunk_order`), where
        the update during backward could keep a step like this one. After a clipped step it is not tried,
        so chunk order would only cost its smaller cache: in it, `CLIPPED_STEPS_BACK` clipped steps in a
        row (and nothing `staged`) take the steps back to the cache's order, until an unclipped one
        weighs it again."""
        session = self.session
        if not self.on or session.settings.backward_every_chunk or session.settings.overlap.on:
            return
        pipeline, planner = session.pipeline, session.planner
        if not pipeline.ascending:
            if self.likely:
                planner.weigh_chunk_order(leads, self.last_boundary_backward)
            else:
                planner.order_why = "not weighed: this step's gradients were clipped"
            self.clipped_in_chunk_order = 0
            return
        self.clipped_in_chunk_order = 0 if self.likely else self.clipped_in_chunk_order + 1
        back = pipeline.cache_slots_latest_first > pipeline.cache_slots
        if back and not staged and self.clipped_in_chunk_order >= CLIPPED_STEPS_BACK:
            pipeline.go_latest_first()
            planner.overlap_backward = False
            planner.order_why = (
                f"back to the cache's order: {self.clipped_in_chunk_order} steps in a row clipped"
            )

    def skipped_step(self, run: BackwardUpdate | None) -> BackwardStep | None:
        """An fp16 overflow skips the update: what the update during backward changed is undone. Its
        record."""
        record, self.abandoned = self.abandoned, None
        if run is not None:
            _, record = self.finish(
                run, keep=False, why="the step was skipped (overflow, or a gradient norm not finite)"
            )
            self.session.grads_final.reset()
        return record

    def settle(
        self,
        run: BackwardUpdate | None,
        grad_scale: float,
        groups: list[dict[str, Any]],
        boundary: BoundaryEnd,
    ) -> Settled:
        """Keeps the update where the step's outcome (`grad_scale`, `groups`) is the one it assumed, else
        undoes it; every chunk is then updated by the step, its parameters written again."""
        likely, self.likely = self.likely, grad_scale == float(1.0 / self.view.loss_scale)
        self._weigh_chunk_order(boundary.leads, staged=run is not None)
        record, self.abandoned = self.abandoned, None
        if run is None:
            idle = self.on and record is None
            if idle:
                why_not = (
                    "not tried: the last step's gradients were clipped" if not likely else boundary.skipped
                )
                if why_not is not None:
                    record = self.record(None, 0, False, why_not)
            return Settled(None, record, set(), idle)
        why = self._verdict(run, grad_scale, groups, boundary.changed)
        keep = why.startswith("kept")
        stats, record = self.finish(run, keep=keep, why=why, redo=not keep)
        record["figures"] = {
            name: getattr(stats, name) for name in ("reads", "reads_dropped", "cached", "retained", "writes")
        }
        self.session.grads_final.reset()
        record["chunk_secs"] = self._measure_chunks(run, boundary.leads)
        return Settled(stats, record, set(stats.staged) if keep else set(), False)

    @staticmethod
    def _verdict(run: BackwardUpdate, grad_scale: float, groups: list[dict[str, Any]], changed: bool) -> str:
        """Whether the update is kept, and why, in words for the step record."""
        if grad_scale != run.grad_scale:
            return (
                f"undone: the gradients' scale was {grad_scale!r}, not {run.grad_scale!r} (they were "
                "clipped, or the loss scale changed)"
            )
        if not run.snapshot.same_groups(groups):
            return "undone: the param groups changed between backward and step()"
        if changed:
            return "undone: a gradient changed after it was final"
        return "kept: the step's outcome was the one expected"

    def _measure_chunks(self, run: BackwardUpdate, leads: list[float]) -> float | None:
        """What a chunk took in this boundary's update (kept or undone: it ran all the same;
        `secs_per_chunk_in_backward`), handed to the plan of the next ones. None where too few chunks
        ended before backward did."""
        start = self.last_backward_start
        ended = [t - start for t in run.ended_at]
        secs = secs_per_chunk_in_backward(
            leads, self.last_boundary_backward, run.began - start, run.taken[: len(ended)], ended
        )
        if secs is not None:
            self.session.planner.observe_backward_chunks(secs)
        return secs

    def finish(
        self, run: BackwardUpdate, keep: bool, why: str, redo: bool = False
    ) -> tuple[StepStats, BackwardStep]:
        """Ends the update: waits for it (stopped first unless `keep`), and keeps its versions (`keep`) or
        forgets them and restores the parameters and Adam steps it changed (`redo`: all but the
        parameters, which the update that follows at once writes again). Returns its figures and its
        record; raises what it raised, having undone it."""
        self.current = None
        if not keep:
            run.stop.set()
        assert run.future is not None
        end = run.backward_end if run.backward_end is not None else time.perf_counter()
        try:
            stats = run.future.result()
        except BaseException as error:
            self.undo(run)
            error.add_note("mlp_offload: raised by the update during backward; it was undone")
            raise
        if keep:
            self.session.pipeline.commit(stats.staged)
        else:
            self.undo(run, params=not redo)
        return stats, self.record(run, sum(t <= end for t in run.ended_at), keep, why)

    def undo(self, run: BackwardUpdate, params: bool = True) -> None:
        """Forgets the staged versions of every chunk the update took, and gives back their subgroups'
        Adam steps and (`params`) their half-precision parameters, from the store's old version or the
        copy set apart."""
        state = self.session.state
        state.pipeline.discard(run.taken)
        for chunk in run.taken:
            i, first, count = state.chunks[chunk]
            if params:
                half = self.view.partition(i)[first : first + count]
                half.copy_(state.current_params(chunk))
                for start, values in run.kept_params.get(chunk, []):
                    half[start : start + values.numel()].copy_(values)
            self.view.set_step(i, run.snapshot.steps[i])
        if params:
            # Subgroups on NVMe: their objects given back before anything fetches them (a gather that
            # undid the update reads them next).
            self.view.settle_partitions()

    def record(self, run: BackwardUpdate | None, in_backward: int, kept: bool, why: str) -> BackwardStep:
        """The step record's account of the update during backward (`run`; None: not tried)."""
        state = self.session.state
        pipeline = state.pipeline
        return {
            "chunks": 0 if run is None else len(run.taken),
            "in_backward": in_backward,
            # What a chunk took during backward, measured (set by `settle`; None: too few to say).
            "chunk_secs": None,
            "kept": kept,
            # Its part of the step's figures (reads, cached, retained, writes; bytes and seconds are in
            # them too), set by `settle` where it ran until step(): undone there, the update after it
            # takes its chunks again, so the step counts them twice. None: in no step's figures (undone
            # before step() because something read the state, or the step was skipped).
            "figures": None,
            "why": why,
            "secs": 0.0 if run is None else time.perf_counter() - run.started,
            # The chunks the plan chose, those of them with a second slot, and why it stopped early.
            "planned": 0 if run is None else run.planned,
            "slotted": 0 if run is None else run.slotted,
            "stopped": None if run is None else run.stopped,
            # Chunks with a second slot, the bytes the ones added took, why adding stopped short, and
            # the slots given back after the plan stopped choosing them (chunks, bytes).
            "slotted_chunks": len(state.slotted),
            "slot_bytes": state.slot_bytes,
            "slots_short": state.slots_short,
            "slots_given_back": state.slots_given_back,
            "slot_bytes_given_back": state.slot_bytes_given_back,
            # Kept copies in host memory (cached chunks' states before), and their bytes.
            "kept_copies": pipeline.kept_copies,
            "kept_bytes": pipeline.kept_bytes,
            "kept_short": pipeline.kept_short,
            # Whether the steps go in chunk order (which it needs), and what the plan found of it.
            "chunk_order": pipeline.ascending,
            "chunk_order_why": self.session.planner.order_why,
        }


def own_copies(params: Iterable[Any]) -> None:
    """Gives each persistent parameter among `params` whose data is its partition (DeepSpeed's
    "gather" where one rank holds the whole parameter, `NoGatherHandle`) a copy of its own. The
    update during backward writes the partitions before `step()`; a persistent parameter stays
    whole between uses, and its new values would show to whatever reads it between backward and
    `step()` (an eval pass, a hook), where stock's show after `step()`. DeepSpeed gathers these
    again at each step's end (the next forward does, behind an update still running), and each
    gather here copies again. Persistent parameters are small by DeepSpeed's threshold
    (`stage3_param_persistence_threshold`)."""
    for p in params:
        if getattr(p, "ds_persist", False) and _is_its_partition(p):
            p.data = p.data.clone()


def _is_its_partition(param: Any) -> bool:
    """Whether the parameter's data is its partition's memory (where one rank holds it whole)."""
    partition = getattr(param, "ds_tensor", None)
    return (
        partition is not None
        and param.data.numel() > 0
        and param.data.untyped_storage().data_ptr() == partition.untyped_storage().data_ptr()
    )
