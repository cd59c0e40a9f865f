//! Measures a storage path's sequential read and write bandwidth through our own engine, over a sweep of
//! chunk sizes and in-flight limits, and keeps the best of each.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::buffer::AlignedBuf;
use crate::completion::Completion;
use crate::engine::{
    open_engine, EngineChoice, EngineKind, HostPtr, IoEngine, IoFile, Op, PathLimits, Transfer,
};
use crate::error::{Error, Result};
use crate::tier::probe_dir;

/// Largest host buffer the probe allocates; larger measurements reuse it for successive file ranges.
const PROBE_BUFFER: usize = 64 << 20;

#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Bytes moved per measurement (the probe file's size).
    pub bytes: u64,
    pub chunk_sizes: Vec<usize>,
    pub depths: Vec<usize>,
    pub engine: EngineChoice,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            bytes: 512 << 20,
            chunk_sizes: vec![1 << 20, 4 << 20, 16 << 20],
            depths: vec![4, 16],
            engine: EngineChoice::Auto,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ProbeSample {
    pub op: &'static str,
    pub chunk_size: usize,
    pub max_inflight: usize,
    pub bytes_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PathProbe {
    pub path: PathBuf,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    pub best_read: PathLimits,
    pub best_write: PathLimits,
    pub engine: EngineKind,
    pub direct_io: bool,
    pub device_id: String,
    pub device_name: String,
    pub samples: Vec<ProbeSample>,
}

/// Probes one directory. `progress` hears a line per measurement.
pub fn probe_path(
    dir: &Path,
    opts: &ProbeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<PathProbe> {
    if opts.bytes == 0 || opts.chunk_sizes.is_empty() || opts.depths.is_empty() {
        return Err(Error::config(
            "probe",
            "bytes, chunk sizes and depths must not be empty",
        ));
    }
    let tier = probe_dir(dir)?;
    let align = tier.alignment();
    let bytes = opts.bytes.div_ceil(align) * align;
    let path = dir.join(format!(".mlp-offload-probe-{}.tmp", std::process::id()));
    let result = (|| {
        let file = Arc::new(IoFile::open(&path, tier.direct_io, true)?);
        let mut buf = AlignedBuf::new(PROBE_BUFFER.min(bytes as usize), false)?;
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8 | 1;
        }
        let mut engine_kind = EngineKind::Threads;
        let mut samples = Vec::new();
        // One unmeasured pass writes real blocks, so reads never hit unwritten extents (which return
        // zeros without touching the device) and writes measure overwrites, as the store does.
        let warm = open_engine(opts.engine, &dir.to_string_lossy(), PathLimits::default())?;
        run(&*warm, Op::Write, &file, &mut buf, bytes, tier.direct_io)?;
        drop(warm);
        for &chunk_size in &opts.chunk_sizes {
            for &depth in &opts.depths {
                let limits = PathLimits {
                    chunk_size,
                    max_inflight: depth,
                };
                limits.validate(align)?;
                let engine = open_engine(opts.engine, &dir.to_string_lossy(), limits)?;
                engine_kind = engine.kind();
                for op in [Op::Write, Op::Read] {
                    let secs = run(&*engine, op, &file, &mut buf, bytes, tier.direct_io)?;
                    let sample = ProbeSample {
                        op: if op == Op::Read { "read" } else { "write" },
                        chunk_size,
                        max_inflight: depth,
                        bytes_per_s: bytes as f64 / secs,
                    };
                    progress(&format!(
                        "{}: {} chunk {} MiB x {} in flight: {:.0} MiB/s",
                        dir.display(),
                        sample.op,
                        chunk_size >> 20,
                        depth,
                        sample.bytes_per_s / (1 << 20) as f64
                    ));
                    samples.push(sample);
                }
            }
        }
        let best = |op: &str| {
            samples
                .iter()
                .filter(|s| s.op == op)
                .max_by(|a, b| a.bytes_per_s.total_cmp(&b.bytes_per_s))
                .map(|s| {
                    (
                        s.bytes_per_s,
                        PathLimits {
                            chunk_size: s.chunk_size,
                            max_inflight: s.max_inflight,
                        },
                    )
                })
                .expect("at least one sample per op")
        };
        let (read_bps, best_read) = best("read");
        let (write_bps, best_write) = best("write");
        Ok(PathProbe {
            path: dir.to_path_buf(),
            read_bytes_per_s: read_bps,
            write_bytes_per_s: write_bps,
            best_read,
            best_write,
            engine: engine_kind,
            direct_io: tier.direct_io,
            device_id: tier.device_id.clone(),
            device_name: tier.device_name.clone(),
            samples,
        })
    })();
    let _ = fs::remove_file(&path);
    result
}

/// Moves `bytes` sequentially between the file and `buf` (reused for successive ranges) and returns the
/// seconds it took.
fn run(
    engine: &dyn IoEngine,
    op: Op,
    file: &Arc<IoFile>,
    buf: &mut AlignedBuf,
    bytes: u64,
    direct: bool,
) -> Result<f64> {
    let completion = Completion::new();
    let ptr = HostPtr(buf.as_mut_ptr());
    let start = Instant::now();
    let mut offset = 0u64;
    while offset < bytes {
        let len = (bytes - offset).min(buf.len() as u64) as usize;
        completion.add_part();
        engine.submit(Transfer {
            op,
            file: file.clone(),
            direct,
            offset,
            buf: ptr,
            len,
            finish: None,
            completion: completion.clone(),
        });
        offset += len as u64;
    }
    completion.seal();
    // `buf` is borrowed mutably for the whole wait, so nothing else can touch or free it meanwhile.
    completion.wait()?;
    Ok(start.elapsed().as_secs_f64())
}
