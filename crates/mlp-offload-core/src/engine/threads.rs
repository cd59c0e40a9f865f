//! The fallback engine: `max_inflight` threads per path doing blocking `pread`/`pwrite`. With node-wide
//! admission each worker takes one of the device's requests before its system call and gives it back
//! after, waiting in the kernel's queue like any other rank.

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use super::{
    split, Chunk, ChunkOutcome, EngineKind, IoEngine, Op, PathCounters, PathLimits, Transfer,
};
use crate::admission::NodeAdmission;
use crate::error::{Error, Result};

pub struct ThreadPoolEngine {
    tx: Option<Sender<Chunk>>,
    workers: Vec<JoinHandle<()>>,
    counters: Arc<PathCounters>,
    limits: PathLimits,
}

impl ThreadPoolEngine {
    pub fn new(
        label: &str,
        limits: PathLimits,
        admission: Option<Arc<NodeAdmission>>,
    ) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Chunk>();
        let counters = Arc::new(PathCounters::default());
        let workers = (0..limits.max_inflight)
            .map(|i| {
                let rx = rx.clone();
                let counters = counters.clone();
                let admission = admission.clone();
                std::thread::Builder::new()
                    .name(format!("mlpo-io-{i}"))
                    .spawn(move || worker(rx, &counters, admission.as_deref()))
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

fn worker(rx: Receiver<Chunk>, counters: &PathCounters, admission: Option<&NodeAdmission>) {
    while let Ok(mut chunk) = rx.recv() {
        let error = loop {
            if let Some(node) = admission {
                take_request(node, counters);
            }
            counters.started(chunk.state.op);
            let result = syscall(&chunk);
            counters.ended(chunk.state.op);
            if let Some(node) = admission {
                node.release();
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

/// Waits in the kernel's queue for one of the device's requests (the worker has nothing else to do).
fn take_request(node: &NodeAdmission, counters: &PathCounters) {
    loop {
        match node.acquire(Duration::from_secs(1)) {
            Ok(true) => break,
            Ok(false) => continue,
            Err(e) => {
                log::error!("{e}; this path goes on without node-wide admission");
                node.disable();
                break;
            }
        }
    }
    counters.observe_node_inflight(node.in_flight() as usize);
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
