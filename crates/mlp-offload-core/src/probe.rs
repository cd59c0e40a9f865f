//! Measures storage paths through our own engine: each path's sequential read and write bandwidth over
//! a sweep of chunk sizes and in-flight limits, its bandwidth with reads and writes at once (the update
//! phase does both), and, for several paths, what each gives while all of them work together (two
//! directories on one device, or a shared file system, do not add up).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::buffer::AlignedBuf;
use crate::completion::Completion;
use crate::engine::{
    open_engine, EngineChoice, EngineKind, HostPtr, IoEngine, IoFile, Op, PathLimits, Transfer,
};
use crate::error::{Error, Result};
use crate::tier::{probe_dir, TierInfo};

/// Largest host buffer the probe allocates; larger measurements reuse it for successive file ranges.
const PROBE_BUFFER: usize = 64 << 20;

#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Bytes moved per measurement (the probe file's size).
    pub bytes: u64,
    pub chunk_sizes: Vec<usize>,
    pub depths: Vec<usize>,
    pub engine: EngineChoice,
    /// How long all paths run together for the concurrent measurement.
    pub together: Duration,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            bytes: 256 << 20,
            chunk_sizes: vec![1 << 20, 4 << 20, 16 << 20],
            depths: vec![4, 16],
            engine: EngineChoice::Auto,
            together: Duration::from_secs(3),
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
    /// Reads and writes at once (half each), bytes of both per second, at the best read limits.
    pub mixed_bytes_per_s: f64,
    /// Mixed reads and writes while every probed path did the same at once; `None` for a lone path.
    pub concurrent_bytes_per_s: Option<f64>,
    pub best_read: PathLimits,
    pub best_write: PathLimits,
    pub engine: EngineKind,
    pub direct_io: bool,
    pub device_id: String,
    pub device_name: String,
    pub samples: Vec<ProbeSample>,
}

/// A probe file of `bytes` real blocks in one directory, removed on drop.
struct ProbeFile {
    tier: TierInfo,
    file: Arc<IoFile>,
    bytes: u64,
}

impl ProbeFile {
    fn create(dir: &Path, opts: &ProbeOptions, buf: &mut AlignedBuf) -> Result<ProbeFile> {
        let tier = probe_dir(dir)?;
        let align = tier.alignment();
        let bytes = opts.bytes.div_ceil(align) * align;
        let path = dir.join(format!(".mlp-offload-probe-{}.tmp", std::process::id()));
        let file = Arc::new(IoFile::open(&path, tier.direct_io, true)?);
        let probe = ProbeFile { tier, file, bytes };
        // One unmeasured pass writes real blocks, so reads never hit unwritten extents (which return
        // zeros without touching the device) and writes measure overwrites, as the store does.
        let warm = open_engine(opts.engine, &dir.to_string_lossy(), PathLimits::default())?;
        run(
            &*warm,
            Op::Write,
            &probe.file,
            buf,
            probe.bytes,
            probe.tier.direct_io,
        )?;
        Ok(probe)
    }
}

impl Drop for ProbeFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.file.path);
    }
}

/// Probes every directory in turn, then, for more than one, all of them together. `progress` hears a
/// line per measurement.
pub fn probe_paths(
    dirs: &[PathBuf],
    opts: &ProbeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<PathProbe>> {
    if opts.bytes == 0 || opts.chunk_sizes.is_empty() || opts.depths.is_empty() || dirs.is_empty() {
        return Err(Error::config(
            "probe",
            "paths, bytes, chunk sizes and depths must not be empty",
        ));
    }
    let mut buf = AlignedBuf::new(PROBE_BUFFER.min(opts.bytes as usize).max(1 << 20), false)?;
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 253) as u8 | 1;
    }
    let mut files = Vec::with_capacity(dirs.len());
    let mut probes = Vec::with_capacity(dirs.len());
    for dir in dirs {
        let file = ProbeFile::create(dir, opts, &mut buf)?;
        probes.push(sweep(dir, &file, opts, &mut buf, progress)?);
        files.push(file);
    }
    if files.len() > 1 {
        let rates = together(&files, &probes, opts)?;
        for (probe, rate) in probes.iter_mut().zip(rates) {
            progress(&format!(
                "{}: mixed, all paths at once: {:.0} MiB/s",
                probe.path.display(),
                rate / (1 << 20) as f64
            ));
            probe.concurrent_bytes_per_s = Some(rate);
        }
    }
    Ok(probes)
}

/// Probes one directory alone.
pub fn probe_path(
    dir: &Path,
    opts: &ProbeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<PathProbe> {
    let mut probes = probe_paths(&[dir.to_path_buf()], opts, progress)?;
    Ok(probes.remove(0))
}

fn sweep(
    dir: &Path,
    probe_file: &ProbeFile,
    opts: &ProbeOptions,
    buf: &mut AlignedBuf,
    progress: &mut dyn FnMut(&str),
) -> Result<PathProbe> {
    let (tier, file, bytes) = (&probe_file.tier, &probe_file.file, probe_file.bytes);
    let mut engine_kind = EngineKind::Threads;
    let mut samples = Vec::new();
    for &chunk_size in &opts.chunk_sizes {
        for &depth in &opts.depths {
            let limits = PathLimits {
                chunk_size,
                max_inflight: depth,
            };
            limits.validate(tier.alignment())?;
            let engine = open_engine(opts.engine, &dir.to_string_lossy(), limits)?;
            engine_kind = engine.kind();
            for op in [Op::Write, Op::Read] {
                let secs = run(&*engine, op, file, buf, bytes, tier.direct_io)?;
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
    let engine = open_engine(opts.engine, &dir.to_string_lossy(), best_read)?;
    let mut write_buf = AlignedBuf::new(best_read.chunk_size, false)?;
    write_buf.as_mut_slice().fill(0x5a);
    let start = Instant::now();
    let moved = mixed_pass(
        &*engine,
        probe_file,
        bytes,
        buf,
        &mut write_buf,
        best_read.chunk_size,
    )?;
    let mixed = moved as f64 / start.elapsed().as_secs_f64();
    progress(&format!(
        "{}: mixed read+write: {:.0} MiB/s",
        dir.display(),
        mixed / (1 << 20) as f64
    ));
    Ok(PathProbe {
        path: dir.to_path_buf(),
        read_bytes_per_s: read_bps,
        write_bytes_per_s: write_bps,
        mixed_bytes_per_s: mixed,
        concurrent_bytes_per_s: None,
        best_read,
        best_write,
        engine: engine_kind,
        direct_io: tier.direct_io,
        device_id: tier.device_id.clone(),
        device_name: tier.device_name.clone(),
        samples,
    })
}

/// Reads the file's first half while writing its second half, chunk by chunk interleaved, so the
/// device sees both at once as in the update phase. Returns the bytes moved.
fn mixed_pass(
    engine: &dyn IoEngine,
    probe_file: &ProbeFile,
    bytes: u64,
    read_buf: &mut AlignedBuf,
    write_buf: &mut AlignedBuf,
    chunk: usize,
) -> Result<u64> {
    let (file, direct, align) = (
        &probe_file.file,
        probe_file.tier.direct_io,
        probe_file.tier.alignment(),
    );
    // Small probe files get smaller chunks, still aligned, so both halves have at least one.
    let chunk = (chunk.min(read_buf.len()).min(write_buf.len()) as u64)
        .min(bytes / 2 / align * align)
        .max(align);
    let half = bytes / 2 / chunk * chunk;
    let completion = Completion::new();
    let (read_ptr, write_ptr) = (
        HostPtr(read_buf.as_mut_ptr()),
        HostPtr(write_buf.as_mut_ptr()),
    );
    let mut offset = 0;
    while offset < half {
        for (op, ptr, at) in [
            (Op::Read, read_ptr, offset),
            (Op::Write, write_ptr, half + offset),
        ] {
            completion.add_part();
            engine.submit(Transfer {
                op,
                file: file.clone(),
                direct,
                offset: at,
                buf: ptr,
                len: chunk as usize,
                finish: None,
                completion: completion.clone(),
            });
        }
        offset += chunk;
    }
    completion.seal();
    // Both buffers are borrowed mutably for the whole wait. Reads land in one buffer over and over:
    // only the timing matters here.
    completion.wait()?;
    Ok(2 * half)
}

/// Every path runs mixed passes at once for `opts.together`; returns each path's bytes per second.
fn together(files: &[ProbeFile], probes: &[PathProbe], opts: &ProbeOptions) -> Result<Vec<f64>> {
    let deadline = Instant::now() + opts.together;
    std::thread::scope(|scope| {
        let workers: Vec<_> = files
            .iter()
            .zip(probes)
            .map(|(f, p)| {
                scope.spawn(move || -> Result<f64> {
                    let engine = open_engine(opts.engine, &p.path.to_string_lossy(), p.best_read)?;
                    let chunk = p.best_read.chunk_size;
                    let mut read_buf = AlignedBuf::new(chunk, false)?;
                    let mut write_buf = AlignedBuf::new(chunk, false)?;
                    write_buf.as_mut_slice().fill(0xa5);
                    // Passes short enough that the last one ends soon after the deadline.
                    let pass = (p.mixed_bytes_per_s * 0.25) as u64;
                    let pass = pass.max(4 * chunk as u64).min(f.bytes);
                    let start = Instant::now();
                    let mut moved = 0;
                    while Instant::now() < deadline {
                        moved +=
                            mixed_pass(&*engine, f, pass, &mut read_buf, &mut write_buf, chunk)?;
                    }
                    Ok(moved as f64 / start.elapsed().as_secs_f64())
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("probe thread panicked"))
            .collect()
    })
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
