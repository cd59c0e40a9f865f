//! io_uring made really unavailable (a seccomp filter makes `io_uring_setup` fail with EPERM, as Docker's
//! default profile does) must leave a working store on the thread-pool engine.

use std::os::unix::process::CommandExt;
use std::process::Command;

use mlp_offload_core::{EngineChoice, EngineKind, Error, ObjectStore, StoreConfig};

const CHILD_ENV: &str = "MLP_OFFLOAD_SECCOMP_CHILD";
const SYS_IO_URING_SETUP: u32 = 425; // the same number on every architecture (new-syscall table)

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// A classic-BPF seccomp program: io_uring_setup -> EPERM, everything else allowed.
fn deny_io_uring_filter() -> Vec<libc::sock_filter> {
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const RET_ERRNO: u32 = 0x0005_0000;
    const RET_ALLOW: u32 = 0x7fff_0000;
    let ins = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    vec![
        ins(LD_W_ABS, 0, 0, 4),               // seccomp_data.arch
        ins(JEQ_K, 0, 3, AUDIT_ARCH),         // other arch: allow
        ins(LD_W_ABS, 0, 0, 0),               // seccomp_data.nr
        ins(JEQ_K, 0, 1, SYS_IO_URING_SETUP), // not io_uring_setup: allow
        ins(RET_K, 0, 0, RET_ERRNO | libc::EPERM as u32),
        ins(RET_K, 0, 0, RET_ALLOW),
    ]
}

#[test]
fn io_uring_denied_by_seccomp_falls_back_to_threads() {
    let mut filter = deny_io_uring_filter();
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    let prog_addr = &prog as *const libc::sock_fprog as usize;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "child_sees_io_uring_unavailable",
        "--exact",
        "--ignored",
        "--nocapture",
    ])
    .env(CHILD_ENV, "1");
    // SAFETY: the closure runs in the forked child before exec and only makes two async-signal-safe
    // system calls; `prog` and `filter` were built before the fork and live in the child's copy of the
    // parent's memory until exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::syscall(
                    libc::SYS_seccomp,
                    1, /* SET_MODE_FILTER */
                    0,
                    prog_addr,
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = match cmd.output() {
        Ok(out) => out,
        // qemu-user (the aarch64 wheel's emulated tests) implements no seccomp: nothing to test there.
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            eprintln!("skipped: this kernel or emulator has no seccomp ({e})");
            return;
        }
        Err(e) => panic!("starting the child under the filter: {e}"),
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "the child test did not run:\n{text}"
    );
}

#[test]
#[ignore = "runs inside the seccomp-restricted child of io_uring_denied_by_seccomp_falls_back_to_threads"]
fn child_sees_io_uring_unavailable() {
    assert_eq!(
        std::env::var(CHILD_ENV).as_deref(),
        Ok("1"),
        "only meaningful under the seccomp filter"
    );
    let why =
        mlp_offload_core::engine::uring_unavailable_reason().expect("io_uring must be unavailable");
    assert!(why.contains("io_uring_setup"), "{why}");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let store = ObjectStore::open(StoreConfig::new([dir.path()])).unwrap();
    assert_eq!(store.engine_kind(), EngineKind::Threads);
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    store
        .write("x", data.clone(), None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        store
            .read("x", vec![0u8; data.len()])
            .unwrap()
            .wait()
            .unwrap(),
        data
    );
    drop(store);
    let err = ObjectStore::open(StoreConfig::new([dir.path()]).with_engine(EngineChoice::IoUring))
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::Config { .. }) && err.to_string().starts_with("engine:"),
        "{err}"
    );
}
