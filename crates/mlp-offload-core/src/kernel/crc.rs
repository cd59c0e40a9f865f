//! The state's CRC32C checksums, cut where the store cuts its stripes: hashed a block at a time before
//! and after the block's update, or folded into the vector loop itself (VPCLMULQDQ), and combined.

use crc_fast::CrcAlgorithm::Crc32Iscsi;

#[cfg(target_arch = "x86_64")]
use super::adam::{AdamConstants, TailFma};
#[cfg(target_arch = "x86_64")]
use super::dispatch::Simd;
use super::elem::Elem;
#[cfg(target_arch = "x86_64")]
use super::pass::{keep_block, run_block, KeptParams, BLOCK};
use super::pass::{Hashed, Part};
#[cfg(target_arch = "x86_64")]
use super::x86;
use crate::checksum::crc32c_combine;
use crate::error::{Error, Result};

/// One contiguous byte range of the state, within one stripe, one array and one thread's range: hashed
/// as the blocks pass by.
pub(super) struct Piece {
    start: u64,
    end: u64,
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
fn hash(pieces: &mut [Piece], at: u64, bytes: &[u8]) {
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

/// The elements of a part where a piece of some array begins or ends, for [`run_part_folding`]: each a
/// whole number of vectors of `lanes` from the part's first element where the vectors reach (below
/// `vector` rounded down to `lanes`), or `None` where one is not, or where nothing is summed.
#[cfg(target_arch = "x86_64")]
pub(super) fn fold_splits<G: Elem, P: Elem>(
    part: &Part<'_, G, P>,
    lanes: usize,
) -> Option<Vec<usize>> {
    if part.sums.iter().all(Option::is_none) {
        return None;
    }
    let folded = part.vector / lanes * lanes;
    let mut splits = Vec::new();
    for arrays in part.sums.iter().flatten() {
        for (a, pieces) in arrays.iter().enumerate() {
            for piece in pieces {
                for edge in [piece.start, piece.end] {
                    let from_first = edge - part.offsets[a] as u64;
                    if from_first >= 4 * folded as u64 {
                        continue;
                    }
                    if !from_first.is_multiple_of(4 * lanes as u64) {
                        return None;
                    }
                    splits.push(from_first as usize / 4);
                }
            }
        }
    }
    splits.retain(|&e| e > 0);
    splits.sort_unstable();
    splits.dedup();
    Some(splits)
}

/// [`run_part`] with the checksums folded into the SIMD loop (`Simd::Avx512Clmul`, `Simd::Avx2Clmul`):
/// the vector elements in stretches cut at `splits`, each piece's fold finished where it ends; the
/// scalar tail (the part's last elements) hashed block-wise as in `run_part`.
#[cfg(target_arch = "x86_64")]
pub(super) fn run_part_folding<G: Elem, P: Elem>(
    mut part: Part<'_, G, P>,
    splits: Vec<usize>,
    grad_scale: f32,
    k: &AdamConstants,
    tail: TailFma,
    simd: Simd,
) -> (Hashed, Option<Vec<KeptParams>>) {
    let len = part.g.len();
    let lanes = simd.lanes();
    // The bytes of one fold: one vector of fp32 lanes.
    let width = 4 * lanes;
    let folded_end = part.vector / lanes * lanes;
    let mut folds = x86::Folds::default();
    // Per stream (direction * 3 + array): bytes folded since its piece began, and that piece's index.
    let mut folded = [0u64; 6];
    let mut current = [0usize; 6];
    let mut splits = splits.into_iter().peekable();
    for b0 in (0..len).step_by(BLOCK) {
        let b1 = (b0 + BLOCK).min(len);
        keep_block(&mut part, b0, b1, simd);
        let simd_end = folded_end.clamp(b0, b1);
        let mut s0 = b0;
        while s0 < simd_end {
            let s1 = match splits.peek() {
                Some(&cut) if cut < simd_end => {
                    splits.next();
                    cut
                }
                _ => simd_end,
            };
            let at = part.lanes(s0, s1);
            // SAFETY: `Simd::parse`/`detect` give these only where the CPU has the instructions (AVX-512F
            // or AVX2, FMA and F16C; VPCLMULQDQ); the slices are distinct, `s1 - s0` a multiple of the
            // lanes (`fold_splits`).
            unsafe {
                if simd == Simd::Avx512Clmul {
                    x86::avx512_folding(&at, grad_scale, k, &mut folds)
                } else {
                    x86::avx2_folding(&at, grad_scale, k, &mut folds)
                }
            };
            for bytes in &mut folded {
                *bytes += 4 * (s1 - s0) as u64;
            }
            let offsets = part.offsets;
            let at_s1 = |a: usize, piece: &Piece| piece.end == (offsets[a] + 4 * s1) as u64;
            close_folds(
                &mut part.sums,
                &mut folds,
                &mut folded,
                &mut current,
                width,
                at_s1,
            );
            s0 = s1;
        }
        if simd_end < b1 {
            hash_block(&mut part, 0, simd_end, b1);
            run_block(&mut part, simd_end, b1, grad_scale, k, tail, Simd::Scalar);
            hash_block(&mut part, 1, simd_end, b1);
        }
    }
    // Pieces whose last bytes were hashed, not folded: their folded start.
    close_folds(
        &mut part.sums,
        &mut folds,
        &mut folded,
        &mut current,
        width,
        |_, _| true,
    );
    (finish_pieces(part.sums), part.kept)
}

/// For each stream (direction * 3 + array) with bytes folded into its current piece that `ends` says
/// is done: the piece's folded CRC finished, the fold begun afresh for the next piece.
#[cfg(target_arch = "x86_64")]
fn close_folds(
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

/// Hashes elements `b0..b1` of the part's state into its pieces of direction `d` (0 read, 1 written).
pub(super) fn hash_block<G: Elem, P: Elem>(
    part: &mut Part<'_, G, P>,
    d: usize,
    b0: usize,
    b1: usize,
) {
    if let Some(pieces) = &mut part.sums[d] {
        for (a, x) in [&part.p, &part.m, &part.v].into_iter().enumerate() {
            hash(
                &mut pieces[a],
                (part.offsets[a] + part.sizes[a] * b0) as u64,
                x.bytes(b0, b1),
            );
        }
    }
}
