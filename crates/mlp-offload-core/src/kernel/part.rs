//! One thread's range of a chunk ([`Part`]), block by block while the block is in the core's cache:
//! what is kept of it before the update, its state hashed into the checksum pieces, the update itself
//! (DeepSpeed's vector arithmetic in SIMD, its scalar loop's, and the rounded pass of a state in half
//! precision), and the parameters narrowed.

use super::adam::{adam_element, AdamConstants, TailFma};
use super::crc::{hash, Piece};
use super::dispatch::Simd;
use super::elem::{Bf16, Elem, Kind, StateKinds, F16};
use super::state::{elem_bytes_of, Array, KeptArrays};
#[cfg(target_arch = "x86_64")]
use super::x86;

/// Elements per block of a thread's range: its state, gradient and parameters (128 KiB in bf16) stay in
/// the core's own cache between the read's checksum, the update and the write's checksum. A multiple of
/// every SIMD width.
pub(super) const BLOCK: usize = 8192;

/// Parameters as they were before a pass, from element `first` of the chunk on: their bytes, each
/// element's `Kind::size()` bytes little-endian. Kept a block (`BLOCK` elements, or the block's share
/// of a thread's range) at a time where any of its elements was not its old weight narrowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptParams {
    pub first: usize,
    pub bytes: Vec<u8>,
}

/// Whether `params` are the fp32 `weights` narrowed ([`Elem::narrow`]), bit for bit: a -0.0 is not a
/// 0.0, a NaN only the NaN the narrowing writes. In SIMD where `simd` says (the same narrowing as the
/// pass's stores), the rest element by element.
pub fn narrows_to<P: Elem>(weights: &[f32], params: &[P], simd: Simd) -> bool {
    assert_eq!(
        weights.len(),
        params.len(),
        "weights and params of one length"
    );
    let lanes = simd.lanes();
    let vectors = if lanes > 1 {
        weights.len() / lanes * lanes
    } else {
        0
    };
    #[cfg(target_arch = "x86_64")]
    if vectors > 0 {
        let (p, o) = (weights.as_ptr(), params.as_ptr().cast::<u8>());
        // SAFETY: `Simd::parse`/`detect` give these only where the CPU has the instructions; both
        // slices hold `vectors` elements, a multiple of the lanes.
        let same = unsafe {
            match simd {
                Simd::Avx512 | Simd::Avx512Clmul => x86::avx512_narrows_to(P::KIND, p, o, vectors),
                Simd::Avx2 | Simd::Avx2Clmul => x86::avx2_narrows_to(P::KIND, p, o, vectors),
                Simd::Scalar => unreachable!("the scalar path has one lane"),
            }
        };
        if !same {
            return false;
        }
    }
    weights[vectors..]
        .iter()
        .zip(&params[vectors..])
        .all(|(&w, &h)| P::narrow(w).bits() == h.bits())
}

/// Each element's `Kind::size()` bytes, little-endian.
pub(super) fn elem_bytes<P: Elem>(x: &[P]) -> Vec<u8> {
    let size = P::KIND.size();
    x.iter()
        .flat_map(|e| e.bits().to_le_bytes().into_iter().take(size))
        .collect()
}

/// One thread's range of a chunk: its arrays, how many of its first elements take the vector
/// arithmetic, its first element in the chunk, each array's first byte in the state and bytes per
/// element, and its checksum pieces (as read, as written).
pub(super) struct Part<'a, G, P> {
    pub(super) p: Array<'a>,
    pub(super) m: Array<'a>,
    pub(super) v: Array<'a>,
    pub(super) g: &'a [G],
    pub(super) o: Option<&'a mut [P]>,
    pub(super) vector: usize,
    pub(super) first: usize,
    pub(super) offsets: [usize; 3],
    pub(super) sizes: [usize; 3],
    pub(super) sums: [Option<[Vec<Piece>; 3]>; 2],
    /// Where the parameters before the pass are kept (`Chunk::keep_params`).
    pub(super) kept: Option<Vec<KeptParams>>,
    /// Where the state before the pass is copied (`Chunk::keep_state`): this range's params,
    /// exp_avg and exp_avg_sq, where each is kept.
    pub(super) kept_state: Option<KeptArrays<'a>>,
    pub(super) kinds: StateKinds,
}

impl<G: Elem, P: Elem> Part<'_, G, P> {
    /// Elements `b0..b1` of every array, for a SIMD pass.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn lanes(&mut self, b0: usize, b1: usize) -> x86::Lanes {
        x86::Lanes {
            p: self.p.ptr_at(b0),
            m: self.m.ptr_at(b0),
            v: self.v.ptr_at(b0),
            stored: StateKinds {
                master: self.p.kind(),
                moments: self.m.kind(),
            },
            g: (G::KIND, self.g[b0..b1].as_ptr().cast()),
            o: self
                .o
                .as_deref_mut()
                .map(|o| (P::KIND, o[b0..b1].as_mut_ptr().cast())),
            len: b1 - b0,
        }
    }
}

/// Keeps elements `b0..b1` as they are before the block is updated (in the core's cache for it): their
/// state where `Chunk::keep_state` asked, and their parameters where `Chunk::keep_params` asked and
/// any of them is not its weight narrowed.
pub(super) fn keep_block<G: Elem, P: Elem>(
    part: &mut Part<'_, G, P>,
    b0: usize,
    b1: usize,
    simd: Simd,
) {
    if let Some(to) = part.kept_state.as_mut() {
        for (to, from) in to.iter_mut().zip([&part.p, &part.m, &part.v]) {
            let Some(to) = to else { continue };
            let (to, from) = (to.bytes_mut(b0, b1), from.bytes(b0, b1));
            #[cfg(target_arch = "x86_64")]
            if simd != Simd::Scalar {
                // SAFETY: every SIMD but the scalar one needs AVX (`Simd::available`).
                unsafe { x86::copy_streaming(to, from) };
                continue;
            }
            to.copy_from_slice(from);
        }
    }
    let Some(kept) = part.kept.as_mut() else {
        return;
    };
    let Some(o) = part.o.as_deref() else {
        // The master weights are the parameters (`Chunk::master_in_params`): every block is kept.
        kept.push(KeptParams {
            first: part.first + b0,
            bytes: part.p.bytes(b0, b1).to_vec(),
        });
        return;
    };
    if !params_are_weights(&part.p, &o[b0..b1], b0, simd) {
        kept.push(KeptParams {
            first: part.first + b0,
            bytes: elem_bytes(&o[b0..b1]),
        });
    }
}

/// Whether `params` are elements `b0..` of the master weights `p` as the pass writes them: the fp32
/// weights narrowed ([`narrows_to`]), or the half-precision weights' own bits.
fn params_are_weights<P: Elem>(p: &Array<'_>, params: &[P], b0: usize, simd: Simd) -> bool {
    match p {
        Array::F32(p) => narrows_to(&p[b0..b0 + params.len()], params, simd),
        half => half.bytes(b0, b0 + params.len()) == elem_bytes_of(params),
    }
}

/// Elements `b0..b1` of a thread's range (see `run_part`).
pub(super) fn run_block<G: Elem, P: Elem>(
    part: &mut Part<'_, G, P>,
    b0: usize,
    b1: usize,
    grad_scale: f32,
    k: &AdamConstants,
    tail: TailFma,
    simd: Simd,
) {
    if !part.kinds.is_fp32() {
        #[cfg(target_arch = "x86_64")]
        if rounded_lanes(simd) {
            // SAFETY: the CPU has AVX2, FMA and F16C (`rounded_lanes`).
            unsafe { rounded_elements_avx2(part, b0, b1, grad_scale, k, tail) };
            return;
        }
        rounded_elements(part, b0, b1, grad_scale, k, tail, false);
        return;
    }
    let lanes = simd.lanes();
    // The SIMD stretch: from the block's start (a multiple of every width) up to its vector elements.
    let simd_end = if lanes > 1 {
        let vector_end = part.vector.clamp(b0, b1);
        b0 + (vector_end - b0) / lanes * lanes
    } else {
        b0
    };
    if simd_end > b0 {
        #[cfg(target_arch = "x86_64")]
        {
            let at = part.lanes(b0, simd_end);
            match simd {
                // SAFETY: `Simd::parse`/`detect` give these only where the CPU has the instructions; the
                // slices are distinct, each at least `simd_end` long, the stretch a multiple of the lanes.
                Simd::Avx512 | Simd::Avx512Clmul => unsafe { x86::avx512(&at, grad_scale, k) },
                // SAFETY: as above.
                Simd::Avx2 | Simd::Avx2Clmul => unsafe { x86::avx2(&at, grad_scale, k) },
                Simd::Scalar => unreachable!("the scalar path has one lane"),
            }
        }
    }
    let (p, m, v, g) = (part.p.f32s(), part.m.f32s(), part.v.f32s(), part.g);
    for i in simd_end..b1 {
        let how = if i < part.vector {
            TailFma::VECTOR
        } else {
            tail
        };
        let grad = g[i].widen() * grad_scale;
        let (param, exp_avg, exp_avg_sq) = adam_element(p[i], grad, m[i], v[i], k, how);
        (p[i], m[i], v[i]) = (param, exp_avg, exp_avg_sq);
        if let Some(o) = part.o.as_deref_mut() {
            o[i] = P::narrow(param);
        }
    }
}

/// Whether the rounded pass runs in AVX2 ([`x86::avx2_rounded`]): wherever `simd` has SIMD and the CPU
/// AVX2, FMA and F16C (an AVX-512 CPU among them).
#[cfg(target_arch = "x86_64")]
fn rounded_lanes(simd: Simd) -> bool {
    simd != Simd::Scalar
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// [`rounded_elements`] with its runs in AVX2, and compiled with FMA instructions for the elements
/// left over, which the specification's fused multiply-adds then are (without them each is a call of
/// the C library's `fmaf`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rounded_elements_avx2<G: Elem, P: Elem>(
    part: &mut Part<'_, G, P>,
    b0: usize,
    b1: usize,
    grad_scale: f32,
    k: &AdamConstants,
    tail: TailFma,
) {
    rounded_elements(part, b0, b1, grad_scale, k, tail, true);
}

/// Elements `b0..b1` of a range whose state is in half precision (`Chunk::kinds`), as DeepSpeed's CPU
/// Adam computes them (see `update`): each run of one arithmetic 8 lanes at a time where `lanes` says
/// (the CPU has AVX2), the rest element by element, in a loop per pair of dtypes, so that nothing is
/// decided per element.
#[inline(always)]
fn rounded_elements<G: Elem, P: Elem>(
    part: &mut Part<'_, G, P>,
    b0: usize,
    b1: usize,
    grad_scale: f32,
    k: &AdamConstants,
    tail: TailFma,
    lanes: bool,
) {
    let vector_end = part.vector.clamp(b0, b1);
    for (from, to, how) in [(b0, vector_end, TailFma::VECTOR), (vector_end, b1, tail)] {
        let simd_end = if lanes {
            from + (to - from) / 8 * 8
        } else {
            from
        };
        #[cfg(target_arch = "x86_64")]
        if simd_end > from {
            let at = part.lanes(from, simd_end);
            // SAFETY: `lanes` only where the CPU has AVX2, FMA and F16C (`rounded_lanes`); the slices
            // are distinct, each at least `simd_end` long, the stretch a multiple of 8.
            unsafe { x86::avx2_rounded(&at, grad_scale, k, how, part.kinds) };
        }
        if simd_end == to {
            continue;
        }
        let from = simd_end;
        match (part.kinds.master, part.kinds.moments) {
            (Kind::Bf16, Kind::F32) => {
                rounded_run::<G, P, Bf16, f32>(part, from, to, grad_scale, k, how)
            }
            (Kind::Bf16, Kind::Bf16) => {
                rounded_run::<G, P, Bf16, Bf16>(part, from, to, grad_scale, k, how)
            }
            (Kind::F16, Kind::F32) => {
                rounded_run::<G, P, F16, f32>(part, from, to, grad_scale, k, how)
            }
            (Kind::F16, Kind::F16) => {
                rounded_run::<G, P, F16, F16>(part, from, to, grad_scale, k, how)
            }
            // `check_chunk` admits no other state in half precision (`StateKinds::check`).
            other => unreachable!("a state in {other:?}"),
        }
    }
}

/// Elements `from..to`, the master weights in `W`, the moments in `S` (which `part.kinds` names), all with
/// `how`'s arithmetic. (No closures: they would not take the caller's target features.)
#[inline(always)]
fn rounded_run<G: Elem, P: Elem, W: Elem, S: Elem>(
    part: &mut Part<'_, G, P>,
    from: usize,
    to: usize,
    grad_scale: f32,
    k: &AdamConstants,
    how: TailFma,
) {
    let (p, m, v, g) = (&mut part.p, &mut part.m, &mut part.v, part.g);
    let mut o = part.o.as_deref_mut();
    for i in from..to {
        let (master, exp_avg, exp_avg_sq) =
            rounded_element::<G, W, S>(p.get(i), m.get(i), v.get(i), g[i], grad_scale, k, how);
        p.set(i, master);
        m.set(i, exp_avg);
        v.set(i, exp_avg_sq);
        if let Some(o) = o.as_deref_mut() {
            // The master weights' own bits (`StateKinds::check`: the same dtype), as DeepSpeed's copy
            // of them into its partition leaves them: exact.
            o[i] = P::narrow_as_cpu_adam(master.widen());
        }
    }
}

/// One element of a state whose master weights are `W` (its gradient `G`, of the same dtype where that
/// is half precision) and whose moments are `S`, as DeepSpeed's CPU Adam computes it with `how`'s
/// arithmetic: the gradient multiplied by `grad_scale` in its own dtype (DeepSpeed's `mul_` of its
/// gradient: torch rounds the product), Adam, and each result stored in its dtype as CPU Adam stores it.
/// Returns the new parameter, `exp_avg` and `exp_avg_sq`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn rounded_element<G: Elem, W: Elem, S: Elem>(
    param: f32,
    exp_avg: f32,
    exp_avg_sq: f32,
    g: G,
    grad_scale: f32,
    k: &AdamConstants,
    how: TailFma,
) -> (W, S, S) {
    let grad = G::narrow(g.widen() * grad_scale).widen();
    let (param, exp_avg, exp_avg_sq) = adam_element(param, grad, exp_avg, exp_avg_sq, k, how);
    (
        W::narrow_as_cpu_adam(param),
        S::narrow_as_cpu_adam(exp_avg),
        S::narrow_as_cpu_adam(exp_avg_sq),
    )
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
