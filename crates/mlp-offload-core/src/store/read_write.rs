//! Reads and writes: an object's stripes laid out by the weights, submitted to each path's engine from
//! caller-owned buffers, their checksums verified, and the files preallocated where a layout grows.

use std::any::Any;
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{
    check_weights, validate_key, IoBuffer, ObjectEntry, ObjectRecord, ObjectStore, Pending,
    ReadCheck, Stripe, StripeSums, OBJECT_SUFFIX,
};
use crate::buffer::AlignedBuf;
use crate::completion::Completion;
use crate::engine::{Finish, HostPtr, IoFile, Op, Transfer};
use crate::error::{Error, Result};
use crate::tier::TierInfo;

impl ObjectStore {
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

    pub(super) fn entry_for_write(
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
    pub(super) fn relayout(&self, entry: &ObjectEntry, slot: u8, stripes: &[Stripe]) -> Result<()> {
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

    pub(super) fn object_path(&self, path_index: usize, key: &str) -> PathBuf {
        self.rank_dirs[path_index].join(format!("{key}{OBJECT_SUFFIX}"))
    }

    /// Queues every stripe's transfers. A failure to queue (no memory for a bounce block) becomes the
    /// completion's error rather than an early return, because transfers already queued still use the
    /// caller's buffer and the caller must wait for them.
    pub(super) fn submit_stripes(
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
}

/// Blocks until the object's in-flight operations selected by `which` are done, and forgets finished ones.
pub(super) fn wait_for(entry: &ObjectEntry, which: impl Fn(Op) -> bool) {
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

/// Where each stripe lies in the caller's buffer: `(offset, length)`.
pub(super) fn ranges_of(stripes: &[Stripe]) -> Vec<(usize, usize)> {
    stripes
        .iter()
        .map(|s| (s.object_offset as usize, s.len as usize))
        .collect()
}

/// Reserves `len` bytes at `offset` now so rewrites never run out of space; falls back to extending the
/// length on file systems without `fallocate`.
pub(super) fn preallocate(file: &File, path: &Path, offset: u64, len: u64) -> Result<()> {
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
pub(super) fn release(file: &File, offset: u64, len: u64) {
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

/// Splits `size` bytes into contiguous stripes in proportion to `weights`; every stripe but the last
/// starts and ends on its path's alignment.
pub(super) fn plan_stripes(size: u64, weights: &[f64], aligns: &[u64]) -> Result<Vec<Stripe>> {
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
