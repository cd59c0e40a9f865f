//! mlp-offload's core: a virtual-tier object store over host memory and any number of storage paths,
//! moved by io_uring (or a pread/pwrite thread pool) with per-path concurrency limits. No Python here;
//! `mlp-offload-py` binds it.
//!
//! Its modules:
//! - [`store`]: the object store (paths, stripes, shadow slots, the manifest, the rank directories'
//!   locks), over [`engine`] (io_uring and a pread/pwrite pool) and [`tier`] (what a directory can do);
//! - [`admission`]: node-wide admission, the ranks of a node sharing each device's in-flight limit;
//! - [`buffer`]: page-aligned host buffers and their pool; [`completion`]: the handle a caller waits on;
//! - [`checksum`]: CRC32C of objects; [`kernel`]: the update's fused pass (Adam as DeepSpeed computes
//!   it, the conversions, the checksums folded in);
//! - [`model`]: the I/O performance model; [`accelerator_update`]: which chunks the accelerator
//!   updates, and the time that split predicts; [`probe`]: the paths' measured bandwidths;
//!   [`blockstat`]: what a block device itself saw;
//! - [`error`]: the one error type.

pub mod accelerator_update;
pub mod admission;
pub mod blockstat;
pub mod buffer;
pub mod checksum;
pub mod completion;
pub mod engine;
pub mod error;
pub mod kernel;
pub mod model;
pub mod probe;
pub mod store;
pub mod tier;

pub use buffer::{
    page_report, AlignedBuf, BufferPool, PageReport, Pages, PooledBuf, BUFFER_ALIGN, HUGE_PAGE,
};
pub use completion::Completion;
pub use engine::{EngineChoice, EngineKind, HostPtr, PathLimits, PathStats};
pub use error::{Error, Result};
pub use store::{IoBuffer, ObjectStore, PathReport, Pending, ReadCheck, StoreConfig, StripeSums};
pub use tier::{probe_dir, TierInfo};
