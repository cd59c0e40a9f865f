//! The pass's worker threads, started once per count and kept for the process's life.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// The update's worker threads: one pool per number of threads beside the caller's, started the first
/// time a pass asks for that many and kept for the process's life. A pass wakes them instead of starting
/// threads: a start costs the caller tens of microseconds each (15 of them about a third of a millisecond
/// on a VM, against a chunk's 2-3 ms), and the last one started decides when the chunk ends. Passes that
/// run at once on the same count (two engines in one process) share its workers.
fn workers(others: usize) -> Result<Arc<rayon::ThreadPool>> {
    struct Pools {
        /// The process that started them: a child forked after a pass has none of their threads, and
        /// starts its own.
        pid: u32,
        by_count: Vec<(usize, Arc<rayon::ThreadPool>)>,
    }
    static POOLS: Mutex<Pools> = Mutex::new(Pools {
        pid: 0,
        by_count: Vec::new(),
    });
    let mut pools = POOLS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let pid = std::process::id();
    if pools.pid != pid {
        // Forgotten, not dropped: dropping a pool signals threads that exist only in the parent.
        std::mem::forget(std::mem::take(&mut pools.by_count));
        pools.pid = pid;
    }
    if let Some((_, pool)) = pools.by_count.iter().find(|(n, _)| *n == others) {
        return Ok(pool.clone());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(others)
        .thread_name(|i| format!("mlp-update-{i}"))
        .build()
        .map_err(|e| {
            Error::config(
                "update_threads",
                format!("could not start {} threads for the update: {e}", others + 1),
            )
        })?;
    let pool = Arc::new(pool);
    pools.by_count.push((others, pool.clone()));
    Ok(pool)
}

/// Runs `run` over `parts`, the first on the caller's thread and each other on a worker of
/// [`workers`]; the results in the parts' order.
pub(super) fn run_on_workers<T: Send, R: Send>(
    parts: Vec<T>,
    run: impl Fn(T) -> R + Sync,
) -> Result<Vec<R>> {
    let mut parts = parts.into_iter();
    let Some(mine) = parts.next() else {
        return Ok(Vec::new());
    };
    if parts.len() == 0 {
        return Ok(vec![run(mine)]);
    }
    let pool = workers(parts.len())?;
    let mut done: Vec<Option<R>> = Vec::new();
    done.resize_with(parts.len() + 1, || None);
    let run = &run;
    let (first, rest) = done.split_first_mut().expect("one part at least");
    // A panic in a worker's part comes back here, once every part has ended.
    pool.in_place_scope(|scope| {
        for (part, slot) in parts.zip(rest) {
            scope.spawn(move |_| *slot = Some(run(part)));
        }
        *first = Some(run(mine));
    });
    Ok(done
        .into_iter()
        .map(|r| r.expect("every part ran"))
        .collect())
}
