//! `cargo bench`: read and write throughput of the object store per path for 1, 4, 16 and 64 MiB
//! objects, and, when fio is installed, the ratio to fio's best figure for the same path and block
//! size, measured interleaved in the same run (this machine's disk is shared and noisy, so figures
//! taken minutes apart are not comparable).
//!
//! Environment:
//! - `MLP_OFFLOAD_BENCH_PATHS`: storage directories separated by `:` (default `target/bench-data`).
//! - `MLP_OFFLOAD_BENCH_CHUNK` / `MLP_OFFLOAD_BENCH_INFLIGHT`: per-path limits (default 64 MiB x 16;
//!   the comparison uses chunks of min(object, chunk), the block size fio is given).
//! - `MLP_OFFLOAD_BENCH_SIZES`: object sizes, comma-separated (default `1M,4M,16M,64M`).
//! - `MLP_OFFLOAD_BENCH_CHECKSUM`: `1` (default) or `0`.
//! - `MLP_OFFLOAD_BENCH_ENGINE`: `auto` (default), `io_uring` or `threads`.
//! - `MLP_OFFLOAD_BENCH_OUT`: where the comparison JSON goes (default `target/mlp-offload-vs-fio.json`).
//! - `MLP_OFFLOAD_BENCH_QUICK=1`: skip the criterion groups, run only the fio comparison.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use mlp_offload_core::{AlignedBuf, EngineChoice, ObjectStore, PathLimits, Pending, StoreConfig};
use serde_json::json;

const MIB: usize = 1 << 20;
const DEFAULT_OBJECT_SIZES: [usize; 4] = [MIB, 4 * MIB, 16 * MIB, 64 * MIB];
/// Bytes moved per timed pass: many objects in flight at once, as in an optimizer step.
const WORKING_SET: usize = 512 * MIB;

/// How many objects of `size` a workload holds: `WORKING_SET` bytes, and never fewer objects than the
/// deepest in-flight limit, so that large objects can keep as many requests in flight as fio does.
fn object_count(size: usize) -> usize {
    (WORKING_SET / size).max(FIO_DEPTHS[FIO_DEPTHS.len() - 1])
}
/// Each side of a comparison runs for about this long.
const COMPARE_SECS: f64 = 1.0;
/// Interleaved rounds of (ours, fio) per comparison; each side's median counts.
const ROUNDS: usize = 5;
const FIO_DEPTHS: [usize; 2] = [8, 32];
const FIO_FILE: &str = "mlpo-fio-ceiling.dat";

#[derive(Clone)]
struct Settings {
    paths: Vec<PathBuf>,
    sizes: Vec<usize>,
    limits: PathLimits,
    checksum: bool,
    engine: EngineChoice,
}

fn env_size(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| parse_size(&v).unwrap_or_else(|| panic!("{name}={v:?} is not a size like 16M")))
        .unwrap_or(default)
}

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
    let scale = match unit
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    num.parse::<usize>().ok().map(|n| n * scale)
}

fn settings() -> Settings {
    let paths: Vec<PathBuf> = std::env::var("MLP_OFFLOAD_BENCH_PATHS")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/bench-data").into())
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    let paths: Vec<PathBuf> = paths
        .iter()
        .map(|p| {
            std::fs::create_dir_all(p)
                .and_then(|()| p.canonicalize())
                .unwrap_or_else(|e| panic!("MLP_OFFLOAD_BENCH_PATHS: {}: {e}", p.display()))
        })
        .collect();
    let sizes =
        std::env::var("MLP_OFFLOAD_BENCH_SIZES").map_or(DEFAULT_OBJECT_SIZES.to_vec(), |v| {
            v.split(',')
                .map(|x| {
                    parse_size(x)
                        .unwrap_or_else(|| panic!("MLP_OFFLOAD_BENCH_SIZES: {x:?} is not a size"))
                })
                .collect()
        });
    Settings {
        paths,
        sizes,
        limits: PathLimits {
            chunk_size: env_size("MLP_OFFLOAD_BENCH_CHUNK", 64 * MIB),
            max_inflight: env_size("MLP_OFFLOAD_BENCH_INFLIGHT", 16),
        },
        checksum: std::env::var("MLP_OFFLOAD_BENCH_CHECKSUM").map_or(true, |v| v != "0"),
        engine: std::env::var("MLP_OFFLOAD_BENCH_ENGINE")
            .unwrap_or_else(|_| "auto".into())
            .parse()
            .expect("MLP_OFFLOAD_BENCH_ENGINE"),
    }
}

/// Fills `buf` with xorshift64 output: incompressible, like real optimizer state and like fio's
/// buffers, so a storage back end that compresses or deduplicates cannot flatter either side.
fn fill_incompressible(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// A store over `paths` holding `object_count(object_size)` objects, with their buffers.
struct Workload {
    store: ObjectStore,
    keys: Vec<String>,
    buffers: Vec<AlignedBuf>,
}

impl Workload {
    fn new(
        s: &Settings,
        paths: &[PathBuf],
        object_size: usize,
        placement: Option<(Vec<f64>, Vec<PathLimits>)>,
        tag: &str,
    ) -> Self {
        let mut config = StoreConfig::new(paths.iter().cloned())
            .with_engine(s.engine)
            .with_limits(s.limits)
            .with_checksum(s.checksum)
            .with_rank(workload_rank());
        if let Some((weights, limits)) = placement {
            config = config.with_weights(weights).with_path_limits(limits);
        }
        let store = ObjectStore::open(config).expect("open store");
        let count = object_count(object_size);
        let keys = (0..count)
            .map(|i| format!("{tag}.{object_size}.{i}"))
            .collect();
        let buffers = (0..count)
            .map(|i| {
                let mut b = AlignedBuf::new(object_size, false).unwrap();
                fill_incompressible(b.as_mut_slice(), i as u64 + 1);
                b
            })
            .collect();
        let mut w = Workload {
            store,
            keys,
            buffers,
        };
        w.pass("write"); // creates and fills every object, so reads and rewrites are of real blocks
        w
    }

    fn bytes(&self) -> usize {
        self.buffers.iter().map(AlignedBuf::len).sum()
    }

    /// Submits `op` ("read" or "write") on every object at once and waits; returns the elapsed time.
    fn pass(&mut self, op: &str) -> Duration {
        let start = Instant::now();
        let pending: Vec<_> = std::mem::take(&mut self.buffers)
            .into_iter()
            .enumerate()
            .map(|(i, b)| self.submit(op, i, b))
            .collect();
        self.buffers = pending.into_iter().map(|p| p.wait().expect(op)).collect();
        start.elapsed()
    }

    fn submit(&self, op: &str, i: usize, buf: AlignedBuf) -> Pending<AlignedBuf> {
        let key = &self.keys[i];
        if op == "read" {
            self.store.read(key, buf).expect("submit read")
        } else {
            self.store.write(key, buf, None).expect("submit write")
        }
    }

    /// Bytes per second over about `COMPARE_SECS` of continuous streaming, as fio's time-based runs do:
    /// every object is in flight, and each is resubmitted the moment it completes.
    fn rate(&mut self, op: &str) -> f64 {
        let start = Instant::now();
        let n = self.buffers.len();
        let mut pending: VecDeque<(usize, Pending<AlignedBuf>)> = std::mem::take(&mut self.buffers)
            .into_iter()
            .enumerate()
            .map(|(i, b)| (i, self.submit(op, i, b)))
            .collect();
        let mut finished: Vec<Option<AlignedBuf>> = (0..n).map(|_| None).collect();
        let (mut bytes, mut last) = (0usize, Duration::ZERO);
        while let Some((i, p)) = pending.pop_front() {
            let buf = p.wait().expect(op);
            bytes += buf.len();
            last = start.elapsed();
            if last.as_secs_f64() < COMPARE_SECS {
                pending.push_back((i, self.submit(op, i, buf)));
            } else {
                finished[i] = Some(buf);
            }
        }
        self.buffers = finished
            .into_iter()
            .map(|b| b.expect("every buffer back"))
            .collect();
        bytes as f64 / last.as_secs_f64()
    }
}

/// A rank of its own for each workload's store: a store locks its rank directory while open, and the
/// comparison holds one workload per in-flight limit at once, so the process id alone is not enough.
fn workload_rank() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::process::id() * 100 + NEXT.fetch_add(1, Ordering::Relaxed) % 100
}

impl Drop for Workload {
    fn drop(&mut self) {
        for k in &self.keys {
            let _ = self.store.delete(k);
        }
        for dir in self.store.rank_dirs() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn criterion_groups(c: &mut Criterion, s: &Settings) {
    for path in &s.paths {
        let mut group = c.benchmark_group(format!("store {}", path.display()));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(4));
        for &size in &s.sizes {
            let mut w = Workload::new(s, std::slice::from_ref(path), size, None, "crit");
            group.throughput(Throughput::Bytes(w.bytes() as u64));
            let label = format!("{} MiB objects", size / MIB);
            group.bench_function(BenchmarkId::new("write", &label), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| w.pass("write")).sum())
            });
            group.bench_function(BenchmarkId::new("read", &label), |b| {
                b.iter_custom(|iters| (0..iters).map(|_| w.pass("read")).sum())
            });
        }
        group.finish();
    }
}

/// fio's bandwidth (bytes/s) for sequential `op` with block size `bs` and `depth` in flight in `dir`.
fn fio_rate(dir: &Path, op: &str, bs: usize, depth: usize) -> Option<f64> {
    let out = Command::new("fio")
        .args([
            "--name=ceiling",
            "--direct=1",
            "--ioengine=io_uring",
            "--numjobs=1",
            "--time_based=1",
            "--output-format=json",
        ])
        // A full path: fio ignores --directory for a --filename given before it.
        .arg(format!("--filename={}", dir.join(FIO_FILE).display()))
        // As many bytes as our workload of `bs` objects, so both sides cycle over equally large regions.
        .arg(format!("--size={}", object_count(bs) * bs))
        .arg(format!("--bs={bs}"))
        .arg(format!("--iodepth={depth}"))
        .arg(format!("--rw={op}"))
        .arg(format!("--runtime={COMPARE_SECS}"))
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v["jobs"][0][op]["bw_bytes"].as_f64()
}

fn fio_installed() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[derive(Clone, Copy, Default)]
struct Largest {
    ours: f64,
    ours_depth: usize,
    fio_depth: usize,
}

/// The index of the sample list with the highest median.
fn best_index(samples: &[Vec<f64>]) -> usize {
    (0..samples.len())
        .max_by(|&a, &b| median(samples[a].clone()).total_cmp(&median(samples[b].clone())))
        .expect("at least one depth")
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Samples of ours and fio, interleaved round by round, per in-flight limit.
#[derive(Default)]
struct Duel {
    ours: Vec<Vec<f64>>,
    fio: Vec<Vec<f64>>,
}

impl Duel {
    /// The best in-flight limit of each side, judged by its median: a shared, noisy disk makes single
    /// samples (and so best-of-N) swing by tens of percent, medians much less.
    fn best(&self) -> (f64, f64) {
        (
            median(self.ours[best_index(&self.ours)].clone()),
            median(self.fio[best_index(&self.fio)].clone()),
        )
    }
}

/// Ours and fio, interleaved and repeated; then all paths together against the sum of fio's figures.
fn compare_with_fio(s: &Settings) {
    if !fio_installed() {
        println!("fio is not installed: no ceiling comparison (apt-get install fio)");
        return;
    }
    let mib = |x: f64| x / MIB as f64;
    let mut rows = Vec::new();
    println!(
        "\nmlp-offload vs fio: medians of {ROUNDS} interleaved rounds of {COMPARE_SECS} s, best of in-flight \
         {FIO_DEPTHS:?} for each side; engine {:?}, chunk min(object, {} MiB), checksum {}",
        s.engine,
        s.limits.chunk_size / MIB,
        if s.checksum { "on" } else { "off" }
    );
    println!(
        "{:<40} {:<6} {:>8} {:>12} {:>12} {:>7}",
        "path", "op", "object", "ours MiB/s", "fio MiB/s", "ratio"
    );
    let largest = *s.sizes.iter().max().expect("at least one object size");
    // Per path and op, at the largest objects: our figure and each side's best in-flight limit.
    let mut at_largest: Vec<[Largest; 2]> = vec![[Largest::default(); 2]; s.paths.len()];
    for (pi, path) in s.paths.iter().enumerate() {
        for &size in &s.sizes {
            let mut workloads: Vec<Workload> = FIO_DEPTHS
                .iter()
                .map(|&depth| {
                    let limits = PathLimits {
                        chunk_size: s.limits.chunk_size.min(size),
                        max_inflight: depth,
                    };
                    let settings = Settings {
                        limits,
                        ..s.clone()
                    };
                    Workload::new(&settings, std::slice::from_ref(path), size, None, "cmp")
                })
                .collect();
            for (oi, op) in ["read", "write"].into_iter().enumerate() {
                let mut duel = Duel {
                    ours: vec![Vec::new(); FIO_DEPTHS.len()],
                    fio: vec![Vec::new(); FIO_DEPTHS.len()],
                };
                for _ in 0..ROUNDS {
                    for (di, (&depth, w)) in FIO_DEPTHS.iter().zip(workloads.iter_mut()).enumerate()
                    {
                        duel.ours[di].push(w.rate(op));
                        duel.fio[di].push(fio_rate(path, op, size, depth).unwrap_or(0.0));
                    }
                }
                let (ours, fio) = duel.best();
                if size == largest {
                    at_largest[pi][oi] = Largest {
                        ours,
                        ours_depth: FIO_DEPTHS[best_index(&duel.ours)],
                        fio_depth: FIO_DEPTHS[best_index(&duel.fio)],
                    };
                }
                println!(
                    "{:<40} {:<6} {:>5} MiB {:>12.0} {:>12.0} {:>7.3}",
                    path.display(),
                    op,
                    size / MIB,
                    mib(ours),
                    mib(fio),
                    ours / fio
                );
                rows.push(
                    json!({"path": path, "op": op, "object_bytes": size, "ours_bytes_per_s": ours,
                                 "fio_bytes_per_s": fio, "ratio": ours / fio,
                                 "ours_samples": duel.ours, "fio_samples": duel.fio}),
                );
            }
        }
        let _ = std::fs::remove_file(path.join(FIO_FILE));
    }
    let mut aggregate = Vec::new();
    if s.paths.len() > 1 {
        println!(
            "\nall {} paths at once, {} MiB objects striped by each path's own measured bandwidth:",
            s.paths.len(),
            largest / MIB
        );
        for (oi, op) in ["read", "write"].into_iter().enumerate() {
            // Each path gets its share by its own measured bandwidth, at its best in-flight limit, in
            // chunks small enough that a stripe makes several requests (this disk wants many).
            let weights: Vec<f64> = at_largest.iter().map(|f| f[oi].ours).collect();
            let limits: Vec<PathLimits> = at_largest
                .iter()
                .map(|f| PathLimits {
                    chunk_size: s.limits.chunk_size.min(16 * MIB),
                    max_inflight: f[oi].ours_depth,
                })
                .collect();
            let mut w = Workload::new(s, &s.paths, largest, Some((weights.clone(), limits)), "agg");
            let (mut ours, mut fio_sum) = (Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                ours.push(w.rate(op));
                // Each path at its best depth, summed: the most the paths give when used one by one.
                let sum: f64 = s
                    .paths
                    .iter()
                    .zip(&at_largest)
                    .map(|(p, f)| fio_rate(p, op, largest, f[oi].fio_depth).unwrap_or(0.0))
                    .sum();
                fio_sum.push(sum);
            }
            let (ours_m, fio_m) = (median(ours.clone()), median(fio_sum.clone()));
            println!(
                "{:<6} ours {:>8.0} MiB/s, sum of fio {:>8.0} MiB/s, ratio {:.3} (weights in MiB/s {:?})",
                op,
                mib(ours_m),
                mib(fio_m),
                ours_m / fio_m,
                weights.iter().map(|w| mib(*w).round()).collect::<Vec<_>>()
            );
            aggregate.push(json!({"op": op, "object_bytes": largest, "ours_bytes_per_s": ours_m,
                                  "fio_sum_bytes_per_s": fio_m, "ratio": ours_m / fio_m, "weights": weights,
                                  "ours_samples": ours, "fio_sum_samples": fio_sum}));
        }
        for p in &s.paths {
            let _ = std::fs::remove_file(p.join(FIO_FILE));
        }
    }
    let out = std::env::var("MLP_OFFLOAD_BENCH_OUT").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../target/mlp-offload-vs-fio.json"
        )
        .into()
    });
    let report = json!({
        "settings": {"paths": s.paths, "chunk_size": s.limits.chunk_size, "max_inflight": s.limits.max_inflight,
                     "checksum": s.checksum, "engine": format!("{:?}", s.engine), "rounds": ROUNDS,
                     "seconds_per_sample": COMPARE_SECS, "depths": FIO_DEPTHS},
        "per_path": rows,
        "aggregate": aggregate,
    });
    std::fs::write(&out, serde_json::to_vec_pretty(&report).unwrap())
        .expect("write comparison JSON");
    println!("\ncomparison written to {out}");
}

fn main() {
    let s = settings();
    println!(
        "paths: {:?}; checksum {}; chunk {} MiB x {} in flight",
        s.paths,
        if s.checksum { "on" } else { "off" },
        s.limits.chunk_size / MIB,
        s.limits.max_inflight
    );
    if std::env::var("MLP_OFFLOAD_BENCH_QUICK").as_deref() != Ok("1") {
        let mut c = Criterion::default().configure_from_args();
        criterion_groups(&mut c, &s);
        c.final_summary();
    }
    compare_with_fio(&s);
}
