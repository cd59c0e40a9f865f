//! The virtual-tier object store: named objects of any size, each placed on one storage path or striped
//! across several by weight, written and read asynchronously from caller-owned host buffers.
//!
//! On disk, each object has one file per path it touches (`<path>/rank<N>/<key>.mlpo`), created once,
//! preallocated, and rewritten in place. With shadow slots (the default) the file holds two copies: a
//! write goes to the slot not in use and becomes current only when every byte of it landed, so a failed
//! write leaves the previous contents readable. Each slot has its own split across the paths: a write
//! places the object by the store's current weights ([`ObjectStore::set_weights`]), so a path that slows
//! down gets less of every object from its next write on. Slot `s` of a path starts at `s` times the
//! object's size (rounded to the path's alignment); only the stripe's own range is allocated, so a
//! path's files use the disk its share needs. A manifest (`manifest.json` in every path's rank
//! directory, replaced atomically by [`ObjectStore::sync`] and by every delete) lets a store be
//! reopened. A deleted object leaves the manifest before its files go, and opening removes object files
//! that no manifest knows (objects created after the last sync, or deleted just before a crash), so no
//! crash leaves a store that cannot be opened. Each rank directory is locked while a store has it open
//! (`store.lock`, an exclusive `flock` the kernel releases when the process dies): a second store on the
//! same path and rank is refused, naming the holder's pid.
//!
//! Its modules: `config` (how a store is opened), `lock` (the rank directories' locks), `manifest`,
//! `read_write` (stripes, submissions, verified reads, preallocation) and `slots` (shadow slots); the
//! types, opening and the objects' table are here.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::admission::{Admitter, NodeAdmission, Sharing};
use crate::buffer::AlignedBuf;
use crate::checksum::PieceSums;
use crate::completion::Completion;
use crate::engine::{open_engine, EngineKind, HostPtr, IoEngine, IoFile, Op, PathStats};
use crate::error::{Error, Result};
use crate::tier::{probe_dir, TierInfo};

mod config;
mod lock;
mod manifest;
mod read_write;
mod slots;

#[cfg(test)]
mod tests;

pub use config::StoreConfig;
use lock::lock_rank_dir;
use read_write::{plan_stripes, ranges_of, wait_for};

const MANIFEST_NAME: &str = "manifest.json";
const LOCK_NAME: &str = "store.lock";
const MANIFEST_FORMAT: u32 = 2;
const OBJECT_SUFFIX: &str = ".mlpo";
const MAX_KEY_LEN: usize = 200;

/// Where one stripe of an object lives.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
struct Stripe {
    /// Index into the store's paths.
    path: usize,
    /// Where the stripe starts in the object.
    object_offset: u64,
    len: u64,
}

/// The persistent description of one object (what the manifest stores).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ObjectRecord {
    size: u64,
    slots: u8,
    /// Per path, where slot 1 starts in the path's file: the object's size rounded up to the path's
    /// alignment, so a slot can hold any share of the object.
    slot_strides: Vec<u64>,
    /// Per slot, the stripes as last written (and allocated).
    layouts: Vec<Vec<Stripe>>,
    /// The slot holding the current contents; `None` before the first complete write or after a failed
    /// write without shadow slots.
    active: Option<u8>,
    generation: u64,
    /// CRC32C of each stripe's contents, per slot; `None` when written with checksums off.
    checksums: Vec<Vec<Option<u32>>>,
    /// The slot holding a complete version written by a staged write and not yet made current
    /// ([`ObjectStore::commit`]). Never in the manifest: a store reopened after a crash has the current
    /// version, as if the staged write had not happened.
    #[serde(skip)]
    staged: Option<u8>,
}

struct ObjectEntry {
    key: String,
    /// Per path, the object's file there; `None` until a layout puts a stripe on that path.
    files: Mutex<Vec<Option<Arc<IoFile>>>>,
    record: Mutex<ObjectRecord>,
    /// Operations submitted and maybe not finished; a write waits for all of them, a read for writes.
    inflight: Mutex<Vec<(Op, Completion)>>,
    /// Serialises the submitting of operations on this object (not their I/O).
    submit_lock: Mutex<()>,
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    format: u32,
    paths: Vec<PathBuf>,
    objects: BTreeMap<String, ObjectRecord>,
}

/// Per-path facts and counters.
#[derive(Debug, Clone, Serialize)]
pub struct PathReport {
    pub tier: TierInfo,
    pub engine: EngineKind,
    pub chunk_size: usize,
    pub max_inflight: usize,
    /// The node-wide limit of requests in flight on the path's device, when admission is on.
    pub device_inflight: Option<u32>,
    /// How the node's ranks share the device, when admission is on.
    pub device_sharing: Option<Sharing>,
    pub stats: PathStats,
}

pub struct ObjectStore {
    config: StoreConfig,
    /// The placement weights of the next write.
    weights: Mutex<Vec<f64>>,
    tiers: Vec<TierInfo>,
    rank_dirs: Vec<PathBuf>,
    engines: Vec<Box<dyn IoEngine>>,
    /// Per path, its engine's side of its device's node-wide admission.
    admissions: Vec<Option<Arc<Admitter>>>,
    objects: Mutex<HashMap<String, Arc<ObjectEntry>>>,
    /// The manifest last written to every rank directory (empty when none is known to be there), held
    /// while one is written: its contents are the object table at that moment. A manifest that would not
    /// change is not written again, so opening and closing a store on a full path needs no new block.
    written_manifest: Mutex<Vec<u8>>,
    /// Each rank directory's lock, held for the store's life (see the module docs).
    _dir_locks: Vec<File>,
}

/// A caller buffer that the store may keep alive while I/O runs.
pub trait IoBuffer: Send + 'static {
    fn io_ptr(&mut self) -> *mut u8;
    fn io_len(&self) -> usize;
}

impl IoBuffer for Vec<u8> {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

impl IoBuffer for AlignedBuf {
    fn io_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

/// What a read without the store's own verification ([`ObjectStore::read_raw_unverified`]) read, for the
/// caller to verify: the object's contents as of the read (its generation), each stripe's start in the
/// object, its stored CRC32C (`None` where written without checksums) and its file.
#[derive(Debug, Clone)]
pub struct ReadCheck {
    key: String,
    generation: u64,
    starts: Vec<u64>,
    expected: Vec<Option<u32>>,
    paths: Vec<PathBuf>,
}

impl ReadCheck {
    /// Each stripe's first byte in the object, ascending from 0: where the caller's sums are cut.
    pub fn starts(&self) -> &[u64] {
        &self.starts
    }

    /// Whether there is anything to verify (the store keeps checksums, and the object has them).
    pub fn has_sums(&self) -> bool {
        self.expected.iter().any(Option::is_some)
    }
}

/// CRC32C sums a caller computed over an object's bytes, one per stripe starting at `starts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StripeSums {
    pub starts: Vec<u64>,
    pub sums: Vec<u32>,
}

/// An operation on an owned buffer; [`wait`](Pending::wait) gives the buffer back.
pub struct Pending<B> {
    completion: Completion,
    buffer: Arc<Mutex<Option<B>>>,
}

impl<B> Pending<B> {
    pub fn completion(&self) -> &Completion {
        &self.completion
    }

    pub fn wait(self) -> Result<B> {
        self.completion.wait()?;
        Ok(self
            .buffer
            .lock()
            .expect("buffer lock")
            .take()
            .expect("buffer returned once"))
    }
}

impl ObjectStore {
    /// Opens (or creates) a store: probes every path, creates the rank directories (0700), starts one
    /// engine per path, and loads the manifest if there is one.
    pub fn open(config: StoreConfig) -> Result<Self> {
        validate_config(&config)?;
        let mut tiers = Vec::with_capacity(config.paths.len());
        let mut rank_dirs = Vec::with_capacity(config.paths.len());
        let mut dir_locks = Vec::with_capacity(config.paths.len());
        for path in &config.paths {
            let meta =
                fs::metadata(path).map_err(|e| Error::io("open storage directory", path, e))?;
            if !meta.is_dir() {
                return Err(Error::io(
                    "open storage directory",
                    path,
                    io::Error::from_raw_os_error(libc::ENOTDIR),
                ));
            }
            let rank_dir = path.join(format!("rank{}", config.rank));
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&rank_dir)
                .map_err(|e| Error::io("create rank directory", &rank_dir, e))?;
            dir_locks.push(lock_rank_dir(&rank_dir)?);
            let tier = probe_dir(&rank_dir)?;
            if let Some(why) = &tier.direct_io_refusal {
                log::warn!(
                    "{} refuses O_DIRECT ({why}); using buffered I/O on this path",
                    path.display()
                );
            }
            tiers.push(tier);
            rank_dirs.push(rank_dir);
        }
        warn_about_shared_devices(&tiers);
        let admissions = open_admissions(&tiers, &config)?;
        let mut engines = Vec::with_capacity(tiers.len());
        for (i, tier) in tiers.iter().enumerate() {
            config.limits[i]
                .validate(tier.alignment())
                .map_err(|e| match e {
                    Error::Config { key, message } => Error::config(
                        format!("paths[{i}].{key}"),
                        format!("{message} ({})", tier.path.display()),
                    ),
                    other => other,
                })?;
            engines.push(open_engine(
                config.engine,
                &tier.path.to_string_lossy(),
                config.limits[i],
                admissions[i].clone(),
            )?);
        }
        let weights = config
            .weights
            .clone()
            .unwrap_or_else(|| vec![1.0; tiers.len()]);
        let store = ObjectStore {
            config,
            weights: Mutex::new(weights),
            tiers,
            rank_dirs,
            engines,
            admissions,
            objects: Mutex::new(HashMap::new()),
            written_manifest: Mutex::new(Vec::new()),
            _dir_locks: dir_locks,
        };
        store.load_manifest()?;
        store.remove_unknown_files()?;
        Ok(store)
    }

    pub fn tiers(&self) -> &[TierInfo] {
        &self.tiers
    }

    pub fn rank_dirs(&self) -> &[PathBuf] {
        &self.rank_dirs
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    pub fn engine_kind(&self) -> EngineKind {
        self.engines[0].kind()
    }

    pub fn path_reports(&self) -> Vec<PathReport> {
        self.tiers
            .iter()
            .zip(&self.engines)
            .zip(&self.config.limits)
            .zip(&self.admissions)
            .map(|(((tier, engine), limits), admission)| PathReport {
                tier: tier.clone(),
                engine: engine.kind(),
                chunk_size: limits.chunk_size,
                max_inflight: limits.max_inflight,
                device_inflight: admission.as_ref().map(|a| a.node().limit()),
                device_sharing: admission.as_ref().map(|a| a.sharing()),
                stats: engine.counters().snapshot(),
            })
            .collect()
    }

    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.lock_objects().keys().cloned().collect();
        keys.sort();
        keys
    }

    /// The object's size in bytes, or `None` if there is no such object.
    pub fn size(&self, key: &str) -> Option<u64> {
        let entry = self.lock_objects().get(key).cloned()?;
        let size = entry.record.lock().expect("record lock").size;
        Some(size)
    }

    /// How many slots the object has on disk: 2 where it takes staged writes (a store with shadow
    /// slots, or [`ObjectStore::add_shadow_slot`], kept in the manifest across reopens), else 1.
    pub fn slots(&self, key: &str) -> Result<u32> {
        let entry = self.entry(key)?;
        let slots = entry.record.lock().expect("record lock").slots;
        Ok(u32::from(slots))
    }

    /// How the object's current contents are split: `(path index, bytes)` per stripe.
    pub fn placement(&self, key: &str) -> Result<Vec<(usize, u64)>> {
        let entry = self.entry(key)?;
        let record = entry.record.lock().expect("record lock");
        let slot = record.active.unwrap_or(0) as usize;
        Ok(record.layouts[slot]
            .iter()
            .map(|s| (s.path, s.len))
            .collect())
    }

    /// The placement weights the next write uses.
    pub fn weights(&self) -> Vec<f64> {
        self.weights.lock().expect("weights lock").clone()
    }

    /// Changes the placement weights of every later write (one per path, finite, non-negative, not all
    /// zero). An object moves to the new split when it is next written, into its free slot, so its
    /// current contents stay readable throughout.
    pub fn set_weights(&self, weights: &[f64]) -> Result<()> {
        check_weights(weights, self.tiers.len())?;
        *self.weights.lock().expect("weights lock") = weights.to_vec();
        Ok(())
    }

    /// A write, made current when it completes or (`stage`) kept beside the current version.
    ///
    /// # Safety
    /// As [`ObjectStore::write_raw_with_sums`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn submit_write(
        &self,
        key: &str,
        buf: HostPtr,
        len: usize,
        keepalive: Box<dyn Any + Send>,
        weights: Option<&[f64]>,
        sums: Option<StripeSums>,
        stage: bool,
    ) -> Result<Completion> {
        let weights = match weights {
            Some(w) => w.to_vec(),
            None => self.weights(),
        };
        let aligns: Vec<u64> = self.tiers.iter().map(TierInfo::alignment).collect();
        let stripes = plan_stripes(len as u64, &weights, &aligns)?;
        let entry = self.entry_for_write(key, len as u64, &stripes)?;
        let _submitting = entry.submit_lock.lock().expect("submit lock");
        wait_for(&entry, |_| true);
        let (slot, slots) = {
            let mut record = entry.record.lock().expect("record lock");
            let slot = match (record.slots, record.active) {
                (2, Some(active)) => 1 - active,
                _ => 0,
            };
            // The free slot is the staged version's: this write replaces it.
            record.staged = None;
            (slot, record.slots)
        };
        // The slot being written is not current, so changing its split disturbs no reader.
        self.relayout(&entry, slot, &stripes)?;
        // The caller's sums where they are cut as this write's stripes; else hashed on the checksum
        // threads while the kernel moves the bytes. The finisher, which runs after every part, records
        // them.
        let starts: Vec<u64> = stripes.iter().map(|s| s.object_offset).collect();
        let given = sums
            .filter(|s| self.config.checksum && s.starts == starts && s.sums.len() == starts.len())
            .map(|s| s.sums);
        let sums =
            (self.config.checksum && given.is_none()).then(|| PieceSums::new(ranges_of(&stripes)));
        let completion = Completion::new();
        completion.keep_alive(keepalive);
        {
            let entry = entry.clone();
            let (sums, given) = (sums.clone(), given.clone());
            let stripe_count = stripes.len();
            completion.set_finisher(move |result| {
                let mut record = entry.record.lock().expect("record lock");
                match &result {
                    Ok(()) => {
                        if stage {
                            record.staged = Some(slot);
                        } else {
                            record.active = Some(slot);
                            record.generation += 1;
                        }
                        record.checksums[slot as usize] = match (&given, &sums) {
                            (Some(given), _) => given.iter().copied().map(Some).collect(),
                            (None, Some(sums)) => sums.range_sums().into_iter().map(Some).collect(),
                            (None, None) => vec![None; stripe_count],
                        };
                    }
                    // The previous slot stays current; with one slot its contents are now unknown.
                    Err(_) if slots == 1 => record.active = None,
                    Err(_) => {}
                }
                result
            });
        }
        self.submit_stripes(Op::Write, &entry, &stripes, slot, buf, &completion);
        if let Some(sums) = &sums {
            // SAFETY: the caller keeps `buf..buf+len` valid and unchanged until the completion is done,
            // and the stripes lie inside it.
            unsafe { sums.hash_on_pool(buf, &completion) };
        }
        entry
            .inflight
            .lock()
            .expect("inflight lock")
            .push((Op::Write, completion.clone()));
        completion.seal();
        Ok(completion)
    }

    /// # Safety
    /// As [`ObjectStore::read_raw`].
    unsafe fn read_raw_verifying(
        &self,
        key: &str,
        buf: HostPtr,
        len: usize,
        keepalive: Box<dyn Any + Send>,
        verify: bool,
    ) -> Result<Completion> {
        let entry = self.entry(key)?;
        let _submitting = entry.submit_lock.lock().expect("submit lock");
        // Never read an object before its last write has completed.
        wait_for(&entry, |op| op == Op::Write);
        let ActiveVersion {
            slot,
            stripes,
            checksums,
            strides,
        } = self.active_version(key, &entry, len)?;
        let files = entry.stripe_files(&stripes);
        check_not_truncated(key, &stripes, &files, slot, &strides)?;
        let completion = Completion::new();
        completion.keep_alive(keepalive);
        let verify = verify && self.config.checksum && checksums.iter().any(Option::is_some);
        if !verify {
            self.submit_stripes(Op::Read, &entry, &stripes, slot, buf, &completion);
        } else {
            let sums = PieceSums::new(ranges_of(&stripes));
            let paths = files.iter().map(|f| f.path.clone()).collect();
            completion.set_finisher(checksums_checked(key, sums.clone(), checksums, paths));
            // The transfers report to a completion of their own. When they are done, the pieces are
            // hashed on the checksum threads as parts of the caller's, which waits for them: the path's
            // I/O thread goes back to its queue at once.
            let transfers = Completion::new();
            completion.add_part();
            let outer = completion.clone();
            transfers.set_finisher(move |result| {
                if result.is_ok() {
                    // SAFETY: every transfer into the buffer is done, and the caller keeps it valid and
                    // untouched until `outer` is done, which waits for the parts added here.
                    unsafe { sums.hash_on_pool(buf, &outer) };
                }
                outer.part_done(result);
                Ok(())
            });
            self.submit_stripes(Op::Read, &entry, &stripes, slot, buf, &transfers);
            transfers.seal();
        }
        entry
            .inflight
            .lock()
            .expect("inflight lock")
            .push((Op::Read, completion.clone()));
        completion.seal();
        Ok(completion)
    }

    /// The object's current version: its slot, stripes, their checksums and the slots' strides. An
    /// error naming the buffer where its size is not the object's, or the object where it has no
    /// complete version.
    fn active_version(&self, key: &str, entry: &ObjectEntry, len: usize) -> Result<ActiveVersion> {
        let record = entry.record.lock().expect("record lock");
        if record.size != len as u64 {
            return Err(Error::config(
                "buffer",
                format!(
                    "object {key:?} has {} bytes but the buffer has {len}",
                    record.size
                ),
            ));
        }
        let Some(slot) = record.active else {
            return Err(Error::Corrupt {
                key: key.to_string(),
                path: self.object_path(record.layouts[0].first().map_or(0, |s| s.path), key),
                reason: "it has no complete contents (never written, or its last write failed)"
                    .into(),
            });
        };
        Ok(ActiveVersion {
            slot,
            stripes: record.layouts[slot as usize].clone(),
            checksums: record.checksums[slot as usize].clone(),
            strides: record.slot_strides.clone(),
        })
    }

    /// Removes an object and its files, after its in-flight operations finish. The manifest forgets it
    /// first, durably: a crash before the files are gone leaves files no manifest knows, which the next
    /// open removes.
    pub fn delete(&self, key: &str) -> Result<()> {
        let entry = self.entry(key)?;
        {
            let _submitting = entry.submit_lock.lock().expect("submit lock");
            wait_for(&entry, |_| true);
        }
        {
            let mut written = self.written_manifest.lock().expect("manifest lock");
            self.lock_objects().remove(key);
            self.write_manifest(&mut written)?;
        }
        for file in entry.all_files() {
            fs::remove_file(&file.path).map_err(|e| Error::io("remove", &file.path, e))?;
        }
        Ok(())
    }

    fn lock_objects(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<ObjectEntry>>> {
        self.objects.lock().expect("object table lock")
    }

    fn entry(&self, key: &str) -> Result<Arc<ObjectEntry>> {
        validate_key(key)?;
        self.lock_objects()
            .get(key)
            .cloned()
            .ok_or_else(|| Error::NotFound {
                key: key.to_string(),
                root: self.rank_dirs[0].clone(),
            })
    }
}

impl Drop for ObjectStore {
    fn drop(&mut self) {
        if let Err(e) = self.sync() {
            log::error!("closing the object store: {e}");
        }
    }
}

impl ObjectEntry {
    /// The files holding `stripes`, in their order. Every stripe's file exists: the layout that named
    /// it created it.
    fn stripe_files(&self, stripes: &[Stripe]) -> Vec<Arc<IoFile>> {
        let files = self.files.lock().expect("files lock");
        stripes
            .iter()
            .map(|s| files[s.path].clone().expect("a stripe's file exists"))
            .collect()
    }

    fn all_files(&self) -> Vec<Arc<IoFile>> {
        self.files
            .lock()
            .expect("files lock")
            .iter()
            .flatten()
            .cloned()
            .collect()
    }
}

/// Per path, its engine's side of its device's node-wide admission: one `NodeAdmission` per device
/// among the paths that ask for it (the first such path's limit), one `Admitter` per path.
fn open_admissions(tiers: &[TierInfo], config: &StoreConfig) -> Result<Vec<Option<Arc<Admitter>>>> {
    let mut by_device: HashMap<&str, Arc<NodeAdmission>> = HashMap::new();
    let mut out = Vec::with_capacity(tiers.len());
    for (i, tier) in tiers.iter().enumerate() {
        let Some(limit) = config.device_inflight[i] else {
            out.push(None);
            continue;
        };
        let node = match by_device.get(tier.device_id.as_str()) {
            Some(node) => node.clone(),
            None => {
                let node = Arc::new(NodeAdmission::open(&tier.device_id, limit).map_err(
                    |e| match e {
                        Error::Config { key, message } => Error::config(
                            format!("paths[{i}].{key}"),
                            format!("{message} ({})", tier.path.display()),
                        ),
                        other => other,
                    },
                )?);
                by_device.insert(&tier.device_id, node.clone());
                node
            }
        };
        out.push(Some(Arc::new(Admitter::new(
            node,
            config.device_sharing[i],
            config.limits[i].chunk_size,
        ))));
    }
    Ok(out)
}

fn validate_config(config: &StoreConfig) -> Result<()> {
    if config.paths.is_empty() {
        return Err(Error::config(
            "paths",
            "at least one storage directory is needed",
        ));
    }
    for (i, a) in config.paths.iter().enumerate() {
        if config.paths[..i].contains(a) {
            return Err(Error::config(
                "paths",
                format!("{} is listed twice", a.display()),
            ));
        }
    }
    // Settings given per path: one entry per path.
    for (key, entries) in [
        ("limits", config.limits.len()),
        ("device_inflight", config.device_inflight.len()),
        ("device_sharing", config.device_sharing.len()),
    ] {
        if entries != config.paths.len() {
            return Err(Error::config(
                key,
                format!("{entries} entries for {} paths", config.paths.len()),
            ));
        }
    }
    if let Some(w) = &config.weights {
        check_weights(w, config.paths.len())?;
    }
    Ok(())
}

fn check_weights(weights: &[f64], n_paths: usize) -> Result<()> {
    if weights.len() != n_paths {
        return Err(Error::config(
            "weights",
            format!("{} weights for {n_paths} paths", weights.len()),
        ));
    }
    if weights.iter().any(|w| !w.is_finite() || *w < 0.0) || weights.iter().all(|w| *w == 0.0) {
        return Err(Error::config(
            "weights",
            format!("{weights:?} must be finite, non-negative and not all zero"),
        ));
    }
    Ok(())
}

/// Keys are file names: letters, digits, `_`, `-`, `.`, not starting with `.`, at most 200 bytes, so a
/// key can never name a path outside the store's directories.
pub fn validate_key(key: &str) -> Result<()> {
    let ok = !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && !key.starts_with('.')
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(Error::config(
            "key",
            format!(
                "{key:?} is not a valid object name (1-{MAX_KEY_LEN} of A-Z a-z 0-9 _ - ., not starting with .)"
            ),
        ))
    }
}

fn warn_about_shared_devices(tiers: &[TierInfo]) {
    for (i, a) in tiers.iter().enumerate() {
        for b in &tiers[i + 1..] {
            if a.device_id == b.device_id && a.fs_type != "tmpfs" {
                log::warn!(
                    "{} and {} are on the same device ({} {}): they share its bandwidth",
                    a.path.display(),
                    b.path.display(),
                    a.device_name,
                    a.device_id
                );
            }
        }
    }
}

/// An object's current version, as a read takes it (`ObjectStore::active_version`).
struct ActiveVersion {
    slot: u8,
    stripes: Vec<Stripe>,
    checksums: Vec<Option<u32>>,
    strides: Vec<u64>,
}

/// A verifying read's finisher: once its transfers and hashing are done, each stripe's sum against
/// the stored one (a stripe stored without one is not checked); a mismatch names the stripe's file.
fn checksums_checked(
    key: &str,
    sums: Arc<PieceSums>,
    checksums: Vec<Option<u32>>,
    paths: Vec<PathBuf>,
) -> impl FnOnce(Result<()>) -> Result<()> + Send + 'static {
    let key = key.to_string();
    move |result| {
        result?;
        let actual = sums.range_sums();
        for ((actual, expected), path) in actual.iter().zip(&checksums).zip(&paths) {
            match expected {
                Some(expected) if expected != actual => {
                    return Err(Error::Corrupt {
                        key: key.clone(),
                        path: path.clone(),
                        reason: format!(
                            "checksum mismatch: stored crc32c {expected:#010x}, read {actual:#010x}"
                        ),
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Each stripe's file long enough to hold the stripe in `slot`; else an error naming the file.
fn check_not_truncated(
    key: &str,
    stripes: &[Stripe],
    files: &[Arc<IoFile>],
    slot: u8,
    strides: &[u64],
) -> Result<()> {
    for (stripe, file) in stripes.iter().zip(files) {
        let needed = u64::from(slot) * strides[stripe.path] + stripe.len;
        let have = file
            .primary()
            .metadata()
            .map_err(|e| Error::io("stat", &file.path, e))?
            .len();
        if have < needed {
            return Err(Error::Corrupt {
                key: key.to_string(),
                path: file.path.clone(),
                reason: format!("the file is truncated: {have} bytes, at least {needed} expected"),
            });
        }
    }
    Ok(())
}
