//! What a storage directory can do: its direct-I/O alignment, whether O_DIRECT really works there,
//! which device it lives on (two directories on one device share its bandwidth), and whether it is the
//! node's own or a file system other nodes mount too (whose bandwidth all of them share).

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
    /// The mount's type as `/proc/self/mountinfo` names it (`ext4`, `lustre`, `fuse.glusterfs`), else the
    /// `statfs` magic's name.
    pub fs_type: String,
    /// What is mounted (`/dev/vda1`, `server:/volume`), from `/proc/self/mountinfo`: a network file
    /// system's device number is new at every mount, and its source names it across mounts.
    pub mount_source: Option<String>,
    /// Node-local or shared with other nodes, from `fs_type` ([`locality_of`]).
    pub locality: Locality,
}

/// Whether other nodes reach the same files through a path: then they share its bandwidth, and one
/// node's probe alone overstates what each node gets.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Locality {
    NodeLocal,
    Shared,
}

/// File systems that serve the same files to many nodes: network and parallel file systems, by the
/// type `/proc/self/mountinfo` gives them (a FUSE client as `fuse.<name>`).
const SHARED_FS_TYPES: &[&str] = &[
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "cifs",
    "smb3",
    "ceph",
    "glusterfs",
    "fuse.glusterfs",
    "fuse.ceph-fuse",
    "fuse.ceph",
    "fuse.mfs",
    "fuse.lizardfs",
    "fuse.juicefs",
    "fuse.sshfs",
    "fuse.s3fs",
    "fuse.gcsfuse",
    "fuse.quobyte",
    "quobyte",
    "panfs",
    "wekafs",
    "orangefs",
    "pvfs2",
    "afs",
    "virtiofs",
];

/// The locality of a file system of type `fs_type`: shared for the network and parallel file systems
/// of [`SHARED_FS_TYPES`], node-local otherwise. A configuration key overrides it for what this list
/// cannot know (an NFS export only one node mounts, an unlisted FUSE client).
pub fn locality_of(fs_type: &str) -> Locality {
    if SHARED_FS_TYPES.contains(&fs_type) {
        Locality::Shared
    } else {
        Locality::NodeLocal
    }
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
    let (fs_type, mount_source) = match mount_of(dir) {
        Some((fs_type, source)) => (fs_type, Some(source)),
        None => (fs_type_name(dir), None),
    };
    let device_name = block_device_name(major, minor).unwrap_or_else(|| fs_type.clone());
    Ok(TierInfo {
        path: dir.to_path_buf(),
        dio_offset_align,
        dio_mem_align,
        direct_io: direct_refusal.is_none(),
        direct_io_refusal: direct_refusal,
        device_id: format!("{major}:{minor}"),
        device_name,
        locality: locality_of(&fs_type),
        fs_type,
        mount_source,
    })
}

/// `<hostname>-<pid>`: names a temporary file no other process writes, on this node or on another node
/// that mounts the same shared directory (process ids repeat across hosts).
pub(crate) fn process_tag() -> String {
    let mut name = [0u8; 256];
    // SAFETY: `name` is writable for its whole length, which is what the call is told; the kernel
    // NUL-terminates a name that fits (a host name is at most 64 bytes).
    let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let host = if rc == 0 {
        String::from_utf8_lossy(&name[..end]).replace('/', "_")
    } else {
        "unknown-host".into()
    };
    format!("{host}-{}", std::process::id())
}

/// The type and source of the mount holding `dir` in this process's mount namespace, from
/// `/proc/self/mountinfo`: unlike `statfs`, it tells FUSE clients apart (`fuse.glusterfs`).
fn mount_of(dir: &Path) -> Option<(String, String)> {
    let dir = fs::canonicalize(dir).ok()?;
    let table = fs::read_to_string("/proc/self/mountinfo").ok()?;
    mount_in(&table, &dir)
}

/// The file system type and source of the last-mounted, longest mount point above `dir` in a mountinfo
/// table (`proc(5)`: the mount point in field 5, the type and source after the `-` separator).
fn mount_in(table: &str, dir: &Path) -> Option<(String, String)> {
    let mut best: Option<(usize, (String, String))> = None;
    for line in table.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let (Some(point), Some(fs_type), Some(source)) =
            (fields.get(4), fields.get(sep + 1), fields.get(sep + 2))
        else {
            continue;
        };
        let point = unescape_mount_field(point);
        // Later lines mount over earlier ones at the same point: `>=` keeps the last.
        if dir.starts_with(&point) && best.as_ref().is_none_or(|(len, _)| point.len() >= *len) {
            let mount = ((*fs_type).to_string(), unescape_mount_field(source));
            best = Some((point.len(), mount));
        }
    }
    best.map(|(_, mount)| mount)
}

/// A mountinfo field with the kernel's octal escapes (`\040` for a space) undone.
fn unescape_mount_field(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `(offset_align, mem_align)` from `statx(STATX_DIOALIGN)`; zeros when the kernel or file system does
/// not report them.
fn dio_alignment(dir: &Path) -> Option<(u32, u32)> {
    let c_path = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statx` is plain old data; all-zero is a valid value that the kernel overwrites.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // The system call, not glibc's wrapper: that appeared in glibc 2.28, and the wheel promises 2.17
    // (manylinux2014), where a reference to it would not resolve at import.
    // SAFETY: `c_path` is a valid NUL-terminated string and `stx` a valid, writable statx buffer that
    // outlives the call; the arguments are the system call's, in its order and types.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_statx,
            libc::AT_FDCWD,
            c_path.as_ptr(),
            0 as libc::c_int,
            libc::STATX_DIOALIGN,
            &mut stx as *mut libc::statx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    // An emulator can pass the mask through without the fields (qemu-user 7.2 does): zero is no answer.
    match (stx.stx_dio_offset_align, stx.stx_dio_mem_align) {
        (0, 0) => None,
        found => Some(found),
    }
}

/// Writes and reads back one aligned block with O_DIRECT in `dir`. `Ok(None)` when it works,
/// `Ok(Some(reason))` when the file system refuses it, `Err` when the directory is not usable at all.
fn try_direct_io(dir: &Path, align: usize) -> Result<Option<String>> {
    let probe_path = dir.join(format!(".mlp-offload-dio-probe-{}", process_tag()));
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
        // The kernel reports the alignment itself (statx's STATX_DIOALIGN, Linux 6.1 on, called as a
        // system call); an older kernel leaves the fallback. ext4 reports it for regular files only, so
        // for the directories `probe_dir` is given there the fallback is what the probe says.
        let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut version = release
            .split(|c: char| !c.is_ascii_digit())
            .map(|v| v.parse::<u32>());
        let (major, minor) = (
            version.next().unwrap().unwrap(),
            version.next().unwrap().unwrap(),
        );
        if (major, minor) >= (6, 1) {
            let file = dir.path().join("regular");
            fs::write(&file, b"x").unwrap();
            match dio_alignment(&file) {
                Some((offset, mem)) => assert!(
                    offset.is_power_of_two() && mem.is_power_of_two(),
                    "{offset} {mem}"
                ),
                // qemu-user reports no alignment (scripts/aarch64.sh runs these tests under it).
                None => assert!(
                    std::env::var_os("MLP_OFFLOAD_UNDER_EMULATION").is_some(),
                    "statx(STATX_DIOALIGN) on the work disk"
                ),
            }
        }
    }

    #[test]
    fn the_mount_table_names_the_file_system_and_its_locality() {
        let table = "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
30 22 0:40 / /scratch rw,relatime shared:9 - lustre 10.0.0.1@tcp:/fs rw
31 22 0:41 / /mnt/my\\040data rw - fuse.glusterfs server:/vol rw,user_id=0
32 31 0:42 / /mnt/my\\040data/local rw - xfs /dev/nvme0n1 rw
33 22 0:43 / /scratch rw - tmpfs tmpfs rw
";
        // (directory, its mount's type and source, the locality of that type)
        let cases = [
            ("/home/me", "ext4", "/dev/vda1", Locality::NodeLocal),
            // Mounted over /scratch later: the last mount at a point is the one seen.
            ("/scratch/run", "tmpfs", "tmpfs", Locality::NodeLocal),
            (
                "/mnt/my data/ckpt",
                "fuse.glusterfs",
                "server:/vol",
                Locality::Shared,
            ),
            (
                "/mnt/my data/local/x",
                "xfs",
                "/dev/nvme0n1",
                Locality::NodeLocal,
            ),
            // A prefix of a component is not the mount point.
            ("/mnt/my datax", "ext4", "/dev/vda1", Locality::NodeLocal),
        ];
        for (dir, fs_type, source, locality) in cases {
            let (found, from) = mount_in(table, Path::new(dir)).unwrap();
            assert_eq!(
                (found.as_str(), from.as_str(), locality_of(&found)),
                (fs_type, source, locality),
                "{dir}"
            );
        }
        assert_eq!(locality_of("lustre"), Locality::Shared);
        assert_eq!(locality_of("nfs4"), Locality::Shared);
        assert_eq!(locality_of("fuse"), Locality::NodeLocal);
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
