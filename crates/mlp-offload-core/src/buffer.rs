//! Page-aligned host buffers owned by the runtime, and a fixed pool of them.
//!
//! O_DIRECT needs buffer addresses aligned to the device's direct-I/O memory alignment; `torch.empty` only
//! gives 64 bytes, so the runtime allocates its own memory and hands it to Python without a copy.

use std::alloc::{self, Layout};
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// The alignment of every runtime buffer: a page, which satisfies every direct-I/O alignment seen in
/// practice (512 on ext4/xfs, 4096 on Lustre and 4Kn drives).
pub const BUFFER_ALIGN: usize = 4096;

/// One page-aligned, zero-initialised allocation, optionally locked in RAM with `mlock`.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    locked: bool,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (like `Box<[u8]>`); the raw pointer is only an
// address, with no thread affinity.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes (rounded up to whole pages for the allocation) aligned to [`BUFFER_ALIGN`].
    /// With `lock`, tries `mlock`; a refusal (RLIMIT_MEMLOCK) leaves the buffer usable but unlocked.
    pub fn new(len: usize, lock: bool) -> Result<Self> {
        let alloc_len = len.max(1).div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN;
        let layout = Layout::from_size_align(alloc_len, BUFFER_ALIGN)
            .map_err(|e| Error::config("buffer_size", format!("{len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size (at least one page).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::io(
                "allocate host buffer",
                "<memory>",
                io::Error::from_raw_os_error(libc::ENOMEM),
            )
        })?;
        let mut buf = AlignedBuf {
            ptr,
            len,
            layout,
            locked: false,
        };
        if lock {
            // SAFETY: the range is the allocation we just made and own.
            let rc = unsafe { libc::mlock(buf.ptr.as_ptr().cast(), alloc_len) };
            if rc == 0 {
                buf.locked = true;
            } else {
                log::warn!(
                    "mlock of a {alloc_len}-byte host buffer failed ({}); continuing with unlocked memory \
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
        // SAFETY: `ptr` points to at least `len` initialised (zeroed at allocation) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.locked {
            // SAFETY: unlocking the range locked in `new`; failure only leaves pages locked until free.
            unsafe { libc::munlock(self.ptr.as_ptr().cast(), self.layout.size()) };
        }
        // SAFETY: allocated in `new` with exactly this layout and not freed before.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
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
}

impl BufferPool {
    pub fn new(count: usize, buffer_size: usize, lock: bool) -> Result<Self> {
        if count == 0 {
            return Err(Error::config("buffer_count", "must be at least 1"));
        }
        if buffer_size == 0 {
            return Err(Error::config("buffer_size", "must be at least 1 byte"));
        }
        let free = (0..count)
            .map(|_| AlignedBuf::new(buffer_size, lock))
            .collect::<Result<Vec<_>>>()?;
        let locked = free.iter().all(AlignedBuf::is_locked);
        Ok(BufferPool {
            inner: Arc::new(PoolInner {
                free: Mutex::new(free),
                buffer_size,
                count,
                locked,
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
    fn buffers_are_page_aligned_and_zeroed() {
        for len in [1, 511, 4096, 4097, 1 << 20] {
            let buf = AlignedBuf::new(len, true).unwrap();
            assert_eq!(buf.as_ptr() as usize % BUFFER_ALIGN, 0, "len {len}");
            assert_eq!(buf.len(), len);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn pool_hands_out_each_buffer_once_and_takes_it_back() {
        let pool = BufferPool::new(2, 8192, false).unwrap();
        let a = pool.acquire().unwrap();
        let b = pool.acquire().unwrap();
        assert!(pool.acquire().is_none());
        assert_ne!(a.as_ptr(), b.as_ptr());
        drop(a);
        assert_eq!(pool.available(), 1);
        drop(b);
        assert_eq!(pool.available(), 2);
    }

    #[test]
    fn empty_pool_is_a_config_error() {
        let err = BufferPool::new(0, 8192, false).err().unwrap();
        assert!(err.to_string().contains("buffer_count"), "{err}");
    }
}
