//! Page-aligned host buffers owned by the runtime, and a fixed pool of them.
//!
//! O_DIRECT needs buffer addresses aligned to the device's direct-I/O memory alignment; `torch.empty` only
//! gives 64 bytes, so the runtime maps its own memory and hands it to Python without a copy.
//!
//! The pages under a buffer matter to the device as well. A block request is a list of physically
//! contiguous segments, at most `max_segments` of them (254 on a virtio disk), so a 4 MiB O_DIRECT
//! request over 4 KiB pages scattered in RAM reaches the device as several smaller requests. Buffers of
//! huge pages (2 MiB, physically contiguous) keep it whole. [`Pages::Huge`] takes huge pages the machine
//! has reserved (`MAP_HUGETLB`) when enough are free and the buffer is a whole number of them, else asks
//! for transparent ones (`MADV_HUGEPAGE` before the first touch). Fragmented memory can leave part of a
//! transparent buffer in 4 KiB pages: [`PageReport`] says how much each way got.

use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The alignment of every runtime buffer: a page, which satisfies every direct-I/O alignment seen in
/// practice (512 on ext4/xfs, 4096 on Lustre and 4Kn drives).
pub const BUFFER_ALIGN: usize = 4096;

/// The huge page size asked for: x86-64's and aarch64's (4 KiB granule) PMD size. Buffers of
/// [`Pages::Huge`] start on this boundary.
pub const HUGE_PAGE: usize = 2 << 20;

/// Which pages host buffers are made of (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pages {
    /// 4 KiB pages, and no transparent huge pages even where the kernel would give them unasked.
    Small,
    /// 2 MiB pages: reserved ones where free, else transparent ones, else (fragmented memory) 4 KiB.
    Huge,
}

impl Pages {
    /// `"small"` or `"huge"`; anything else is an error naming `key`.
    pub fn parse(key: &str, value: &str) -> Result<Self> {
        match value {
            "small" => Ok(Pages::Small),
            "huge" => Ok(Pages::Huge),
            other => Err(Error::config(
                key,
                format!("{other:?} is not \"small\" or \"huge\""),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pages::Small => "small",
            Pages::Huge => "huge",
        }
    }
}

/// How one buffer's memory was mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mapping {
    /// 4 KiB pages, transparent huge pages refused.
    Small,
    /// Huge pages the machine reserved (`MAP_HUGETLB`): huge throughout, by construction.
    Reserved,
    /// Transparent huge pages asked for; the kernel decides page by page at the first touch.
    Transparent,
}

/// How a set of buffers' bytes are backed, as the kernel reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PageReport {
    /// The buffers' bytes in all.
    pub bytes: usize,
    /// In huge pages the machine reserved (`MAP_HUGETLB`).
    pub reserved_huge_bytes: usize,
    /// In transparent huge pages (the `AnonHugePages` of `/proc/self/smaps`).
    pub transparent_huge_bytes: usize,
}

impl PageReport {
    /// Bytes in huge pages of either kind.
    pub fn huge_bytes(&self) -> usize {
        self.reserved_huge_bytes + self.transparent_huge_bytes
    }
}

/// One page-aligned, zero-initialised anonymous mapping, optionally locked in RAM with `mlock`.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// The length of the mapping (`len` rounded up to whole pages of its kind).
    map_len: usize,
    mapping: Mapping,
    locked: bool,
}

// SAFETY: `AlignedBuf` owns its mapping exclusively (like `Box<[u8]>`); the raw pointer is only an
// address, with no thread affinity.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for AlignedBuf {}

/// An anonymous private read-write mapping of `len` bytes with the extra `flags`, or the OS error.
fn map_anonymous(len: usize, flags: libc::c_int) -> io::Result<NonNull<u8>> {
    // SAFETY: a fresh anonymous mapping touches no existing memory; the result is checked below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(NonNull::new(raw.cast()).expect("mmap never maps address 0"))
}

/// An anonymous mapping of `len` bytes starting on an `align` boundary: `align` more is mapped, and the
/// ends outside the aligned range are unmapped again.
fn map_aligned(len: usize, align: usize) -> io::Result<NonNull<u8>> {
    let raw = map_anonymous(len + align, 0)?.as_ptr() as usize;
    let start = raw.next_multiple_of(align);
    let (head, tail) = (start - raw, raw + align - start);
    // SAFETY: both ranges lie inside the mapping just made, outside `start..start + len`, which stays.
    unsafe {
        if head > 0 {
            libc::munmap(raw as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
    }
    Ok(NonNull::new(start as *mut u8).expect("an aligned address inside a mapping is not 0"))
}

impl AlignedBuf {
    /// `len` bytes of 4 KiB pages aligned to [`BUFFER_ALIGN`]; see [`AlignedBuf::with_pages`].
    pub fn new(len: usize, lock: bool) -> Result<Self> {
        Self::with_pages(len, lock, Pages::Small)
    }

    /// Maps `len` bytes (rounded up to whole pages for the mapping) of `pages`, zeroed, aligned to
    /// [`BUFFER_ALIGN`] and, for huge pages, to [`HUGE_PAGE`]. A buffer smaller than one huge page gets
    /// small pages whatever `pages` says. Huge pages are touched here, so the kernel chooses each page's
    /// size now, while memory is least fragmented, not during the first I/O. With `lock`, tries `mlock`;
    /// a refusal (RLIMIT_MEMLOCK) leaves the buffer usable but unlocked.
    pub fn with_pages(len: usize, lock: bool, pages: Pages) -> Result<Self> {
        let small_len = len.max(1).div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN;
        let out_of_memory = |e: io::Error| Error::io("map host buffer", "<memory>", e);
        let (ptr, map_len, mapping) = if pages == Pages::Huge && len >= HUGE_PAGE {
            // Reserved pages only for a whole number of them: a rounded-up tail would be memory the
            // budget did not count.
            let reserved = len
                .is_multiple_of(HUGE_PAGE)
                .then(|| map_anonymous(len, libc::MAP_HUGETLB).ok())
                .flatten();
            match reserved {
                Some(ptr) => (ptr, len, Mapping::Reserved),
                None => {
                    let ptr = map_aligned(small_len, HUGE_PAGE).map_err(out_of_memory)?;
                    // SAFETY: advice on the mapping just made. A kernel without transparent huge
                    // pages refuses it (EINVAL), which leaves small pages: the report says so.
                    unsafe {
                        libc::madvise(ptr.as_ptr().cast(), small_len, libc::MADV_HUGEPAGE);
                    }
                    (ptr, small_len, Mapping::Transparent)
                }
            }
        } else {
            let ptr = map_anonymous(small_len, 0).map_err(out_of_memory)?;
            // SAFETY: advice on the mapping just made; refused (EINVAL) where the kernel has no
            // transparent huge pages, and then there are none to refuse.
            unsafe {
                libc::madvise(ptr.as_ptr().cast(), small_len, libc::MADV_NOHUGEPAGE);
            }
            (ptr, small_len, Mapping::Small)
        };
        let mut buf = AlignedBuf {
            ptr,
            len,
            map_len,
            mapping,
            locked: false,
        };
        if mapping != Mapping::Small {
            // One write per huge page makes the kernel fault it in whole (a read would map the shared
            // zero page instead). The memory is zero already; this keeps it so.
            for offset in (0..map_len).step_by(HUGE_PAGE) {
                // SAFETY: `offset` lies inside the mapping, which only this buffer owns.
                unsafe { std::ptr::write_volatile(buf.ptr.as_ptr().add(offset), 0) };
            }
        }
        if lock {
            // SAFETY: the range is the mapping we just made and own.
            let rc = unsafe { libc::mlock(buf.ptr.as_ptr().cast(), map_len) };
            if rc == 0 {
                buf.locked = true;
            } else {
                log::warn!(
                    "mlock of a {map_len}-byte host buffer failed ({}); continuing with unlocked memory \
                     (raise RLIMIT_MEMLOCK to lock it)",
                    io::Error::last_os_error()
                );
            }
        }
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_locked(&self) -> bool {
        self.locked
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to at least `len` initialised (zero-filled anonymous) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `with_pages`, unmapped once, here (which also unlocks it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

/// How `buffers` are backed: reserved huge pages by construction; transparent ones as the kernel
/// reports them per mapping in `/proc/self/smaps` (`AnonHugePages`), counted where a mapping overlaps a
/// buffer. Adjacent buffers the kernel merged into one mapping are counted together, never twice.
pub fn page_report<'a>(buffers: impl IntoIterator<Item = &'a AlignedBuf>) -> PageReport {
    let mut report = PageReport::default();
    let mut transparent: Vec<(usize, usize)> = Vec::new();
    for buf in buffers {
        report.bytes += buf.len;
        match buf.mapping {
            Mapping::Reserved => report.reserved_huge_bytes += buf.len,
            Mapping::Transparent => {
                let start = buf.ptr.as_ptr() as usize;
                transparent.push((start, start + buf.len));
            }
            Mapping::Small => {}
        }
    }
    if !transparent.is_empty() {
        // Unreadable smaps (no /proc) counts as no huge pages: the report never claims more than seen.
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        report.transparent_huge_bytes = transparent_huge_bytes(&smaps, &transparent);
    }
    report
}

/// The transparent huge page bytes that `smaps` (the text of `/proc/<pid>/smaps`) reports inside
/// `ranges` (`start..end` addresses): per mapping, its `AnonHugePages`, at most its overlap with them.
fn transparent_huge_bytes(smaps: &str, ranges: &[(usize, usize)]) -> usize {
    let mut total = 0;
    let mut overlap = 0;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some((start, end)) = first.split_once('-').and_then(|(s, e)| {
            Some((
                usize::from_str_radix(s, 16).ok()?,
                usize::from_str_radix(e, 16).ok()?,
            ))
        }) {
            // A mapping's header line: how much of it lies in the ranges.
            overlap = ranges
                .iter()
                .map(|&(a, b)| b.min(end).saturating_sub(a.max(start)))
                .sum();
        } else if first == "AnonHugePages:" && overlap > 0 {
            let kib: usize = fields.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            total += (kib << 10).min(overlap);
        }
    }
    total
}

/// A fixed set of equally sized buffers. `acquire` hands one out; it returns to the pool when dropped.
#[derive(Clone)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    free: Mutex<Vec<AlignedBuf>>,
    buffer_size: usize,
    count: usize,
    locked: bool,
    pages: Pages,
    /// How the buffers are backed, read once every buffer was touched.
    report: PageReport,
}

impl BufferPool {
    /// `count` buffers of `buffer_size` bytes in 4 KiB pages; see [`BufferPool::with_pages`].
    pub fn new(count: usize, buffer_size: usize, lock: bool) -> Result<Self> {
        Self::with_pages(count, buffer_size, lock, Pages::Small)
    }

    /// `count` buffers of `buffer_size` bytes of `pages` (see [`AlignedBuf::with_pages`]).
    pub fn with_pages(count: usize, buffer_size: usize, lock: bool, pages: Pages) -> Result<Self> {
        if count == 0 {
            return Err(Error::config("buffer_count", "must be at least 1"));
        }
        if buffer_size == 0 {
            return Err(Error::config("buffer_size", "must be at least 1 byte"));
        }
        let free = (0..count)
            .map(|_| AlignedBuf::with_pages(buffer_size, lock, pages))
            .collect::<Result<Vec<_>>>()?;
        let locked = free.iter().all(AlignedBuf::is_locked);
        let report = page_report(&free);
        if pages == Pages::Huge && buffer_size >= HUGE_PAGE && report.huge_bytes() < report.bytes {
            log::info!(
                "host buffers: {} of {} MiB in huge pages (the rest in 4 KiB pages: memory is fragmented, \
                 or transparent huge pages are off)",
                report.huge_bytes() >> 20,
                report.bytes >> 20
            );
        }
        Ok(BufferPool {
            inner: Arc::new(PoolInner {
                free: Mutex::new(free),
                buffer_size,
                count,
                locked,
                pages,
                report,
            }),
        })
    }

    /// A free buffer, or `None` when all are handed out.
    pub fn acquire(&self) -> Option<PooledBuf> {
        let buf = self.inner.free.lock().expect("pool lock").pop()?;
        Some(PooledBuf {
            buf: Some(buf),
            pool: self.inner.clone(),
        })
    }

    pub fn buffer_size(&self) -> usize {
        self.inner.buffer_size
    }

    pub fn count(&self) -> usize {
        self.inner.count
    }

    pub fn available(&self) -> usize {
        self.inner.free.lock().expect("pool lock").len()
    }

    /// Whether every buffer of the pool is locked in RAM.
    pub fn is_locked(&self) -> bool {
        self.inner.locked
    }

    /// The pages asked for.
    pub fn pages(&self) -> Pages {
        self.inner.pages
    }

    /// How the buffers' bytes are backed, as the kernel reported it once they were touched.
    pub fn page_report(&self) -> PageReport {
        self.inner.report
    }
}

/// A buffer on loan from a [`BufferPool`].
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<PoolInner>,
}

impl std::ops::Deref for PooledBuf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        self.buf.as_ref().expect("buffer present until drop")
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        self.buf.as_mut().expect("buffer present until drop")
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.free.lock().expect("pool lock").push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_zeroed_on_either_pages() {
        // len, pages, the alignment expected
        let cases = [
            (1, Pages::Small, BUFFER_ALIGN),
            (511, Pages::Small, BUFFER_ALIGN),
            (4097, Pages::Small, BUFFER_ALIGN),
            (1 << 20, Pages::Small, BUFFER_ALIGN),
            // Smaller than a huge page: small pages, whatever was asked.
            (4096, Pages::Huge, BUFFER_ALIGN),
            (HUGE_PAGE, Pages::Huge, HUGE_PAGE),
            (3 * HUGE_PAGE + 12_345, Pages::Huge, HUGE_PAGE),
        ];
        for (len, pages, align) in cases {
            let buf = AlignedBuf::with_pages(len, true, pages).unwrap();
            assert_eq!(buf.as_ptr() as usize % align, 0, "len {len} {pages:?}");
            assert_eq!(buf.len(), len);
            assert!(
                buf.as_slice().iter().all(|&b| b == 0),
                "len {len} {pages:?}"
            );
        }
    }

    #[test]
    fn small_pages_report_no_huge_bytes_and_huge_ones_at_most_their_size() {
        let small = AlignedBuf::with_pages(8 * HUGE_PAGE, false, Pages::Small).unwrap();
        let report = page_report([&small]);
        assert_eq!(report.bytes, 8 * HUGE_PAGE);
        assert_eq!(report.huge_bytes(), 0, "{report:?}");
        let huge = AlignedBuf::with_pages(8 * HUGE_PAGE, false, Pages::Huge).unwrap();
        let report = page_report([&huge]);
        assert!(report.huge_bytes() <= report.bytes, "{report:?}");
        if std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|mode| !mode.contains("[never]"))
            && report.reserved_huge_bytes == 0
        {
            // Where the kernel has transparent huge pages, an unfragmented 16 MiB gets some.
            assert!(report.transparent_huge_bytes > 0, "{report:?}");
        }
    }

    #[test]
    fn smaps_overlaps_count_each_mapping_once() {
        let smaps = "\
7f0000000000-7f0000800000 rw-p 00000000 00:00 0
Size:               8192 kB
AnonHugePages:      6144 kB
7f0000800000-7f0000a00000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
7f0001000000-7f0001400000 rw-p 00000000 00:00 0 [heap]
AnonHugePages:      4096 kB
";
        let base = 0x7f00_0000_0000usize;
        // name, ranges, expected bytes
        type Ranges = Vec<(usize, usize)>;
        let cases: &[(&str, Ranges, usize)] = &[
            ("one whole mapping", vec![(base, base + (8 << 20))], 6 << 20),
            // Two buffers the kernel merged into one mapping: its huge bytes once.
            (
                "two buffers in one mapping",
                vec![
                    (base, base + (4 << 20)),
                    (base + (4 << 20), base + (8 << 20)),
                ],
                6 << 20,
            ),
            // Part of a mapping: at most the overlap.
            ("a part", vec![(base, base + (2 << 20))], 2 << 20),
            (
                "a mapping not ours",
                vec![(base + (0x1000 << 20), base + (0x1001 << 20))],
                0,
            ),
            (
                "two mappings",
                vec![(base, base + (10 << 20))],
                (6 << 20) + (2 << 20),
            ),
        ];
        for (name, ranges, expected) in cases {
            assert_eq!(transparent_huge_bytes(smaps, ranges), *expected, "{name}");
        }
    }

    #[test]
    fn pages_parse_by_name_and_refuse_others() {
        assert_eq!(Pages::parse("host_pages", "huge").unwrap(), Pages::Huge);
        assert_eq!(Pages::parse("host_pages", "small").unwrap(), Pages::Small);
        let err = Pages::parse("host_pages", "large").unwrap_err().to_string();
        assert!(err.contains("host_pages") && err.contains("large"), "{err}");
    }

    #[test]
    fn pool_hands_out_each_buffer_once_and_takes_it_back() {
        for pages in [Pages::Small, Pages::Huge] {
            let pool = BufferPool::with_pages(2, HUGE_PAGE, false, pages).unwrap();
            assert_eq!(pool.pages(), pages);
            assert_eq!(pool.page_report().bytes, 2 * HUGE_PAGE);
            let a = pool.acquire().unwrap();
            let b = pool.acquire().unwrap();
            assert!(pool.acquire().is_none());
            assert_ne!(a.as_ptr(), b.as_ptr());
            drop(a);
            assert_eq!(pool.available(), 1);
            drop(b);
            assert_eq!(pool.available(), 2);
        }
    }

    #[test]
    fn empty_pool_is_a_config_error() {
        let err = BufferPool::new(0, 8192, false).err().unwrap();
        assert!(err.to_string().contains("buffer_count"), "{err}");
    }
}
