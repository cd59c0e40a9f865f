//! How a store is opened: its paths, rank, engine, limits, weights, checksums and shadow slots.

use std::path::PathBuf;

use crate::admission::Sharing;
use crate::engine::{EngineChoice, PathLimits};

/// How a store is opened. Every `with_*` setter documents its default.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub(super) paths: Vec<PathBuf>,
    pub(super) rank: u32,
    pub(super) engine: EngineChoice,
    pub(super) limits: Vec<PathLimits>,
    pub(super) weights: Option<Vec<f64>>,
    pub(super) checksum: bool,
    pub(super) shadow_slots: bool,
    pub(super) device_inflight: Vec<Option<u32>>,
    pub(super) device_sharing: Vec<Sharing>,
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
    ///
    /// [`ObjectStore::set_weights`]: super::ObjectStore::set_weights
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
