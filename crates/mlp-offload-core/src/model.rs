//! The I/O performance model (first part of the performance-model issue): pure functions from measured
//! path bandwidths and a workload to a placement plan and a predicted update-phase time. The formulas are
//! written out in `docs/model.md`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What the model needs to know about one storage path (a probe's figures).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PathProfile {
    /// Paths with the same device id share one device's bandwidth.
    pub device_id: String,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    /// Reads and writes at once on this path alone, bytes of both per second.
    #[serde(default)]
    pub mixed_bytes_per_s: Option<f64>,
    /// Mixed reads and writes while every path of the plan worked at once.
    #[serde(default)]
    pub concurrent_bytes_per_s: Option<f64>,
    /// The in-flight limit at which the path was fastest.
    pub best_inflight: usize,
}

/// One optimizer step's update phase, as the offload engine sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateWorkload {
    pub subgroups: usize,
    /// Bytes read from storage per uncached subgroup (fp32 params and both Adam moments).
    pub read_bytes_per_subgroup: u64,
    /// Bytes written back per uncached subgroup.
    pub write_bytes_per_subgroup: u64,
    /// Host memory one subgroup's state occupies while it is in a buffer.
    pub host_bytes_per_subgroup: u64,
    /// The host memory the engine may use for buffers and the cache.
    pub host_memory: u64,
    /// Buffers the pipeline needs besides the cache: one being read ahead, one being updated, one
    /// being written behind.
    pub pipeline_buffers: usize,
    /// CPU Adam time for one subgroup (measured), in seconds.
    pub adam_secs_per_subgroup: f64,
    /// Forward plus backward time of one step, when known (0 otherwise): storage can work meanwhile.
    pub fwd_bwd_secs: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Placement weights, one per path, summing to 1.
    pub weights: Vec<f64>,
    /// In-flight limit per path.
    pub max_inflight: Vec<usize>,
    /// The bandwidth (reads plus writes) each path gives in this plan, bytes/s: the starting point of
    /// [`WeightTuner`].
    pub path_bytes_per_s: Vec<f64>,
    /// Subgroups that stay in host memory between steps and skip their read and write.
    pub cached_subgroups: usize,
    /// Storage time of one uncached subgroup with every path working in parallel.
    pub io_secs_per_subgroup: f64,
    /// All uncached subgroups' bytes over the aggregate bandwidth: no schedule can beat it.
    pub io_floor_secs: f64,
    /// Of the I/O floor, what runs while forward and backward do.
    pub hidden_io_secs: f64,
    /// The update phase with reads ahead and writes behind overlapping CPU Adam.
    pub predicted_update_secs: f64,
}

/// Plans one update phase. Paths without bandwidth get weight 0; paths on one device share it.
pub fn plan(paths: &[PathProfile], work: &UpdateWorkload) -> Result<Plan> {
    if paths.is_empty() {
        return Err(Error::config(
            "paths",
            "at least one storage path is needed",
        ));
    }
    if work.subgroups == 0 {
        return Err(Error::config("subgroups", "the workload has no subgroups"));
    }
    let buffers = (work.host_memory / work.host_bytes_per_subgroup.max(1)) as usize;
    if buffers < work.pipeline_buffers.max(1) {
        return Err(Error::config(
            "host_memory",
            format!(
                "{} bytes hold {buffers} subgroup buffers of {} bytes; the pipeline needs at least {}",
                work.host_memory,
                work.host_bytes_per_subgroup,
                work.pipeline_buffers.max(1)
            ),
        ));
    }
    let (r, w_bytes) = (
        work.read_bytes_per_subgroup as f64,
        work.write_bytes_per_subgroup as f64,
    );
    let usable = |bw: f64| bw.is_finite() && bw > 0.0;
    // Figures measured with every path at once already show what shared devices give each path: then
    // every path stands alone. Otherwise paths on one device share the best figure of any of them.
    let concurrent = paths.iter().all(|p| p.concurrent_bytes_per_s.is_some());
    // Seconds a path needs per subgroup if it held all of it, reads and writes sharing it.
    let cost = |p: &PathProfile| -> Option<f64> {
        if concurrent {
            return p
                .concurrent_bytes_per_s
                .filter(|bw| usable(*bw))
                .map(|bw| (r + w_bytes) / bw);
        }
        if let Some(mixed) = p.mixed_bytes_per_s {
            return usable(mixed).then(|| (r + w_bytes) / mixed);
        }
        let needed = |bw: f64, bytes: f64| bytes == 0.0 || usable(bw);
        if !needed(p.read_bytes_per_s, r) || !needed(p.write_bytes_per_s, w_bytes) {
            return None;
        }
        let part = |bytes: f64, bw: f64| if bytes == 0.0 { 0.0 } else { bytes / bw };
        Some(part(r, p.read_bytes_per_s) + part(w_bytes, p.write_bytes_per_s))
    };
    // Group paths by device: a device's share is split evenly among its paths.
    let mut devices: Vec<(String, f64, Vec<usize>)> = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        let Some(c) = cost(p) else { continue };
        let device = if concurrent {
            format!("path {i}")
        } else {
            p.device_id.clone()
        };
        match devices.iter_mut().find(|(id, _, _)| *id == device) {
            // Figures measured one path at a time each show the whole device: keep the best.
            Some((_, best, members)) => {
                *best = best.min(c);
                members.push(i);
            }
            None => devices.push((device, c, vec![i])),
        }
    }
    if devices.is_empty() {
        return Err(Error::config(
            "paths",
            "no path has a usable read and write bandwidth",
        ));
    }
    // Minimising the slowest device's time, max_g f_g c_g with sum f_g = 1, gives f_g ∝ 1/c_g.
    let speed: f64 = devices.iter().map(|(_, c, _)| 1.0 / c).sum();
    let mut weights = vec![0.0; paths.len()];
    for (_, c, members) in &devices {
        for &i in members {
            weights[i] = (1.0 / c) / speed / members.len() as f64;
        }
    }
    let io_secs_per_subgroup = 1.0 / speed;
    // The first read of a step overlaps no write and the last write no read: each runs at the
    // one-direction bandwidth, the slowest device's stripe deciding.
    let alone = |bytes: f64, bw: fn(&PathProfile) -> f64| -> f64 {
        devices
            .iter()
            .map(|(_, c, members)| {
                let share = (1.0 / c) / speed;
                let best = members.iter().map(|&i| bw(&paths[i])).fold(0.0, f64::max);
                if usable(best) {
                    share * bytes / best
                } else {
                    // No one-direction figure: its part of the mixed cost.
                    share * c * bytes / (r + w_bytes)
                }
            })
            .fold(0.0, f64::max)
    };
    let first_read_secs = alone(r, |p| p.read_bytes_per_s);
    let last_write_secs = alone(w_bytes, |p| p.write_bytes_per_s);
    let cached_subgroups = (buffers - work.pipeline_buffers).min(work.subgroups);
    let uncached = (work.subgroups - cached_subgroups) as f64;
    let io_floor_secs = uncached * io_secs_per_subgroup;
    let adam = work.adam_secs_per_subgroup.max(0.0);
    let t = io_secs_per_subgroup;
    let n = work.subgroups as f64;
    // Storage working while forward and backward run: the previous step's last writes, at most the
    // pipeline's buffers' worth. Their buffers keep the state, so the next step also skips those
    // subgroups' reads (the same I/O time, saved rather than hidden).
    let hidden_secs = if uncached > 0.0 {
        work.fwd_bwd_secs
            .max(0.0)
            .min(work.pipeline_buffers as f64 * t)
            .min(io_floor_secs)
    } else {
        0.0
    };
    let predicted_update_secs = if uncached == 0.0 {
        n * adam
    } else if hidden_secs > 0.0 {
        // The first reads ran during backward and the last writes run into the next forward.
        (io_floor_secs - hidden_secs + adam).max(n * adam)
    } else {
        // Bound by I/O: reads of one subgroup overlap writes of another, but the first read and the
        // last write run alone, and the last update sits between its read and its write. Bound by
        // Adam: updates back to back; the first read hides behind the cached subgroups' updates as
        // far as they last, the last write behind nothing.
        let io_bound = (uncached - 1.0) * t + first_read_secs + last_write_secs + adam;
        let exposed = (first_read_secs - cached_subgroups as f64 * adam).max(0.0) + last_write_secs;
        io_bound.max(n * adam + exposed)
    };
    let path_bytes_per_s = weights
        .iter()
        .map(|w| w * (r + w_bytes) / io_secs_per_subgroup)
        .collect();
    Ok(Plan {
        path_bytes_per_s,
        weights,
        max_inflight: paths.iter().map(|p| p.best_inflight.max(1)).collect(),
        cached_subgroups,
        io_secs_per_subgroup,
        io_floor_secs,
        hidden_io_secs: hidden_secs,
        predicted_update_secs,
    })
}

/// Moves placement weights toward the bandwidth each path delivers while training runs, so a path that
/// slows down (a busy parallel file system) gets less of the next step's data.
///
/// Per path it estimates the read and the write bandwidth from the bytes moved over the time the path
/// had reads (writes) in flight, and the bandwidth of both together over the time it was busy at all.
/// The split follows the per-direction figures: they are properties of the path, whereas how much of
/// a path's reads overlap its writes depends on the schedule and on the share it was given. The
/// combined figure is what the path delivered in this schedule: what to predict step times with.
///
/// None of these depends on the share a path was given, so a new split does not feed back into the
/// next measurement and the weights do not oscillate. Estimates are smoothed exponentially
/// (`smoothing` is the weight of the newest step), and the weights move only when one of them would
/// change by more than `dead_band` (relative), so noise does not re-split objects every step.
#[derive(Debug, Clone)]
pub struct WeightTuner {
    read: Vec<f64>,
    write: Vec<f64>,
    combined: Vec<f64>,
    /// The reads' share of the bytes moved, smoothed like the rest.
    read_fraction: f64,
    weights: Vec<f64>,
    smoothing: f64,
    dead_band: f64,
}

/// What one path did during one step.
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct PathSample {
    pub read_bytes: u64,
    /// Seconds with at least one read in flight.
    pub read_busy_secs: f64,
    pub write_bytes: u64,
    pub write_busy_secs: f64,
    /// Seconds with anything in flight.
    pub busy_secs: f64,
}

impl WeightTuner {
    /// Starts from the bandwidths the plan assumed, one per path (bytes/s of reads and writes
    /// together; 0 keeps a path out), taking each path's read and write bandwidth to be the same.
    pub fn new(bytes_per_s: Vec<f64>, smoothing: f64, dead_band: f64) -> Result<Self> {
        if bytes_per_s.is_empty()
            || bytes_per_s.iter().any(|b| !b.is_finite() || *b < 0.0)
            || bytes_per_s.iter().all(|b| *b == 0.0)
        {
            return Err(Error::config(
                "bandwidths",
                format!("{bytes_per_s:?} must be finite, non-negative and not all zero"),
            ));
        }
        if !(smoothing > 0.0 && smoothing <= 1.0) {
            return Err(Error::config(
                "smoothing",
                format!("{smoothing} is not in (0, 1]"),
            ));
        }
        if !(0.0..1.0).contains(&dead_band) {
            return Err(Error::config(
                "dead_band",
                format!("{dead_band} is not in [0, 1)"),
            ));
        }
        let weights = normalise(&bytes_per_s);
        Ok(WeightTuner {
            read: bytes_per_s.clone(),
            write: bytes_per_s.clone(),
            combined: bytes_per_s,
            read_fraction: 0.5,
            weights,
            smoothing,
            dead_band,
        })
    }

    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// The smoothed bandwidth of each path with reads and writes as this schedule mixes them, bytes/s.
    pub fn estimates(&self) -> &[f64] {
        &self.combined
    }

    /// The smoothed read and write bandwidth of each path, bytes/s.
    pub fn direction_estimates(&self) -> (&[f64], &[f64]) {
        (&self.read, &self.write)
    }

    /// Folds in one step's measurements, one per path; returns the new weights when they moved. A path
    /// that moved nothing in a direction (or has weight 0) keeps that estimate.
    pub fn observe(&mut self, samples: &[PathSample]) -> Result<Option<Vec<f64>>> {
        if samples.len() != self.combined.len() {
            return Err(Error::config(
                "samples",
                format!(
                    "{} samples for {} paths",
                    samples.len(),
                    self.combined.len()
                ),
            ));
        }
        let a = self.smoothing;
        let fold = |estimate: &mut f64, bytes: u64, secs: f64| {
            if bytes > 0 && secs > 0.0 {
                *estimate += a * (bytes as f64 / secs - *estimate);
            }
        };
        for (i, sample) in samples.iter().enumerate() {
            if self.weights[i] == 0.0 {
                continue;
            }
            fold(&mut self.read[i], sample.read_bytes, sample.read_busy_secs);
            fold(
                &mut self.write[i],
                sample.write_bytes,
                sample.write_busy_secs,
            );
            fold(
                &mut self.combined[i],
                sample.read_bytes + sample.write_bytes,
                sample.busy_secs,
            );
        }
        let (read, written) = samples.iter().fold((0u64, 0u64), |(r, w), s| {
            (r + s.read_bytes, w + s.write_bytes)
        });
        if read + written > 0 {
            self.read_fraction += a * (read as f64 / (read + written) as f64 - self.read_fraction);
        }
        // Seconds per byte of this step's mix of reads and writes on each path; the split is its
        // inverse.
        let rho = self.read_fraction;
        let speed: Vec<f64> = (0..self.combined.len())
            .map(|i| {
                if self.weights[i] == 0.0 || self.read[i] <= 0.0 || self.write[i] <= 0.0 {
                    0.0
                } else {
                    1.0 / (rho / self.read[i] + (1.0 - rho) / self.write[i])
                }
            })
            .collect();
        let target = normalise(&speed);
        let moved = target
            .iter()
            .zip(&self.weights)
            .any(|(t, w)| (t - w).abs() > self.dead_band * w.max(f64::MIN_POSITIVE));
        if !moved {
            return Ok(None);
        }
        self.weights = target;
        Ok(Some(self.weights.clone()))
    }
}

fn normalise(values: &[f64]) -> Vec<f64> {
    let total: f64 = values.iter().sum();
    values.iter().map(|v| v / total).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: f64 = 1e6;

    fn path(device: &str, read_mb: f64, write_mb: f64) -> PathProfile {
        PathProfile {
            device_id: device.into(),
            read_bytes_per_s: read_mb * MB,
            write_bytes_per_s: write_mb * MB,
            mixed_bytes_per_s: None,
            concurrent_bytes_per_s: None,
            best_inflight: 16,
        }
    }

    fn measured(device: &str, mixed_mb: Option<f64>, concurrent_mb: Option<f64>) -> PathProfile {
        PathProfile {
            mixed_bytes_per_s: mixed_mb.map(|m| m * MB),
            concurrent_bytes_per_s: concurrent_mb.map(|c| c * MB),
            ..path(device, 9999.0, 9999.0)
        }
    }

    fn work(subgroups: usize, buffers: u64) -> UpdateWorkload {
        UpdateWorkload {
            subgroups,
            read_bytes_per_subgroup: 240_000_000, // 2e7 params x 12 bytes
            write_bytes_per_subgroup: 240_000_000,
            host_bytes_per_subgroup: 240_000_000,
            host_memory: buffers * 240_000_000,
            pipeline_buffers: 3,
            adam_secs_per_subgroup: 0.05,
            fwd_bwd_secs: 0.0,
        }
    }

    #[test]
    fn weights_and_times_follow_the_formulas() {
        struct Case {
            name: &'static str,
            paths: Vec<PathProfile>,
            buffers: u64,
            weights: Vec<f64>,
            cached: usize,
            io_per_subgroup: f64,
        }
        let cases = [
            Case {
                name: "one path",
                paths: vec![path("a", 2000.0, 2000.0)],
                buffers: 3,
                weights: vec![1.0],
                cached: 0,
                io_per_subgroup: 0.24,
            },
            Case {
                name: "two equal devices halve the time",
                paths: vec![path("a", 2000.0, 2000.0), path("b", 2000.0, 2000.0)],
                buffers: 3,
                weights: vec![0.5, 0.5],
                cached: 0,
                io_per_subgroup: 0.12,
            },
            Case {
                name: "a 3x faster device takes 3/4",
                paths: vec![path("a", 1500.0, 1500.0), path("b", 500.0, 500.0)],
                buffers: 5,
                weights: vec![0.75, 0.25],
                cached: 2,
                io_per_subgroup: 0.24,
            },
            Case {
                name: "two directories on one device share it",
                paths: vec![
                    path("a", 2000.0, 2000.0),
                    path("a", 2000.0, 2000.0),
                    path("b", 2000.0, 2000.0),
                ],
                buffers: 3,
                weights: vec![0.25, 0.25, 0.5],
                cached: 0,
                io_per_subgroup: 0.12,
            },
            Case {
                name: "a path without bandwidth gets nothing",
                paths: vec![path("a", 2000.0, 2000.0), path("b", 0.0, 0.0)],
                buffers: 3,
                weights: vec![1.0, 0.0],
                cached: 0,
                io_per_subgroup: 0.24,
            },
            Case {
                name: "a mixed figure replaces read and write: 480 MB at 1000 and 1000/3 MB/s",
                paths: vec![
                    measured("a", Some(1000.0), None),
                    measured("b", Some(1000.0 / 3.0), None),
                ],
                buffers: 3,
                weights: vec![0.75, 0.25],
                cached: 0,
                io_per_subgroup: 0.48 * 0.75,
            },
            Case {
                name: "figures measured together stand alone, even on one device",
                paths: vec![
                    measured("a", Some(2000.0), Some(600.0)),
                    measured("a", Some(2000.0), Some(200.0)),
                ],
                buffers: 3,
                weights: vec![0.75, 0.25],
                cached: 0,
                io_per_subgroup: 0.48 / 800.0 * 1000.0,
            },
            Case {
                name: "together figures only count when every path has one",
                paths: vec![
                    measured("a", Some(1000.0), Some(100.0)),
                    measured("b", Some(1000.0), None),
                ],
                buffers: 3,
                weights: vec![0.5, 0.5],
                cached: 0,
                io_per_subgroup: 0.24,
            },
            Case {
                name: "reads and writes at different speeds",
                paths: vec![path("a", 1000.0, 4000.0), path("b", 500.0, 500.0)],
                buffers: 3,
                // c_a = 0.24 + 0.06 = 0.30, c_b = 0.96: f ∝ 1/c.
                weights: vec![0.96 / 1.26, 0.30 / 1.26],
                cached: 0,
                io_per_subgroup: 1.0 / (1.0 / 0.30 + 1.0 / 0.96),
            },
        ];
        for c in cases {
            let plan = plan(&c.paths, &work(10, c.buffers)).unwrap();
            for (got, want) in plan.weights.iter().zip(&c.weights) {
                assert!(
                    (got - want).abs() < 1e-9,
                    "{}: weights {:?}",
                    c.name,
                    plan.weights
                );
            }
            assert!(
                (plan.weights.iter().sum::<f64>() - 1.0).abs() < 1e-9,
                "{}",
                c.name
            );
            assert_eq!(plan.cached_subgroups, c.cached, "{}", c.name);
            assert!(
                (plan.io_secs_per_subgroup - c.io_per_subgroup).abs() < 1e-9,
                "{}",
                c.name
            );
            let uncached = (10 - c.cached) as f64;
            assert!(
                (plan.io_floor_secs - uncached * c.io_per_subgroup).abs() < 1e-9,
                "{}",
                c.name
            );
            // Every uncached subgroup but one overlaps its read with another's write.
            assert!(
                plan.predicted_update_secs >= (uncached - 1.0) * c.io_per_subgroup,
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn prediction_takes_the_slower_of_io_and_adam_and_counts_the_cache() {
        let paths = vec![path("a", 2000.0, 2000.0)];
        // 10 subgroups, 7 buffers: 4 cached, 6 uncached at 0.24 s of I/O each.
        struct Case {
            name: &'static str,
            adam: f64,
            fwd_bwd: f64,
            hidden: f64,
            predicted: f64,
        }
        let cases = [
            Case {
                name: "Adam slower than I/O: Adam back to back, plus the last write (the first read hides behind the cached updates)",
                adam: 0.5,
                fwd_bwd: 0.0,
                hidden: 0.0,
                predicted: 10.0 * 0.5 + 0.12,
            },
            Case {
                name: "I/O bound: the I/O floor plus the last update",
                adam: 0.01,
                fwd_bwd: 0.0,
                hidden: 0.0,
                predicted: 6.0 * 0.24 + 0.01,
            },
            Case {
                name: "I/O bound, first read and last write at one-direction speed (the same here)",
                adam: 0.0,
                fwd_bwd: 0.0,
                hidden: 0.0,
                predicted: 5.0 * 0.24 + 0.12 + 0.12,
            },
            Case {
                name: "a short backward hides part of the I/O",
                adam: 0.01,
                fwd_bwd: 0.5,
                hidden: 0.5,
                predicted: 6.0 * 0.24 - 0.5 + 0.01,
            },
            Case {
                name: "a long backward hides at most the pipeline's three buffers",
                adam: 0.01,
                fwd_bwd: 10.0,
                hidden: 3.0 * 0.24,
                predicted: 3.0 * 0.24 + 0.01,
            },
            Case {
                name: "Adam bound with I/O in backward: nothing exposed",
                adam: 0.5,
                fwd_bwd: 10.0,
                hidden: 3.0 * 0.24,
                predicted: 10.0 * 0.5,
            },
        ];
        for c in cases {
            let mut w = work(10, 7);
            w.adam_secs_per_subgroup = c.adam;
            w.fwd_bwd_secs = c.fwd_bwd;
            let p = plan(&paths, &w).unwrap();
            assert_eq!(p.cached_subgroups, 4, "{}", c.name);
            assert!((p.io_floor_secs - 6.0 * 0.24).abs() < 1e-9, "{}", c.name);
            assert!(
                (p.hidden_io_secs - c.hidden).abs() < 1e-9,
                "{}: {p:?}",
                c.name
            );
            assert!(
                (p.predicted_update_secs - c.predicted).abs() < 1e-9,
                "{}: {p:?}",
                c.name
            );
        }
        let all_cached = plan(&paths, &work(2, 10)).unwrap();
        assert_eq!(all_cached.cached_subgroups, 2);
        assert_eq!(all_cached.io_floor_secs, 0.0);
        assert!((all_cached.predicted_update_secs - 2.0 * 0.05).abs() < 1e-9);
    }

    #[test]
    fn degenerate_inputs_are_clear_errors() {
        let one = vec![path("a", 2000.0, 2000.0)];
        let cases: Vec<(Vec<PathProfile>, UpdateWorkload, &str)> = vec![
            (vec![], work(10, 3), "paths"),
            (
                vec![path("a", 0.0, 0.0), path("b", f64::NAN, 1.0)],
                work(10, 3),
                "paths",
            ),
            (one.clone(), work(10, 2), "host_memory"),
            (one.clone(), work(0, 3), "subgroups"),
        ];
        for (paths, w, key) in cases {
            let err = plan(&paths, &w).unwrap_err();
            assert!(
                err.to_string().starts_with(&format!("{key}:")),
                "want {key}: {err}"
            );
        }
    }

    /// Each path reading and writing at `bytes_per_s`, a quarter second each, with full overlap.
    fn samples(bytes_per_s: &[f64]) -> Vec<PathSample> {
        bytes_per_s
            .iter()
            .map(|b| PathSample {
                read_bytes: (b * 0.25) as u64,
                read_busy_secs: 0.25,
                write_bytes: (b * 0.25) as u64,
                write_busy_secs: 0.25,
                busy_secs: 0.5,
            })
            .collect()
    }

    #[test]
    fn the_tuner_follows_a_slowed_path_without_oscillating() {
        struct Case {
            name: &'static str,
            start: Vec<f64>,
            /// Per step, what each path delivers.
            steps: Vec<Vec<f64>>,
            /// Steps after which the weights changed.
            moved_at: Vec<usize>,
            final_weights: Vec<f64>,
        }
        let slow_b = |n| vec![vec![1500.0, 125.0]; n];
        let cases = [
            Case {
                name: "as planned: nothing moves",
                start: vec![1500.0, 500.0],
                steps: vec![vec![1500.0, 500.0]; 6],
                moved_at: vec![],
                final_weights: vec![0.75, 0.25],
            },
            Case {
                name: "noise inside the dead band: nothing moves",
                start: vec![1500.0, 500.0],
                steps: vec![
                    vec![1530.0, 490.0],
                    vec![1470.0, 510.0],
                    vec![1520.0, 495.0],
                    vec![1480.0, 505.0],
                ],
                moved_at: vec![],
                final_weights: vec![0.75, 0.25],
            },
            Case {
                name: "path b slows to a quarter: b's weight falls monotonically toward 125/1625",
                start: vec![1500.0, 500.0],
                steps: slow_b(8),
                // The first step moves at once; later moves come while a step changes b by over 5%.
                moved_at: vec![0, 1, 2, 3, 4, 6],
                final_weights: vec![1500.0 / 1625.0, 125.0 / 1625.0],
            },
            Case {
                name: "a path planned out stays out",
                start: vec![1500.0, 0.0],
                steps: vec![vec![1200.0, 0.0]; 3],
                moved_at: vec![],
                final_weights: vec![1.0, 0.0],
            },
        ];
        for c in cases {
            let mut tuner = WeightTuner::new(c.start.clone(), 0.5, 0.05).unwrap();
            let mut moved = Vec::new();
            let mut previous_b = tuner.weights()[1];
            for (i, step) in c.steps.iter().enumerate() {
                if tuner.observe(&samples(step)).unwrap().is_some() {
                    moved.push(i);
                }
                let b = tuner.weights()[1];
                assert!(
                    b <= previous_b + 1e-12,
                    "{}: b's weight went back up",
                    c.name
                );
                previous_b = b;
            }
            assert_eq!(moved, c.moved_at, "{}", c.name);
            for (got, want) in tuner.weights().iter().zip(&c.final_weights) {
                assert!(
                    (got - want).abs() < 0.01,
                    "{}: {:?}",
                    c.name,
                    tuner.weights()
                );
            }
        }
    }

    #[test]
    fn the_split_follows_per_direction_bandwidth_not_the_overlap() {
        // Path a reads and writes twice as fast as path b, and its reads and writes also overlapped
        // more this step, so its combined bandwidth looks 3x path b's: the split stays 2:1.
        let mut tuner = WeightTuner::new(vec![1000.0, 1000.0], 1.0, 0.05).unwrap();
        let a = PathSample {
            read_bytes: 200,
            read_busy_secs: 0.1,
            write_bytes: 200,
            write_busy_secs: 0.1,
            busy_secs: 0.1,
        };
        let b = PathSample {
            read_bytes: 100,
            read_busy_secs: 0.1,
            write_bytes: 100,
            write_busy_secs: 0.1,
            busy_secs: 0.15,
        };
        let weights = tuner.observe(&[a, b]).unwrap().unwrap();
        assert!((weights[0] - 2.0 / 3.0).abs() < 1e-9, "{weights:?}");
        assert!((tuner.estimates()[0] / tuner.estimates()[1] - 3.0).abs() < 1e-9);
    }

    #[test]
    fn a_path_that_moved_nothing_keeps_its_estimate_and_bad_input_is_named() {
        let mut tuner = WeightTuner::new(vec![1000.0, 1000.0], 0.5, 0.05).unwrap();
        let idle = [
            PathSample::default(),
            PathSample {
                read_bytes: 250,
                read_busy_secs: 0.25,
                write_bytes: 250,
                write_busy_secs: 0.25,
                busy_secs: 0.5,
            },
        ];
        assert_eq!(tuner.observe(&idle).unwrap(), None);
        assert_eq!(tuner.estimates(), &[1000.0, 1000.0]);
        assert_eq!(
            tuner.direction_estimates(),
            (&[1000.0, 1000.0][..], &[1000.0, 1000.0][..])
        );
        let cases: Vec<(Result<WeightTuner>, &str)> = vec![
            (WeightTuner::new(vec![], 0.5, 0.05), "bandwidths"),
            (WeightTuner::new(vec![0.0, 0.0], 0.5, 0.05), "bandwidths"),
            (
                WeightTuner::new(vec![1.0, f64::NAN], 0.5, 0.05),
                "bandwidths",
            ),
            (WeightTuner::new(vec![1.0], 0.0, 0.05), "smoothing"),
            (WeightTuner::new(vec![1.0], 0.5, 1.0), "dead_band"),
        ];
        for (result, key) in cases {
            let err = result.unwrap_err();
            assert!(err.to_string().starts_with(&format!("{key}:")), "{err}");
        }
        let err = tuner.observe(&idle[..1]).unwrap_err();
        assert!(err.to_string().starts_with("samples:"), "{err}");
    }

    #[test]
    fn the_plan_gives_each_path_its_bandwidth() {
        let p = plan(
            &[path("a", 1500.0, 1500.0), path("b", 500.0, 500.0)],
            &work(10, 3),
        )
        .unwrap();
        // 480 MB per subgroup in 0.24 s: 2000 MB/s, three quarters on a.
        assert!((p.path_bytes_per_s[0] - 1500.0 * MB).abs() < 1.0, "{p:?}");
        assert!((p.path_bytes_per_s[1] - 500.0 * MB).abs() < 1.0, "{p:?}");
    }
}
