//! The update on the accelerator (Deep Optimizer States): which chunks of a step's update stream to the
//! accelerator, updated there by the exact kernel while the host's pass updates the others, so that both
//! sides end together; and the time that split predicts. A pure function of measured rates (the formulas
//! are written out in `docs/model.md`, "The update on the accelerator").
//!
//! Where a chunk is updated changes no bit (the kernel is the host pass's, bit for bit), so the split is
//! a matter of time alone: the host pass, the accelerator's copies and kernel, and the host memory both
//! sides' traffic crosses.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The rates and sizes the split is chosen from: the step's chunks (their elements, in the order the
/// step updates them), each side's measured rate and the memory each may use.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitInputs {
    /// Each chunk's elements, in the step's order.
    pub chunk_elements: Vec<u64>,
    /// The state's bytes per element, as a chunk keeps it (12 in fp32, 10 or 6 in half precision, 8 or
    /// 4 with the master weights in the parameters): copied to the accelerator and back.
    pub state_bytes_per_element: u64,
    /// The gradient's bytes per element (its half precision): copied to the accelerator.
    pub grad_bytes_per_element: u64,
    /// The parameters' bytes per element copied to the accelerator: their half precision where the
    /// master weights are in the parameters and the partition is in host memory (the kernel reads them
    /// there), else 0.
    pub params_h2d_bytes_per_element: u64,
    /// The parameters' bytes per element copied back: their half precision where the partition is in
    /// host memory (the kernel writes the new ones on the accelerator), else 0.
    pub params_d2h_bytes_per_element: u64,
    /// The host pass's elements per second (measured, on its threads).
    pub host_elements_per_s: f64,
    /// The accelerator kernel's elements per second (measured).
    pub device_elements_per_s: f64,
    /// Host-to-device copy rate, bytes per second (from page-locked memory).
    pub h2d_bytes_per_s: f64,
    /// Device-to-host copy rate, bytes per second.
    pub d2h_bytes_per_s: f64,
    /// Chunks in flight on the accelerator at once, 0 to 2: as many slots as the memory the update may
    /// use there holds, each a chunk's state, gradient and the parameters it copies, as the caller lays
    /// a slot out. With one, a chunk's copies and kernel run one after another; two let one chunk's
    /// copies run beside another's kernel; none keeps every chunk on the host.
    pub device_slots: usize,
    /// The host's memory bandwidth both sides' traffic shares, bytes per second (0: not limiting). The
    /// host pass moves `host_bytes_per_element` per element; a chunk on the accelerator moves its state
    /// out and back, its gradient out and the parameters it copies, by DMA, through the same memory.
    pub host_memory_bytes_per_s: f64,
    /// The host pass's memory traffic per element (its reads and writes of the state, the gradient and
    /// the parameters).
    pub host_bytes_per_element: u64,
    /// The step's storage time (reads and writes of the streamed chunks, as the I/O model predicts it):
    /// a floor neither side's split moves.
    pub io_secs: f64,
}

/// The split of one step's update between the host and the accelerator.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Split {
    /// The chunks updated on the accelerator (indices into the step's order): the last ones, so that
    /// the first subgroups, which the next forward needs first, are the host's.
    pub device_chunks: Vec<usize>,
    /// Chunks in flight on the accelerator at once (0 where none fits).
    pub device_slots: usize,
    /// The host pass's time over its chunks.
    pub host_secs: f64,
    /// The accelerator's time over its chunks: copies and kernels, pipelined over its slots.
    pub device_secs: f64,
    /// Both sides' traffic over the host's memory bandwidth (0 where not limiting).
    pub memory_secs: f64,
    /// The step's update: the longest of the two sides, the memory traffic and the storage.
    pub predicted_secs: f64,
    /// The same update with every chunk on the host.
    pub host_only_secs: f64,
}

/// Chunks in flight on the accelerator at most: one's copies beside another's kernel.
const MAX_SLOTS: usize = 2;

fn usable(rate: f64) -> bool {
    rate.is_finite() && rate > 0.0
}

fn check(inputs: &SplitInputs) -> Result<()> {
    for (key, rate) in [
        ("host_elements_per_s", inputs.host_elements_per_s),
        ("device_elements_per_s", inputs.device_elements_per_s),
        ("h2d_bytes_per_s", inputs.h2d_bytes_per_s),
        ("d2h_bytes_per_s", inputs.d2h_bytes_per_s),
    ] {
        if !usable(rate) {
            return Err(Error::config(key, format!("{rate} is not a positive rate")));
        }
    }
    let memory = inputs.host_memory_bytes_per_s;
    if !(memory == 0.0 || usable(memory)) {
        return Err(Error::config(
            "host_memory_bytes_per_s",
            format!("{memory} is neither 0 (not limiting) nor a positive rate"),
        ));
    }
    if inputs.device_slots > MAX_SLOTS {
        return Err(Error::config(
            "device_slots",
            format!(
                "{} slots: at most {MAX_SLOTS} chunks are in flight there",
                inputs.device_slots
            ),
        ));
    }
    if !(inputs.io_secs.is_finite() && inputs.io_secs >= 0.0) {
        return Err(Error::config(
            "io_secs",
            format!("{} is not a time", inputs.io_secs),
        ));
    }
    Ok(())
}

/// The accelerator's time over chunks of these elements with `slots` in flight: with one, each chunk's
/// copy out, kernel and copy back one after another; with two or more, the copies of one chunk run beside
/// another's kernel (the two directions on their own copy engines), so each chunk takes its slowest stage
/// and the first copy out and the last copy back run alone.
fn device_secs(elements: &[u64], slots: usize, inputs: &SplitInputs) -> f64 {
    let stages = |n: u64| {
        let n = n as f64;
        (
            n * out_bytes(inputs) as f64 / inputs.h2d_bytes_per_s,
            n / inputs.device_elements_per_s,
            n * back_bytes(inputs) as f64 / inputs.d2h_bytes_per_s,
        )
    };
    if elements.is_empty() {
        return 0.0;
    }
    if slots == 1 {
        return elements
            .iter()
            .map(|&n| {
                let (h2d, kernel, d2h) = stages(n);
                h2d + kernel + d2h
            })
            .sum();
    }
    let steady: f64 = elements
        .iter()
        .map(|&n| {
            let (h2d, kernel, d2h) = stages(n);
            h2d.max(kernel).max(d2h)
        })
        .sum();
    let (first_h2d, _, _) = stages(elements[0]);
    let (_, _, last_d2h) = stages(elements[elements.len() - 1]);
    steady + first_h2d.min(steady) + last_d2h.min(steady)
}

/// A chunk's bytes per element copied to the accelerator: its state, its gradient and the parameters
/// the kernel reads there.
fn out_bytes(inputs: &SplitInputs) -> u64 {
    inputs.state_bytes_per_element
        + inputs.grad_bytes_per_element
        + inputs.params_h2d_bytes_per_element
}

/// A chunk's bytes per element copied back: its state and the parameters written there.
fn back_bytes(inputs: &SplitInputs) -> u64 {
    inputs.state_bytes_per_element + inputs.params_d2h_bytes_per_element
}

/// Chooses how many of the step's last chunks go to the accelerator: the count whose prediction is the
/// least (the fewest among equals: each one moved costs copies and accelerator memory for nothing), and
/// that prediction. An error names the input that is not a usable rate.
pub fn split(inputs: &SplitInputs) -> Result<Split> {
    check(inputs)?;
    let chunks = &inputs.chunk_elements;
    let slots = inputs.device_slots;
    let dma_per_element = (out_bytes(inputs) + back_bytes(inputs)) as f64;
    let evaluate = |k: usize| {
        let (host, device) = chunks.split_at(chunks.len() - k);
        let host_elements: u64 = host.iter().sum();
        let device_elements: u64 = device.iter().sum();
        let host_secs = host_elements as f64 / inputs.host_elements_per_s;
        let device_secs = device_secs(device, slots, inputs);
        let memory_secs = if inputs.host_memory_bytes_per_s > 0.0 {
            (host_elements as f64 * inputs.host_bytes_per_element as f64
                + device_elements as f64 * dma_per_element)
                / inputs.host_memory_bytes_per_s
        } else {
            0.0
        };
        let predicted = host_secs
            .max(device_secs)
            .max(memory_secs)
            .max(inputs.io_secs);
        (predicted, host_secs, device_secs, memory_secs)
    };
    let most = if slots == 0 { 0 } else { chunks.len() };
    let host_only = evaluate(0);
    let (mut best_k, mut best) = (0, host_only);
    for k in 1..=most {
        let candidate = evaluate(k);
        if candidate.0 < best.0 {
            (best_k, best) = (k, candidate);
        }
    }
    Ok(Split {
        device_chunks: (chunks.len() - best_k..chunks.len()).collect(),
        device_slots: if best_k == 0 { 0 } else { slots },
        host_secs: best.1,
        device_secs: best.2,
        memory_secs: best.3,
        predicted_secs: best.0,
        host_only_secs: host_only.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    /// 1B parameters in 64 chunks of 16 Mi elements, fp32 state, bf16 gradients, on an H100's host:
    /// the host pass at 1.8e9 elements/s, the kernel at 2e10, PCIe at 25 GB/s each way.
    fn base() -> SplitInputs {
        SplitInputs {
            chunk_elements: vec![16 * M; 64],
            state_bytes_per_element: 12,
            grad_bytes_per_element: 2,
            params_h2d_bytes_per_element: 0,
            params_d2h_bytes_per_element: 0,
            host_elements_per_s: 1.8e9,
            device_elements_per_s: 2e10,
            h2d_bytes_per_s: 25e9,
            d2h_bytes_per_s: 25e9,
            device_slots: 2,
            host_memory_bytes_per_s: 0.0,
            host_bytes_per_element: 28,
            io_secs: 0.0,
        }
    }

    fn with(change: impl FnOnce(&mut SplitInputs)) -> SplitInputs {
        let mut inputs = base();
        change(&mut inputs);
        inputs
    }

    /// name, inputs, chunks on the accelerator, slots, predicted seconds (to 1e-6), worked by hand from
    /// the formulas (`docs/model.md`).
    fn rows() -> Vec<(&'static str, SplitInputs, usize, usize, f64)> {
        let chunk = (16 * M) as f64;
        // A chunk on the host: 16 Mi elements at 1.8e9 a second, 9.32 ms.
        let host = |chunks: f64| chunks * chunk / 1.8e9;
        // On the accelerator, fp32: out 14 bytes an element (9.40 ms a chunk, the slowest stage), the
        // kernel 0.84 ms, back 12 bytes (8.05 ms).
        let out = |bytes: f64| chunk * bytes / 25e9;
        vec![
            (
                // 31 on the accelerator: 31 x 9.40 + 9.40 + 8.05 = 308.7 ms against 33 x 9.32 = 307.6.
                "the state in host memory, PCIe bound",
                base(),
                31,
                2,
                32.0 * out(14.0) + out(12.0),
            ),
            (
                "no slot: every chunk the host's",
                with(|i| i.device_slots = 0),
                0,
                0,
                host(64.0),
            ),
            (
                // One slot: copy out, kernel, copy back, one after another (18.3 ms a chunk): 21 there
                // (384 ms) against 43 on the host (401 ms); 22 would take 402 ms there.
                "one slot: serial copies",
                with(|i| i.device_slots = 1),
                21,
                1,
                host(43.0),
            ),
            (
                "storage-bound: the split cannot beat the I/O",
                with(|i| i.io_secs = 2.0),
                0,
                0,
                2.0,
            ),
            (
                // 60 GB/s of host memory for both: 28 bytes an element on the host, 26 by DMA. 48 there:
                // the memory's (16 x 28 + 48 x 26) x 16 Mi / 60e9 = 474.2 ms above their 468.4 ms; 49
                // would take 477.8 ms there.
                "host memory bandwidth shared",
                with(|i| i.host_memory_bytes_per_s = 60e9),
                48,
                2,
                (16.0 * 28.0 + 48.0 * 26.0) * chunk / 60e9,
            ),
            (
                "a slow accelerator link: none moved",
                with(|i| {
                    i.h2d_bytes_per_s = 1e8;
                    i.d2h_bytes_per_s = 1e8;
                }),
                0,
                0,
                host(64.0),
            ),
            (
                // 6 bytes of state: out 8 bytes an element (5.37 ms a chunk), back 6. 40 there: 41 x 5.37
                // + 4.03 = 224.1 ms against 24 x 9.32 = 223.7 on the host.
                "bf16 weights and moments",
                with(|i| i.state_bytes_per_element = 6),
                40,
                2,
                41.0 * out(8.0) + out(6.0),
            ),
            (
                // The master weights in bf16 parameters held in host memory (`offload_param: cpu`):
                // 4 bytes of moments, the parameters over and back, the same bytes as the row above.
                "bf16 moments, the master weights in parameters in host memory",
                with(|i| {
                    i.state_bytes_per_element = 4;
                    i.params_h2d_bytes_per_element = 2;
                    i.params_d2h_bytes_per_element = 2;
                }),
                40,
                2,
                41.0 * out(8.0) + out(6.0),
            ),
            (
                // fp32 with the parameters in host memory: back 14 bytes too (9.40 ms). 31 there:
                // 33 x 9.40 = 310.0 ms against 33 x 9.32; 30 would leave the host 34 (316.9 ms).
                "the parameters in host memory, fp32: their copy back",
                with(|i| i.params_d2h_bytes_per_element = 2),
                31,
                2,
                33.0 * out(14.0),
            ),
            (
                // One slot with the parameters' copy back: serial copies, out 14 and back 14 bytes
                // (19.6 ms a chunk); 20 there (392.6 ms) against 44 on the host (410.1 ms); 21 would
                // take 412.2 ms there.
                "one slot, the parameters' copy back",
                with(|i| {
                    i.device_slots = 1;
                    i.params_d2h_bytes_per_element = 2;
                }),
                20,
                1,
                host(44.0),
            ),
        ]
    }

    #[test]
    fn the_split_and_its_prediction() {
        for (name, inputs, device, slots, predicted) in rows() {
            let s = split(&inputs).unwrap();
            assert_eq!(s.device_chunks.len(), device, "{name}: {s:?}");
            let last = inputs.chunk_elements.len();
            assert_eq!(
                s.device_chunks,
                (last - device..last).collect::<Vec<_>>(),
                "{name}"
            );
            assert_eq!(s.device_slots, slots, "{name}");
            assert!(
                (s.predicted_secs - predicted).abs() < 1e-6,
                "{name}: predicted {} s, the row says {predicted} s",
                s.predicted_secs
            );
            assert!(s.predicted_secs <= s.host_only_secs, "{name}");
        }
    }

    #[test]
    fn a_rate_that_is_none_is_named() {
        for (key, change) in [
            (
                "device_elements_per_s",
                Box::new(|i: &mut SplitInputs| i.device_elements_per_s = 0.0)
                    as Box<dyn Fn(&mut SplitInputs)>,
            ),
            (
                "h2d_bytes_per_s",
                Box::new(|i| i.h2d_bytes_per_s = f64::NAN),
            ),
            (
                "host_memory_bytes_per_s",
                Box::new(|i| i.host_memory_bytes_per_s = -1.0),
            ),
            ("io_secs", Box::new(|i| i.io_secs = f64::INFINITY)),
            ("device_slots", Box::new(|i| i.device_slots = 3)),
        ] {
            let mut inputs = base();
            change(&mut inputs);
            let e = split(&inputs).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
