//! The object store against real files, real O_DIRECT and real io_uring. Every test body runs once per
//! engine (`io_uring::*` and `threads::*`).

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use mlp_offload_core::admission::Sharing;
use mlp_offload_core::checksum::crc32c;
use mlp_offload_core::engine::{open_engine, IoFile, Op, Transfer};
use mlp_offload_core::{
    AlignedBuf, Completion, EngineChoice, EngineKind, Error, HostPtr, IoBuffer, ObjectStore,
    PathLimits, StoreConfig, StripeSums,
};
use rand::{Rng, SeedableRng};

/// Small chunks so that even small objects go through the chunking and in-flight limits.
const SMALL_LIMITS: PathLimits = PathLimits {
    chunk_size: 64 << 10,
    max_inflight: 4,
};

fn dirs(n: usize) -> (tempfile::TempDir, Vec<PathBuf>) {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let paths = (0..n)
        .map(|i| {
            let p = root.path().join(format!("path{i}"));
            fs::create_dir(&p).unwrap();
            p
        })
        .collect();
    (root, paths)
}

fn open(paths: &[PathBuf], engine: EngineChoice) -> ObjectStore {
    ObjectStore::open(
        StoreConfig::new(paths.iter().cloned())
            .with_engine(engine)
            .with_limits(SMALL_LIMITS),
    )
    .unwrap()
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

/// Object `key`'s whole contents (`len` bytes), read into a fresh vector.
fn read_back(store: &ObjectStore, key: &str, len: usize) -> Vec<u8> {
    store.read(key, vec![0u8; len]).unwrap().wait().unwrap()
}

fn aligned_copy(data: &[u8]) -> AlignedBuf {
    let mut buf = AlignedBuf::new(data.len(), false).unwrap();
    buf.as_mut_slice().copy_from_slice(data);
    buf
}

/// A buffer whose address is deliberately one byte past an aligned one.
struct Misaligned {
    storage: Vec<u8>,
    len: usize,
}

impl Misaligned {
    fn new(data: &[u8]) -> Self {
        let mut storage = vec![0u8; data.len() + 1];
        storage[1..].copy_from_slice(data);
        Misaligned {
            storage,
            len: data.len(),
        }
    }
    fn bytes(&self) -> &[u8] {
        &self.storage[1..]
    }
}

impl IoBuffer for Misaligned {
    fn io_ptr(&mut self) -> *mut u8 {
        self.storage[1..].as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len
    }
}

/// Writes `src` as `key`, waits, reads it back into `dst` and returns `dst`.
fn write_then_read<S: IoBuffer, D: IoBuffer>(store: &ObjectStore, key: &str, src: S, dst: D) -> D {
    store.write(key, src, None).unwrap().wait().unwrap();
    store.read(key, dst).unwrap().wait().unwrap()
}

fn skip_unless_engine(engine: EngineChoice) -> bool {
    if engine == EngineChoice::IoUring {
        if let Some(why) = mlp_offload_core::engine::uring_unavailable_reason() {
            eprintln!("skipped: io_uring unavailable here ({why})");
            return true;
        }
    }
    false
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A tmpfs of `size` mounted over `dir` for the life of the guard (root only).
struct Mount(PathBuf);

impl Mount {
    fn tmpfs(dir: &Path, options: &str) -> Mount {
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(status.success(), "mount tmpfs on {}", dir.display());
        Mount(dir.to_path_buf())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

macro_rules! for_each_engine {
    ($($name:ident),* $(,)?) => {
        mod io_uring {
            $(#[test] fn $name() { if !super::skip_unless_engine(super::EngineChoice::IoUring) { super::$name(super::EngineChoice::IoUring) } })*
        }
        mod threads {
            $(#[test] fn $name() { super::$name(super::EngineChoice::Threads) })*
        }
    };
}

for_each_engine!(
    round_trips_of_many_sizes_aligned_and_not,
    objects_are_rewritten_in_place,
    a_reopened_store_reads_what_was_written,
    a_short_read_reports_path_and_offset,
    truncated_object_file_is_detected,
    corrupted_object_file_is_detected_unless_checksums_are_off,
    sums_computed_by_the_caller_are_kept_and_verified,
    running_out_of_space_names_the_path_and_keeps_the_old_contents,
    a_full_path_opens_and_rewrites_and_only_a_changed_manifest_fails,
    a_read_waits_for_the_write_before_it,
    the_in_flight_limit_holds,
    two_ranks_share_a_device_request_by_request,
    two_ranks_take_a_device_in_turns,
    stripes_go_where_the_weights_say,
    new_weights_move_an_object_on_its_next_write,
    a_delete_is_in_the_manifest_before_it_returns,
    files_no_manifest_knows_are_removed_at_open,
    a_staged_version_is_read_only_once_committed,
    a_second_slot_added_to_one_object_takes_staged_writes,
    a_second_slot_is_given_back_once_the_current_version_is_in_slot_0,
);

fn round_trips_of_many_sizes_aligned_and_not(engine: EngineChoice) {
    let sizes = [
        1usize,
        511,
        512,
        4095,
        4096,
        4097,
        65_536 + 7,
        1 << 20,
        (4 << 20) + 123,
        9 << 20,
    ];
    for n_paths in [1, 3] {
        let (_root, paths) = dirs(n_paths);
        let store = open(&paths, engine);
        assert_eq!(
            store.engine_kind(),
            if engine == EngineChoice::IoUring {
                EngineKind::IoUring
            } else {
                EngineKind::Threads
            }
        );
        // Where every path takes O_DIRECT, the bytes through the page cache are the misaligned ones alone.
        let direct = store.path_reports().iter().all(|r| r.tier.direct_io);
        let buffered = |store: &ObjectStore| -> u64 {
            store
                .path_reports()
                .iter()
                .map(|r| r.stats.bytes_buffered)
                .sum()
        };
        for (i, &size) in sizes.iter().enumerate() {
            let data = random_bytes(size, i as u64);
            // Page-aligned buffers take the O_DIRECT path (with a bounce block for the tail).
            let key = format!("aligned.{size}");
            let before = buffered(&store);
            let back = write_then_read(
                &store,
                &key,
                aligned_copy(&data),
                AlignedBuf::new(size, false).unwrap(),
            );
            assert!(
                back.as_slice() == &data[..],
                "{n_paths} paths, aligned, {size} bytes"
            );
            if direct {
                assert_eq!(
                    buffered(&store),
                    before,
                    "{n_paths} paths, aligned, {size} bytes"
                );
            }
            // Misaligned buffers take the buffered path; both must read what either wrote.
            let key = format!("misaligned.{size}");
            let before = buffered(&store);
            let back = write_then_read(
                &store,
                &key,
                Misaligned::new(&data),
                Misaligned::new(&vec![0; size]),
            );
            assert!(
                back.bytes() == &data[..],
                "{n_paths} paths, misaligned, {size} bytes"
            );
            assert_eq!(
                buffered(&store) - before,
                2 * size as u64,
                "{n_paths} paths, misaligned, {size} bytes: written and read through the page cache"
            );
            let back = store
                .read(&key, AlignedBuf::new(size, false).unwrap())
                .unwrap()
                .wait()
                .unwrap();
            assert!(
                back.as_slice() == &data[..],
                "{n_paths} paths, misaligned then aligned, {size} bytes"
            );
        }
    }
}

fn objects_are_rewritten_in_place(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let store = open(&paths, engine);
    let file = paths[0].join("rank0/obj.mlpo");
    for round in 0..5u64 {
        let data = random_bytes(300_000, round);
        store
            .write("obj", aligned_copy(&data), None)
            .unwrap()
            .wait()
            .unwrap();
        let back = read_back(&store, "obj", data.len());
        assert!(back == data, "round {round}");
    }
    use std::os::unix::fs::MetadataExt;
    let ino = fs::metadata(&file).unwrap().ino();
    store
        .write("obj", aligned_copy(&random_bytes(300_000, 9)), None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        fs::metadata(&file).unwrap().ino(),
        ino,
        "the file is reused, not recreated"
    );
    assert_eq!(
        fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        fs::metadata(paths[0].join("rank0"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    let err = store.write("obj", vec![0u8; 10], None).err().unwrap();
    assert!(
        matches!(err, Error::Config { .. }) && err.to_string().contains("\"obj\""),
        "{err}"
    );
}

fn a_reopened_store_reads_what_was_written(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let data = random_bytes(1_000_003, 7);
    {
        let store = open(&paths, engine);
        store
            .write("kept", aligned_copy(&data), Some(&[1.0, 2.0]))
            .unwrap()
            .wait()
            .unwrap();
        store
            .write("kept", aligned_copy(&data), None)
            .unwrap()
            .wait()
            .unwrap();
    } // dropped: manifest written
    let store = open(&paths, engine);
    assert_eq!(store.keys(), vec!["kept".to_string()]);
    assert_eq!(store.size("kept"), Some(data.len() as u64));
    let back = read_back(&store, "kept", data.len());
    assert!(back == data);
    drop(store);
    let err = ObjectStore::open(
        StoreConfig::new([paths[1].clone(), paths[0].clone()]).with_engine(engine),
    )
    .err()
    .unwrap();
    assert!(err.to_string().starts_with("paths:"), "{err}");
}

fn a_delete_is_in_the_manifest_before_it_returns(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let store = open(&paths, engine);
    for key in ["k0", "k1", "k2"] {
        store
            .write(key, aligned_copy(&random_bytes(70_000, 1)), None)
            .unwrap()
            .wait()
            .unwrap();
    }
    store.sync().unwrap();
    store.delete("k1").unwrap();
    // Read while the store is still open: what a crash right now would leave.
    for path in &paths {
        let manifest = fs::read_to_string(path.join("rank0/manifest.json")).unwrap();
        assert!(
            manifest.contains("\"k0\"") && !manifest.contains("\"k1\""),
            "{manifest}"
        );
        assert!(!path.join("rank0/k1.mlpo").exists());
    }
}

fn files_no_manifest_knows_are_removed_at_open(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let data = random_bytes(100_000, 3);
    {
        let store = open(&paths, engine);
        store
            .write("kept", aligned_copy(&data), None)
            .unwrap()
            .wait()
            .unwrap();
    }
    // What a crash leaves: files of objects created after the last sync, or deleted just before it.
    let strays: Vec<PathBuf> = paths
        .iter()
        .map(|p| p.join("rank0/created-after-sync.mlpo"))
        .collect();
    for stray in &strays {
        fs::write(stray, b"partial").unwrap();
    }
    let store = open(&paths, engine);
    assert_eq!(store.keys(), vec!["kept".to_string()]);
    assert!(strays.iter().all(|s| !s.exists()));
    let back = read_back(&store, "kept", data.len());
    assert!(back == data);
}

#[test]
fn a_second_store_on_the_same_rank_directory_is_refused_naming_the_holder() {
    let (_root, paths) = dirs(2);
    let first = open(&paths, EngineChoice::Threads);
    let err = ObjectStore::open(
        StoreConfig::new(paths.iter().cloned()).with_engine(EngineChoice::Threads),
    )
    .err()
    .unwrap();
    assert_eq!(err.errno(), Some(libc::EWOULDBLOCK), "{err}");
    assert_eq!(err.path(), Some(paths[0].join("rank0").as_path()), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("process {}", std::process::id())),
        "{err}"
    );
    // Another rank on the same paths is another directory.
    ObjectStore::open(
        StoreConfig::new(paths.iter().cloned())
            .with_engine(EngineChoice::Threads)
            .with_rank(1),
    )
    .unwrap();
    drop(first);
    open(&paths, EngineChoice::Threads);
}

fn a_short_read_reports_path_and_offset(engine: EngineChoice) {
    let (_root, paths) = dirs(1);
    let path = paths[0].join("short");
    fs::write(&path, vec![7u8; 10_000]).unwrap();
    let file = std::sync::Arc::new(IoFile::new(
        path.clone(),
        fs::File::options()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap(),
        false,
    ));
    let engine = open_engine(engine, "test", SMALL_LIMITS, None).unwrap();
    let mut buf = vec![0u8; 200_000];
    let completion = Completion::new();
    completion.add_part();
    engine.submit(Transfer {
        op: Op::Read,
        file,
        direct: false,
        offset: 0,
        buf: HostPtr(buf.as_mut_ptr()),
        len: buf.len(),
        finish: None,
        completion: completion.clone(),
    });
    completion.seal();
    let err = completion.wait().unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("offset 10000"),
        "{msg}"
    );
    assert_eq!(
        &buf[..10_000],
        &[7u8; 10_000][..],
        "the bytes before the end were read"
    );
}

fn truncated_object_file_is_detected(engine: EngineChoice) {
    let (_root, paths) = dirs(1);
    let store = open(&paths, engine);
    let data = random_bytes(100_000, 1);
    store
        .write("t", aligned_copy(&data), None)
        .unwrap()
        .wait()
        .unwrap();
    let file = paths[0].join("rank0/t.mlpo");
    fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let err = store.read("t", vec![0u8; data.len()]).err().unwrap();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(
        err.to_string().contains("truncated")
            && err.to_string().contains(&file.display().to_string()),
        "{err}"
    );
}

fn corrupted_object_file_is_detected_unless_checksums_are_off(engine: EngineChoice) {
    for checksum in [true, false] {
        let (_root, paths) = dirs(1);
        let store = ObjectStore::open(
            StoreConfig::new(paths.clone())
                .with_engine(engine)
                .with_checksum(checksum)
                .with_shadow_slots(false),
        )
        .unwrap();
        let data = random_bytes(50_000, 2);
        store
            .write("c", aligned_copy(&data), None)
            .unwrap()
            .wait()
            .unwrap();
        let file = paths[0].join("rank0/c.mlpo");
        let mut bytes = fs::read(&file).unwrap();
        bytes[12_345] ^= 0xff;
        fs::write(&file, &bytes).unwrap();
        let result = store.read("c", vec![0u8; data.len()]).unwrap().wait();
        if checksum {
            let err = result.err().unwrap();
            assert!(
                err.to_string().contains("checksum mismatch") && err.to_string().contains("c.mlpo"),
                "{err}"
            );
            assert_eq!(err.errno(), Some(libc::EIO));
        } else {
            let back = result.unwrap();
            assert_eq!(
                back[12_345],
                data[12_345] ^ 0xff,
                "without checksums the damage goes unnoticed"
            );
        }
    }
}

/// Each stripe's CRC32C of `data`, cut at `starts`.
fn sums_at(data: &[u8], starts: &[u64]) -> Vec<u32> {
    let mut ends: Vec<u64> = starts[1..].to_vec();
    ends.push(data.len() as u64);
    starts
        .iter()
        .zip(&ends)
        .map(|(&a, &b)| crc32c(&data[a as usize..b as usize]))
        .collect()
}

/// Writes `data` as `key` with the caller's `sums`, and waits for it.
fn write_with_sums(store: &ObjectStore, key: &str, data: &[u8], sums: StripeSums) {
    let mut buf = aligned_copy(data);
    let ptr = HostPtr(buf.as_mut_ptr());
    // SAFETY: the buffer is the completion's to keep alive until the write is done, and nothing changes
    // it meanwhile.
    unsafe { store.write_raw_with_sums(key, ptr, data.len(), Box::new(buf), None, Some(sums)) }
        .unwrap()
        .wait()
        .unwrap();
}

fn sums_computed_by_the_caller_are_kept_and_verified(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let store = ObjectStore::open(
        StoreConfig::new(paths.clone())
            .with_engine(engine)
            .with_limits(SMALL_LIMITS)
            .with_weights(vec![1.0, 3.0])
            .with_shadow_slots(false),
    )
    .unwrap();
    let data = random_bytes(300_000, 9);
    let starts = store.write_cuts(data.len() as u64).unwrap();
    assert_eq!(starts.len(), 2, "two stripes: {starts:?}");
    // Sums cut as the write cuts are kept: a verifying read agrees.
    let given = StripeSums {
        starts: starts.clone(),
        sums: sums_at(&data, &starts),
    };
    write_with_sums(&store, "a", &data, given);
    assert_eq!(read_back(&store, "a", data.len()), data);
    // Sums cut elsewhere (as if the weights had moved) are not used: the store hashes the bytes itself.
    let wrong = StripeSums {
        starts: vec![0],
        sums: vec![0xdead_beef],
    };
    write_with_sums(&store, "b", &data, wrong);
    assert_eq!(read_back(&store, "b", data.len()), data);
    // A read the caller verifies: the right sums pass, a flipped byte is named by its stripe's file.
    let mut out = AlignedBuf::new(data.len(), false).unwrap();
    let ptr = HostPtr(out.as_mut_ptr());
    // SAFETY: `out` outlives the wait and nothing else touches it.
    unsafe { store.read_raw_unverified("a", ptr, data.len(), Box::new(())) }
        .unwrap()
        .wait()
        .unwrap();
    let check = store.read_check("a").unwrap();
    assert_eq!(check.starts(), &starts[..]);
    store
        .verify(&check, &sums_at(out.as_slice(), check.starts()))
        .unwrap();
    let file = paths[1].join("rank0/a.mlpo");
    let mut bytes = fs::read(&file).unwrap();
    bytes[100] ^= 0x40;
    fs::write(&file, &bytes).unwrap();
    // SAFETY: as above.
    unsafe { store.read_raw_unverified("a", ptr, data.len(), Box::new(())) }
        .unwrap()
        .wait()
        .expect("an unverified read does not check");
    let check = store.read_check("a").unwrap();
    let err = store
        .verify(&check, &sums_at(out.as_slice(), check.starts()))
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(
        err.to_string().contains("checksum mismatch")
            && err.to_string().contains("path1/rank0/a.mlpo"),
        "{err}"
    );
    // A check taken before the object was written again is refused, not compared.
    store
        .write("a", aligned_copy(&data), None)
        .unwrap()
        .wait()
        .unwrap();
    let err = store.verify(&check, &[0, 0]).unwrap_err().to_string();
    assert!(err.contains("written again"), "{err}");
    let err = store
        .verify(&store.read_check("a").unwrap(), &[0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("1 sums for the 2 stripes"), "{err}");
}

/// Stages `data` as the next version of `key` (with the caller's sums where given); the completion.
fn stage(store: &ObjectStore, key: &str, data: &[u8], sums: Option<StripeSums>) -> Completion {
    let mut buf = aligned_copy(data);
    let ptr = HostPtr(buf.as_mut_ptr());
    // SAFETY: the buffer is the completion's to keep alive until the write is done, and nothing changes
    // it meanwhile.
    unsafe { store.stage_raw_with_sums(key, ptr, data.len(), Box::new(buf), None, sums) }.unwrap()
}

fn a_staged_version_is_read_only_once_committed(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let len = 300_000;
    let versions: Vec<Vec<u8>> = (0..6).map(|v| random_bytes(len, 100 + v)).collect();
    let store = open(&paths, engine);
    store
        .write("obj", aligned_copy(&versions[0]), None)
        .unwrap()
        .wait()
        .unwrap();
    // Staged, hashed by the store or by the caller: reads go on seeing the current version, and a read
    // check taken before stays valid (the current version did not change).
    let check = store.read_check("obj").unwrap();
    let starts = store.write_cuts(len as u64).unwrap();
    let sums = StripeSums {
        starts: starts.clone(),
        sums: sums_at(&versions[1], &starts),
    };
    for given in [None, Some(sums)] {
        let staged = stage(&store, "obj", &versions[1], given);
        assert_eq!(read_back(&store, "obj", len), versions[0]);
        staged.wait().unwrap();
        assert_eq!(read_back(&store, "obj", len), versions[0]);
    }
    store
        .verify(&check, &sums_at(&versions[0], check.starts()))
        .unwrap();
    // Committed: current, with its own sums (a verifying read checks them), and gone from the staging.
    store.commit("obj").unwrap();
    assert_eq!(read_back(&store, "obj", len), versions[1]);
    let err = store.verify(&check, &[0, 0]).unwrap_err().to_string();
    assert!(err.contains("written again"), "{err}");
    let err = store.commit("obj").unwrap_err();
    assert!(
        matches!(err, Error::Config { .. })
            && err.to_string().contains("\"obj\" has no staged version"),
        "{err}"
    );
    // Discarded: the current version stays.
    stage(&store, "obj", &versions[2], None);
    assert!(store.discard("obj").unwrap());
    assert!(!store.discard("obj").unwrap());
    assert_eq!(read_back(&store, "obj", len), versions[1]);
    // Another write replaces a staged version: nothing is left to commit.
    stage(&store, "obj", &versions[3], None);
    store
        .write("obj", aligned_copy(&versions[4]), None)
        .unwrap()
        .wait()
        .unwrap();
    assert!(store.commit("obj").is_err());
    assert_eq!(read_back(&store, "obj", len), versions[4]);
    // A store closed with a version staged (as a crash would leave it) reopens at the current one.
    stage(&store, "obj", &versions[5], None).wait().unwrap();
    drop(store);
    let store = open(&paths, engine);
    assert_eq!(read_back(&store, "obj", len), versions[4]);
    assert!(!store.discard("obj").unwrap());
    // Named refusals: an object never written, and a store without a second slot to stage into.
    let mut buf = aligned_copy(&versions[0]);
    let ptr = HostPtr(buf.as_mut_ptr());
    // SAFETY: refused before any I/O; `buf` outlives the call.
    let err = unsafe { store.stage_raw_with_sums("new", ptr, len, Box::new(()), None, None) }
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::NotFound { .. }) && err.to_string().contains("\"new\""),
        "{err}"
    );
    drop(store);
    let (_root1, paths1) = dirs(1);
    let store = ObjectStore::open(
        StoreConfig::new(paths1)
            .with_engine(engine)
            .with_shadow_slots(false),
    )
    .unwrap();
    store
        .write("obj", aligned_copy(&versions[0]), None)
        .unwrap()
        .wait()
        .unwrap();
    // SAFETY: as above.
    let err = unsafe { store.stage_raw_with_sums("obj", ptr, len, Box::new(()), None, None) }
        .err()
        .unwrap();
    assert!(err.to_string().contains("shadow_slots"), "{err}");
}

/// A store on `paths` with shadow slots off: one slot per object unless one is added.
fn open_without_shadow_slots(paths: &[PathBuf], engine: EngineChoice) -> ObjectStore {
    ObjectStore::open(
        StoreConfig::new(paths.iter().cloned())
            .with_engine(engine)
            .with_shadow_slots(false),
    )
    .unwrap()
}

/// The bytes the file system holds for object `key` of rank 0, over all `paths`.
fn allocated_on(paths: &[PathBuf], key: &str) -> u64 {
    paths
        .iter()
        .map(|path| allocated(&path.join(format!("rank0/{key}.mlpo"))))
        .sum()
}

fn a_second_slot_added_to_one_object_takes_staged_writes(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let len = 300_000;
    let versions: Vec<Vec<u8>> = (0..5).map(|v| random_bytes(len, 200 + v)).collect();
    let open_one_slot = || open_without_shadow_slots(&paths, engine);
    let on_disk = |key: &str| allocated_on(&paths, key);
    let store = open_one_slot();
    for key in ["a", "b"] {
        store
            .write(key, aligned_copy(&versions[0]), None)
            .unwrap()
            .wait()
            .unwrap();
    }
    let refused = |store: &ObjectStore, key: &str| {
        let mut buf = aligned_copy(&versions[0]);
        let ptr = HostPtr(buf.as_mut_ptr());
        // SAFETY: refused before any I/O; `buf` outlives the call.
        let err = unsafe { store.stage_raw_with_sums(key, ptr, len, Box::new(()), None, None) }
            .err()
            .map(|e| e.to_string());
        err.is_some_and(|e| e.contains("shadow_slots") && e.contains(&format!("{key:?}")))
    };
    assert!(refused(&store, "a"));
    // The second slot's blocks are reserved at once, split as the current version; a second call has
    // nothing to add.
    let before = on_disk("a");
    assert_eq!(
        (store.slots("a").unwrap(), store.slots("b").unwrap()),
        (1, 1)
    );
    let added = store.add_shadow_slot("a").unwrap();
    assert_eq!(
        (store.slots("a").unwrap(), store.slots("b").unwrap()),
        (2, 1)
    );
    assert!(
        (len as u64..len as u64 + 2 * 4096).contains(&added),
        "{added}"
    );
    assert_eq!(on_disk("a"), before + added);
    assert_eq!(store.add_shadow_slot("a").unwrap(), 0);
    // "a" now stages, commits and discards as an object of a store with shadow slots; "b" does not.
    stage(&store, "a", &versions[1], None).wait().unwrap();
    assert_eq!(read_back(&store, "a", len), versions[0]);
    store.commit("a").unwrap();
    assert_eq!(read_back(&store, "a", len), versions[1]);
    stage(&store, "a", &versions[2], None);
    assert!(store.discard("a").unwrap());
    assert_eq!(read_back(&store, "a", len), versions[1]);
    // A plain write goes to the slot not in use and flips: the version before stays whole until then.
    store
        .write("a", aligned_copy(&versions[3]), None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(read_back(&store, "a", len), versions[3]);
    assert!(refused(&store, "b"));
    assert_eq!(read_back(&store, "b", len), versions[0]);
    // The manifest keeps each object's slots: reopened, "a" stages and "b" still refuses.
    drop(store);
    let store = open_one_slot();
    assert_eq!(
        (store.slots("a").unwrap(), store.slots("b").unwrap()),
        (2, 1)
    );
    assert_eq!(read_back(&store, "a", len), versions[3]);
    stage(&store, "a", &versions[4], None).wait().unwrap();
    store.commit("a").unwrap();
    assert_eq!(read_back(&store, "a", len), versions[4]);
    assert!(refused(&store, "b"));
    let err = store.add_shadow_slot("nothing").unwrap_err();
    assert!(
        matches!(err, Error::NotFound { .. }) && err.to_string().contains("\"nothing\""),
        "{err}"
    );
    let err = store.slots("nothing").unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    drop(store);
    if !is_root() {
        eprintln!("skipped: running out of space (mounting a small tmpfs needs root)");
        return;
    }
    // Out of space: named, and the object keeps its one slot and its contents.
    let (_root1, paths1) = dirs(1);
    let _mount = Mount::tmpfs(&paths1[0], "size=2m");
    let store = ObjectStore::open(
        StoreConfig::new(paths1.iter().cloned())
            .with_engine(engine)
            .with_shadow_slots(false),
    )
    .unwrap();
    store
        .write("c", aligned_copy(&versions[0]), None)
        .unwrap()
        .wait()
        .unwrap();
    fill(&paths1[0]);
    let err = store.add_shadow_slot("c").unwrap_err();
    assert_eq!(err.errno(), Some(libc::ENOSPC), "{err}");
    assert!(err.to_string().contains("c.mlpo"), "{err}");
    assert_eq!(read_back(&store, "c", len), versions[0]);
    assert_eq!(store.slots("c").unwrap(), 1);
    assert!(refused(&store, "c"));
    fs::remove_file(paths1[0].join("filler")).unwrap();
    assert!(store.add_shadow_slot("c").unwrap() >= len as u64);
    stage(&store, "c", &versions[1], None).wait().unwrap();
    store.commit("c").unwrap();
    assert_eq!(read_back(&store, "c", len), versions[1]);
}

fn a_second_slot_is_given_back_once_the_current_version_is_in_slot_0(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let len = 300_000;
    let versions: Vec<Vec<u8>> = (0..6).map(|v| random_bytes(len, 300 + v)).collect();
    let open_one_slot = || open_without_shadow_slots(&paths, engine);
    let on_disk = |key: &str| allocated_on(&paths, key);
    let write = |store: &ObjectStore, version: &[u8]| {
        store
            .write("a", aligned_copy(version), None)
            .unwrap()
            .wait()
            .unwrap();
    };
    let store = open_one_slot();
    write(&store, &versions[0]);
    // One slot: nothing to give back.
    assert_eq!(store.remove_shadow_slot("a").unwrap(), Some(0));
    let one_slot = on_disk("a");
    let added = store.add_shadow_slot("a").unwrap();
    // Current in slot 1 (a staged version kept): kept as it is, both slots.
    stage(&store, "a", &versions[1], None).wait().unwrap();
    store.commit("a").unwrap();
    assert_eq!(store.remove_shadow_slot("a").unwrap(), None);
    assert_eq!(store.slots("a").unwrap(), 2);
    assert_eq!(on_disk("a"), one_slot + added);
    // A staged version waiting in slot 0: refused, naming the key; it stays committable.
    stage(&store, "a", &versions[2], None).wait().unwrap();
    let err = store.remove_shadow_slot("a").unwrap_err();
    assert!(
        err.to_string().contains("\"a\"") && err.to_string().contains("staged"),
        "{err}"
    );
    store.commit("a").unwrap();
    assert_eq!(read_back(&store, "a", len), versions[2]);
    // Current in slot 0: given back, every byte the slot took, and the contents stay.
    assert_eq!(store.remove_shadow_slot("a").unwrap(), Some(added));
    assert_eq!(store.slots("a").unwrap(), 1);
    assert_eq!(on_disk("a"), one_slot);
    assert_eq!(read_back(&store, "a", len), versions[2]);
    // One slot again: writes in place, staged writes refused.
    write(&store, &versions[3]);
    assert_eq!(on_disk("a"), one_slot);
    let mut buf = aligned_copy(&versions[4]);
    let ptr = HostPtr(buf.as_mut_ptr());
    // SAFETY: refused before any I/O; `buf` outlives the call.
    let err = unsafe { store.stage_raw_with_sums("a", ptr, len, Box::new(()), None, None) }
        .err()
        .unwrap();
    assert!(err.to_string().contains("shadow_slots"), "{err}");
    // The manifest already says so: reopened (as after a crash), one slot and the last contents.
    drop(store);
    let store = open_one_slot();
    assert_eq!(store.slots("a").unwrap(), 1);
    assert_eq!(read_back(&store, "a", len), versions[3]);
    // And a slot can be added again, taking as many bytes.
    assert_eq!(store.add_shadow_slot("a").unwrap(), added);
    stage(&store, "a", &versions[5], None).wait().unwrap();
    store.commit("a").unwrap();
    assert_eq!(read_back(&store, "a", len), versions[5]);
    let err = store.remove_shadow_slot("nothing").unwrap_err();
    assert!(
        matches!(err, Error::NotFound { .. }) && err.to_string().contains("\"nothing\""),
        "{err}"
    );
    drop(store);
    // A store with shadow slots keeps two for every object.
    let (_root2, paths2) = dirs(1);
    let store = open(&paths2, engine);
    store
        .write("s", aligned_copy(&versions[0]), None)
        .unwrap()
        .wait()
        .unwrap();
    let err = store.remove_shadow_slot("s").unwrap_err();
    assert!(
        err.to_string().contains("\"s\"") && err.to_string().contains("shadow slots on"),
        "{err}"
    );
    assert_eq!(store.slots("s").unwrap(), 2);
}

fn running_out_of_space_names_the_path_and_keeps_the_old_contents(engine: EngineChoice) {
    if !is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let (_root, paths) = dirs(1);
    let _mount = Mount::tmpfs(&paths[0], "size=2m");
    let store = open(&paths, engine);
    let old = random_bytes(300_000, 3);
    store
        .write("a", aligned_copy(&old), None)
        .unwrap()
        .wait()
        .unwrap();
    // A new object that cannot fit: preallocation fails before any byte is written.
    let err = store.write("b", vec![1u8; 4 << 20], None).err().unwrap();
    assert_eq!(err.errno(), Some(libc::ENOSPC), "{err}");
    assert!(err.to_string().contains("b.mlpo"), "{err}");
    assert!(
        !paths[0].join("rank0/b.mlpo").exists(),
        "a failed creation leaves no file behind"
    );
    // A rewrite that runs out of space half-way: take away the unused slot's blocks and fill the disk.
    let file = paths[0].join("rank0/a.mlpo");
    let stride = 300_000u64.div_ceil(4096) * 4096;
    fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(stride)
        .unwrap();
    let filler = paths[0].join("filler");
    let free = free_bytes(&paths[0]);
    fs::write(&filler, vec![0u8; free as usize - 8192]).unwrap();
    let new = random_bytes(300_000, 4);
    let err = store
        .write("a", aligned_copy(&new), None)
        .unwrap()
        .wait()
        .err()
        .unwrap();
    assert_eq!(err.errno(), Some(libc::ENOSPC), "{err}");
    assert!(
        err.to_string().contains(&file.display().to_string()),
        "{err}"
    );
    let back = read_back(&store, "a", old.len());
    assert!(back == old, "the previous contents stay readable");
    drop(store);
    fs::remove_file(&filler).unwrap();
}

/// The bytes free for an unprivileged file on the file system under `dir`.
fn free_bytes(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: statvfs is plain old data, overwritten by the call; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` outlives the call.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail * st.f_frsize
}

/// Takes every free block of the file system under `dir` (as another job's files would).
fn fill(dir: &Path) {
    let filler = fs::File::create(dir.join("filler")).unwrap();
    let len = free_bytes(dir) as libc::off_t;
    // SAFETY: plain syscall on an open descriptor.
    assert_eq!(
        unsafe { libc::posix_fallocate(filler.as_raw_fd(), 0, len) },
        0
    );
}

fn a_full_path_opens_and_rewrites_and_only_a_changed_manifest_fails(engine: EngineChoice) {
    if !is_root() {
        eprintln!("skipped: mounting a small tmpfs needs root");
        return;
    }
    // With shadow slots the last manifest's copy reads back; with one copy it is refused by name.
    for shadow in [true, false] {
        let (_root, paths) = dirs(1);
        let _mount = Mount::tmpfs(&paths[0], "size=4m");
        let open = || {
            ObjectStore::open(
                StoreConfig::new(paths.iter().cloned())
                    .with_engine(engine)
                    .with_limits(SMALL_LIMITS)
                    .with_shadow_slots(shadow),
            )
            .unwrap()
        };
        let old = random_bytes(300_000, 5);
        {
            let store = open();
            store
                .write("a", aligned_copy(&old), None)
                .unwrap()
                .wait()
                .unwrap();
        } // dropped: manifest written
        fill(&paths[0]);
        // Opening and syncing with nothing changed writes nothing, so a full path opens and closes.
        let store = open();
        assert!(read_back(&store, "a", old.len()) == old);
        store.sync().unwrap();
        // Rewrites reuse the blocks reserved when the object was created.
        let new = random_bytes(300_000, 6);
        store
            .write("a", aligned_copy(&new), None)
            .unwrap()
            .wait()
            .unwrap();
        assert!(read_back(&store, "a", new.len()) == new);
        // The manifest now changes (the new checksum), and its replacement needs a block.
        let err = store.sync().err().unwrap();
        assert_eq!(err.errno(), Some(libc::ENOSPC), "{err}");
        assert!(err.to_string().contains("manifest.json"), "{err}");
        drop(store);
        // The last manifest written stays whole, and the store opens on the full path.
        let store = open();
        assert_eq!(store.keys(), vec!["a".to_string()]);
        let read = store.read("a", vec![0u8; old.len()]).unwrap().wait();
        if shadow {
            assert!(read.unwrap() == old, "the last manifest's copy");
        } else {
            let err = read.err().unwrap();
            assert!(err.to_string().contains("a.mlpo"), "{err}");
        }
        drop(store);
        fs::remove_file(paths[0].join("filler")).unwrap();
    }
}

fn a_read_waits_for_the_write_before_it(engine: EngineChoice) {
    let (_root, paths) = dirs(2);
    let store = open(&paths, engine);
    let size = 8 << 20;
    store
        .write("x", aligned_copy(&random_bytes(size, 5)), None)
        .unwrap()
        .wait()
        .unwrap();
    for round in 0..4u64 {
        let data = random_bytes(size, 100 + round);
        let write = store.write("x", aligned_copy(&data), None).unwrap();
        // No wait here: the store must order the read after the write.
        let back = store
            .read("x", AlignedBuf::new(size, false).unwrap())
            .unwrap()
            .wait()
            .unwrap();
        assert!(back.as_slice() == &data[..], "round {round}");
        write.wait().unwrap();
    }
}

fn the_in_flight_limit_holds(engine: EngineChoice) {
    for limit in [1usize, 2, 5] {
        let (_root, paths) = dirs(1);
        let store = ObjectStore::open(
            StoreConfig::new(paths.clone())
                .with_engine(engine)
                .with_limits(PathLimits {
                    chunk_size: 64 << 10,
                    max_inflight: limit,
                }),
        )
        .unwrap();
        let data = random_bytes(16 << 20, 6);
        let pending: Vec<_> = (0..4)
            .map(|i| {
                store
                    .write(&format!("o{i}"), aligned_copy(&data), None)
                    .unwrap()
            })
            .collect();
        for p in pending {
            p.wait().unwrap();
        }
        let stats = store.path_reports()[0].stats;
        assert!(
            stats.inflight_max <= limit,
            "limit {limit}, saw {}",
            stats.inflight_max
        );
        assert!(stats.inflight_max >= 1);
        assert_eq!(stats.bytes_written, 4 * (16 << 20));
    }
}

fn two_ranks_share_a_device_request_by_request(engine: EngineChoice) {
    two_ranks_on_one_device(engine, Sharing::Shared);
}

fn two_ranks_take_a_device_in_turns(engine: EngineChoice) {
    two_ranks_on_one_device(engine, Sharing::Turns);
}

/// Two stores of two ranks on one device, each allowed 8 requests in flight, under a node-wide limit of 3:
/// the limit holds across them (as each saw it when it took a request), both move all their bytes, and
/// a path without admission reports none. By turns, one store's requests never overlap the other's:
/// their busy times add up to no more than the time both took (shared, they add up to more).
fn two_ranks_on_one_device(engine: EngineChoice, sharing: Sharing) {
    // The device's limit is shared with every other store of this user on the device: one test of
    // this binary at a time uses it.
    static DEVICE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    let (_root, paths) = dirs(1);
    let limit = 3;
    let open_rank = |rank| {
        ObjectStore::open(
            StoreConfig::new(paths.clone())
                .with_rank(rank)
                .with_engine(engine)
                .with_limits(PathLimits {
                    chunk_size: 64 << 10,
                    max_inflight: 8,
                })
                .with_device_inflight(vec![Some(limit)])
                .with_device_sharing(vec![sharing]),
        )
        .unwrap()
    };
    let stores = [open_rank(0), open_rank(1)];
    let data = random_bytes(8 << 20, 17);
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        for (rank, store) in stores.iter().enumerate() {
            let data = &data;
            scope.spawn(move || {
                let pending: Vec<_> = (0..4)
                    .map(|i| {
                        store
                            .write(&format!("r{rank}o{i}"), aligned_copy(data), None)
                            .unwrap()
                    })
                    .collect();
                for p in pending {
                    p.wait().unwrap();
                }
            });
        }
    });
    let took = started.elapsed().as_nanos() as u64;
    let mut busy = 0;
    for (rank, store) in stores.iter().enumerate() {
        for i in 0..4 {
            assert!(read_back(store, &format!("r{rank}o{i}"), data.len()) == data);
        }
        let report = &store.path_reports()[0];
        assert_eq!(report.device_inflight, Some(limit));
        assert_eq!(report.device_sharing, Some(sharing));
        let seen = report.stats.node_inflight_max;
        assert!(
            (1..=limit as usize).contains(&seen),
            "node-wide limit {limit}, saw {seen} in flight"
        );
        assert!(report.stats.inflight_max <= limit as usize);
        assert_eq!(report.stats.bytes_written, 4 * (8 << 20));
        busy += report.stats.write_busy_ns;
    }
    if sharing == Sharing::Turns {
        assert!(
            busy <= took,
            "turns overlapped: busy {busy} ns in {took} ns"
        );
    }
    drop(stores);
    let free = open(&paths, engine);
    assert_eq!(free.path_reports()[0].device_inflight, None);
    assert_eq!(free.path_reports()[0].stats.node_inflight_max, 0);
}

fn stripes_go_where_the_weights_say(engine: EngineChoice) {
    let (_root, paths) = dirs(3);
    let store = open(&paths, engine);
    let data = random_bytes(6 << 20, 8);
    store
        .write("w", aligned_copy(&data), Some(&[3.0, 0.0, 1.0]))
        .unwrap()
        .wait()
        .unwrap();
    let placement = store.placement("w").unwrap();
    assert_eq!(
        placement.iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![0, 2]
    );
    let (a, b) = (placement[0].1 as f64, placement[1].1 as f64);
    assert!((a / (a + b) - 0.75).abs() < 0.01, "{placement:?}");
    assert!(paths[0].join("rank0/w.mlpo").exists());
    assert!(!paths[1].join("rank0/w.mlpo").exists());
    assert!(paths[2].join("rank0/w.mlpo").exists());
    let reports = store.path_reports();
    assert!(reports[0].stats.bytes_written >= a as u64 && reports[1].stats.bytes_written == 0);
    let back = read_back(&store, "w", data.len());
    assert!(back == data);
}

/// Blocks the file system holds for a file (`st_blocks` is in 512-byte units).
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

fn new_weights_move_an_object_on_its_next_write(engine: EngineChoice) {
    const SIZE: usize = 8 << 20;
    let (_root, paths) = dirs(2);
    let file_on = |i: usize| paths[i].join("rank0/m.mlpo");
    // Each step: the store's weights, then the share of the object path 0 holds after one write.
    let steps: [(&[f64], f64); 4] = [
        (&[1.0, 1.0], 0.5),
        (&[3.0, 1.0], 0.75),
        (&[0.0, 1.0], 0.0),
        (&[1.0, 0.0], 1.0),
    ];
    {
        let store = ObjectStore::open(
            StoreConfig::new(paths.iter().cloned())
                .with_engine(engine)
                .with_limits(SMALL_LIMITS)
                .with_weights(vec![0.0, 1.0]),
        )
        .unwrap();
        // Created on path 1 only: path 0 has no file until a split puts a stripe there.
        store
            .write("m", aligned_copy(&random_bytes(SIZE, 0)), None)
            .unwrap()
            .wait()
            .unwrap();
        assert!(!file_on(0).exists());
        for (i, (weights, share)) in steps.iter().enumerate() {
            store.set_weights(weights).unwrap();
            let data = random_bytes(SIZE, i as u64 + 1);
            store
                .write("m", aligned_copy(&data), None)
                .unwrap()
                .wait()
                .unwrap();
            let on_0: u64 = store
                .placement("m")
                .unwrap()
                .iter()
                .filter(|p| p.0 == 0)
                .map(|p| p.1)
                .sum();
            assert!(
                (on_0 as f64 / SIZE as f64 - share).abs() < 0.01,
                "weights {weights:?}: {on_0} bytes on path 0"
            );
            let back = read_back(&store, "m", SIZE);
            assert!(back == data, "weights {weights:?}: contents differ");
        }
        // The slots now hold the splits [0, 1] and [1, 0]: one whole object per path. Without giving
        // back the blocks of shrunk stripes, path 1 would still hold [3, 1]'s quarter as well.
        for i in 0..2 {
            let bytes = allocated(&file_on(i));
            assert!(
                (SIZE as u64..=SIZE as u64 + (64 << 10)).contains(&bytes),
                "path {i}: {bytes} bytes allocated"
            );
        }
        let bad = store.set_weights(&[1.0]).unwrap_err();
        assert!(bad.to_string().starts_with("weights:"), "{bad}");
    }
    // The split of each slot is in the manifest: a reopened store reads the last contents.
    let store = open(&paths, engine);
    let back = read_back(&store, "m", SIZE);
    assert!(back == random_bytes(SIZE, steps.len() as u64));
}

#[test]
fn missing_and_unwritable_directories_are_named() {
    let (_root, paths) = dirs(1);
    let missing = paths[0].join("does-not-exist");
    let err = ObjectStore::open(StoreConfig::new([paths[0].clone(), missing.clone()]))
        .err()
        .unwrap();
    assert_eq!(err.errno(), Some(libc::ENOENT));
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    if !is_root() {
        eprintln!("skipped the read-only part: mounting needs root");
        return;
    }
    let ro = paths[0].join("ro");
    fs::create_dir(&ro).unwrap();
    let _mount = Mount::tmpfs(&ro, "ro,size=1m");
    let err = ObjectStore::open(StoreConfig::new([ro.clone()]))
        .err()
        .unwrap();
    assert_eq!(err.errno(), Some(libc::EROFS), "{err}");
    assert!(err.to_string().contains(&ro.display().to_string()), "{err}");
}

#[test]
fn bad_configuration_names_the_key() {
    let (_root, paths) = dirs(2);
    let cases: Vec<(StoreConfig, &str)> = vec![
        (StoreConfig::new(Vec::<PathBuf>::new()), "paths"),
        (
            StoreConfig::new([paths[0].clone(), paths[0].clone()]),
            "paths",
        ),
        (
            StoreConfig::new(paths.clone()).with_weights(vec![1.0]),
            "weights",
        ),
        (
            StoreConfig::new(paths.clone()).with_limits(PathLimits {
                chunk_size: 1000,
                max_inflight: 4,
            }),
            "paths[0].chunk_size",
        ),
        (
            StoreConfig::new(paths.clone()).with_limits(PathLimits {
                chunk_size: 1 << 20,
                max_inflight: 0,
            }),
            "paths[0].max_inflight",
        ),
        (
            StoreConfig::new(paths.clone()).with_device_inflight(vec![Some(4)]),
            "device_inflight",
        ),
        (
            StoreConfig::new(paths.clone()).with_device_inflight(vec![Some(0), None]),
            "paths[0].device_inflight",
        ),
        (
            StoreConfig::new(paths.clone()).with_device_sharing(vec![Sharing::Turns]),
            "device_sharing",
        ),
    ];
    for (config, key) in cases {
        let err = ObjectStore::open(config).err().unwrap();
        assert!(matches!(err, Error::Config { .. }), "{err}");
        assert!(
            err.to_string().starts_with(&format!("{key}:")),
            "want {key}, got {err}"
        );
    }
    let store = ObjectStore::open(StoreConfig::new(paths.clone())).unwrap();
    let err = store.write("../escape", vec![0u8; 8], None).err().unwrap();
    assert!(err.to_string().starts_with("key:"), "{err}");
    let err = store.read("absent", vec![0u8; 8]).err().unwrap();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    store
        .write("eight", vec![0u8; 8], None)
        .unwrap()
        .wait()
        .unwrap();
    let err = store.read("eight", vec![0u8; 9]).err().unwrap();
    assert!(err.to_string().starts_with("buffer:"), "{err}");
}
