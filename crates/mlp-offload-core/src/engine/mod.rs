//! How bytes move between host memory and one storage path: an io_uring engine (one ring on its own
//! thread per path) and a pread/pwrite thread pool, behind one trait.
//!
//! A [`Transfer`] is one contiguous range of one file. The engine splits it into chunks of the path's chunk
//! size, keeps at most the path's in-flight limit of chunks in the kernel, resubmits short transfers and
//! EAGAIN/EINTR, and reports the transfer's status (path, offset, errno) through its [`Completion`].

mod threads;
mod uring;

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::admission::Admitter;
use crate::completion::Completion;
use crate::error::{Error, Result};

pub use threads::ThreadPoolEngine;
pub use uring::{uring_unavailable_reason, UringEngine};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl Op {
    fn verb(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

/// Which engine to use. `Auto` probes io_uring once per process and falls back to the thread pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EngineChoice {
    #[default]
    Auto,
    IoUring,
    Threads,
}

impl std::str::FromStr for EngineChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(EngineChoice::Auto),
            "io_uring" | "uring" => Ok(EngineChoice::IoUring),
            "threads" | "thread_pool" => Ok(EngineChoice::Threads),
            other => Err(Error::config(
                "engine",
                format!("{other:?} is not one of \"auto\", \"io_uring\", \"threads\""),
            )),
        }
    }
}

/// The engine actually in use on a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    IoUring,
    Threads,
}

impl EngineKind {
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::IoUring => "io_uring",
            EngineKind::Threads => "threads",
        }
    }
}

/// Per-path I/O limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathLimits {
    /// Largest single read or write handed to the kernel, in bytes (a multiple of the path's alignment).
    pub chunk_size: usize,
    /// Most chunks in the kernel at once on this path.
    pub max_inflight: usize,
}

impl Default for PathLimits {
    fn default() -> Self {
        PathLimits {
            chunk_size: 4 << 20,
            max_inflight: 8,
        }
    }
}

impl PathLimits {
    pub fn validate(&self, align: u64) -> Result<()> {
        if self.max_inflight == 0 || self.max_inflight > 1024 {
            return Err(Error::config(
                "max_inflight",
                format!("{} is outside 1..=1024", self.max_inflight),
            ));
        }
        if self.chunk_size == 0
            || !(self.chunk_size as u64).is_multiple_of(align)
            || self.chunk_size > 1 << 30
        {
            return Err(Error::config(
                "chunk_size",
                format!(
                    "{} must be a positive multiple of the path's alignment {align} and at most 1 GiB",
                    self.chunk_size
                ),
            ));
        }
        Ok(())
    }
}

/// An open object file: the O_DIRECT descriptor (plain buffered when the path refuses O_DIRECT) and,
/// opened on first need, a buffered one for transfers whose buffer or length is not aligned.
pub struct IoFile {
    pub path: PathBuf,
    primary: File,
    primary_is_direct: bool,
    buffered: OnceLock<io::Result<File>>,
}

impl IoFile {
    pub fn new(path: PathBuf, primary: File, primary_is_direct: bool) -> Self {
        IoFile {
            path,
            primary,
            primary_is_direct,
            buffered: OnceLock::new(),
        }
    }

    /// Opens `path` read-write (mode 0600 when `create`, which also truncates), with O_DIRECT when
    /// `direct`.
    pub fn open(path: &std::path::Path, direct: bool, create: bool) -> Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut options = std::fs::OpenOptions::new();
        options.read(true).write(true).mode(0o600);
        if create {
            options.create(true).truncate(true);
        }
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = options
            .open(path)
            .map_err(|e| Error::io(if create { "create" } else { "open" }, path, e))?;
        Ok(IoFile::new(path.to_path_buf(), file, direct))
    }

    pub fn is_direct(&self) -> bool {
        self.primary_is_direct
    }

    pub fn primary(&self) -> &File {
        &self.primary
    }

    /// The descriptor for a transfer: the primary one when `direct` is wanted (or the primary is already
    /// buffered), else a buffered descriptor of the same file.
    fn fd_for(&self, direct: bool) -> Result<i32> {
        if direct || !self.primary_is_direct {
            return Ok(self.primary.as_raw_fd());
        }
        match self.buffered.get_or_init(|| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.path)
        }) {
            Ok(f) => Ok(f.as_raw_fd()),
            Err(e) => Err(Error::io(
                "open (buffered)",
                &self.path,
                io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(libc::EIO)),
            )),
        }
    }
}

/// A raw host address that may cross to an I/O thread.
#[derive(Clone, Copy, Debug)]
pub struct HostPtr(pub *mut u8);
// SAFETY: a `HostPtr` is only an address. Whoever builds a `Transfer` guarantees the memory stays valid
// (kept alive by the transfer's `Completion`) and is not touched by anyone else until the completion fires.
unsafe impl Send for HostPtr {}
// SAFETY: as above; the address itself is immutable.
unsafe impl Sync for HostPtr {}

/// Work run on the I/O thread once a transfer's bytes have all moved.
pub type Finish = Box<dyn FnOnce() -> Result<()> + Send>;

/// One contiguous file range moved to or from host memory.
pub struct Transfer {
    pub op: Op,
    pub file: Arc<IoFile>,
    /// Whether the range, the length and the address meet the path's O_DIRECT alignment.
    pub direct: bool,
    pub offset: u64,
    pub buf: HostPtr,
    pub len: usize,
    /// Runs on the I/O thread after every byte moved, before the part is reported (the copy out of a
    /// bounce buffer into the caller's memory).
    pub finish: Option<Finish>,
    /// The operation this transfer is one part of; the caller has called `add_part` for it.
    pub completion: Completion,
}

/// Counters of one path, shared by its engine and whoever reads statistics.
#[derive(Default, Debug)]
pub struct PathCounters {
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Of those, the bytes moved through the page cache rather than with O_DIRECT.
    pub bytes_buffered: AtomicU64,
    pub chunks: AtomicU64,
    pub retries: AtomicU64,
    pub inflight_max: AtomicUsize,
    /// The most requests seen in flight on the device node-wide, all ranks together, when this path
    /// took one (0 without node-wide admission).
    pub node_inflight_max: AtomicUsize,
    busy: Mutex<BusyClocks>,
}

/// Time with at least one chunk in the kernel, in all and per direction: bytes over busy time is the
/// bandwidth the path gave, whatever share of the wall clock it was kept busy.
#[derive(Default, Debug)]
struct BusyClocks {
    any: BusyClock,
    read: BusyClock,
    write: BusyClock,
}

#[derive(Default, Debug)]
struct BusyClock {
    inflight: usize,
    since: Option<Instant>,
    total: Duration,
}

impl BusyClock {
    fn start(&mut self, now: Instant) {
        self.inflight += 1;
        if self.inflight == 1 {
            self.since = Some(now);
        }
    }

    fn end(&mut self, now: Instant) {
        self.inflight -= 1;
        if self.inflight == 0 {
            if let Some(since) = self.since.take() {
                self.total += now - since;
            }
        }
    }

    fn ns(&self, now: Instant) -> u64 {
        let open = self.since.map_or(Duration::ZERO, |s| now - s);
        (self.total + open).as_nanos() as u64
    }
}

impl BusyClocks {
    fn of(&mut self, op: Op) -> &mut BusyClock {
        match op {
            Op::Read => &mut self.read,
            Op::Write => &mut self.write,
        }
    }
}

impl PathCounters {
    fn started(&self, op: Op) {
        // The clocks change under one lock, so a chunk ending on another thread cannot close an
        // interval that this one is opening.
        let mut busy = self.busy.lock().expect("busy clock lock");
        let now = Instant::now();
        busy.any.start(now);
        busy.of(op).start(now);
        // The clock of all chunks counts what is in flight.
        self.inflight_max
            .fetch_max(busy.any.inflight, Ordering::Relaxed);
    }

    fn ended(&self, op: Op) {
        let mut busy = self.busy.lock().expect("busy clock lock");
        let now = Instant::now();
        busy.any.end(now);
        busy.of(op).end(now);
    }

    fn observe_node_inflight(&self, n: usize) {
        self.node_inflight_max.fetch_max(n, Ordering::Relaxed);
    }

    fn moved(&self, op: Op, n: usize, direct: bool) {
        let counter = match op {
            Op::Read => &self.bytes_read,
            Op::Write => &self.bytes_written,
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        if !direct {
            self.bytes_buffered.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    pub fn snapshot(&self) -> PathStats {
        let busy = self.busy.lock().expect("busy clock lock");
        let now = Instant::now();
        PathStats {
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            bytes_buffered: self.bytes_buffered.load(Ordering::Relaxed),
            chunks: self.chunks.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            inflight_max: self.inflight_max.load(Ordering::Relaxed),
            node_inflight_max: self.node_inflight_max.load(Ordering::Relaxed),
            busy_ns: busy.any.ns(now),
            read_busy_ns: busy.read.ns(now),
            write_busy_ns: busy.write.ns(now),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PathStats {
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Of the bytes read and written, those through the page cache: from or into memory, or of a length,
    /// that O_DIRECT cannot take, or on a path that refuses O_DIRECT.
    pub bytes_buffered: u64,
    pub chunks: u64,
    pub retries: u64,
    /// The most chunks ever in the kernel at once on this path.
    pub inflight_max: usize,
    /// The most requests seen in flight on this path's device, node-wide (0 without admission).
    pub node_inflight_max: usize,
    /// Nanoseconds with at least one chunk in the kernel.
    pub busy_ns: u64,
    /// Nanoseconds with at least one read chunk in the kernel.
    pub read_busy_ns: u64,
    /// Nanoseconds with at least one write chunk in the kernel.
    pub write_busy_ns: u64,
}

impl PathStats {
    /// What happened between `earlier` and `self` (counters only grow; the maximum is kept).
    pub fn since(&self, earlier: &PathStats) -> PathStats {
        PathStats {
            bytes_read: self.bytes_read - earlier.bytes_read,
            bytes_written: self.bytes_written - earlier.bytes_written,
            bytes_buffered: self.bytes_buffered - earlier.bytes_buffered,
            chunks: self.chunks - earlier.chunks,
            retries: self.retries - earlier.retries,
            inflight_max: self.inflight_max,
            node_inflight_max: self.node_inflight_max,
            busy_ns: self.busy_ns - earlier.busy_ns,
            read_busy_ns: self.read_busy_ns - earlier.read_busy_ns,
            write_busy_ns: self.write_busy_ns - earlier.write_busy_ns,
        }
    }

    /// Bytes moved per busy second; `None` before any I/O.
    pub fn bytes_per_busy_s(&self) -> Option<f64> {
        (self.busy_ns > 0)
            .then(|| (self.bytes_read + self.bytes_written) as f64 / (self.busy_ns as f64 * 1e-9))
    }
}

/// The engine of one storage path.
pub trait IoEngine: Send + Sync {
    fn kind(&self) -> EngineKind;
    /// Queues a transfer. Never blocks on I/O; every outcome, errors included, arrives through
    /// `transfer.completion`.
    fn submit(&self, transfer: Transfer);
    fn counters(&self) -> &PathCounters;
}

/// Builds the engine for one path. `label` names the path in logs and errors; with `admission` every
/// request also takes one of its device's node-wide requests.
pub fn open_engine(
    choice: EngineChoice,
    label: &str,
    limits: PathLimits,
    admission: Option<Arc<Admitter>>,
) -> Result<Box<dyn IoEngine>> {
    let uring = match choice {
        EngineChoice::Threads => false,
        EngineChoice::IoUring => match uring_unavailable_reason() {
            None => true,
            Some(why) => {
                return Err(Error::config(
                    "engine",
                    format!("\"io_uring\" was asked for but is unavailable here: {why}"),
                ))
            }
        },
        EngineChoice::Auto => uring_unavailable_reason().is_none(),
    };
    Ok(if uring {
        Box::new(UringEngine::new(label, limits, admission)?)
    } else {
        Box::new(ThreadPoolEngine::new(label, limits, admission)?)
    })
}

/// Shared state of one transfer split into chunks: counts chunks still out and keeps the first error.
struct TransferState {
    op: Op,
    file: Arc<IoFile>,
    fd: i32,
    /// Whether `fd` moves the bytes with O_DIRECT.
    direct: bool,
    chunks_left: AtomicUsize,
    first_error: Mutex<Option<Error>>,
    finish: Mutex<Option<Finish>>,
    completion: Completion,
}

/// A piece of a transfer: at most `chunk_size` bytes at `offset` from/to `buf`.
struct Chunk {
    state: Arc<TransferState>,
    offset: u64,
    buf: HostPtr,
    len: usize,
}

impl Chunk {
    /// Moves past `n` transferred bytes after a short read or write.
    fn advance(&mut self, n: usize) {
        self.offset += n as u64;
        // SAFETY: `n < len`, so the result stays inside the transfer's buffer.
        self.buf = HostPtr(unsafe { self.buf.0.add(n) });
        self.len -= n;
    }

    fn error(&self, source: io::Error) -> Error {
        Error::io_at(
            self.state.op.verb(),
            &self.state.file.path,
            self.offset,
            source,
        )
    }

    /// What a completed system call result means for this chunk.
    fn outcome(&mut self, result: io::Result<usize>, counters: &PathCounters) -> ChunkOutcome {
        match result {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) => {
                counters.retries.fetch_add(1, Ordering::Relaxed);
                ChunkOutcome::Again
            }
            Err(e) => ChunkOutcome::Failed(self.error(e)),
            Ok(0) if self.len > 0 => ChunkOutcome::Failed(self.error(match self.state.op {
                Op::Read => io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the file ends before the requested range",
                ),
                Op::Write => io::Error::from_raw_os_error(libc::EIO),
            })),
            Ok(n) => {
                counters.moved(self.state.op, n, self.state.direct);
                if n < self.len {
                    counters.retries.fetch_add(1, Ordering::Relaxed);
                    self.advance(n);
                    ChunkOutcome::Again
                } else {
                    ChunkOutcome::Done
                }
            }
        }
    }

    /// Records this chunk's end; the last chunk of a transfer runs its finisher and reports the part.
    fn finish(self, error: Option<Error>) {
        let state = self.state;
        if let Some(e) = error {
            // Chunks finish in any order; report the failure nearest the start of the range, so the
            // error is the same whatever the engine's concurrency.
            let mut first = state.first_error.lock().expect("transfer lock");
            if first.as_ref().is_none_or(|f| offset_of(&e) < offset_of(f)) {
                *first = Some(e);
            }
        }
        if state.chunks_left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let result = match state.first_error.lock().expect("transfer lock").take() {
            Some(e) => Err(e),
            None => match state.finish.lock().expect("transfer lock").take() {
                Some(f) => f(),
                None => Ok(()),
            },
        };
        state.completion.part_done(result);
    }
}

fn offset_of(e: &Error) -> u64 {
    match e {
        Error::Io { offset, .. } => offset.unwrap_or(0),
        _ => 0,
    }
}

enum ChunkOutcome {
    Done,
    Again,
    Failed(Error),
}

/// Splits a transfer into chunks. On a descriptor error the part is reported failed and nothing returns.
fn split(transfer: Transfer, chunk_size: usize) -> Vec<Chunk> {
    let fd = match transfer.file.fd_for(transfer.direct) {
        Ok(fd) => fd,
        Err(e) => {
            transfer.completion.part_done(Err(e));
            return Vec::new();
        }
    };
    let n_chunks = transfer.len.div_ceil(chunk_size).max(1);
    let direct = transfer.direct && transfer.file.is_direct();
    let state = Arc::new(TransferState {
        op: transfer.op,
        file: transfer.file,
        fd,
        direct,
        chunks_left: AtomicUsize::new(n_chunks),
        first_error: Mutex::new(None),
        finish: Mutex::new(transfer.finish),
        completion: transfer.completion,
    });
    (0..n_chunks)
        .map(|i| {
            let start = i * chunk_size;
            Chunk {
                state: state.clone(),
                offset: transfer.offset + start as u64,
                // SAFETY: `start <= len`, inside (or one past the end of) the transfer's buffer.
                buf: HostPtr(unsafe { transfer.buf.0.add(start) }),
                len: chunk_size.min(transfer.len - start),
            }
        })
        .collect()
}
