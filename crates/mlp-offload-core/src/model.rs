//! The I/O performance model (first part of the performance-model issue): pure functions from measured
//! path bandwidths and a workload to a placement plan and a predicted update-phase time. The formulas are
//! written out in `docs/model.md`.

use serde::Serialize;

use crate::error::{Error, Result};

/// What the model needs to know about one storage path.
#[derive(Debug, Clone, PartialEq)]
pub struct PathProfile {
    /// Paths with the same device id share one device's bandwidth.
    pub device_id: String,
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
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
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Placement weights, one per path, summing to 1.
    pub weights: Vec<f64>,
    /// In-flight limit per path.
    pub max_inflight: Vec<usize>,
    /// Subgroups that stay in host memory between steps and skip their read and write.
    pub cached_subgroups: usize,
    /// Storage time of one uncached subgroup with every path working in parallel.
    pub io_secs_per_subgroup: f64,
    /// All uncached subgroups' bytes over the aggregate bandwidth: no schedule can beat it.
    pub io_floor_secs: f64,
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
    let (r, w) = (
        work.read_bytes_per_subgroup as f64,
        work.write_bytes_per_subgroup as f64,
    );
    // Seconds a device needs per subgroup if it held all of it: reads and writes share the device.
    let cost = |p: &PathProfile| -> Option<f64> {
        let usable = |bw: f64, bytes: f64| bytes == 0.0 || (bw.is_finite() && bw > 0.0);
        if !usable(p.read_bytes_per_s, r) || !usable(p.write_bytes_per_s, w) {
            return None;
        }
        let part = |bytes: f64, bw: f64| if bytes == 0.0 { 0.0 } else { bytes / bw };
        Some(part(r, p.read_bytes_per_s) + part(w, p.write_bytes_per_s))
    };
    // Group paths by device: a device's share is split evenly among its paths.
    let mut devices: Vec<(String, f64, Vec<usize>)> = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        let Some(c) = cost(p) else { continue };
        match devices.iter_mut().find(|(id, _, _)| *id == p.device_id) {
            // Figures measured one path at a time each show the whole device: keep the best.
            Some((_, best, members)) => {
                *best = best.min(c);
                members.push(i);
            }
            None => devices.push((p.device_id.clone(), c, vec![i])),
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
    let cached_subgroups = (buffers - work.pipeline_buffers).min(work.subgroups);
    let uncached = (work.subgroups - cached_subgroups) as f64;
    let io_floor_secs = uncached * io_secs_per_subgroup;
    let adam = work.adam_secs_per_subgroup.max(0.0);
    // Steady state: each uncached subgroup costs the slower of its I/O and its Adam step; cached ones
    // cost their Adam step. The first read and the last write cannot overlap anything.
    let fill = if uncached > 0.0 {
        io_secs_per_subgroup
    } else {
        0.0
    };
    let predicted_update_secs =
        uncached * io_secs_per_subgroup.max(adam) + cached_subgroups as f64 * adam + fill;
    Ok(Plan {
        weights,
        max_inflight: paths.iter().map(|p| p.best_inflight.max(1)).collect(),
        cached_subgroups,
        io_secs_per_subgroup,
        io_floor_secs,
        predicted_update_secs,
    })
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
            best_inflight: 16,
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
            assert!(
                plan.predicted_update_secs >= plan.io_floor_secs,
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn prediction_takes_the_slower_of_io_and_adam_and_counts_the_cache() {
        let paths = vec![path("a", 2000.0, 2000.0)];
        let mut w = work(10, 7); // 4 cached, 6 uncached
        w.adam_secs_per_subgroup = 0.5; // slower than the 0.24 s of I/O
        let p = plan(&paths, &w).unwrap();
        assert_eq!(p.cached_subgroups, 4);
        assert!(
            (p.predicted_update_secs - (6.0 * 0.5 + 4.0 * 0.5 + 0.24)).abs() < 1e-9,
            "{p:?}"
        );
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
}
