//! The state's CRC32C checksums, cut where the store cuts its stripes: hashed a block at a time before
//! and after the block's update, or folded into the vector loop itself (VPCLMULQDQ), and combined.

use crc_fast::CrcAlgorithm::Crc32Iscsi;

#[cfg(target_arch = "x86_64")]
use super::x86;
use crate::checksum::crc32c_combine;
use crate::error::{Error, Result};

/// One contiguous byte range of the state, within one stripe, one array and one thread's range: hashed
/// as the blocks pass by.
pub(super) struct Piece {
    pub(super) start: u64,
    pub(super) end: u64,
    /// The CRC32C of its first bytes where they were folded in the SIMD loop (`Simd::Avx512Clmul`).
    folded: Option<u32>,
    /// Of the bytes after those, how many `digest` hashed.
    digested: u64,
    digest: crc_fast::Digest,
}

/// The pieces of one thread's range of the state, per array (its bytes from `starts[a]` on, `bytes[a]`
/// of them), cut at `cuts`.
pub(super) fn pieces(cuts: &[u64], starts: [usize; 3], bytes: [usize; 3]) -> [Vec<Piece>; 3] {
    std::array::from_fn(|a| {
        let (lo, hi) = (starts[a] as u64, (starts[a] + bytes[a]) as u64);
        let mut bounds: Vec<u64> = cuts.iter().copied().filter(|&c| c > lo && c < hi).collect();
        bounds.insert(0, lo);
        bounds.push(hi);
        bounds
            .windows(2)
            .filter(|w| w[1] > w[0])
            .map(|w| Piece {
                start: w[0],
                end: w[1],
                folded: None,
                digested: 0,
                digest: crc_fast::Digest::new(Crc32Iscsi),
            })
            .collect()
    })
}

/// Hashes `bytes`, the state's bytes from offset `at`, into the pieces they fall in.
pub(super) fn hash(pieces: &mut [Piece], at: u64, bytes: &[u8]) {
    let end = at + bytes.len() as u64;
    for piece in pieces.iter_mut().filter(|p| p.start < end && p.end > at) {
        let (from, to) = (piece.start.max(at), piece.end.min(end));
        piece
            .digest
            .update(&bytes[(from - at) as usize..(to - at) as usize]);
        piece.digested += to - from;
    }
}

/// Each stripe's CRC32C from the pieces (together covering every byte once): combined in order.
pub(super) fn stripe_sums(cuts: &[u64], mut pieces: Vec<(u64, u64, u32)>) -> Vec<u32> {
    pieces.sort_unstable_by_key(|p| p.0);
    let mut sums = vec![0u32; cuts.len()];
    for (start, len, crc) in pieces {
        // The stripe holding this piece: the last start at or before it.
        let s = cuts.partition_point(|&c| c <= start).saturating_sub(1);
        sums[s] = crc32c_combine(sums[s], crc, len);
    }
    sums
}

pub(super) fn check_cuts(name: &str, cuts: &[u64], total: u64) -> Result<()> {
    let ascending = cuts.windows(2).all(|w| w[0] < w[1]);
    if cuts.first() != Some(&0) || !ascending || cuts.last().is_some_and(|&c| c >= total.max(1)) {
        return Err(Error::config(
            name,
            format!("{cuts:?} must ascend from 0 within the {total} bytes of the state"),
        ));
    }
    Ok(())
}

/// A thread's checksum pieces, `(start, len, crc)`, of the state as read and as written.
pub(super) type Hashed = [Option<Vec<(u64, u64, u32)>>; 2];

/// Each piece's `(start, len, crc)`: its folded first bytes and its hashed rest, combined.
pub(super) fn finish_pieces(sums: [Option<[Vec<Piece>; 3]>; 2]) -> Hashed {
    sums.map(|pieces| {
        pieces.map(|arrays| {
            arrays
                .into_iter()
                .flatten()
                .map(|p| {
                    let crc = match p.folded {
                        Some(folded) if p.digested > 0 => {
                            crc32c_combine(folded, p.digest.finalize() as u32, p.digested)
                        }
                        Some(folded) => folded,
                        None => p.digest.finalize() as u32,
                    };
                    (p.start, p.end - p.start, crc)
                })
                .collect()
        })
    })
}

/// For each stream (direction * 3 + array) with bytes folded into its current piece that `ends` says
/// is done: the piece's folded CRC finished, the fold begun afresh for the next piece.
#[cfg(target_arch = "x86_64")]
pub(super) fn close_folds(
    sums: &mut [Option<[Vec<Piece>; 3]>; 2],
    folds: &mut x86::Folds,
    folded: &mut [u64; 6],
    current: &mut [usize; 6],
    width: usize,
    ends: impl Fn(usize, &Piece) -> bool,
) {
    for (d, arrays) in sums.iter_mut().enumerate() {
        let Some(arrays) = arrays else {
            continue;
        };
        for (a, pieces) in arrays.iter_mut().enumerate() {
            let stream = 3 * d + a;
            if folded[stream] == 0 {
                continue;
            }
            let piece = &mut pieces[current[stream]];
            if ends(a, piece) {
                piece.folded = Some(finish_fold(&folds.0[stream], width, folded[stream]));
                folds.0[stream] = [0; 8];
                folded[stream] = 0;
                current[stream] += 1;
            }
        }
    }
}

/// The CRC32C of `len` bytes from their fold begun at zero ([`x86::Folds`], its first `width` bytes).
/// The fold keeps the bytes' remainder as if the CRC began at zero; CRC32C begins at all ones, whose
/// remainder carried over `len` bytes is added back: `crc32c(fold ^ ones) ^ shift(ones, len)`, where the
/// first term is the CRC of the fold's bytes less the initial value it adds.
#[cfg(target_arch = "x86_64")]
fn finish_fold(fold: &[u64; 8], width: usize, len: u64) -> u32 {
    let mut bytes = [0u8; 64];
    for (to, word) in bytes.chunks_exact_mut(8).zip(fold) {
        to.copy_from_slice(&word.to_le_bytes());
    }
    for b in &mut bytes[..4] {
        *b ^= 0xff;
    }
    let crc = crc_fast::checksum(Crc32Iscsi, &bytes[..width]) as u32;
    // Combining with the CRC 0 of nothing-added is the shift alone.
    crc ^ crc32c_combine(0xffff_ffff, 0, len)
}
