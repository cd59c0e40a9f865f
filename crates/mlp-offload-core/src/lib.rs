//! mlp-offload's core: a virtual-tier object store over host memory and any number of storage paths,
//! moved by io_uring (or a pread/pwrite thread pool) with per-path concurrency limits. No Python here;
//! `mlp-offload-py` binds it.

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
