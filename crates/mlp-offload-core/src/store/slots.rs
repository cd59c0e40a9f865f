//! Shadow slots: a second copy of an object's blocks, so that a write lands in the slot not in use and
//! becomes current only when every byte of it did (staged writes commit or are discarded).

use super::read_write::{release, wait_for};
use super::{ObjectStore, Stripe};
use crate::engine::Op;
use crate::error::{Error, Result};

impl ObjectStore {
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
}
