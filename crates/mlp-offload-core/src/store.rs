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

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::admission::{Admitter, NodeAdmission, Sharing};
use crate::buffer::AlignedBuf;
use crate::checksum::PieceSums;
use crate::completion::Completion;
use crate::engine::{
    open_engine, EngineChoice, EngineKind, Finish, HostPtr, IoEngine, IoFile, Op, PathLimits,
    PathStats, Transfer,
};
use crate::error::{Error, Result};
use crate::tier::{probe_dir, TierInfo};

const MANIFEST_NAME: &str = "manifest.json";
const LOCK_NAME: &str = "store.lock";
const MANIFEST_FORMAT: u32 = 2;
const OBJECT_SUFFIX: &str = ".mlpo";
const MAX_KEY_LEN: usize = 200;

/// How a store is opened. Every `with_*` setter documents its default.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    paths: Vec<PathBuf>,
    rank: u32,
    engine: EngineChoice,
    limits: Vec<PathLimits>,
    weights: Option<Vec<f64>>,
    checksum: bool,
    shadow_slots: bool,
    device_inflight: Vec<Option<u32>>,
    device_sharing: Vec<Sharing>,
}

impl StoreConfig {
    /// A store over `paths` (existing directories; each gets a `rank<N>` subdirectory).
    pub fn new<P: Into<PathBuf>>(paths: impl IntoIterator<Item = P>) -> Self {
        let paths: Vec<PathBuf> = paths.into_iter().map(Into::into).collect();
        let limits = vec![PathLimits::default(); paths.len()];
        let n_paths = paths.len();
        StoreConfig {
            paths,
            rank: 0,
            engine: EngineChoice::Auto,
            limits,
            weights: None,
            checksum: true,
            shadow_slots: true,
            device_inflight: vec![None; n_paths],
            device_sharing: vec![Sharing::Shared; n_paths],
        }
    }

    /// The rank whose private directories this store uses. Default 0.
    pub fn with_rank(mut self, rank: u32) -> Self {
        self.rank = rank;
        self
    }

    /// io_uring, the pread/pwrite thread pool, or `Auto` (io_uring when `io_uring_setup` works).
    /// Default `Auto`.
    pub fn with_engine(mut self, engine: EngineChoice) -> Self {
        self.engine = engine;
        self
    }

    /// The same chunk size and in-flight limit on every path. Default 4 MiB chunks, 8 in flight.
    pub fn with_limits(mut self, limits: PathLimits) -> Self {
        self.limits = vec![limits; self.paths.len()];
        self
    }

    /// Limits per path, in the order of the paths.
    pub fn with_path_limits(mut self, limits: Vec<PathLimits>) -> Self {
        self.limits = limits;
        self
    }

    /// Initial placement weights, one per path: a write splits the object into contiguous stripes in
    /// these proportions (a zero weight keeps a path out). [`ObjectStore::set_weights`] changes them
    /// while the store runs. Default: equal weights.
    pub fn with_weights(mut self, weights: Vec<f64>) -> Self {
        self.weights = Some(weights);
        self
    }

    /// Whether a CRC32C of every object is kept and checked on read. Default on.
    pub fn with_checksum(mut self, on: bool) -> Self {
        self.checksum = on;
        self
    }

    /// Two slots per object so a failed write leaves the previous contents readable (twice the disk
    /// space). Without, a failed write marks the object unreadable instead. Default on.
    pub fn with_shadow_slots(mut self, on: bool) -> Self {
        self.shadow_slots = on;
        self
    }

    /// Per path, the node-wide limit of requests in flight on its device, shared by every store of this
    /// user on the node whose path lies on the same device (see [`crate::admission`]); `None` leaves
    /// the path to its own `max_inflight`. Paths on one device share the first path's limit.
    /// Default: `None` everywhere.
    pub fn with_device_inflight(mut self, limits: Vec<Option<u32>>) -> Self {
        self.device_inflight = limits;
        self
    }

    /// Per path, how the node's ranks share its device under the node-wide limit: one request at a
    /// time each, or the whole limit by turns (see [`Sharing`]). Default: shared everywhere.
    pub fn with_device_sharing(mut self, sharing: Vec<Sharing>) -> Self {
        self.device_sharing = sharing;
        self
    }

    /// Whether a CRC32C of every stripe is kept and checked.
    pub fn checksum(&self) -> bool {
        self.checksum
    }

    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }
}

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

    /// Writes `buf` as object `key`, creating it on first write, split by `weights` or else the
    /// store's current weights. Returns when the I/O is submitted; the buffer comes back from `wait`.
    pub fn write<B: IoBuffer>(
        &self,
        key: &str,
        mut buf: B,
        weights: Option<&[f64]>,
    ) -> Result<Pending<B>> {
        let (ptr, len) = (HostPtr(buf.io_ptr()), buf.io_len());
        let buffer = Arc::new(Mutex::new(Some(buf)));
        // SAFETY: the buffer's heap memory does not move when `B` moves; it is kept alive by the
        // completion's keepalive until every transfer is done, and `Pending` gives access back only after.
        let completion =
            unsafe { self.write_raw(key, ptr, len, Box::new(buffer.clone()), weights)? };
        Ok(Pending { completion, buffer })
    }

    /// Reads object `key` into `buf`, which must have exactly the object's size.
    pub fn read<B: IoBuffer>(&self, key: &str, mut buf: B) -> Result<Pending<B>> {
        let (ptr, len) = (HostPtr(buf.io_ptr()), buf.io_len());
        let buffer = Arc::new(Mutex::new(Some(buf)));
        // SAFETY: as in `write`.
        let completion = unsafe { self.read_raw(key, ptr, len, Box::new(buffer.clone()))? };
        Ok(Pending { completion, buffer })
    }

    /// Where each stripe of a `len`-byte object written now starts (the current weights' split): what a
    /// caller computing a write's checksums itself cuts them at ([`ObjectStore::write_raw_with_sums`]).
    pub fn write_cuts(&self, len: u64) -> Result<Vec<u64>> {
        let aligns: Vec<u64> = self.tiers.iter().map(TierInfo::alignment).collect();
        Ok(plan_stripes(len, &self.weights(), &aligns)?
            .iter()
            .map(|s| s.object_offset)
            .collect())
    }

    /// Writes `len` bytes at `buf` as object `key`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unmodified until the returned completion is done; `keepalive`
    /// is held until then, so it may be what owns the memory.
    pub unsafe fn write_raw(
        &self,
        key: &str,
        buf: HostPtr,
        len: usize,
        keepalive: Box<dyn Any + Send>,
        weights: Option<&[f64]>,
    ) -> Result<Completion> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.write_raw_with_sums(key, buf, len, keepalive, weights, None) }
    }

    /// [`ObjectStore::write_raw`] with the stripes' CRC32C computed by the caller (`sums`, cut at
    /// [`ObjectStore::write_cuts`]) instead of on the store's checksum threads. Sums cut elsewhere (the
    /// weights changed in between) are not used: the store hashes the bytes itself, as without them.
    ///
    /// # Safety
    /// As [`ObjectStore::write_raw`]; and `sums` must be the CRC32C of those bytes.
    pub unsafe fn write_raw_with_sums(
        &self,
        key: &str,
        buf: HostPtr,
        len: usize,
        keepalive: Box<dyn Any + Send>,
        weights: Option<&[f64]>,
        sums: Option<StripeSums>,
    ) -> Result<Completion> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.submit_write(key, buf, len, keepalive, weights, sums, false) }
    }

    /// [`ObjectStore::write_raw_with_sums`] that does not make the new version current: it lands in the
    /// object's free shadow slot and waits there, while reads go on seeing the current version, until
    /// [`ObjectStore::commit`] makes it current or [`ObjectStore::discard`] forgets it (any other write
    /// of the object also replaces it). So an update whose outcome is not yet known can send its
    /// writes and still be undone without a byte moved. Needs shadow slots and a current version.
    ///
    /// # Safety
    /// As [`ObjectStore::write_raw_with_sums`].
    pub unsafe fn stage_raw_with_sums(
        &self,
        key: &str,
        buf: HostPtr,
        len: usize,
        keepalive: Box<dyn Any + Send>,
        weights: Option<&[f64]>,
        sums: Option<StripeSums>,
    ) -> Result<Completion> {
        {
            let entry = self.entry(key)?;
            let record = entry.record.lock().expect("record lock");
            if record.slots != 2 {
                return Err(Error::config(
                    "shadow_slots",
                    format!(
                        "object {key:?}: a staged write keeps the current version in the other slot, \
                         and the store has shadow slots off"
                    ),
                ));
            }
            if record.active.is_none() {
                return Err(Error::config(
                    "stage",
                    format!("object {key:?} has no current version to keep beside a staged one"),
                ));
            }
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { self.submit_write(key, buf, len, keepalive, weights, sums, true) }
    }

    /// Gives object `key`, created by a store with shadow slots off, a second slot of its own: its
    /// blocks are reserved now, split as the current version is, and from then on the object's writes
    /// alternate between its two slots and it takes staged writes ([`ObjectStore::stage_raw_with_sums`]),
    /// as every object of a store with shadow slots does. So an engine pays the second copy's disk only
    /// for the objects it stages. Returns the bytes reserved: 0 when the object already had two slots.
    /// Waits for the object's writes in flight first. Out of space, the error names the file and the
    /// object keeps its one slot, its contents as they were.
    pub fn add_shadow_slot(&self, key: &str) -> Result<u64> {
        let entry = self.entry(key)?;
        let _submitting = entry.submit_lock.lock().expect("submit lock");
        wait_for(&entry, |op| op == Op::Write);
        let stripes = {
            let mut record = entry.record.lock().expect("record lock");
            if record.slots == 2 {
                return Ok(0);
            }
            // Slot 1 begins at the stride every record keeps, one slot or two, so slot 0 stays where
            // it is.
            record.slots = 2;
            record.layouts.push(Vec::new());
            record.checksums.push(Vec::new());
            record.layouts[0].clone()
        };
        if let Err(e) = self.relayout(&entry, 1, &stripes) {
            // Give back whatever of slot 1 was reserved before the failure, and the object its one slot.
            let files = entry.files.lock().expect("files lock").clone();
            let mut record = entry.record.lock().expect("record lock");
            for (path, file) in files.iter().enumerate() {
                if let Some(file) = file {
                    let stride = record.slot_strides[path];
                    release(file.primary(), stride, stride);
                }
            }
            record.slots = 1;
            record.layouts.truncate(1);
            record.checksums.truncate(1);
            return Err(e);
        }
        Ok(stripes.iter().map(|s| self.reserved_len(s)).sum())
    }

    /// The bytes a slot's stripe takes in its path's file: its length rounded up to the path's
    /// alignment, as `relayout` reserves it.
    fn reserved_len(&self, stripe: &Stripe) -> u64 {
        let align = self.tiers[stripe.path].alignment();
        stripe.len.div_ceil(align) * align
    }

    /// Gives back the second slot [`ObjectStore::add_shadow_slot`] gave object `key`: the object goes
    /// back to one slot, its writes in place and no staged ones, and slot 1's blocks go back to the file
    /// system. Only while its current version lies in slot 0: returns `None` and changes nothing when it
    /// lies in slot 1 (the object's next write goes to slot 0; ask again after it). Returns the bytes
    /// given back, 0 when the object has one slot. Waits for the object's operations in flight first.
    /// The manifest forgets the slot first, durably, so a store reopened after a crash never stages into
    /// blocks that are gone (a crash before they go leaves them reserved, where the next
    /// `add_shadow_slot` takes them again). An error naming the key while a staged version waits, and
    /// in a store with shadow slots on, whose every object keeps two.
    pub fn remove_shadow_slot(&self, key: &str) -> Result<Option<u64>> {
        if self.config.shadow_slots {
            return Err(Error::config(
                "shadow_slots",
                format!(
                    "object {key:?}: the store keeps two slots for every object (shadow slots on)"
                ),
            ));
        }
        let entry = self.entry(key)?;
        let _submitting = entry.submit_lock.lock().expect("submit lock");
        wait_for(&entry, |_| true);
        let (layout, sums, strides) = {
            let mut record = entry.record.lock().expect("record lock");
            if record.slots == 1 {
                return Ok(Some(0));
            }
            if record.staged.is_some() {
                return Err(Error::config(
                    "remove_shadow_slot",
                    format!(
                        "object {key:?} has a staged version in its second slot: commit or discard it \
                         first"
                    ),
                ));
            }
            if record.active == Some(1) {
                return Ok(None);
            }
            record.slots = 1;
            let sums = record.checksums.pop().expect("a second slot's checksums");
            let layout = record.layouts.pop().expect("a second slot's layout");
            (layout, sums, record.slot_strides.clone())
        };
        {
            let mut written = self.written_manifest.lock().expect("manifest lock");
            if let Err(e) = self.write_manifest(&mut written) {
                // Not given back: the object keeps both slots, as the manifest on disk still says.
                let mut record = entry.record.lock().expect("record lock");
                record.slots = 2;
                record.layouts.push(layout);
                record.checksums.push(sums);
                return Err(e);
            }
        }
        let files = entry.files.lock().expect("files lock").clone();
        let mut given = 0;
        for stripe in &layout {
            let len = self.reserved_len(stripe);
            if let Some(file) = &files[stripe.path] {
                release(file.primary(), strides[stripe.path], len);
            }
            given += len;
        }
        Ok(Some(given))
    }

    /// Makes the staged version of `key` current, once its write has completed (a metadata change: no
    /// I/O). An error, naming the key, when there is none: none was written since the object's last
    /// write or commit, it was discarded, or its write failed (that write's own wait raised why).
    pub fn commit(&self, key: &str) -> Result<()> {
        let entry = self.entry(key)?;
        let _submitting = entry.submit_lock.lock().expect("submit lock");
        wait_for(&entry, |op| op == Op::Write);
        let mut record = entry.record.lock().expect("record lock");
        let Some(slot) = record.staged.take() else {
            return Err(Error::config(
                "commit",
                format!(
                    "object {key:?} has no staged version (none written since its last write or \
                     commit, discarded, or its write failed)"
                ),
            ));
        };
        record.active = Some(slot);
        record.generation += 1;
        Ok(())
    }

    /// Forgets the staged version of `key`, once its write has completed; the current version stays
    /// as it was. Returns whether there was one.
    pub fn discard(&self, key: &str) -> Result<bool> {
        let entry = self.entry(key)?;
        let _submitting = entry.submit_lock.lock().expect("submit lock");
        wait_for(&entry, |op| op == Op::Write);
        let staged = entry.record.lock().expect("record lock").staged.take();
        Ok(staged.is_some())
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

    /// Reads object `key` into `len` bytes at `buf`.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and untouched by others until the returned completion is done;
    /// `keepalive` is held until then.
    pub unsafe fn read_raw(
        &self,
        key: &str,
        buf: HostPtr,
        len: usize,
        keepalive: Box<dyn Any + Send>,
    ) -> Result<Completion> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.read_raw_verifying(key, buf, len, keepalive, true) }
    }

    /// [`ObjectStore::read_raw`] without the store's checksum verification: the caller hashes the bytes
    /// it reads (in the same pass as it uses them) and verifies them with [`ObjectStore::read_check`] and
    /// [`ObjectStore::verify`] before trusting anything it made of them.
    ///
    /// # Safety
    /// As [`ObjectStore::read_raw`].
    pub unsafe fn read_raw_unverified(
        &self,
        key: &str,
        buf: HostPtr,
        len: usize,
        keepalive: Box<dyn Any + Send>,
    ) -> Result<Completion> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.read_raw_verifying(key, buf, len, keepalive, false) }
    }

    /// What a read of `key` now reads (its current contents), for [`ObjectStore::verify`]: take it after
    /// the read and before the next write of `key`.
    pub fn read_check(&self, key: &str) -> Result<ReadCheck> {
        let entry = self.entry(key)?;
        let record = entry.record.lock().expect("record lock");
        let slot = record.active.unwrap_or(0) as usize;
        let stripes = &record.layouts[slot];
        Ok(ReadCheck {
            key: key.to_string(),
            generation: record.generation,
            starts: stripes.iter().map(|s| s.object_offset).collect(),
            expected: if self.config.checksum {
                record.checksums[slot].clone()
            } else {
                vec![None; stripes.len()]
            },
            paths: stripes
                .iter()
                .map(|s| self.object_path(s.path, key))
                .collect(),
        })
    }

    /// Compares `sums`, the caller's CRC32C of each stripe of what it read (cut at `check.starts()`),
    /// with the stored ones; a mismatch is [`Error::Corrupt`] naming the stripe's file, as the store's
    /// own verification reports it.
    pub fn verify(&self, check: &ReadCheck, sums: &[u32]) -> Result<()> {
        if sums.len() != check.starts.len() {
            return Err(Error::config(
                "sums",
                format!(
                    "{} sums for the {} stripes of object {:?}",
                    sums.len(),
                    check.starts.len(),
                    check.key
                ),
            ));
        }
        let generation = self
            .entry(&check.key)?
            .record
            .lock()
            .expect("record lock")
            .generation;
        if generation != check.generation {
            return Err(Error::config(
                "check",
                format!(
                    "object {:?} was written again after the read being verified",
                    check.key
                ),
            ));
        }
        for ((actual, expected), path) in sums.iter().zip(&check.expected).zip(&check.paths) {
            match expected {
                Some(expected) if expected != actual => {
                    return Err(Error::Corrupt {
                        key: check.key.clone(),
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
        let (slot, stripes, checksums, strides) = {
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
            (
                slot,
                record.layouts[slot as usize].clone(),
                record.checksums[slot as usize].clone(),
                record.slot_strides.clone(),
            )
        };
        let files = entry.stripe_files(&stripes);
        for (stripe, file) in stripes.iter().zip(&files) {
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
                    reason: format!(
                        "the file is truncated: {have} bytes, at least {needed} expected"
                    ),
                });
            }
        }
        let completion = Completion::new();
        completion.keep_alive(keepalive);
        let verify = verify && self.config.checksum && checksums.iter().any(Option::is_some);
        if !verify {
            self.submit_stripes(Op::Read, &entry, &stripes, slot, buf, &completion);
        } else {
            let sums = PieceSums::new(ranges_of(&stripes));
            {
                let (key, sums) = (key.to_string(), sums.clone());
                let paths: Vec<PathBuf> = files.iter().map(|f| f.path.clone()).collect();
                completion.set_finisher(move |result| {
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
                });
            }
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

    /// Waits for every in-flight operation, flushes object files to stable storage, and replaces the
    /// manifest atomically. Returns the first error of the flush or manifest write.
    pub fn sync(&self) -> Result<()> {
        let entries: Vec<Arc<ObjectEntry>> = self.lock_objects().values().cloned().collect();
        for entry in &entries {
            wait_for(entry, |_| true);
            for file in entry.all_files() {
                file.primary()
                    .sync_data()
                    .map_err(|e| Error::io("fdatasync", &file.path, e))?;
            }
        }
        let mut written = self.written_manifest.lock().expect("manifest lock");
        self.write_manifest(&mut written)
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

    fn entry_for_write(
        &self,
        key: &str,
        size: u64,
        stripes: &[Stripe],
    ) -> Result<Arc<ObjectEntry>> {
        validate_key(key)?;
        if let Some(entry) = self.lock_objects().get(key).cloned() {
            let existing = entry.record.lock().expect("record lock").size;
            if existing != size {
                return Err(Error::config(
                    "buffer",
                    format!(
                        "object {key:?} has {existing} bytes; a write of {size} bytes needs it deleted first"
                    ),
                ));
            }
            return Ok(entry);
        }
        let slots: u8 = if self.config.shadow_slots { 2 } else { 1 };
        let entry = Arc::new(ObjectEntry {
            key: key.to_string(),
            files: Mutex::new(vec![None; self.tiers.len()]),
            record: Mutex::new(ObjectRecord {
                size,
                slots,
                slot_strides: self
                    .tiers
                    .iter()
                    .map(|t| size.div_ceil(t.alignment()) * t.alignment())
                    .collect(),
                layouts: vec![Vec::new(); slots as usize],
                checksums: vec![Vec::new(); slots as usize],
                active: None,
                generation: 0,
                staged: None,
            }),
            inflight: Mutex::new(Vec::new()),
            submit_lock: Mutex::new(()),
        });
        // Every slot's blocks are reserved now, so running out of space shows at creation, not in a
        // rewrite.
        for slot in 0..slots {
            if let Err(e) = self.relayout(&entry, slot, stripes) {
                for file in entry.all_files() {
                    let _ = fs::remove_file(&file.path);
                }
                return Err(e);
            }
        }
        // Two threads creating the same key: the first one in wins, the other's files are the same paths.
        Ok(self
            .lock_objects()
            .entry(key.to_string())
            .or_insert(entry)
            .clone())
    }

    /// Gives `slot` the split `stripes`: allocates the ranges that grow (creating a path's file when it
    /// gets its first stripe) and releases the ranges that shrink. Without shadow slots the slot is the
    /// current one, so the object is marked unreadable first.
    fn relayout(&self, entry: &ObjectEntry, slot: u8, stripes: &[Stripe]) -> Result<()> {
        let (old, strides) = {
            let mut record = entry.record.lock().expect("record lock");
            if record.layouts[slot as usize] == stripes {
                return Ok(());
            }
            if record.active == Some(slot) {
                record.active = None;
            }
            (
                record.layouts[slot as usize].clone(),
                record.slot_strides.clone(),
            )
        };
        let len_on = |layout: &[Stripe], path: usize| {
            layout.iter().find(|s| s.path == path).map_or(0, |s| s.len)
        };
        for (path, tier) in self.tiers.iter().enumerate() {
            let align = tier.alignment();
            let had = len_on(&old, path).div_ceil(align) * align;
            let wants = len_on(stripes, path).div_ceil(align) * align;
            let base = u64::from(slot) * strides[path];
            if wants > had {
                let file = self.object_file(entry, path)?;
                preallocate(file.primary(), &file.path, base + had, wants - had)?;
            } else if wants < had {
                if let Some(file) = entry.files.lock().expect("files lock")[path].clone() {
                    release(file.primary(), base + wants, had - wants);
                }
            }
        }
        let mut record = entry.record.lock().expect("record lock");
        record.layouts[slot as usize] = stripes.to_vec();
        record.checksums[slot as usize] = vec![None; stripes.len()];
        Ok(())
    }

    /// The object's file on `path`, created on first use.
    fn object_file(&self, entry: &ObjectEntry, path: usize) -> Result<Arc<IoFile>> {
        let mut files = entry.files.lock().expect("files lock");
        if let Some(file) = &files[path] {
            return Ok(file.clone());
        }
        let file = Arc::new(IoFile::open(
            &self.object_path(path, &entry.key),
            self.tiers[path].direct_io,
            true,
        )?);
        files[path] = Some(file.clone());
        Ok(file)
    }

    fn object_path(&self, path_index: usize, key: &str) -> PathBuf {
        self.rank_dirs[path_index].join(format!("{key}{OBJECT_SUFFIX}"))
    }

    /// Queues every stripe's transfers. A failure to queue (no memory for a bounce block) becomes the
    /// completion's error rather than an early return, because transfers already queued still use the
    /// caller's buffer and the caller must wait for them.
    fn submit_stripes(
        &self,
        op: Op,
        entry: &ObjectEntry,
        stripes: &[Stripe],
        slot: u8,
        buf: HostPtr,
        completion: &Completion,
    ) {
        let files = entry.stripe_files(stripes);
        let strides = entry
            .record
            .lock()
            .expect("record lock")
            .slot_strides
            .clone();
        for (stripe, file) in stripes.iter().zip(&files) {
            let file_base = u64::from(slot) * strides[stripe.path];
            if let Err(e) = self.submit_stripe(op, file, stripe, file_base, buf, completion) {
                completion.add_part();
                completion.part_done(Err(e));
                return;
            }
        }
    }

    /// Queues the transfers of one stripe: the aligned body with O_DIRECT, the unaligned tail through an
    /// aligned bounce block; or the whole stripe buffered when the caller's memory is not aligned.
    fn submit_stripe(
        &self,
        op: Op,
        file: &Arc<IoFile>,
        stripe: &Stripe,
        file_base: u64,
        buf: HostPtr,
        completion: &Completion,
    ) -> Result<()> {
        let tier = &self.tiers[stripe.path];
        let align = tier.alignment();
        let engine = &self.engines[stripe.path];
        // SAFETY: stripes lie inside the caller's buffer (checked against the object size).
        let mem = HostPtr(unsafe { buf.0.add(stripe.object_offset as usize) });
        let aligned_mem = (mem.0 as usize).is_multiple_of(tier.dio_mem_align.max(512) as usize);
        let transfer = |direct: bool, offset: u64, ptr: HostPtr, len: usize, finish| {
            completion.add_part();
            Transfer {
                op,
                file: file.clone(),
                direct,
                offset,
                buf: ptr,
                len,
                finish,
                completion: completion.clone(),
            }
        };
        if !(file.is_direct() && aligned_mem) {
            engine.submit(transfer(false, file_base, mem, stripe.len as usize, None));
            return Ok(());
        }
        let body = stripe.len / align * align;
        let tail = (stripe.len - body) as usize;
        if body > 0 {
            engine.submit(transfer(true, file_base, mem, body as usize, None));
        }
        if tail > 0 {
            let mut bounce = AlignedBuf::new(align as usize, false)?;
            // SAFETY: `body <= stripe.len`, inside the caller's buffer.
            let tail_mem = HostPtr(unsafe { mem.0.add(body as usize) });
            let bounce_ptr = HostPtr(bounce.as_mut_ptr());
            let finish: Option<Finish> = match op {
                Op::Write => {
                    // SAFETY: `tail` bytes at `tail_mem` are the end of the caller's stripe; the bounce
                    // block has `align > tail` bytes. Both are valid and distinct.
                    unsafe { std::ptr::copy_nonoverlapping(tail_mem.0, bounce.as_mut_ptr(), tail) };
                    completion.keep_alive(Box::new(bounce));
                    None
                }
                Op::Read => Some(Box::new(move || {
                    // Whole-value moves: a closure capturing only the field `.0` would not be `Send`.
                    let (bounce, dst) = (bounce, tail_mem);
                    // SAFETY: the read into the bounce block is done; the caller's buffer is alive
                    // (the completion keeps it) and nobody else touches it until completion.
                    unsafe { std::ptr::copy_nonoverlapping(bounce.as_ptr(), dst.0, tail) };
                    Ok(())
                })),
            };
            engine.submit(transfer(
                true,
                file_base + body,
                bounce_ptr,
                align as usize,
                finish,
            ));
        }
        Ok(())
    }

    /// Loads the manifest. Every path's rank directory holds a copy, so a store reopened with its paths
    /// reordered, missing or added is recognised whichever path comes first.
    fn load_manifest(&self) -> Result<()> {
        let mut found: Option<Manifest> = None;
        // Each rank directory's manifest as read, to know whether every one already holds the table.
        let mut on_disk: Vec<String> = Vec::new();
        for dir in &self.rank_dirs {
            let path = dir.join(MANIFEST_NAME);
            let text = match fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("read manifest", &path, e)),
            };
            let manifest: Manifest = serde_json::from_str(&text).map_err(|e| Error::Corrupt {
                key: MANIFEST_NAME.into(),
                path: path.clone(),
                reason: format!("unreadable manifest: {e}"),
            })?;
            if manifest.format != MANIFEST_FORMAT {
                return Err(Error::config(
                    "manifest",
                    format!(
                        "{} has format {} (this version reads {MANIFEST_FORMAT})",
                        path.display(),
                        manifest.format
                    ),
                ));
            }
            if manifest.paths != self.config.paths {
                return Err(Error::config(
                    "paths",
                    format!(
                        "the store in {} was created with paths {:?}, not {:?}",
                        path.display(),
                        manifest.paths,
                        self.config.paths
                    ),
                ));
            }
            found.get_or_insert(manifest);
            on_disk.push(text);
        }
        let Some(manifest) = found else { return Ok(()) };
        let mut objects = self.lock_objects();
        for (key, record) in manifest.objects {
            validate_key(&key)?;
            let mut files = vec![None; self.tiers.len()];
            for stripe in record.layouts.iter().flatten() {
                if files[stripe.path].is_none() {
                    let path = self.object_path(stripe.path, &key);
                    files[stripe.path] = Some(Arc::new(IoFile::open(
                        &path,
                        self.tiers[stripe.path].direct_io,
                        false,
                    )?));
                }
            }
            objects.insert(
                key.clone(),
                Arc::new(ObjectEntry {
                    key,
                    files: Mutex::new(files),
                    record: Mutex::new(record),
                    inflight: Mutex::new(Vec::new()),
                    submit_lock: Mutex::new(()),
                }),
            );
        }
        drop(objects);
        // Every rank directory already holds this table: closing unchanged writes nothing.
        let text = self.manifest_text();
        if on_disk.len() == self.rank_dirs.len() && on_disk.iter().all(|t| t.as_bytes() == text) {
            *self.written_manifest.lock().expect("manifest lock") = text;
        }
        Ok(())
    }

    /// Removes object files in the rank directories that no object of the manifest uses: objects
    /// created after the last sync, or deleted after the manifest forgot them, before a crash.
    fn remove_unknown_files(&self) -> Result<()> {
        let objects = self.lock_objects();
        for (path_index, dir) in self.rank_dirs.iter().enumerate() {
            let listing = fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
            for item in listing {
                let item = item.map_err(|e| Error::io("list", dir, e))?;
                let name = item.file_name();
                let Some(key) = name.to_str().and_then(|n| n.strip_suffix(OBJECT_SUFFIX)) else {
                    continue;
                };
                let known = objects.get(key).is_some_and(|entry| {
                    entry.files.lock().expect("files lock")[path_index].is_some()
                });
                if !known {
                    let file = item.path();
                    fs::remove_file(&file)
                        .map_err(|e| Error::io("remove unknown file", &file, e))?;
                    log::info!(
                        "removed {}: no object of the store's manifest uses it",
                        file.display()
                    );
                }
            }
        }
        Ok(())
    }

    /// The manifest of the object table as it is now, as it is written.
    fn manifest_text(&self) -> Vec<u8> {
        let manifest = Manifest {
            format: MANIFEST_FORMAT,
            paths: self.config.paths.clone(),
            objects: self
                .lock_objects()
                .values()
                .map(|e| (e.key.clone(), e.record.lock().expect("record lock").clone()))
                .collect(),
        };
        serde_json::to_vec_pretty(&manifest).expect("manifest serialises")
    }

    /// Replaces the manifest in every rank directory with the object table as it is now, unless that is
    /// what `written` says they hold (the caller holds its lock, so two writers never interleave).
    fn write_manifest(&self, written: &mut std::sync::MutexGuard<'_, Vec<u8>>) -> Result<()> {
        let text = self.manifest_text();
        if **written == text {
            return Ok(());
        }
        for dir in &self.rank_dirs {
            let path = dir.join(MANIFEST_NAME);
            let tmp = path.with_extension("json.tmp");
            let write = || -> io::Result<()> {
                let mut f = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&tmp)?;
                f.write_all(&text)?;
                f.sync_all()?;
                fs::rename(&tmp, &path)?;
                File::open(dir)?.sync_all()
            };
            write().map_err(|e| Error::io("write manifest", &path, e))?;
        }
        **written = text;
        Ok(())
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

/// Takes the exclusive lock of a rank directory, recording this process's pid in it. The kernel drops
/// the lock when the file is closed or the process dies, so a crashed store never blocks the next one.
fn lock_rank_dir(dir: &Path) -> Result<File> {
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

/// Blocks until the object's in-flight operations selected by `which` are done, and forgets finished ones.
fn wait_for(entry: &ObjectEntry, which: impl Fn(Op) -> bool) {
    let waiting: Vec<Completion> = {
        let mut inflight = entry.inflight.lock().expect("inflight lock");
        inflight.retain(|(_, c)| !c.is_done());
        inflight
            .iter()
            .filter(|(op, _)| which(*op))
            .map(|(_, c)| c.clone())
            .collect()
    };
    for c in waiting {
        // Its outcome belongs to whoever submitted it; here only the ordering matters.
        let _ = c.wait();
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

/// Where each stripe lies in the caller's buffer: `(offset, length)`.
fn ranges_of(stripes: &[Stripe]) -> Vec<(usize, usize)> {
    stripes
        .iter()
        .map(|s| (s.object_offset as usize, s.len as usize))
        .collect()
}

/// Reserves `len` bytes at `offset` now so rewrites never run out of space; falls back to extending the
/// length on file systems without `fallocate`.
fn preallocate(file: &File, path: &Path, offset: u64, len: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            0,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        let have = file
            .metadata()
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        return file
            .set_len(have.max(offset + len))
            .map_err(|e| Error::io("set length of", path, e));
    }
    Err(Error::io("preallocate", path, e))
}

/// Gives back the blocks of a range that no longer holds a stripe. Best effort: a file system that
/// cannot punch holes keeps them, which costs space, not correctness.
fn release(file: &File, offset: u64, len: u64) {
    // SAFETY: plain syscall on an open descriptor; KEEP_SIZE leaves the file's length alone.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if rc != 0 {
        log::debug!(
            "could not release {len} bytes at {offset}: {}",
            io::Error::last_os_error()
        );
    }
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

/// Splits `size` bytes into contiguous stripes in proportion to `weights`; every stripe but the last
/// starts and ends on its path's alignment.
fn plan_stripes(size: u64, weights: &[f64], aligns: &[u64]) -> Result<Vec<Stripe>> {
    check_weights(weights, aligns.len())?;
    let total: f64 = weights.iter().sum();
    let used: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0.0).collect();
    let mut stripes = Vec::with_capacity(used.len());
    let mut offset = 0u64;
    for (n, &i) in used.iter().enumerate() {
        let len = if n + 1 == used.len() {
            size - offset
        } else {
            let share = (size as f64 * weights[i] / total) as u64;
            (share / aligns[i] * aligns[i]).min(size - offset)
        };
        if len > 0 {
            stripes.push(Stripe {
                path: i,
                object_offset: offset,
                len,
            });
        }
        offset += len;
    }
    Ok(stripes)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_follow_weights_and_alignment() {
        struct Case {
            size: u64,
            weights: &'static [f64],
            want: &'static [(usize, u64)],
        }
        let cases = [
            Case {
                size: 1 << 20,
                weights: &[1.0],
                want: &[(0, 1 << 20)],
            },
            Case {
                size: 1 << 20,
                weights: &[1.0, 1.0],
                want: &[(0, 1 << 19), (1, 1 << 19)],
            },
            Case {
                size: 1 << 20,
                weights: &[3.0, 1.0],
                want: &[(0, 786_432), (1, 262_144)],
            },
            Case {
                size: 1000,
                weights: &[1.0, 1.0],
                want: &[(1, 1000)],
            },
            Case {
                size: 10_000,
                weights: &[1.0, 1.0],
                want: &[(0, 4096), (1, 5904)],
            },
            Case {
                size: 8192,
                weights: &[0.0, 2.0, 1.0],
                want: &[(1, 4096), (2, 4096)],
            },
            Case {
                size: 0,
                weights: &[1.0, 1.0],
                want: &[],
            },
        ];
        for c in cases {
            let aligns = vec![4096; c.weights.len()];
            let stripes = plan_stripes(c.size, c.weights, &aligns).unwrap();
            let got: Vec<(usize, u64)> = stripes.iter().map(|s| (s.path, s.len)).collect();
            assert_eq!(got, c.want, "size {} weights {:?}", c.size, c.weights);
            assert_eq!(stripes.iter().map(|s| s.len).sum::<u64>(), c.size);
            assert!(
                stripes.iter().all(|s| s.object_offset % 4096 == 0),
                "{stripes:?}"
            );
        }
    }

    #[test]
    fn bad_weights_name_the_key() {
        for weights in [
            &[][..],
            &[1.0][..],
            &[0.0, 0.0][..],
            &[-1.0, 2.0][..],
            &[f64::NAN, 1.0][..],
        ] {
            let err = plan_stripes(10, weights, &[4096, 4096]).unwrap_err();
            assert!(
                err.to_string().starts_with("weights:"),
                "{weights:?}: {err}"
            );
        }
    }

    #[test]
    fn keys_cannot_escape_the_store() {
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "/etc/passwd",
            ".hidden",
            "a\0b",
            "é",
            &"x".repeat(201),
        ] {
            assert!(validate_key(bad).is_err(), "{bad:?} accepted");
        }
        for good in [
            "a",
            "sg17.exp_avg",
            "sub-group_0.fp32",
            "a..b",
            &"x".repeat(200),
        ] {
            validate_key(good).unwrap();
        }
    }
}
