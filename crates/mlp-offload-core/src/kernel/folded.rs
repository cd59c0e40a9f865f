//! A thread's range with the state's checksums folded into the SIMD loop itself (`Simd::Avx512Clmul`,
//! `Simd::Avx2Clmul`): each vector of the state folded into its stream's running CRC in the register it
//! was loaded into or stored from, the stretches cut where a checksum's piece begins or ends.

use super::adam::{AdamConstants, TailFma};
use super::crc::{close_folds, finish_pieces, Hashed, Piece};
use super::dispatch::Simd;
use super::elem::Elem;
use super::part::{hash_block, keep_block, run_block, KeptParams, Part, BLOCK};
use super::x86;

/// The elements of a part where a piece of some array begins or ends, for [`run_part_folding`]: each a
/// whole number of vectors of `lanes` from the part's first element where the vectors reach (below
/// `vector` rounded down to `lanes`), or `None` where one is not, or where nothing is summed.
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

/// `run_part` with the checksums folded into the SIMD loop (`Simd::Avx512Clmul`, `Simd::Avx2Clmul`):
/// the vector elements in stretches cut at `splits`, each piece's fold finished where it ends; the
/// scalar tail (the part's last elements) hashed block-wise as in `run_part`.
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
