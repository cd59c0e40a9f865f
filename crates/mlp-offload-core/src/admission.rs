//! Node-wide admission: the ranks of a node share each storage device's in-flight limit.
//!
//! Every rank of a node runs its own store, and all of them update at the same moment on the same
//! devices, so per-process limits alone put N times the requests a device serves best into its queue.
//! Each device (by the `major:minor` of its file system) gets one System V semaphore whose value is the
//! number of requests that may still enter the kernel, node-wide. A request takes one before it is
//! submitted and gives it back when it completes.
//!
//! - **Crashes.** Both operations use `SEM_UNDO`: the kernel gives back what a process held when it
//!   dies, SIGKILL included. A rank killed while holding requests never blocks the others, and nobody
//!   waits for a timeout to find out.
//! - **Fairness.** A waiter blocks in the kernel, which serves waiters of a single-semaphore decrement
//!   in arrival order. Each engine asks for one request at a time (the io_uring engine through one
//!   waiting thread, the thread pool through its workers), so the device's requests go round the ranks
//!   that want them and no rank starves.
//! - **Turns.** With [`Sharing::Turns`] a rank takes the whole limit at once (one decrement of the
//!   limit, waiting in the same queue) and keeps it for a turn, so the ranks have the device one after
//!   another instead of interleaving; which way a device is shared is the performance model's choice
//!   from the probe's measurement of both.
//! - **Identity.** The semaphore set is found through a lock file per device and user in `/dev/shm`
//!   (or the temporary directory), `ftok` of which is its key. The file's `flock` serialises creation,
//!   so a set is initialised exactly once; it carries a marker, checked when it is found again.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The set's semaphores: the free requests, the limit it was made with, and the marker.
const FREE: u16 = 0;
const LIMIT: u16 = 1;
const MARKER: u16 = 2;
const SEMS: i32 = 3;
/// "ML": a set found under our key without it belongs to someone else.
const MARKER_VALUE: i32 = 0x4d4c;
/// `SEMVMX` on Linux: a semaphore's largest value.
const MAX_LIMIT: u32 = 32767;

/// One device's node-wide limit of requests in flight, shared by every process of this user on the
/// node that opens it with the same device id.
#[derive(Debug)]
pub struct NodeAdmission {
    semid: i32,
    limit: u32,
    device_id: String,
    key_file: PathBuf,
    /// Set when the semaphore failed (removed by hand): requests then pass freely.
    disabled: AtomicBool,
    /// A set of this process alone (`private`), removed when dropped.
    private: bool,
}

/// Where the key files live: `/dev/shm` (node-local memory, gone at reboot with the sets themselves),
/// else the temporary directory.
fn key_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join("mlp-offload-admission")
}

impl NodeAdmission {
    /// Opens the admission of device `device_id` (`major:minor`), creating it with `limit` requests
    /// when no process has it. A set found with another limit takes `limit` when none of its requests
    /// is held, else keeps its own (with a warning): the ranks of one job ask for the same.
    pub fn open(device_id: &str, limit: u32) -> Result<Self> {
        // Longer than 80 lines for a reason: System V's steps in their order (the key file, the set made
        // or found, its limit checked and taken), each checked where it is made.
        if limit == 0 || limit > MAX_LIMIT {
            return Err(Error::config(
                "device_inflight",
                format!("{limit} is outside 1..={MAX_LIMIT}"),
            ));
        }
        let dir = key_dir();
        if !dir.is_dir() {
            fs::create_dir_all(&dir)
                .map_err(|e| Error::io("create admission directory", &dir, e))?;
            // Shared by every user of the node, each with key files of their own, like /tmp. Best
            // effort: another user may have made it a moment ago.
            let _ = fs::set_permissions(&dir, fs::Permissions::from_mode(0o1777));
        }
        // SAFETY: plain syscall.
        let uid = unsafe { libc::getuid() };
        let key_file = dir.join(format!("dev-{}-uid{uid}", device_id.replace(':', "-")));
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&key_file)
            .map_err(|e| Error::io("open admission key file", &key_file, e))?;
        let _held = FileLock::exclusive(&lock, &key_file)?;
        let key = ftok(&key_file)?;
        let io_err = |what: &'static str, e: io::Error| Error::io(what, &key_file, e);
        // SAFETY: plain syscall; the result is checked.
        let created = unsafe { libc::semget(key, SEMS, libc::IPC_CREAT | libc::IPC_EXCL | 0o600) };
        let (semid, limit) = if created >= 0 {
            set_value(created, LIMIT, limit as i32)
                .map_err(|e| io_err("initialise semaphore", e))?;
            set_value(created, MARKER, MARKER_VALUE)
                .map_err(|e| io_err("initialise semaphore", e))?;
            set_value(created, FREE, limit as i32)
                .map_err(|e| io_err("initialise semaphore", e))?;
            (created, limit)
        } else {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(io_err("create semaphore", e));
            }
            // SAFETY: plain syscall; the result is checked.
            let found = unsafe { libc::semget(key, SEMS, 0o600) };
            if found < 0 {
                return Err(io_err("open semaphore", io::Error::last_os_error()));
            }
            if get_value(found, MARKER).map_err(|e| io_err("read semaphore", e))? != MARKER_VALUE {
                return Err(Error::config(
                    "device_inflight",
                    format!(
                        "the System V semaphore with key {key:#x} (from {}) is not mlp-offload's; \
                         remove it with `ipcrm -S {key:#x}` or move /dev/shm/mlp-offload-admission",
                        key_file.display()
                    ),
                ));
            }
            let had = get_value(found, LIMIT).map_err(|e| io_err("read semaphore", e))? as u32;
            let free = get_value(found, FREE).map_err(|e| io_err("read semaphore", e))? as u32;
            if had == limit {
                (found, limit)
            } else if free == had {
                // Nobody holds a request: the set takes the new limit.
                set_value(found, LIMIT, limit as i32).map_err(|e| io_err("reset semaphore", e))?;
                set_value(found, FREE, limit as i32).map_err(|e| io_err("reset semaphore", e))?;
                (found, limit)
            } else {
                log::warn!(
                    "device {device_id}: other processes share it with a node-wide limit of {had} \
                     requests in flight; keeping {had} (this one asked for {limit})"
                );
                (found, had)
            }
        };
        Ok(NodeAdmission {
            semid,
            limit,
            device_id: device_id.to_string(),
            key_file,
            disabled: AtomicBool::new(false),
            private: false,
        })
    }

    /// A set of `limit` requests for this process alone (`IPC_PRIVATE`), removed when dropped: the probe
    /// measures ranks sharing a device with it, as threads of one process.
    pub fn private(limit: u32) -> Result<Self> {
        let key_file = PathBuf::from("IPC_PRIVATE");
        // SAFETY: plain syscall; the result is checked.
        let semid = unsafe { libc::semget(libc::IPC_PRIVATE, SEMS, 0o600) };
        if semid < 0 {
            return Err(Error::io(
                "create semaphore",
                &key_file,
                io::Error::last_os_error(),
            ));
        }
        let admission = NodeAdmission {
            semid,
            limit,
            device_id: "private".into(),
            key_file,
            disabled: AtomicBool::new(false),
            private: true,
        };
        for (sem, value) in [
            (LIMIT, limit as i32),
            (MARKER, MARKER_VALUE),
            (FREE, limit as i32),
        ] {
            set_value(semid, sem, value)
                .map_err(|e| Error::io("initialise semaphore", &admission.key_file, e))?;
        }
        Ok(admission)
    }

    /// The node-wide limit in force.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    pub fn device_id(&self) -> &str {
        &self.device_id
    }

    /// Takes `n` requests at once, waiting at most `timeout` (in the kernel's queue of waiters).
    /// `Ok(false)` when the time ran out.
    pub fn acquire(&self, n: u32, timeout: Duration) -> Result<bool> {
        if self.disabled.load(Ordering::Relaxed) {
            return Ok(true);
        }
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        loop {
            match self.semop(-(n as i16), Some(&ts)) {
                Ok(()) => return Ok(true),
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Ok(false),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(Error::io("take a device request from", &self.key_file, e)),
            }
        }
    }

    /// Gives `n` requests back. A failure (the set removed under us) is logged: the requests are gone
    /// with the set.
    pub fn release(&self, n: u32) {
        if n == 0 || self.disabled.load(Ordering::Relaxed) {
            return;
        }
        loop {
            match self.semop(n as i16, None) {
                Ok(()) => return,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    log::error!(
                        "device {}: giving back requests to {}: {e}; going on without node-wide \
                         admission",
                        self.device_id,
                        self.key_file.display()
                    );
                    self.disable();
                    return;
                }
            }
        }
    }

    /// Lets every request pass from now on (after the semaphore failed; the caller says why).
    pub fn disable(&self) {
        self.disabled.store(true, Ordering::Relaxed);
    }

    /// Requests in flight node-wide now (the limit less the free ones).
    pub fn in_flight(&self) -> u32 {
        get_value(self.semid, FREE).map_or(0, |free| self.limit.saturating_sub(free as u32))
    }

    fn semop(&self, op: i16, timeout: Option<&libc::timespec>) -> io::Result<()> {
        let mut sop = libc::sembuf {
            sem_num: FREE,
            sem_op: op,
            sem_flg: libc::SEM_UNDO as i16,
        };
        let ts = timeout.map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: semtimedop(2) with one valid `sembuf` and a valid (or null) timespec, both live for
        // the call (the libc crate has no wrapper for it).
        let rc = unsafe {
            libc::syscall(
                libc::SYS_semtimedop,
                self.semid,
                &mut sop as *mut libc::sembuf,
                1usize,
                ts,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// How the ranks of a node share a device under its node-wide limit: which of the two the performance
/// model picks from the probe's measurement of both (`probe.rs`, "sharing").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Sharing {
    /// Every rank takes one request at a time: the ranks' requests interleave on the device.
    #[default]
    Shared,
    /// A rank takes the whole limit at once, for a turn of up to [`TURN_BYTES`], then gives it all
    /// back; the next rank in the kernel's queue has the device to itself. For devices that lose
    /// bandwidth when several streams interleave (seeking disks, some remote file systems).
    Turns,
}

impl std::str::FromStr for Sharing {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "shared" => Ok(Sharing::Shared),
            "turns" => Ok(Sharing::Turns),
            other => Err(Error::config(
                "device_sharing",
                format!("{other:?} is not one of \"shared\", \"turns\""),
            )),
        }
    }
}

/// The bytes of one turn (with [`Sharing::Turns`]).
pub const TURN_BYTES: usize = 256 << 20;

/// How long a waiter sleeps in the kernel before it checks whether its engine is closing.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// One engine's side of its device's admission, whatever the engine: [`take`](Admitter::take) before
/// a request enters the kernel, [`give_back`](Admitter::give_back) when it completes.
pub struct Admitter {
    node: Arc<NodeAdmission>,
    sharing: Sharing,
    /// Requests per turn (turns only).
    turn_requests: usize,
    turn: Mutex<Turn>,
    turn_changed: Condvar,
}

/// A turn's requests (turns only).
#[derive(Default)]
struct Turn {
    /// Taken from the node for this turn and not handed to the engine.
    held: u32,
    /// Requests the turn may still start.
    left: usize,
    /// This turn's requests not yet given back to the node (held or in the engine's hands).
    out: u32,
    /// A thread is waiting in the kernel for the next turn.
    fetching: bool,
}

impl Admitter {
    /// `chunk_size` is the engine's request size (it sets how many requests make a turn).
    pub fn new(node: Arc<NodeAdmission>, sharing: Sharing, chunk_size: usize) -> Self {
        Admitter {
            node,
            sharing,
            turn_requests: TURN_BYTES.div_ceil(chunk_size.max(1)).max(1),
            turn: Mutex::new(Turn::default()),
            turn_changed: Condvar::new(),
        }
    }

    pub fn node(&self) -> &NodeAdmission {
        &self.node
    }

    pub fn sharing(&self) -> Sharing {
        self.sharing
    }

    /// Blocks until this engine may start one request (`true`), or until `closing` is set (`false`).
    /// A failing semaphore is logged and admission turned off: requests then pass.
    pub fn take(&self, closing: &AtomicBool) -> bool {
        match self.sharing {
            Sharing::Shared => self.wait_for(1, closing),
            Sharing::Turns => self.take_in_turn(closing),
        }
    }

    /// One request of this engine is done; `more` says whether the engine has more waiting, which lets
    /// a turn go on.
    pub fn give_back(&self, more: bool) {
        if self.sharing == Sharing::Shared {
            self.node.release(1);
            return;
        }
        let mut turn = self.turn.lock().expect("turn lock");
        if turn.left > 0 && more {
            turn.held += 1;
        } else {
            // The turn is spent, or this engine has nothing more to do: all of it goes back, what is
            // still in flight as it completes.
            let n = 1 + turn.held;
            turn.held = 0;
            turn.left = 0;
            turn.out -= n;
            self.node.release(n);
        }
        self.turn_changed.notify_all();
    }

    /// Waits in the kernel's queue for `n` requests of the node.
    fn wait_for(&self, n: u32, closing: &AtomicBool) -> bool {
        loop {
            if closing.load(Ordering::Acquire) {
                return false;
            }
            match self.node.acquire(n, WAIT_SLICE) {
                Ok(true) => break,
                Ok(false) => continue,
                Err(e) => {
                    // The set is gone (removed by hand): go on without it.
                    log::error!("{e}; this path goes on without node-wide admission");
                    self.node.disable();
                    break;
                }
            }
        }
        true
    }

    fn take_in_turn(&self, closing: &AtomicBool) -> bool {
        let mut turn = self.turn.lock().expect("turn lock");
        loop {
            if closing.load(Ordering::Acquire) {
                return false;
            }
            if turn.held > 0 && turn.left > 0 {
                turn.held -= 1;
                turn.left -= 1;
                return true;
            }
            if turn.out == 0 && !turn.fetching {
                // The last turn is all back: queue for the next one (the whole limit at once).
                turn.fetching = true;
                drop(turn);
                let limit = self.node.limit();
                let got = self.wait_for(limit, closing);
                turn = self.turn.lock().expect("turn lock");
                turn.fetching = false;
                if got {
                    *turn = Turn {
                        held: limit,
                        left: self.turn_requests,
                        out: limit,
                        fetching: false,
                    };
                }
                self.turn_changed.notify_all();
                continue;
            }
            turn = self
                .turn_changed
                .wait_timeout(turn, WAIT_SLICE)
                .expect("turn lock")
                .0;
        }
    }

    /// Gives back what this engine holds and no longer uses (when it closes).
    pub fn close(&self) {
        if self.sharing == Sharing::Turns {
            let mut turn = self.turn.lock().expect("turn lock");
            let n = turn.held;
            turn.held = 0;
            turn.out -= n;
            turn.left = 0;
            self.node.release(n);
        }
    }
}

impl Drop for NodeAdmission {
    fn drop(&mut self) {
        if self.private {
            // SAFETY: plain syscall on our own set, which nothing uses any more.
            unsafe { libc::semctl(self.semid, 0, libc::IPC_RMID) };
        }
    }
}

/// An exclusive `flock` held until dropped (or the process dies).
struct FileLock<'a>(&'a File);

impl<'a> FileLock<'a> {
    fn exclusive(file: &'a File, path: &Path) -> Result<Self> {
        loop {
            // SAFETY: `file` owns the descriptor for the lock's life; flock touches nothing else.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(FileLock(file));
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(Error::io("lock", path, e));
            }
        }
    }
}

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        // SAFETY: as in `exclusive`.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn ftok(path: &Path) -> Result<libc::key_t> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::config(
            "device_inflight",
            format!("{} has a NUL byte", path.display()),
        )
    })?;
    // SAFETY: a valid NUL-terminated path for the call's duration.
    let key = unsafe { libc::ftok(c_path.as_ptr(), i32::from(b'M')) };
    if key == -1 {
        return Err(Error::io("ftok", path, io::Error::last_os_error()));
    }
    Ok(key)
}

fn get_value(semid: i32, sem: u16) -> io::Result<i32> {
    // SAFETY: GETVAL takes no fourth argument.
    let v = unsafe { libc::semctl(semid, i32::from(sem), libc::GETVAL) };
    if v < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(v)
    }
}

fn set_value(semid: i32, sem: u16, value: i32) -> io::Result<()> {
    // SAFETY: SETVAL's fourth argument is a `union semun` whose `val` member is an int, passed by value
    // as a variadic int on every Linux ABI.
    let rc = unsafe { libc::semctl(semid, i32::from(sem), libc::SETVAL, value) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_semaphore_removed_by_hand_is_an_error_naming_the_key_file_then_requests_pass() {
        let node =
            NodeAdmission::open(&format!("test-removed-{}:0", std::process::id()), 1).unwrap();
        assert!(node.acquire(1, Duration::from_millis(10)).unwrap());
        // What `ipcrm -s` does.
        // SAFETY: plain syscall on our own set.
        assert_eq!(unsafe { libc::semctl(node.semid, 0, libc::IPC_RMID) }, 0);
        let e = node.acquire(1, Duration::from_millis(10)).unwrap_err();
        assert!(e.to_string().contains("mlp-offload-admission"), "{e}");
        // What the engines do with that error: go on without admission.
        node.disable();
        assert!(node.acquire(1, Duration::from_millis(10)).unwrap());
        node.release(1);
    }
}
