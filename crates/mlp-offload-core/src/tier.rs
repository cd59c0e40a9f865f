//! What a storage directory can do: its direct-I/O alignment, whether O_DIRECT really works there, and
//! which device it lives on (two directories on one device share its bandwidth).

use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::buffer::{AlignedBuf, BUFFER_ALIGN};
use crate::error::{Error, Result};

/// The alignment assumed when the kernel does not report one (`STATX_DIOALIGN` needs Linux 6.1 and a
/// file system that fills it in): a page, which every O_DIRECT implementation accepts.
const FALLBACK_DIO_ALIGN: u32 = 4096;

/// The facts about one storage directory that placement and I/O depend on.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct TierInfo {
    pub path: PathBuf,
    /// Required alignment of file offsets and lengths for O_DIRECT, in bytes.
    pub dio_offset_align: u32,
    /// Required alignment of buffer addresses for O_DIRECT, in bytes.
    pub dio_mem_align: u32,
    /// Whether a real O_DIRECT write and read-back succeeded in this directory.
    pub direct_io: bool,
    /// Why O_DIRECT is not used, when it is not.
    pub direct_io_refusal: Option<String>,
    /// `major:minor` of the device holding the directory; equal ids share bandwidth.
    pub device_id: String,
    /// The block device's kernel name (`vda`, `nvme0n1`, `loop3`), or the file system type for devices
    /// without one (`tmpfs`, `lustre`, `nfs`).
    pub device_name: String,
    pub fs_type: String,
}

impl TierInfo {
    /// The alignment the engine uses for offsets, lengths and addresses on this path.
    pub fn alignment(&self) -> u64 {
        u64::from(self.dio_offset_align.max(self.dio_mem_align).max(512))
    }
}

/// Probes `dir`, which must exist and be writable: statx for alignment, a real O_DIRECT write+read of one
/// aligned block, and the device identity.
pub fn probe_dir(dir: &Path) -> Result<TierInfo> {
    let meta = fs::metadata(dir).map_err(|e| Error::io("open storage directory", dir, e))?;
    if !meta.is_dir() {
        return Err(Error::io(
            "open storage directory",
            dir,
            io::Error::from_raw_os_error(libc::ENOTDIR),
        ));
    }
    let (offset_align, mem_align) = dio_alignment(dir).unwrap_or((0, 0));
    let dio_offset_align = if offset_align == 0 {
        FALLBACK_DIO_ALIGN
    } else {
        offset_align
    };
    let dio_mem_align = if mem_align == 0 {
        FALLBACK_DIO_ALIGN
    } else {
        mem_align
    };
    let direct_refusal = try_direct_io(dir, dio_offset_align.max(dio_mem_align) as usize)?;
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let fs_type = fs_type_name(dir);
    let device_name = block_device_name(major, minor).unwrap_or_else(|| fs_type.clone());
    Ok(TierInfo {
        path: dir.to_path_buf(),
        dio_offset_align,
        dio_mem_align,
        direct_io: direct_refusal.is_none(),
        direct_io_refusal: direct_refusal,
        device_id: format!("{major}:{minor}"),
        device_name,
        fs_type,
    })
}

/// `(offset_align, mem_align)` from `statx(STATX_DIOALIGN)`; zeros when the kernel or file system does
/// not report them.
fn dio_alignment(dir: &Path) -> Option<(u32, u32)> {
    let c_path = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statx` is plain old data; all-zero is a valid value that the kernel overwrites.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a valid NUL-terminated string and `stx` a valid, writable statx buffer that
    // outlives the call.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c_path.as_ptr(),
            0,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some((stx.stx_dio_offset_align, stx.stx_dio_mem_align))
}

/// Writes and reads back one aligned block with O_DIRECT in `dir`. `Ok(None)` when it works,
/// `Ok(Some(reason))` when the file system refuses it, `Err` when the directory is not usable at all.
fn try_direct_io(dir: &Path, align: usize) -> Result<Option<String>> {
    let probe_path = dir.join(format!(".mlp-offload-dio-probe-{}", std::process::id()));
    let result = (|| -> Result<Option<String>> {
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_DIRECT)
            .open(&probe_path);
        let file = match direct {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // The file system rejects the flag itself; check the directory is writable at all.
                OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&probe_path)
                    .map_err(|e| Error::io("create file in storage directory", &probe_path, e))?;
                return Ok(Some(format!("open with O_DIRECT: {e}")));
            }
            Err(e) => {
                return Err(Error::io(
                    "create file in storage directory",
                    &probe_path,
                    e,
                ))
            }
        };
        let len = align.max(BUFFER_ALIGN);
        let mut out = AlignedBuf::new(len, false)?;
        for (i, b) in out.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let mut back = AlignedBuf::new(len, false)?;
        use std::os::unix::fs::FileExt;
        if let Err(e) = file.write_all_at(out.as_slice(), 0) {
            return match e.raw_os_error() {
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                    Ok(Some(format!("O_DIRECT write: {e}")))
                }
                // A full file system took the flag at open but has no block for the probe. The store's
                // objects had their blocks reserved when they were created, so a full path must still
                // open: its objects read and rewrite in place (a new object fails, naming itself).
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => Ok(None),
                _ => Err(Error::io("write to storage directory", &probe_path, e)),
            };
        }
        if let Err(e) = file.read_exact_at(back.as_mut_slice(), 0) {
            return match e.raw_os_error() {
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => {
                    Ok(Some(format!("O_DIRECT read: {e}")))
                }
                _ => Err(Error::io("read from storage directory", &probe_path, e)),
            };
        }
        if out.as_slice() != back.as_slice() {
            return Ok(Some(
                "O_DIRECT read-back differs from what was written".into(),
            ));
        }
        Ok(None)
    })();
    let _ = fs::remove_file(&probe_path);
    result
}

fn fs_type_name(dir: &Path) -> String {
    let Ok(c_path) = CString::new(dir.as_os_str().as_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: `statfs` is plain old data; zeroed is valid and the kernel fills it.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and a writable statfs buffer that outlives the call.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut sfs) } != 0 {
        return "unknown".into();
    }
    // Magic numbers from linux/magic.h (and Lustre's and GPFS's own headers).
    match sfs.f_type as u64 {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x6969 => "nfs",
        0x0BD0_0BD0 => "lustre",
        0x4750_4653 => "gpfs",
        0x794C_7630 => "overlayfs",
        0x2FC1_2FC1 => "zfs",
        0x6573_5546 => "fuse",
        0x0100_2003 => "beegfs",
        _ => return format!("0x{:x}", sfs.f_type),
    }
    .into()
}

/// The whole-disk kernel name for a block device number (a partition maps to its disk, since partitions
/// share the disk's bandwidth), or `None` for devices without a block device (tmpfs, NFS, Lustre).
fn block_device_name(major: u32, minor: u32) -> Option<String> {
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let resolved = fs::canonicalize(&sys).ok()?;
    let disk = if resolved.join("partition").exists() {
        resolved.parent()?.to_path_buf()
    } else {
        resolved
    };
    disk.file_name().map(|n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_disk_directory_supports_direct_io() {
        // On the work disk (target/), not /tmp, which may be a tmpfs elsewhere.
        let dir =
            tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target")).unwrap();
        let info = probe_dir(dir.path()).unwrap();
        assert!(info.direct_io, "{info:?}");
        assert!(info.alignment().is_power_of_two() && info.alignment() >= 512);
        assert!(info.device_id.contains(':'));
        // The probe file is gone.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn missing_directory_names_the_path() {
        let err = probe_dir(Path::new("/nonexistent/mlp-offload")).unwrap_err();
        assert_eq!(err.errno(), Some(libc::ENOENT));
        assert!(
            err.to_string().contains("/nonexistent/mlp-offload"),
            "{err}"
        );
    }

    #[test]
    fn a_file_is_not_a_directory() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let err = probe_dir(file.path()).unwrap_err();
        assert_eq!(err.errno(), Some(libc::ENOTDIR));
    }
}
