//! Each rank directory locked while a store has it open (`store.lock`, an exclusive `flock` the kernel
//! releases when the process dies), naming the holder's pid to a second store.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::LOCK_NAME;
use crate::error::{Error, Result};

/// Takes the exclusive lock of a rank directory, recording this process's pid in it. The kernel drops
/// the lock when the file is closed or the process dies, so a crashed store never blocks the next one.
pub(super) fn lock_rank_dir(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_NAME);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| Error::io("open lock file", &path, e))?;
    if let Err(e) = try_lock_without_signals(&file) {
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(Error::io("lock", &path, e));
        }
        let holder = fs::read_to_string(&path)
            .ok()
            .and_then(|text| text.trim().parse().ok());
        return Err(Error::InUse {
            path: dir.to_path_buf(),
            holder,
        });
    }
    file.set_len(0)
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .map_err(|e| Error::io("write lock file", &path, e))?;
    Ok(file)
}

/// An exclusive, non-blocking `flock` of `file`, taken with every signal blocked in this thread.
///
/// On a FUSE mount a signal that arrives while the lock request waits for the daemon's answer makes the
/// kernel send the daemon an interrupt for it, and GlusterFS's client (10.x, gluster/glusterfs#4371)
/// then holds one of its event threads until the interrupt is answered, an answer only an event thread
/// can read: two interrupted lock requests, its default two threads, and the mount hangs for good. A
/// rank's children (DeepSpeed's op builds, torch's `ldconfig`) exit as its stores open, and their
/// SIGCHLD did that to two of four ranks resuming on one node (tests/test_cluster.py). Blocked, a signal
/// waits the few microseconds the request takes, or goes to another thread of the process.
fn try_lock_without_signals(file: &File) -> io::Result<()> {
    // SAFETY: sigset_t is plain data that sigfillset initialises before any use.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    let mut before: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: both sets are valid for writes; pthread_sigmask changes only this thread's mask, which
    // is put back below on every path.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut before);
    }
    // SAFETY: `file` owns the descriptor and outlives the call; flock touches nothing else.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    let result = if locked == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    };
    // SAFETY: `before` was filled by the call above; restoring it undoes exactly that change.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut()) };
    result
}
