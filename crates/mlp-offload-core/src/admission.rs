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
//! - **Identity.** The semaphore set is found through a lock file per device and user in `/dev/shm`
//!   (or the temporary directory), `ftok` of which is its key. The file's `flock` serialises creation,
//!   so a set is initialised exactly once; it carries a marker, checked when it is found again.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

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
        if limit == 0 || limit > MAX_LIMIT {
            return Err(Error::config(
                "device_inflight",
                format!("{limit} is outside 1..={MAX_LIMIT}"),
            ));
        }
        let dir = key_dir();
        fs::create_dir_all(&dir).map_err(|e| Error::io("create admission directory", &dir, e))?;
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
        })
    }

    /// The node-wide limit in force.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    pub fn device_id(&self) -> &str {
        &self.device_id
    }

    /// Takes one request, waiting at most `timeout` (in the kernel's queue of waiters). `Ok(false)` when
    /// the time ran out.
    pub fn acquire(&self, timeout: Duration) -> Result<bool> {
        if self.disabled.load(Ordering::Relaxed) {
            return Ok(true);
        }
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        loop {
            match self.semop(-1, Some(&ts)) {
                Ok(()) => return Ok(true),
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Ok(false),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(Error::io("take a device request from", &self.key_file, e)),
            }
        }
    }

    /// Gives one request back. A failure (the set removed under us) is logged: the request is gone
    /// with the set.
    pub fn release(&self) {
        if self.disabled.load(Ordering::Relaxed) {
            return;
        }
        loop {
            match self.semop(1, None) {
                Ok(()) => return,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    log::error!(
                        "device {}: giving back a request to {}: {e}; going on without node-wide \
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
        assert!(node.acquire(Duration::from_millis(10)).unwrap());
        // What `ipcrm -s` does.
        // SAFETY: plain syscall on our own set.
        assert_eq!(unsafe { libc::semctl(node.semid, 0, libc::IPC_RMID) }, 0);
        let e = node.acquire(Duration::from_millis(10)).unwrap_err();
        assert!(e.to_string().contains("mlp-offload-admission"), "{e}");
        // What the engines do with that error: go on without admission.
        node.disable();
        assert!(node.acquire(Duration::from_millis(10)).unwrap());
        node.release();
    }
}
