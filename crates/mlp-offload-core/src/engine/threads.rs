//! The fallback engine: `max_inflight` threads per path doing blocking `pread`/`pwrite`. With node-wide
//! admission each worker takes one of the device's requests before its system call and gives it back
//! after, waiting in the kernel's queue (or for its engine's turn) like any other rank.

use std::io;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use super::{
    split, Chunk, ChunkOutcome, EngineKind, IoEngine, Op, PathCounters, PathLimits, Transfer,
};
use crate::admission::Admitter;
use crate::error::{Error, Result};

pub struct ThreadPoolEngine {
    tx: Option<Sender<Chunk>>,
    workers: Vec<JoinHandle<()>>,
    counters: Arc<PathCounters>,
    limits: PathLimits,
}

impl ThreadPoolEngine {
    pub fn new(label: &str, limits: PathLimits, admission: Option<Arc<Admitter>>) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Chunk>();
        let counters = Arc::new(PathCounters::default());
        let workers = (0..limits.max_inflight)
            .map(|i| {
                let rx = rx.clone();
                let counters = counters.clone();
                let admission = admission.clone();
                std::thread::Builder::new()
                    .name(format!("mlpo-io-{i}"))
                    .spawn(move || worker(&rx, &counters, admission.as_deref()))
                    .map_err(|e| Error::io("start I/O thread for", label, e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ThreadPoolEngine {
            tx: Some(tx),
            workers,
            counters,
            limits,
        })
    }
}

/// A worker never stops waiting for admission: it holds a chunk that must be done.
static NEVER_CLOSING: AtomicBool = AtomicBool::new(false);

fn worker(rx: &Receiver<Chunk>, counters: &PathCounters, admission: Option<&Admitter>) {
    while let Ok(mut chunk) = rx.recv() {
        let error = loop {
            if let Some(admitter) = admission {
                admitter.take(&NEVER_CLOSING);
                counters.observe_node_inflight(admitter.node().in_flight() as usize);
            }
            counters.started(chunk.state.op);
            let result = syscall(&chunk);
            counters.ended(chunk.state.op);
            if let Some(admitter) = admission {
                admitter.give_back(!rx.is_empty());
            }
            match chunk.outcome(result, counters) {
                ChunkOutcome::Done => break None,
                ChunkOutcome::Again => continue,
                ChunkOutcome::Failed(e) => break Some(e),
            }
        };
        counters
            .chunks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        chunk.finish(error);
    }
}

fn syscall(chunk: &Chunk) -> io::Result<usize> {
    let fd = chunk.state.fd;
    let offset = chunk.offset as libc::off_t;
    // SAFETY: `buf..buf+len` lies inside the transfer's buffer, which its completion keeps alive and
    // which nobody else touches until the completion fires; `fd` is kept open by `chunk.state.file`.
    let n = unsafe {
        match chunk.state.op {
            Op::Read => libc::pread(fd, chunk.buf.0.cast(), chunk.len, offset),
            Op::Write => libc::pwrite(fd, chunk.buf.0.cast(), chunk.len, offset),
        }
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl IoEngine for ThreadPoolEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Threads
    }

    fn submit(&self, transfer: Transfer) {
        let tx = self.tx.as_ref().expect("sender lives until drop");
        for chunk in split(transfer, self.limits.chunk_size) {
            // The receivers live as long as `self`, so sending cannot fail here.
            let _ = tx.send(chunk);
        }
    }

    fn counters(&self) -> &PathCounters {
        &self.counters
    }
}

impl Drop for ThreadPoolEngine {
    fn drop(&mut self) {
        // Closing the channel lets the workers finish what is queued and exit.
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
