//! CRC32C of objects, computed on threads of their own.
//!
//! Hashing costs a pass of the CPU over every byte moved: on a 2-vCPU machine CRC32C runs at about 6 to 8
//! GB/s per core (`crc-fast`, which folds with carry-less multiplication; the crc32 instruction alone gave
//! 5.8), not much faster than a disk moves the bytes. Done on the caller's thread (writes) or on a path's
//! I/O thread (reads), it delayed the next update and left the path's queue empty while it ran. So an
//! object is cut into pieces of at most [`PIECE`] bytes, each piece hashed as its own part of the
//! operation's [`Completion`] on a process-wide pool, and the pieces' CRCs are combined per stripe
//! ([`crc32c_combine`]), which gives the same value as hashing the stripe whole.

use std::sync::{Arc, Mutex, OnceLock};

use crossbeam_channel::Sender;

use crate::completion::Completion;
use crate::engine::HostPtr;

/// The CRC32C (iSCSI polynomial) of `bytes`: the store's checksum of a stripe.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// The CRC32C polynomial, reflected: bit 31 is the coefficient of x^0.
const POLY: u32 = 0x82f6_3b78;

/// a(x) b(x) mod P(x), both reflected.
const fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 0;
    while bit < 32 {
        if a & (1 << (31 - bit)) != 0 {
            product ^= b;
        }
        // b(x) x mod P(x).
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit += 1;
    }
    product
}

/// x^(2^k) mod P(x) for k in 0..64: a shift by any length below 2^61 bytes is a product of them.
const X_TO_TWO_TO_THE: [u32; 64] = {
    let mut table = [0; 64];
    // x^1.
    table[0] = 1 << 30;
    let mut k = 1;
    while k < 64 {
        table[k] = mul_mod_p(table[k - 1], table[k - 1]);
        k += 1;
    }
    table
};

/// The CRC32C of two byte sequences one after the other, from each one's CRC and the second's length:
/// `crc1` carried over `len2` bytes (times x^(8 len2) mod P, a product of at most one table entry per
/// bit of the length), plus `crc2`. The all-ones start and end of CRC32C cancel in it, as in zlib's
/// `crc32_combine`. About 0.3 µs: `crc_fast::checksum_combine` squares 64x64 bit matrices instead,
/// about 50 µs a call, which the fused pass paid several times per thread, array and stripe of every
/// chunk (serially, after the threads: on 16 threads 7.5 ms beside a pass of 1.1 ms).
pub const fn crc32c_combine(crc1: u32, crc2: u32, len2: u64) -> u32 {
    // x^0.
    let mut shift = 1 << 31;
    // len2 bytes are 8 len2 bits: the table from x^(2^3).
    let mut k = 3;
    let mut rest = len2;
    while rest != 0 {
        if rest & 1 != 0 {
            shift = mul_mod_p(X_TO_TWO_TO_THE[k], shift);
        }
        rest >>= 1;
        k += 1;
    }
    mul_mod_p(shift, crc1) ^ crc2
}

/// The largest piece one job hashes: small enough that the pool's threads share an object, large enough
/// that combining costs nothing.
pub const PIECE: usize = 4 << 20;

type Job = Box<dyn FnOnce() + Send>;

/// The process's checksum threads: `MLP_OFFLOAD_CHECKSUM_THREADS`, else one per CPU, at most 8.
fn pool() -> &'static Sender<Job> {
    static POOL: OnceLock<Sender<Job>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::env::var("MLP_OFFLOAD_CHECKSUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get().min(8)));
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("mlpo-crc-{i}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .expect("start a checksum thread");
        }
        tx
    })
}

/// One object's ranges (its stripes, as `(offset in the buffer, length)`) cut into pieces, and the
/// pieces' CRCs as the pool computes them.
pub struct PieceSums {
    ranges: Vec<(usize, usize)>,
    /// Per piece: its range's index, its offset in the buffer, its length.
    pieces: Vec<(usize, usize, usize)>,
    sums: Mutex<Vec<u32>>,
}

impl PieceSums {
    pub fn new(ranges: Vec<(usize, usize)>) -> Arc<Self> {
        let mut pieces = Vec::new();
        for (r, &(offset, len)) in ranges.iter().enumerate() {
            let mut at = 0;
            loop {
                let n = PIECE.min(len - at);
                pieces.push((r, offset + at, n));
                at += n;
                if at >= len {
                    break;
                }
            }
        }
        let sums = Mutex::new(vec![0; pieces.len()]);
        Arc::new(PieceSums {
            ranges,
            pieces,
            sums,
        })
    }

    /// Hashes every piece of `buf` on the pool, each as one more part of `completion`.
    ///
    /// # Safety
    /// `buf` must cover every range and stay valid and unwritten until `completion` is done (its
    /// keep-alive values own the memory, and the parts added here hold it open).
    pub unsafe fn hash_on_pool(self: &Arc<Self>, buf: HostPtr, completion: &Completion) {
        for k in 0..self.pieces.len() {
            completion.add_part();
            let (this, completion) = (self.clone(), completion.clone());
            let job: Job = Box::new(move || {
                // Whole-value move: a closure capturing only the field `.0` would not be `Send`.
                let buf = buf;
                let (_, offset, len) = this.pieces[k];
                // SAFETY: the caller keeps the range valid and unwritten until the completion is done,
                // which cannot happen before this part reports below.
                let bytes = unsafe { std::slice::from_raw_parts(buf.0.add(offset), len) };
                let crc = crc_fast::crc32_iscsi(bytes);
                this.sums.lock().expect("checksum lock")[k] = crc;
                completion.part_done(Ok(()));
            });
            pool()
                .send(job)
                .expect("the checksum threads live as long as the process");
        }
    }

    /// Each range's CRC32C, from its pieces' (once every piece is hashed).
    pub fn range_sums(&self) -> Vec<u32> {
        let sums = self.sums.lock().expect("checksum lock");
        let mut out: Vec<Option<u32>> = vec![None; self.ranges.len()];
        for (&(r, _, len), &crc) in self.pieces.iter().zip(sums.iter()) {
            out[r] = Some(match out[r] {
                None => crc,
                Some(before) => crc32c_combine(before, crc, len as u64),
            });
        }
        out.into_iter().map(|s| s.unwrap_or(0)).collect()
    }
}

#[cfg(test)]
mod tests {
    use crc_fast::CrcAlgorithm::Crc32Iscsi;

    use super::*;

    #[test]
    fn the_sums_are_crc32c() {
        // The check value of the CRC-32C (iSCSI) catalogue entry: stores written before keep reading.
        assert_eq!(crc_fast::crc32_iscsi(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn combining_is_the_crc_of_the_two_sequences_one_after_the_other() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 131 % 251) as u8).collect();
        // Where the first sequence ends: empty either side, a byte, a word, lines, a page and more.
        for split in [0, 1, 3, 4, 63, 64, 4095, 4096, 65_537, data.len()] {
            let (a, b) = data.split_at(split);
            let whole = crc_fast::crc32_iscsi(&data);
            let (crc1, crc2) = (crc_fast::crc32_iscsi(a), crc_fast::crc32_iscsi(b));
            assert_eq!(
                crc32c_combine(crc1, crc2, b.len() as u64),
                whole,
                "split {split}"
            );
        }
    }

    #[test]
    fn combining_agrees_with_crc_fast_at_every_length() {
        // Lengths past what can be hashed here: every bit of a 64-bit length up to 2^60, and odd ones.
        let lengths = (0..61).map(|b| 1u64 << b).chain([
            0,
            5,
            12 << 20,
            (48 << 20) + 12,
            (1 << 40) - 1,
            0x0123_4567_89ab,
        ]);
        for (i, len) in lengths.enumerate() {
            let (crc1, crc2) = (
                (i as u32).wrapping_mul(0x9e37_79b9),
                !(i as u32) ^ 0x5bd1_e995,
            );
            let expected = crc_fast::checksum_combine(Crc32Iscsi, crc1.into(), crc2.into(), len);
            assert_eq!(
                u64::from(crc32c_combine(crc1, crc2, len)),
                expected,
                "len {len}"
            );
        }
    }

    #[test]
    fn pieces_combine_to_the_whole_ranges_crc() {
        let data: Vec<u8> = (0..3 * PIECE + 12_345)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        // Ranges: empty, shorter than a piece, exactly one, several with a tail.
        let cases = [(0, 0), (7, 1000), (4096, PIECE), (1, 3 * PIECE + 12_000)];
        let sums = PieceSums::new(cases.to_vec());
        let completion = Completion::new();
        // SAFETY: `data` outlives the completion, which is waited for below.
        unsafe { sums.hash_on_pool(HostPtr(data.as_ptr() as *mut u8), &completion) };
        completion.seal();
        completion.wait().unwrap();
        let expected: Vec<u32> = cases
            .iter()
            .map(|&(o, n)| crc_fast::crc32_iscsi(&data[o..o + n]))
            .collect();
        assert_eq!(sums.range_sums(), expected);
    }
}
