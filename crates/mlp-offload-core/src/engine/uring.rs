//! The io_uring engine: one ring per path, driven by its own thread that blocks in `submit_and_wait`
//! when there is nothing to do (never spins). New transfers arrive over a channel; an eventfd polled by
//! the ring wakes the thread when one is queued while it waits for completions.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{opcode, types, IoUring, Probe};

use super::{
    split, Chunk, ChunkOutcome, EngineKind, IoEngine, Op, PathCounters, PathLimits, Transfer,
};
use crate::admission::Admitter;
use crate::error::{Error, Result};

/// `user_data` of the eventfd poll; chunk slots use their index.
const WAKE_TOKEN: u64 = u64::MAX;

/// Why io_uring cannot be used in this process (seccomp, `kernel.io_uring_disabled`, an old kernel, a
/// kernel without the opcodes we use), or `None` when it can. Probed once, by really creating a ring.
pub fn uring_unavailable_reason() -> Option<String> {
    static REASON: OnceLock<Option<String>> = OnceLock::new();
    REASON
        .get_or_init(|| {
            let reason = probe_uring().err();
            if let Some(why) = &reason {
                log::warn!(
                    "io_uring is unavailable ({why}); using the pread/pwrite thread-pool engine"
                );
            }
            reason
        })
        .clone()
}

fn probe_uring() -> std::result::Result<(), String> {
    let ring = IoUring::new(4).map_err(|e| format!("io_uring_setup: {e}"))?;
    let mut probe = Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| format!("IORING_REGISTER_PROBE: {e}"))?;
    for (code, name) in [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::PollAdd::CODE, "POLL_ADD"),
    ] {
        if !probe.is_supported(code) {
            return Err(format!("the kernel lacks IORING_OP_{name}"));
        }
    }
    Ok(())
}

pub struct UringEngine {
    tx: Option<Sender<Transfer>>,
    wake: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<PathCounters>,
}

impl UringEngine {
    /// An engine for one path; with `admission`, every request also takes one of the device's
    /// node-wide requests (see [`Admitter`]).
    pub fn new(label: &str, limits: PathLimits, admission: Option<Arc<Admitter>>) -> Result<Self> {
        let entries = (limits.max_inflight + 1).next_power_of_two() as u32;
        let ring = IoUring::new(entries).map_err(|e| Error::io("io_uring_setup for", label, e))?;
        // SAFETY: plain syscall; the returned descriptor is checked before use.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(Error::io("eventfd for", label, io::Error::last_os_error()));
        }
        // SAFETY: `efd` is a fresh descriptor that nothing else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let (tx, rx) = crossbeam_channel::unbounded();
        let counters = Arc::new(PathCounters::default());
        let admission = admission
            .map(|admitter| AdmissionLink::start(admitter, wake.clone(), counters.clone(), label))
            .transpose()?;
        let worker = RingWorker {
            ring,
            rx,
            wake: wake.clone(),
            limits,
            counters: counters.clone(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            queued: VecDeque::new(),
            inflight: 0,
            wake_armed: false,
            closed: false,
            admission,
        };
        let thread = std::thread::Builder::new()
            .name("mlpo-uring".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::io("start I/O thread for", label, e))?;
        Ok(UringEngine {
            tx: Some(tx),
            wake,
            thread: Some(thread),
            counters,
        })
    }

    fn kick(&self) {
        kick(&self.wake);
    }
}

impl IoEngine for UringEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::IoUring
    }

    fn submit(&self, transfer: Transfer) {
        let tx = self.tx.as_ref().expect("sender lives until drop");
        // The worker holds the receiver until the sender is dropped, so this cannot fail.
        let _ = tx.send(transfer);
        self.kick();
    }

    fn counters(&self) -> &PathCounters {
        &self.counters
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.tx.take();
        self.kick();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct RingWorker {
    ring: IoUring,
    rx: Receiver<Transfer>,
    wake: Arc<OwnedFd>,
    limits: PathLimits,
    counters: Arc<PathCounters>,
    /// Chunks in the kernel, indexed by their `user_data`.
    slots: Vec<Option<Chunk>>,
    free_slots: Vec<usize>,
    /// Chunks waiting for an in-flight slot, in arrival order (retries go to the front).
    queued: VecDeque<Chunk>,
    inflight: usize,
    wake_armed: bool,
    closed: bool,
    admission: Option<AdmissionLink>,
}

/// The ring's side of node-wide admission: a thread that waits (in the kernel's queue, or for this
/// engine's turn) for one request at a time on the ring's behalf, so the ring itself never blocks there
/// and goes on reaping completions.
struct AdmissionLink {
    admitter: Arc<Admitter>,
    asks: Option<Sender<()>>,
    grants: Receiver<()>,
    /// A request asked for and not yet granted (at most one: one place in the queue).
    asked: bool,
    /// Requests granted and not yet used.
    held: usize,
    closing: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl AdmissionLink {
    fn start(
        admitter: Arc<Admitter>,
        wake: Arc<OwnedFd>,
        counters: Arc<PathCounters>,
        label: &str,
    ) -> Result<Self> {
        let (asks, asked) = crossbeam_channel::unbounded::<()>();
        let (granted, grants) = crossbeam_channel::unbounded::<()>();
        let closing = Arc::new(AtomicBool::new(false));
        let thread = {
            let (admitter, closing) = (admitter.clone(), closing.clone());
            std::thread::Builder::new()
                .name("mlpo-admit".into())
                .spawn(move || {
                    while asked.recv().is_ok() {
                        if !admitter.take(&closing) {
                            return;
                        }
                        counters.observe_node_inflight(admitter.node().in_flight() as usize);
                        if granted.send(()).is_err() {
                            admitter.give_back(false);
                            return;
                        }
                        kick(&wake);
                    }
                })
                .map_err(|e| Error::io("start admission thread for", label, e))?
        };
        Ok(AdmissionLink {
            admitter,
            asks: Some(asks),
            grants,
            asked: false,
            held: 0,
            closing,
            thread: Some(thread),
        })
    }

    fn take_grants(&mut self) {
        while self.grants.try_recv().is_ok() {
            self.held += 1;
            self.asked = false;
        }
    }

    /// Whether a granted request is there to use; if not, one is asked for.
    fn take(&mut self) -> bool {
        if self.held > 0 {
            self.held -= 1;
            return true;
        }
        if !self.asked {
            if let Some(asks) = &self.asks {
                self.asked = asks.send(()).is_ok();
            }
        }
        false
    }
}

impl Drop for AdmissionLink {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        self.asks.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Granted and never used: back to the other ranks.
        self.take_grants();
        for _ in 0..self.held {
            self.admitter.give_back(false);
        }
        self.admitter.close();
    }
}

fn kick(wake: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to our own eventfd. A full counter (EAGAIN) already means a
    // wake-up is pending, so the result needs no handling.
    unsafe { libc::write(wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

impl RingWorker {
    fn run(mut self) {
        let mut reaped: Vec<(u64, i32)> = Vec::with_capacity(64);
        loop {
            self.take_new_transfers();
            // Armed while more can arrive: transfers, or grants for chunks still queued after close.
            if !self.wake_armed && (!self.closed || !self.queued.is_empty()) {
                let poll =
                    opcode::PollAdd::new(types::Fd(self.wake.as_raw_fd()), libc::POLLIN as u32)
                        .build()
                        .user_data(WAKE_TOKEN);
                // SAFETY: the eventfd outlives the ring (both owned by this worker / its engine).
                if unsafe { self.ring.submission().push(&poll) }.is_ok() {
                    self.wake_armed = true;
                }
            }
            self.fill();
            if self.closed && self.inflight == 0 && self.queued.is_empty() {
                return;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                // Interrupted, or the completion queue is full: reap and go round again.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) => {}
                // Anything else (ENOMEM under memory pressure) leaves the ring intact: buffers the kernel
                // owns must not be released, so keep the chunks and try again shortly.
                Err(e) => {
                    log::error!("io_uring_enter failed: {e}; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            reaped.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            for (token, result) in reaped.drain(..) {
                if token == WAKE_TOKEN {
                    self.wake_armed = false;
                    let mut counter = 0u64;
                    // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd; EAGAIN is fine.
                    unsafe {
                        libc::read(self.wake.as_raw_fd(), (&mut counter as *mut u64).cast(), 8)
                    };
                } else {
                    self.complete(token as usize, result);
                }
            }
        }
    }

    fn take_new_transfers(&mut self) {
        if let Some(admission) = &mut self.admission {
            admission.take_grants();
        }
        loop {
            match self.rx.try_recv() {
                Ok(t) => self.queued.extend(split(t, self.limits.chunk_size)),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.closed = true;
                    return;
                }
            }
        }
    }

    /// Moves queued chunks into the kernel up to the in-flight limit.
    fn fill(&mut self) {
        while self.inflight < self.limits.max_inflight {
            if self.queued.is_empty() {
                return;
            }
            if let Some(admission) = &mut self.admission {
                if !admission.take() {
                    // Asked for; the grant wakes the ring.
                    return;
                }
            }
            let Some(chunk) = self.queued.pop_front() else {
                return;
            };
            let slot = self.free_slots.pop().unwrap_or_else(|| {
                self.slots.push(None);
                self.slots.len() - 1
            });
            let fd = types::Fd(chunk.state.fd);
            // `len` fits: chunks are at most `chunk_size`, which is validated to be at most 1 GiB.
            let entry = match chunk.state.op {
                Op::Read => opcode::Read::new(fd, chunk.buf.0, chunk.len as u32)
                    .offset(chunk.offset)
                    .build(),
                Op::Write => opcode::Write::new(fd, chunk.buf.0, chunk.len as u32)
                    .offset(chunk.offset)
                    .build(),
            }
            .user_data(slot as u64);
            // SAFETY: the buffer range is kept alive by the transfer's completion until this chunk is
            // reaped (the chunk sits in `slots` until then), and the file stays open through
            // `chunk.state.file`.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                // Submission queue full: the chunk waits for the next round, keeping its grant.
                self.free_slots.push(slot);
                self.queued.push_front(chunk);
                if let Some(admission) = &mut self.admission {
                    admission.held += 1;
                }
                return;
            }
            self.counters.started(chunk.state.op);
            self.slots[slot] = Some(chunk);
            self.inflight += 1;
        }
    }

    fn complete(&mut self, slot: usize, result: i32) {
        let Some(mut chunk) = self.slots[slot].take() else {
            return;
        };
        self.free_slots.push(slot);
        self.inflight -= 1;
        self.counters.ended(chunk.state.op);
        if let Some(admission) = &self.admission {
            // Given back at once, also before a retry: a waiting rank is served first (or, in a turn,
            // kept for this engine's next request while it has one).
            admission
                .admitter
                .give_back(!self.queued.is_empty() || self.inflight > 0);
        }
        let result = if result < 0 {
            Err(io::Error::from_raw_os_error(-result))
        } else {
            Ok(result as usize)
        };
        match chunk.outcome(result, &self.counters) {
            ChunkOutcome::Again => self.queued.push_front(chunk),
            ChunkOutcome::Done => {
                self.counters
                    .chunks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                chunk.finish(None);
            }
            ChunkOutcome::Failed(e) => {
                self.counters
                    .chunks
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                chunk.finish(Some(e));
            }
        }
    }
}
