//! The manifest (`manifest.json` in every path's rank directory, replaced atomically): written by
//! [`ObjectStore::sync`] and every delete, loaded at opening, which removes the object files it does not
//! know.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Arc, Mutex};

use super::read_write::wait_for;
use super::{
    validate_key, Manifest, ObjectEntry, ObjectStore, MANIFEST_FORMAT, MANIFEST_NAME, OBJECT_SUFFIX,
};
use crate::engine::IoFile;
use crate::error::{Error, Result};

impl ObjectStore {
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

    /// Loads the manifest. Every path's rank directory holds a copy, so a store reopened with its paths
    /// reordered, missing or added is recognised whichever path comes first.
    pub(super) fn load_manifest(&self) -> Result<()> {
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
    pub(super) fn remove_unknown_files(&self) -> Result<()> {
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
    pub(super) fn write_manifest(
        &self,
        written: &mut std::sync::MutexGuard<'_, Vec<u8>>,
    ) -> Result<()> {
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
