//! Measures storage paths through our own engine: each path's sequential read and write bandwidth over
//! a sweep of chunk sizes and in-flight limits, its bandwidth with reads and writes at once (the update
//! phase does both), and, for several paths, what each gives while all of them work together (two
//! directories on one device, or a shared file system, do not add up). For a node of several ranks,
//! what each device gives to that many streams at once with no node-wide limit, and under one, request
//! by request and by turns, so the model can pick whether and how its ranks share it.
//!
//! Host buffers of huge pages reach a device in larger requests (see [`crate::buffer`]): the sweep runs
//! on them, each path's best settings are measured again with 4 KiB pages, and the sustained figures
//! use whichever moved more ([`crate::model::pages_choice`]). Every figure carries what the device
//! itself saw meanwhile, where it has block counters: its request sizes, merges and queue depth.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::admission::{Admitter, NodeAdmission, Sharing};
use crate::blockstat::{observe, BlockActivity};
use crate::buffer::{page_report, AlignedBuf, PageReport, Pages};
use crate::completion::Completion;
use crate::engine::{
    open_engine, EngineChoice, EngineKind, HostPtr, IoEngine, IoFile, Op, PathLimits, Transfer,
};
use crate::error::{Error, Result};
use crate::model::{pages_choice, PageRates};
use crate::tier::{probe_dir, process_tag, Locality, TierInfo};

/// Largest host buffer the probe allocates; larger measurements reuse it for successive file ranges.
const PROBE_BUFFER: usize = 64 << 20;

/// A sustained figure is the mean of this many successive windows that agree within `SETTLED`.
const SETTLE_WINDOWS: usize = 4;
const SETTLED: f64 = 0.10;
/// Sustained measurements stop after this many passes over the working set, settled or not.
const MAX_PASSES: u64 = 3;

#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Bytes moved per measurement of the sweep over chunk sizes and in-flight limits.
    pub bytes: u64,
    /// The working set of the sustained measurements (read, write, mixed, all paths at once) at the
    /// sweep's best settings: larger than the caches in front of a device, so the rates are the
    /// device's own. Each runs in windows until the rate settles.
    pub sustained_bytes: u64,
    pub chunk_sizes: Vec<usize>,
    pub depths: Vec<usize>,
    pub engine: EngineChoice,
    /// How long all paths run together for the concurrent measurement (and each way of sharing a
    /// device runs for the sharing measurement).
    pub together: Duration,
    /// Ranks of the node: above 1, how each device is best shared among them is measured.
    pub ranks: usize,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            bytes: 256 << 20,
            sustained_bytes: 2 << 30,
            chunk_sizes: vec![1 << 20, 4 << 20, 16 << 20],
            depths: vec![4, 16],
            engine: EngineChoice::Auto,
            together: Duration::from_secs(3),
            ranks: 1,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ProbeSample {
    pub op: &'static str,
    pub chunk_size: usize,
    pub max_inflight: usize,
    pub bytes_per_s: f64,
    /// What reached the device meanwhile; `None` without block counters.
    pub device: Option<BlockActivity>,
}

/// Each path's best read and write settings measured with host buffers of either page size, and the
/// pages chosen for the path's sustained figures.
#[derive(Debug, Clone, Serialize)]
pub struct PagesProbe {
    #[serde(flatten)]
    pub rates: PageRates,
    /// How the probe's huge-page buffer was backed: fragmented memory can leave it in small pages.
    pub huge_buffer: PageReport,
    pub chosen: Pages,
    /// What reached the device during each measurement, where it has block counters.
    pub small_read_device: Option<BlockActivity>,
    pub huge_read_device: Option<BlockActivity>,
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
    /// The best settings again with either page size, and the pages the sustained figures used.
    pub pages: PagesProbe,
    /// What reached the device during the sustained read, write and mixed measurements.
    pub read_device: Option<BlockActivity>,
    pub write_device: Option<BlockActivity>,
    pub mixed_device: Option<BlockActivity>,
    pub engine: EngineKind,
    pub direct_io: bool,
    pub device_id: String,
    pub device_name: String,
    pub fs_type: String,
    pub mount_source: Option<String>,
    /// A shared path's figures are one node's alone; [`probe_across_nodes`] measures its share.
    pub locality: Locality,
    pub samples: Vec<ProbeSample>,
    /// How the device serves the node's ranks at once (`ranks` above 1), the same for every path on it.
    pub sharing: Option<SharingProbe>,
}

/// What a device gives to several ranks at once under one node-wide limit of requests in flight, by
/// each way of sharing it ([`Sharing`]).
#[derive(Debug, Clone, Serialize)]
pub struct SharingProbe {
    /// Ranks stood in for: streams at once, each with its own engine and its own part of the file.
    pub streams: usize,
    /// The node-wide limit they shared: the device's best in-flight count.
    pub limit: u32,
    /// Reads and writes of all streams together, bytes per second, each with its own in-flight limit
    /// and none for the node (what the ranks do without admission).
    pub free_bytes_per_s: f64,
    /// Reads and writes of all streams together, bytes per second, each taking one request at a time.
    pub shared_bytes_per_s: f64,
    /// The same, each taking the whole limit for a turn.
    pub turns_bytes_per_s: f64,
}

/// A probe file of real blocks in one directory, removed on drop: the sweep uses its first `bytes`, the
/// sustained measurements all `sustained_bytes` of it.
struct ProbeFile {
    tier: TierInfo,
    file: Arc<IoFile>,
    bytes: u64,
    sustained_bytes: u64,
}

impl ProbeFile {
    fn create(dir: &Path, opts: &ProbeOptions, buf: &mut AlignedBuf) -> Result<ProbeFile> {
        let tier = probe_dir(dir)?;
        let align = tier.alignment();
        let bytes = opts.bytes.div_ceil(align) * align;
        let sustained_bytes = opts.sustained_bytes.div_ceil(align).max(1) * align;
        let path = dir.join(format!(".mlp-offload-probe-{}.tmp", process_tag()));
        let file = Arc::new(IoFile::open(&path, tier.direct_io, true)?);
        let probe = ProbeFile {
            tier,
            file,
            bytes,
            sustained_bytes,
        };
        // One unmeasured pass writes real blocks, so reads never hit unwritten extents (which return
        // zeros without touching the device) and writes measure overwrites, as the store does.
        let warm = open_engine(
            opts.engine,
            &dir.to_string_lossy(),
            PathLimits::default(),
            None,
        )?;
        run(
            &*warm,
            Op::Write,
            &probe.file,
            buf,
            0,
            probe.bytes.max(probe.sustained_bytes),
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
    if opts.bytes == 0
        || opts.sustained_bytes == 0
        || opts.chunk_sizes.is_empty()
        || opts.depths.is_empty()
        || dirs.is_empty()
    {
        return Err(Error::config(
            "probe",
            "paths, bytes, sustained bytes, chunk sizes and depths must not be empty",
        ));
    }
    let mut buf = probe_buffer(opts, Pages::Huge)?;
    let mut files = Vec::with_capacity(dirs.len());
    let mut probes = Vec::with_capacity(dirs.len());
    for (i, dir) in dirs.iter().enumerate() {
        let started = Instant::now();
        let file = ProbeFile::create(dir, opts, &mut buf)?;
        if i == 0 {
            // The first file's unmeasured pass is the first rate there is to tell the time by.
            let written = file.bytes.max(file.sustained_bytes) as f64;
            let rate = written / started.elapsed().as_secs_f64().max(1e-9);
            let plan = ProbePlan::of(dirs.len(), opts);
            progress(&plan.describe(dir, rate));
        }
        probes.push(sweep(dir, &file, opts, &mut buf, progress)?);
        files.push(file);
    }
    if opts.ranks > 1 {
        let mut measured: Vec<(String, SharingProbe)> = Vec::new();
        for (file, probe) in files.iter().zip(probes.iter_mut()) {
            let found = measured.iter().find(|(id, _)| *id == probe.device_id);
            let sharing = match found {
                Some((_, s)) => s.clone(),
                None => {
                    let s = sharing(file, probe, opts)?;
                    progress(&format!(
                        "{}: {} ranks at once: {:.0} MiB/s each at its own limit; under {} in flight for the node, {:.0} MiB/s request by request, {:.0} MiB/s by turns",
                        probe.path.display(),
                        s.streams,
                        s.free_bytes_per_s / (1 << 20) as f64,
                        s.limit,
                        s.shared_bytes_per_s / (1 << 20) as f64,
                        s.turns_bytes_per_s / (1 << 20) as f64
                    ));
                    measured.push((probe.device_id.clone(), s.clone()));
                    s
                }
            };
            probe.sharing = Some(sharing);
        }
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

/// What a probe of some paths does, to say beforehand how long it takes: the bytes it moves at the least
/// (every sustained figure settled as soon as it can be) and at the most (`MAX_PASSES` passes each), and
/// the time its measurements of a set length run, at the least (all paths on one device) and at the
/// most (each on its own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbePlan {
    pub bytes: (u64, u64),
    pub timed: (Duration, Duration),
}

impl ProbePlan {
    pub fn of(paths: usize, opts: &ProbeOptions) -> ProbePlan {
        let (n, sweep, working_set) = (paths as u64, opts.bytes, opts.sustained_bytes);
        let measurements = (opts.chunk_sizes.len() * opts.depths.len()) as u64;
        // The unmeasured pass, each sweep setting's write and read, and the pages' three measurements.
        let fixed = sweep.max(working_set) + measurements * 2 * sweep + 3 * sweep;
        // Each of the sustained read, write and mixed: a first pass, then the windows that settle.
        let settled = working_set + SETTLE_WINDOWS as u64 * (working_set / 8);
        let per_path = |sustained: u64| fixed + 3 * sustained;
        // The sharing measurement runs three ways on each device; all paths at once, once.
        let sharing = if opts.ranks > 1 {
            3 * opts.together
        } else {
            Duration::ZERO
        };
        let together = if n > 1 { opts.together } else { Duration::ZERO };
        ProbePlan {
            bytes: (
                n * per_path(settled),
                n * per_path(MAX_PASSES * working_set),
            ),
            timed: (sharing + together, sharing * paths as u32 + together),
        }
    }

    /// Seconds at the least and at the most, its bytes at `bytes_per_s`.
    pub fn secs_at(&self, bytes_per_s: f64) -> (f64, f64) {
        let at = |bytes: u64, timed: Duration| bytes as f64 / bytes_per_s + timed.as_secs_f64();
        (
            at(self.bytes.0, self.timed.0),
            at(self.bytes.1, self.timed.1),
        )
    }

    /// The progress line that says it, `dir` the first path, `bytes_per_s` its first rate.
    fn describe(&self, dir: &Path, bytes_per_s: f64) -> String {
        let (least, most) = self.secs_at(bytes_per_s);
        format!(
            "{}: first pass written at {:.0} MiB/s; at that rate the probe takes about {:.0}-{:.0} s ({:.1}-{:.1} GiB moved)",
            dir.display(),
            bytes_per_s / (1 << 20) as f64,
            least,
            most,
            self.bytes.0 as f64 / (1u64 << 30) as f64,
            self.bytes.1 as f64 / (1u64 << 30) as f64,
        )
    }
}

/// The probe's host buffer of `pages`, filled with a pattern (never all zeros, which some devices
/// compress or skip).
fn probe_buffer(opts: &ProbeOptions, pages: Pages) -> Result<AlignedBuf> {
    let len = PROBE_BUFFER.min(opts.bytes as usize).max(1 << 20);
    let mut buf = AlignedBuf::with_pages(len, false, pages)?;
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 253) as u8 | 1;
    }
    Ok(buf)
}

/// `bytes` per second, and `activity` in the words of a progress line: the device's request sizes,
/// merges and queue depth.
fn describe(bytes_per_s: f64, activity: Option<&BlockActivity>) -> String {
    let rate = format!("{:.0} MiB/s", bytes_per_s / (1 << 20) as f64);
    match activity {
        Some(a) if a.read_requests + a.write_requests > 0 => {
            let mut parts = Vec::new();
            if a.read_requests > 0 {
                parts.push(format!(
                    "reads of {:.0} KiB ({:.0}% merged)",
                    a.read_request_bytes / 1024.0,
                    a.read_merged * 100.0
                ));
            }
            if a.write_requests > 0 {
                parts.push(format!(
                    "writes of {:.0} KiB ({:.0}% merged)",
                    a.write_request_bytes / 1024.0,
                    a.write_merged * 100.0
                ));
            }
            format!(
                "{rate}; the device saw {}, {:.1} queued",
                parts.join(" and "),
                a.queue_depth
            )
        }
        _ => rate,
    }
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

/// One path's probe: the sweep of settings, the best again with 4 KiB pages, and the sustained figures
/// with the pages chosen.
fn sweep(
    dir: &Path,
    probe_file: &ProbeFile,
    opts: &ProbeOptions,
    buf: &mut AlignedBuf,
    progress: &mut dyn FnMut(&str),
) -> Result<PathProbe> {
    let tier = &probe_file.tier;
    let (samples, engine_kind) = sweep_settings(dir, probe_file, opts, buf, progress)?;
    let (huge_read, best_read) = best_of(&samples, "read");
    let (huge_write, best_write) = best_of(&samples, "write");
    // The best settings again with 4 KiB pages, then the sustained figures with the pages that won.
    let pages = compare_pages(
        dir,
        probe_file,
        opts,
        buf,
        (best_read, huge_read),
        (best_write, huge_write),
    )?;
    progress(&format!(
        "{}: host buffers of 4 KiB pages: read {}, write {:.0} MiB/s; of huge pages ({} of {} MiB huge): read {}, write {:.0} MiB/s: {} pages chosen",
        dir.display(),
        describe(pages.rates.small_read_bytes_per_s, pages.small_read_device.as_ref()),
        pages.rates.small_write_bytes_per_s / (1 << 20) as f64,
        pages.huge_buffer.huge_bytes() >> 20,
        pages.huge_buffer.bytes >> 20,
        describe(pages.rates.huge_read_bytes_per_s, pages.huge_read_device.as_ref()),
        pages.rates.huge_write_bytes_per_s / (1 << 20) as f64,
        pages.chosen.name(),
    ));
    let mut small_buf;
    let buf = if pages.chosen == Pages::Huge {
        buf
    } else {
        small_buf = probe_buffer(opts, Pages::Small)?;
        &mut small_buf
    };
    let mut sustained = Sustained {
        dir,
        probe_file,
        opts,
        pages: pages.chosen,
        buf,
        progress,
    };
    let (write_bps, write_device) = sustained.measure("write", best_write, Some(Op::Write))?;
    let (read_bps, read_device) = sustained.measure("read", best_read, Some(Op::Read))?;
    let (mixed, mixed_device) = sustained.measure("mixed read+write", best_read, None)?;
    Ok(PathProbe {
        path: dir.to_path_buf(),
        read_bytes_per_s: read_bps,
        write_bytes_per_s: write_bps,
        mixed_bytes_per_s: mixed,
        concurrent_bytes_per_s: None,
        best_read,
        best_write,
        pages,
        read_device,
        write_device,
        mixed_device,
        engine: engine_kind,
        direct_io: tier.direct_io,
        device_id: tier.device_id.clone(),
        device_name: tier.device_name.clone(),
        fs_type: tier.fs_type.clone(),
        mount_source: tier.mount_source.clone(),
        locality: tier.locality,
        samples,
        sharing: None,
    })
}

/// Every chunk size and depth of the options, a write then a read of the probe file at each: the
/// samples, and the engine that ran them.
fn sweep_settings(
    dir: &Path,
    probe_file: &ProbeFile,
    opts: &ProbeOptions,
    buf: &mut AlignedBuf,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<ProbeSample>, EngineKind)> {
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
            let engine = open_engine(opts.engine, &dir.to_string_lossy(), limits, None)?;
            engine_kind = engine.kind();
            for op in [Op::Write, Op::Read] {
                let (secs, device) = observe(&tier.device_id, || {
                    run(&*engine, op, file, buf, 0, bytes, tier.direct_io)
                });
                let sample = ProbeSample {
                    op: if op == Op::Read { "read" } else { "write" },
                    chunk_size,
                    max_inflight: depth,
                    bytes_per_s: bytes as f64 / secs?,
                    device,
                };
                progress(&format!(
                    "{}: {} chunk {} MiB x {} in flight: {}",
                    dir.display(),
                    sample.op,
                    chunk_size >> 20,
                    depth,
                    describe(sample.bytes_per_s, sample.device.as_ref())
                ));
                samples.push(sample);
            }
        }
    }
    Ok((samples, engine_kind))
}

/// The fastest sample of `op` ("read" or "write"): its rate and settings.
fn best_of(samples: &[ProbeSample], op: &str) -> (f64, PathLimits) {
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
}

/// The sustained figures of a path, at the best settings, over the whole working set, through host
/// buffers of the pages chosen.
struct Sustained<'a> {
    dir: &'a Path,
    probe_file: &'a ProbeFile,
    opts: &'a ProbeOptions,
    pages: Pages,
    buf: &'a mut AlignedBuf,
    progress: &'a mut dyn FnMut(&str),
}

impl Sustained<'_> {
    /// One sustained figure at `limits`: of `op`, or with `None` of reads and writes mixed.
    fn measure(
        &mut self,
        label: &str,
        limits: PathLimits,
        op: Option<Op>,
    ) -> Result<(f64, Option<BlockActivity>)> {
        let (dir, probe_file) = (self.dir, self.probe_file);
        let (tier, file) = (&probe_file.tier, &probe_file.file);
        let engine = open_engine(self.opts.engine, &dir.to_string_lossy(), limits, None)?;
        let mut write_buf = AlignedBuf::with_pages(limits.chunk_size, false, self.pages)?;
        write_buf.as_mut_slice().fill(0x5a);
        let (total, align) = (probe_file.sustained_bytes, tier.alignment());
        let buf = &mut *self.buf;
        let (rate, device) = observe(&tier.device_id, || {
            sustained(total, align, |offset, window| {
                let start = Instant::now();
                let moved = match op {
                    Some(op) => {
                        run(&*engine, op, file, buf, offset, window, tier.direct_io)?;
                        window
                    }
                    None => mixed_pass(
                        &*engine,
                        probe_file,
                        offset,
                        window,
                        buf,
                        &mut write_buf,
                        limits.chunk_size,
                    )?,
                };
                Ok((moved, start.elapsed().as_secs_f64()))
            })
        });
        let rate = rate?;
        (self.progress)(&format!(
            "{}: {label}, sustained over {} MiB: {}",
            dir.display(),
            probe_file.sustained_bytes >> 20,
            describe(rate, device.as_ref())
        ));
        Ok((rate, device))
    }
}

/// Measures the best read and write settings again with a host buffer of 4 KiB pages, beside the sweep's
/// figures on `huge` (its buffer of huge pages), and chooses the pages of the path's sustained figures.
fn compare_pages(
    dir: &Path,
    probe_file: &ProbeFile,
    opts: &ProbeOptions,
    huge: &mut AlignedBuf,
    (best_read, huge_read): (PathLimits, f64),
    (best_write, huge_write): (PathLimits, f64),
) -> Result<PagesProbe> {
    let (tier, file, bytes) = (&probe_file.tier, &probe_file.file, probe_file.bytes);
    let mut small = probe_buffer(opts, Pages::Small)?;
    let rate = |limits: PathLimits,
                op: Op,
                buf: &mut AlignedBuf|
     -> Result<(f64, Option<BlockActivity>)> {
        let engine = open_engine(opts.engine, &dir.to_string_lossy(), limits, None)?;
        let (secs, device) = observe(&tier.device_id, || {
            run(&*engine, op, file, buf, 0, bytes, tier.direct_io)
        });
        Ok((bytes as f64 / secs?, device))
    };
    let (small_write, _) = rate(best_write, Op::Write, &mut small)?;
    let (small_read, small_read_device) = rate(best_read, Op::Read, &mut small)?;
    // Read once more on huge pages, beside the small-page figure in time, for the device's view.
    let (_, huge_read_device) = rate(best_read, Op::Read, huge)?;
    let rates = PageRates {
        small_read_bytes_per_s: small_read,
        small_write_bytes_per_s: small_write,
        huge_read_bytes_per_s: huge_read,
        huge_write_bytes_per_s: huge_write,
    };
    Ok(PagesProbe {
        rates,
        huge_buffer: page_report([&*huge]),
        chosen: pages_choice(&[rates]),
        small_read_device,
        huge_read_device,
    })
}

/// Reads the first half of the file's `bytes` from `base` while writing the second half, chunk by chunk
/// interleaved, so the device sees both at once as in the update phase. Returns the bytes moved.
fn mixed_pass(
    engine: &dyn IoEngine,
    probe_file: &ProbeFile,
    base: u64,
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
            (Op::Read, read_ptr, base + offset),
            (Op::Write, write_ptr, base + half + offset),
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

/// Runs `measure(offset, window)` (bytes moved, seconds) over successive windows of the sustained working
/// set, wrapping around, until the last `SETTLE_WINDOWS` rates, all measured after a first whole pass,
/// lie within `SETTLED` of their mean (or `MAX_PASSES` passes are done); returns that mean. The first pass
/// fills whatever cache sits in front of the device; a cache larger than the working set still shows.
fn sustained(
    total: u64,
    align: u64,
    mut measure: impl FnMut(u64, u64) -> Result<(u64, f64)>,
) -> Result<f64> {
    // Windows of an eighth of the working set: enough of them in one pass to see a rate settle.
    let window = (total / 8 / align * align).max(align).min(total);
    let mut rates: Vec<f64> = Vec::new();
    let (mut moved, mut offset) = (0u64, 0u64);
    let mut first_after_pass = None;
    loop {
        let len = window.min(total - offset);
        let (bytes, secs) = measure(offset, len)?;
        if moved >= total && first_after_pass.is_none() {
            first_after_pass = Some(rates.len());
        }
        rates.push(bytes as f64 / secs.max(1e-9));
        moved += len;
        offset = if offset + len >= total {
            0
        } else {
            offset + len
        };
        let from = rates.len().saturating_sub(SETTLE_WINDOWS);
        let last = &rates[from..];
        let mean = last.iter().sum::<f64>() / last.len() as f64;
        let settled = first_after_pass.is_some_and(|first| from >= first)
            && last.len() == SETTLE_WINDOWS
            && last.iter().all(|r| (r - mean).abs() <= SETTLED * mean);
        if settled || moved >= MAX_PASSES * total {
            return Ok(mean);
        }
    }
}

/// Every path runs mixed passes at once for `opts.together`, over its whole sustained working set;
/// returns each path's bytes per second.
fn together(files: &[ProbeFile], probes: &[PathProbe], opts: &ProbeOptions) -> Result<Vec<f64>> {
    let deadline = Instant::now() + opts.together;
    std::thread::scope(|scope| {
        let workers: Vec<_> = files
            .iter()
            .zip(probes)
            .map(|(f, p)| {
                scope.spawn(move || {
                    mixed_until(
                        f,
                        opts.engine,
                        p.best_read,
                        p.pages.chosen,
                        p.mixed_bytes_per_s,
                        deadline,
                    )
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("probe thread panicked"))
            .collect()
    })
}

/// Mixed passes over the probe file's sustained working set at `limits`, on host buffers of `pages`,
/// until `deadline`; bytes per second. `expected`, the path's bytes per second as measured before, sizes
/// the passes so that the last ends soon after the deadline.
fn mixed_until(
    f: &ProbeFile,
    engine: EngineChoice,
    limits: PathLimits,
    pages: Pages,
    expected: f64,
    deadline: Instant,
) -> Result<f64> {
    let engine = open_engine(engine, &f.tier.path.to_string_lossy(), limits, None)?;
    let chunk = limits.chunk_size;
    let mut read_buf = AlignedBuf::with_pages(chunk, false, pages)?;
    let mut write_buf = AlignedBuf::with_pages(chunk, false, pages)?;
    write_buf.as_mut_slice().fill(0xa5);
    let pass = (expected * 0.25) as u64;
    // Whole chunks, so every pass starts aligned for O_DIRECT.
    let chunk_bytes = chunk as u64;
    let pass =
        (pass.max(4 * chunk_bytes).min(f.sustained_bytes) / chunk_bytes).max(1) * chunk_bytes;
    let start = Instant::now();
    let (mut moved, mut base) = (0, 0);
    while Instant::now() < deadline {
        if base + pass > f.sustained_bytes {
            base = 0;
        }
        moved += mixed_pass(
            &*engine,
            f,
            base,
            pass,
            &mut read_buf,
            &mut write_buf,
            chunk,
        )?;
        base += pass;
    }
    Ok(moved as f64 / start.elapsed().as_secs_f64())
}

/// One node's part of measuring a path that other nodes share: mixed reads and writes at `limits` on
/// buffers of `pages`, over a file of `working_bytes` in `dir`. `expected` is the path's mixed rate from
/// this node's probe. Each step is a window the nodes take together: the file is written first, then,
/// per step, `step(i)` is called (the caller's barrier across the nodes) and returns how long this node
/// measures in window `i`, or `None` to wait for the others. Returns the rate of each window this node
/// measured in (`None` for the others), for the caller to compare: alone, one node at a time, against
/// all nodes at once.
#[allow(clippy::too_many_arguments)]
pub fn probe_across_nodes(
    dir: &Path,
    engine: EngineChoice,
    limits: PathLimits,
    pages: Pages,
    expected: f64,
    working_bytes: u64,
    steps: usize,
    step: &mut dyn FnMut(usize) -> Result<Option<Duration>>,
) -> Result<Vec<Option<f64>>> {
    if working_bytes < 2 * limits.chunk_size as u64 {
        return Err(Error::config(
            "probe across nodes",
            format!(
                "needs a working set of at least two {}-byte requests, not {working_bytes} bytes",
                limits.chunk_size
            ),
        ));
    }
    let opts = ProbeOptions {
        bytes: working_bytes,
        sustained_bytes: working_bytes,
        engine,
        ..ProbeOptions::default()
    };
    let mut buf = probe_buffer(&opts, pages)?;
    let file = ProbeFile::create(dir, &opts, &mut buf)?;
    limits.validate(file.tier.alignment())?;
    (0..steps)
        .map(|i| match step(i)? {
            Some(secs) => {
                let deadline = Instant::now() + secs;
                mixed_until(&file, engine, limits, pages, expected, deadline).map(Some)
            }
            None => Ok(None),
        })
        .collect()
}

/// Most streams the sharing measurement runs: enough to show interleaving, few enough for small files.
const SHARING_STREAMS: usize = 4;

/// `min(ranks, 4)` streams at once on the path's device, each its own engine at the path's best settings
/// over its own part of the sustained working set, for `opts.together` each: with no node-wide limit,
/// then under one private node-wide limit of the best in-flight count request by request, then by turns.
fn sharing(f: &ProbeFile, p: &PathProbe, opts: &ProbeOptions) -> Result<SharingProbe> {
    let streams = opts.ranks.min(SHARING_STREAMS);
    let limits = p.best_read;
    let limit = limits.max_inflight as u32;
    let chunk = limits.chunk_size as u64;
    // Each stream's part of the file, whole chunks (so every pass starts aligned for O_DIRECT).
    let part = (f.sustained_bytes / streams as u64 / chunk).max(2) * chunk;
    let pass = ((p.mixed_bytes_per_s * 0.25 / streams as f64) as u64 / chunk)
        .clamp(2, part / chunk)
        * chunk;
    // `None`: no node-wide limit, each stream at its own.
    let measure = |way: Option<Sharing>| -> Result<f64> {
        let node = way
            .map(|way| NodeAdmission::private(limit).map(|node| (Arc::new(node), way)))
            .transpose()?;
        let start = Instant::now();
        let deadline = start + opts.together;
        let moved = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..streams as u64)
                .map(|k| {
                    let node = node.clone();
                    scope.spawn(move || -> Result<u64> {
                        let admitter = node.map(|(node, way)| {
                            Arc::new(Admitter::new(node, way, limits.chunk_size))
                        });
                        let label = p.path.to_string_lossy();
                        let engine = open_engine(opts.engine, &label, limits, admitter)?;
                        let pages = p.pages.chosen;
                        let mut read_buf = AlignedBuf::with_pages(limits.chunk_size, false, pages)?;
                        let mut write_buf =
                            AlignedBuf::with_pages(limits.chunk_size, false, pages)?;
                        write_buf.as_mut_slice().fill(0x3c);
                        let (first, mut offset, mut moved) =
                            ((k * part).min(f.sustained_bytes - part), 0, 0);
                        while Instant::now() < deadline {
                            if offset + pass > part {
                                offset = 0;
                            }
                            moved += mixed_pass(
                                &*engine,
                                f,
                                first + offset,
                                pass,
                                &mut read_buf,
                                &mut write_buf,
                                limits.chunk_size,
                            )?;
                            offset += pass;
                        }
                        Ok(moved)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("probe thread panicked"))
                .sum::<Result<u64>>()
        })?;
        Ok(moved as f64 / start.elapsed().as_secs_f64())
    };
    Ok(SharingProbe {
        streams,
        limit,
        free_bytes_per_s: measure(None)?,
        shared_bytes_per_s: measure(Some(Sharing::Shared))?,
        turns_bytes_per_s: measure(Some(Sharing::Turns))?,
    })
}

/// Moves `bytes` from `base` sequentially between the file and `buf` (reused for successive ranges) and
/// returns the seconds it took.
fn run(
    engine: &dyn IoEngine,
    op: Op,
    file: &Arc<IoFile>,
    buf: &mut AlignedBuf,
    base: u64,
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
            offset: base + offset,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Rates per window as a device with a cache in front gives them: fast until the cache is full.
    fn windows(rates: &[f64]) -> impl FnMut(u64, u64) -> Result<(u64, f64)> + '_ {
        let mut i = 0;
        move |_, len| {
            let rate = rates[i.min(rates.len() - 1)];
            i += 1;
            Ok((len, len as f64 / rate))
        }
    }

    #[test]
    fn a_probes_plan_counts_what_it_moves_and_how_long_it_runs() {
        let mib = 1u64 << 20;
        let secs = Duration::from_secs;
        let opts = ProbeOptions {
            bytes: 8 * mib,
            sustained_bytes: 64 * mib,
            chunk_sizes: vec![1 << 20, 4 << 20],
            depths: vec![4],
            together: secs(2),
            ..ProbeOptions::default()
        };
        // Per path: the unmeasured 64 MiB, 2 sweep settings x (write, read) x 8 MiB, 3 x 8 MiB for the
        // pages, then 3 sustained figures of 64 MiB + 4 windows of 8 MiB at the least, 3 x 64 MiB at most.
        let (least, most) = (
            (64 + 32 + 24 + 3 * 96) * mib,
            (64 + 32 + 24 + 3 * 192) * mib,
        );
        // name, paths, ranks, expected plan
        let cases: &[(&str, usize, usize, ProbePlan)] = &[
            (
                "one path, one rank",
                1,
                1,
                ProbePlan {
                    bytes: (least, most),
                    timed: (secs(0), secs(0)),
                },
            ),
            (
                "two paths: all at once, once",
                2,
                1,
                ProbePlan {
                    bytes: (2 * least, 2 * most),
                    timed: (secs(2), secs(2)),
                },
            ),
            (
                "two paths, 4 ranks: three ways of sharing on one device or on each",
                2,
                4,
                ProbePlan {
                    bytes: (2 * least, 2 * most),
                    timed: (secs(8), secs(14)),
                },
            ),
        ];
        for (name, paths, ranks, expected) in cases {
            let plan = ProbePlan::of(
                *paths,
                &ProbeOptions {
                    ranks: *ranks,
                    ..opts.clone()
                },
            );
            assert_eq!(plan, *expected, "{name}");
        }
        let plan = ProbePlan::of(1, &opts);
        assert_eq!(
            plan.secs_at(mib as f64),
            ((least / mib) as f64, (most / mib) as f64)
        );
    }

    #[test]
    fn a_sustained_rate_is_the_settled_one_not_the_burst() {
        let gib = 1u64 << 30;
        // name, rates per window (an eighth of the working set each), expected figure
        let cases: &[(&str, Vec<f64>, f64)] = &[
            ("steady", vec![100.0; 40], 100.0),
            (
                "a cache's burst, then the device",
                [vec![400.0; 6], vec![100.0; 34]].concat(),
                100.0,
            ),
            (
                "a burst longer than one pass",
                [vec![400.0; 10], vec![100.0; 30]].concat(),
                100.0,
            ),
            // A cache that holds the whole working set is all this can see.
            (
                "a cache larger than the working set",
                vec![400.0; 40],
                400.0,
            ),
            // Never settles: the last four windows after three passes, whatever they are.
            (
                "never settles",
                (0..40)
                    .map(|i| if i % 2 == 0 { 50.0 } else { 150.0 })
                    .collect(),
                100.0,
            ),
        ];
        for (name, rates, expected) in cases {
            let rate = sustained(2 * gib, 4096, windows(rates)).unwrap();
            assert!((rate - expected).abs() < 1e-6, "{name}: {rate}");
        }
    }

    #[test]
    fn sustained_windows_cover_the_working_set_and_wrap() {
        let mut seen = Vec::new();
        sustained(8 << 20, 4096, |offset, len| {
            seen.push((offset, len));
            Ok((len, 1.0))
        })
        .unwrap();
        // Eighths of 8 MiB, from 0, wrapping after the last; settled on four windows after the first pass.
        let expected: Vec<(u64, u64)> = (0..12).map(|i| ((i % 8) << 20, 1 << 20)).collect();
        assert_eq!(seen, expected);
    }
}
