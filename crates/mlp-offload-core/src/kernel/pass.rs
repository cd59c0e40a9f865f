//! The chunk's pass: its arguments checked, the chunk cut into one range per thread (whole cache
//! lines apart), each range updated block by block while the block is in the core's cache.

use super::adam::{adam_element, AdamConstants, DeepSpeedArith, TailFma};
use super::crc::{check_cuts, finish_pieces, hash_block, pieces, stripe_sums, Piece};
#[cfg(target_arch = "x86_64")]
use super::crc::{fold_splits, run_part_folding};
use super::dispatch::Simd;
use super::elem::{Bf16, Elem, Kind, StateKinds, F16};
use super::pool::run_on_workers;
use super::state::{elem_bytes_of, Array, Arrays, KeptArrays};
#[cfg(target_arch = "x86_64")]
use super::x86;
use crate::error::{Error, Result};

/// One chunk's memory for a fused update: `state` its master weights, `exp_avg` and `exp_avg_sq` (`n`
/// each, in the dtypes they are kept in: `kinds`' own, or fp32 holding values of `kinds`), `grad` the
/// chunk's gradient (`n`), `params` where the new half-precision parameters go (`n`), if anywhere;
/// `kinds` the dtypes DeepSpeed keeps the state in, to which each value of `state` is rounded.
pub struct Chunk<'a, G: Elem, P: Elem> {
    pub state: Arrays<'a>,
    pub grad: &'a [G],
    pub params: Option<&'a mut [P]>,
    /// Keep the parameters as they were before the pass wherever they are not the old weights
    /// narrowed ([`ChunkSums::kept_params`]), so that an update that is undone can give them back
    /// (the old weights alone give back the rest). Needs `params`.
    pub keep_params: bool,
    /// Where the state as it was before the pass goes (arrays as `state`'s, each one given), copied a
    /// block at a time in the pass itself, while the block is in the core's cache for its update: an
    /// update of state kept nowhere else (a chunk cached in host memory) that may be undone gives it
    /// back from here, at the cost of this write alone (no second read of the state).
    pub keep_state: Option<KeptArrays<'a>>,
    pub kinds: StateKinds,
    /// The master weights are the half-precision parameters themselves: `state[0]` is the partition and
    /// `params` is `None`. DeepSpeed keeps its master weights in the parameters' dtype in these modes and
    /// copies them into the parameters after every step, so the two hold the same bits and the store
    /// keeps only the moments ([`StateKinds::moments_layout`]). The parameters' bytes are hashed as one
    /// more stripe after the moments' ([`ChunkSums::params`]), and `keep_params` keeps every block of them
    /// (they are the old weights an undo gives back).
    pub master_in_params: bool,
}

/// The dtypes `arrays` keep the master weights and the moments in (`exp_avg`'s).
fn stored_kinds(arrays: &Arrays<'_>) -> StateKinds {
    StateKinds {
        master: arrays[0].kind(),
        moments: arrays[1].kind(),
    }
}

/// Elements per thread's share are a multiple of this: whole cache lines of every array, so no two
/// threads write one line.
const SHARE_ALIGN: usize = 64;

/// Elements per block of a thread's range: its state, gradient and parameters (128 KiB in bf16) stay in
/// the core's own cache between the read's checksum, the update and the write's checksum. A multiple of
/// every SIMD width.
pub(super) const BLOCK: usize = 8192;

/// Where to cut the checksums of a chunk's state (its bytes as [`StateKinds::layout`] lays them out), as
/// the store cuts the object into stripes: each stripe's first byte, ascending from 0 (the store's
/// `read_check().starts()` for the state as read, `write_cuts()` for it as written). `None`: not summed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cuts<'a> {
    pub read: Option<&'a [u64]>,
    pub write: Option<&'a [u64]>,
}

/// The CRC32C of each stripe of the state as read and as written, where [`Cuts`] asked for them; and,
/// where [`Chunk::keep_params`] asked, the parameters before the pass that were not the old weights
/// narrowed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkSums {
    pub read: Option<Vec<u32>>,
    pub write: Option<Vec<u32>>,
    pub kept_params: Option<Vec<KeptParams>>,
    /// With [`Chunk::master_in_params`], the CRC32C of the parameters as read and as written, where
    /// [`Cuts`] asked for the state's.
    pub params: [Option<u32>; 2],
}

/// Parameters as they were before a pass, from element `first` of the chunk on: their bytes, each
/// element's `Kind::size()` bytes little-endian. Kept a block ([`BLOCK`] elements, or the block's share
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

/// Updates `chunk` in one pass: each gradient element widened and multiplied by `grad_scale`, Adam with
/// `k` as DeepSpeed computes it (its last `n % arith.vector_width` elements with `arith.tail`'s
/// arithmetic), the new parameters narrowed into `chunk.params`, and the state's checksums where `cuts`
/// asks for them. Runs on `threads` threads (the caller's among them), each over its own range.
///
/// With a state in half precision (`chunk.kinds`), as DeepSpeed's CPU Adam runs it: the gradient
/// multiplied in its own dtype (DeepSpeed's `mul_` of its half-precision gradient), each result
/// rounded to its dtype as CPU Adam stores it, the parameters written being the master weights' bits,
/// and the vector arithmetic only where DeepSpeed's build has it for those dtypes
/// ([`DeepSpeedArith::vector_width_for`]). That pass runs 8 lanes at a time where the CPU has AVX2,
/// element by element elsewhere.
#[allow(clippy::too_many_arguments)]
pub fn update<G: Elem, P: Elem>(
    chunk: Chunk<'_, G, P>,
    grad_scale: f32,
    k: &AdamConstants,
    arith: &DeepSpeedArith,
    simd: Simd,
    threads: usize,
    cuts: Cuts<'_>,
) -> Result<ChunkSums> {
    check_chunk(&chunk, arith, cuts)?;
    let keep_params = chunk.keep_params;
    let vector_width = arith.vector_width_for(chunk.kinds);
    // With the master weights in the parameters, their bytes are one more stripe after the moments'.
    let in_params = chunk.master_in_params;
    let stored_bytes = stored_kinds(&chunk.state)
        .layout_for(chunk.grad.len(), in_params)
        .1 as u64;
    let [read_cuts, write_cuts] = [cuts.read, cuts.write].map(|c| {
        c.map(|c| {
            let mut c = c.to_vec();
            if in_params {
                c.push(stored_bytes);
            }
            c
        })
    });
    let cuts = Cuts {
        read: read_cuts.as_deref(),
        write: write_cuts.as_deref(),
    };
    let parts = cut_into_parts(chunk, vector_width, threads, cuts);
    let run = |part: Part<'_, G, P>| run_part(part, grad_scale, k, arith.tail, simd);
    let done: Vec<(Hashed, Option<Vec<KeptParams>>)> = run_on_workers(parts, run)?;
    let [mut read, mut write] = [0, 1].map(|d| {
        [cuts.read, cuts.write][d].map(|c| {
            let pieces = done
                .iter()
                .flat_map(|(h, _)| h[d].iter().flatten().copied())
                .collect();
            stripe_sums(c, pieces)
        })
    });
    let params = [&mut read, &mut write].map(|sums| {
        sums.as_mut()
            .filter(|_| in_params)
            .and_then(|sums| sums.pop())
    });
    // The parts in order, each's blocks in order.
    let kept_params = keep_params.then(|| {
        done.into_iter()
            .flat_map(|(_, k)| k.unwrap_or_default())
            .collect()
    });
    Ok(ChunkSums {
        read,
        write,
        kept_params,
        params,
    })
}

/// The chunk's arrays of the lengths its gradient asks for, and the cuts within its state: an error
/// naming the argument otherwise.
fn check_chunk<G: Elem, P: Elem>(
    chunk: &Chunk<'_, G, P>,
    arith: &DeepSpeedArith,
    cuts: Cuts<'_>,
) -> Result<()> {
    let n = chunk.grad.len();
    check_arrays("state", &chunk.state, n)?;
    if let Some(params) = &chunk.params {
        if params.len() != n {
            return Err(Error::config(
                "params",
                format!("{} elements for a gradient of {n}", params.len()),
            ));
        }
    }
    if chunk.keep_params && chunk.params.is_none() && !chunk.master_in_params {
        return Err(Error::config(
            "keep_params",
            "keeps the parameters before the pass, and no params were given",
        ));
    }
    let stored = stored_kinds(&chunk.state);
    if chunk.master_in_params {
        check_master_in_params(chunk, stored)?;
    }
    if let Some(kept) = &chunk.keep_state {
        check_kept_arrays(kept, &chunk.state, n)?;
    }
    if arith.vector_width == 0 {
        return Err(Error::config("vector_width", "must be at least 1"));
    }
    let params_kind = if chunk.master_in_params {
        Some(stored.master)
    } else {
        chunk.params.as_ref().map(|_| P::KIND)
    };
    chunk.kinds.check(G::KIND, params_kind)?;
    chunk.kinds.check_stored(stored)?;
    let total = stored.layout_for(n, chunk.master_in_params).1 as u64;
    for (name, c) in [("read_cuts", cuts.read), ("write_cuts", cuts.write)] {
        if let Some(c) = c {
            check_cuts(name, c, total)?;
        }
    }
    Ok(())
}

/// With the master weights in the parameters: they are in half precision, DeepSpeed's master weights'
/// dtype, and no other parameters are written; an error naming the argument otherwise.
fn check_master_in_params<G: Elem, P: Elem>(
    chunk: &Chunk<'_, G, P>,
    stored: StateKinds,
) -> Result<()> {
    if chunk.params.is_some() {
        return Err(Error::config(
            "params",
            "given beside master weights kept in the parameters: the pass writes the parameters once",
        ));
    }
    if stored.master == Kind::F32 || stored.master != chunk.kinds.master {
        return Err(Error::config(
            "master_in_params",
            format!(
                "parameters in {:?} for master weights in {:?}: only master weights in the parameters' \
                 half precision are the parameters",
                stored.master, chunk.kinds.master
            ),
        ));
    }
    Ok(())
}

/// A kept state's arrays, each given one of `n` elements in its array's dtype: an error naming
/// `keep_state` otherwise.
fn check_kept_arrays(kept: &KeptArrays<'_>, state: &Arrays<'_>, n: usize) -> Result<()> {
    let fits = kept.iter().zip(state).all(|(to, from)| {
        to.as_ref()
            .is_none_or(|to| to.len() == n && to.kind() == from.kind())
    });
    if fits {
        return Ok(());
    }
    let each = kept.each_ref().map(|to| match to {
        Some(to) => format!("{} {:?}", to.len(), to.kind()),
        None => "none".to_string(),
    });
    Err(Error::config(
        "keep_state",
        format!(
            "[{}] elements to keep a state of {n} each in {:?}",
            each.join(", "),
            stored_kinds(state)
        ),
    ))
}

/// Arrays of `n` elements each, the moments of one dtype: an error naming `name` otherwise.
fn check_arrays(name: &str, arrays: &Arrays<'_>, n: usize) -> Result<()> {
    let lens = arrays.each_ref().map(Array::len);
    if lens != [n; 3] {
        return Err(Error::config(
            name,
            format!("{lens:?} elements for a gradient of {n}: params, exp_avg and exp_avg_sq need {n} each"),
        ));
    }
    if arrays[1].kind() != arrays[2].kind() {
        return Err(Error::config(
            name,
            format!(
                "exp_avg in {:?}, exp_avg_sq in {:?}: the moments are of one dtype",
                arrays[1].kind(),
                arrays[2].kind()
            ),
        ));
    }
    Ok(())
}

/// The chunk cut into one range per thread (at most `threads`, each a multiple of [`SHARE_ALIGN`]
/// elements but the last), each with its arrays, its elements below the vector arithmetic's end
/// (`n - n % vector_width`), and its checksum pieces.
fn cut_into_parts<'a, G: Elem, P: Elem>(
    chunk: Chunk<'a, G, P>,
    vector_width: usize,
    threads: usize,
    cuts: Cuts<'_>,
) -> Vec<Part<'a, G, P>> {
    let n = chunk.grad.len();
    let stored = stored_kinds(&chunk.state);
    let (starts, _) = stored.layout_for(n, chunk.master_in_params);
    let sizes = [
        stored.master.size(),
        stored.moments.size(),
        stored.moments.size(),
    ];
    let [p, m, v] = chunk.state;
    // Elements below `body` get DeepSpeed's vector arithmetic, the rest its scalar loop's (every one for
    // a build without SIMD, width 1).
    let body = if vector_width > 1 {
        n - n % vector_width
    } else {
        0
    };
    let threads = threads.clamp(1, n.div_ceil(SHARE_ALIGN).max(1));
    let share = (n / threads).next_multiple_of(SHARE_ALIGN);
    let mut parts = Vec::with_capacity(threads);
    let (mut p, mut m, mut v, mut g) = (p, m, v, chunk.grad);
    let mut out = chunk.params;
    let mut keep = chunk.keep_state;
    let mut first = 0;
    while first < n {
        let len = if parts.len() + 1 == threads {
            n - first
        } else {
            share.min(n - first)
        };
        let (p0, p1) = p.split_at_mut(len);
        let (m0, m1) = m.split_at_mut(len);
        let (v0, v1) = v.split_at_mut(len);
        let (g0, g1) = g.split_at(len);
        let o0 = match out.take() {
            Some(o) => {
                let (o0, o1) = o.split_at_mut(len);
                out = Some(o1);
                Some(o0)
            }
            None => None,
        };
        let ks = keep.take().map(|arrays| {
            let (mut this, mut rest) = ([None, None, None], [None, None, None]);
            for (a, array) in arrays.into_iter().enumerate() {
                if let Some((x, y)) = array.map(|array| array.split_at_mut(len)) {
                    (this[a], rest[a]) = (Some(x), Some(y));
                }
            }
            keep = Some(rest);
            this
        });
        // Of this part, how much lies below `body` (vector arithmetic).
        let vector = body.saturating_sub(first).min(len);
        let offsets = [0, 1, 2].map(|a| starts[a] + sizes[a] * first);
        let sums =
            [cuts.read, cuts.write].map(|c| c.map(|c| pieces(c, offsets, sizes.map(|s| s * len))));
        parts.push(Part {
            p: p0,
            m: m0,
            v: v0,
            g: g0,
            o: o0,
            vector,
            first,
            offsets,
            sizes,
            sums,
            kept: chunk.keep_params.then(Vec::new),
            kept_state: ks,
            kinds: chunk.kinds,
        });
        (p, m, v, g) = (p1, m1, v1, g1);
        first += len;
    }
    parts
}

/// [`update`] over raw memory: `state` holds a state of `count` elements in the dtypes it names, laid
/// out as [`StateKinds::layout`] says (its values in `kinds`' dtypes, [`Chunk::kinds`]), `keep_state`
/// (if given) room for as many bytes, `grad` `count` elements of its kind, `params` (if given) `count`
/// of its kind, kept where they are not the weights narrowed with `keep_params`
/// ([`Chunk::keep_params`]). With `master_in_params` ([`Chunk::master_in_params`]), `state` holds the
/// moments alone ([`StateKinds::moments_layout`]), `keep_state` room for them, and `params` are the
/// master weights. Misaligned addresses are an error naming the array.
///
/// # Safety
/// Every address must point to live memory of that many elements, which nothing else reads or writes
/// until this returns, and no two ranges may overlap.
#[allow(clippy::too_many_arguments)]
pub unsafe fn update_at(
    state: (usize, StateKinds),
    grad: (usize, Kind),
    params: Option<(usize, Kind)>,
    keep_params: bool,
    keep_state: Option<usize>,
    master_in_params: bool,
    kinds: StateKinds,
    count: usize,
    grad_scale: f32,
    k: &AdamConstants,
    arith: &DeepSpeedArith,
    simd: Simd,
    threads: usize,
    cuts: Cuts<'_>,
) -> Result<ChunkSums> {
    // Longer than 80 lines for a reason: every address checked, naming its array, before any memory is
    // touched, then one call per gradient element type, each written out in full by rustfmt.
    let (state, stored) = state;
    // Every array starts aligned for its elements where the state does for its widest
    // (`StateKinds::layout`; the moments alone with the master weights in the parameters).
    let widest = if master_in_params || stored.master.size() < stored.moments.size() {
        stored.moments
    } else {
        stored.master
    };
    for (name, address, kind) in [("state", state, widest), ("grad", grad.0, grad.1)]
        .into_iter()
        .chain(params.map(|(a, kind)| ("params", a, kind)))
        .chain(keep_state.map(|a| ("keep_state", a, widest)))
    {
        if address == 0 || address % kind.size() != 0 {
            return Err(Error::config(
                name,
                format!("address {address:#x} is not aligned for {kind:?} elements"),
            ));
        }
    }
    let master = if master_in_params {
        let (at, kind) = params.ok_or_else(|| {
            Error::config(
                "params",
                "none given, and the master weights are kept in the parameters",
            )
        })?;
        if kind != stored.master {
            return Err(Error::config(
                "params",
                format!(
                    "{kind:?} elements, and the master weights they hold are {:?}",
                    stored.master
                ),
            ));
        }
        Some(at)
    } else {
        None
    };
    let params = if master_in_params { None } else { params };
    // SAFETY: the caller's promise, and the alignment checked above.
    let state = unsafe { arrays_at(state, stored, count, master) };
    // SAFETY: as above.
    let keep_state = keep_state.map(|a| unsafe { kept_at(a, stored, count, master_in_params) });
    // SAFETY: as above.
    unsafe {
        match grad.1 {
            Kind::F32 => update_with_params(
                state,
                slice::<f32>(grad.0, count),
                params,
                keep_params,
                keep_state,
                master_in_params,
                kinds,
                count,
                grad_scale,
                k,
                arith,
                simd,
                threads,
                cuts,
            ),
            Kind::Bf16 => update_with_params(
                state,
                slice::<Bf16>(grad.0, count),
                params,
                keep_params,
                keep_state,
                master_in_params,
                kinds,
                count,
                grad_scale,
                k,
                arith,
                simd,
                threads,
                cuts,
            ),
            Kind::F16 => update_with_params(
                state,
                slice::<F16>(grad.0, count),
                params,
                keep_params,
                keep_state,
                master_in_params,
                kinds,
                count,
                grad_scale,
                k,
                arith,
                simd,
                threads,
                cuts,
            ),
        }
    }
}

/// The arrays of a state of `count` elements in `stored`'s dtypes at `address`; with `master` (the
/// parameters' address) the moments alone lie there ([`StateKinds::moments_layout`]) and the master
/// weights at `master`.
///
/// # Safety
/// As [`update_at`]: the state's bytes ([`StateKinds::layout_for`]) live at `address`, aligned for its
/// widest elements, and `count` master weights at `master`, if given, used by nothing else.
unsafe fn arrays_at<'a>(
    address: usize,
    stored: StateKinds,
    count: usize,
    master: Option<usize>,
) -> Arrays<'a> {
    let (starts, _) = stored.layout_for(count, master.is_some());
    let kinds = [stored.master, stored.moments, stored.moments];
    std::array::from_fn(|a| {
        let at = match master {
            Some(at) if a == 0 => at,
            _ => address + starts[a],
        };
        // SAFETY: the caller's promise; each array starts at a multiple of its element's size
        // (`StateKinds::layout_for`), and the three do not overlap.
        unsafe { array_at(kinds[a], at, count) }
    })
}

/// Where a kept state of `count` elements in `stored`'s dtypes goes, at `address`: every array, or the
/// moments alone with the master weights in the parameters (`keep_params` keeps those).
///
/// # Safety
/// As [`arrays_at`], for room of the state's bytes at `address`.
unsafe fn kept_at<'a>(
    address: usize,
    stored: StateKinds,
    count: usize,
    master_in_params: bool,
) -> KeptArrays<'a> {
    let (starts, _) = stored.layout_for(count, master_in_params);
    let kinds = [stored.master, stored.moments, stored.moments];
    std::array::from_fn(|a| {
        // SAFETY: as `arrays_at`.
        (a > 0 || !master_in_params)
            .then(|| unsafe { array_at(kinds[a], address + starts[a], count) })
    })
}

/// # Safety
/// As [`update_at`]: `count` live, aligned elements of `kind` at `at`, used by nothing else.
unsafe fn array_at<'a>(kind: Kind, at: usize, count: usize) -> Array<'a> {
    // SAFETY: the caller's promise.
    unsafe {
        match kind {
            Kind::F32 => Array::F32(slice_mut(at, count)),
            Kind::Bf16 => Array::Bf16(slice_mut(at, count)),
            Kind::F16 => Array::F16(slice_mut(at, count)),
        }
    }
}

/// # Safety
/// As [`update_at`]: `count` live, aligned elements of `T` at `address`.
unsafe fn slice<'a, T>(address: usize, count: usize) -> &'a [T] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(address as *const T, count) }
}

/// # Safety
/// As [`update_at`]: `count` live, aligned elements of `T` at `address`, used by nothing else.
unsafe fn slice_mut<'a, T>(address: usize, count: usize) -> &'a mut [T] {
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts_mut(address as *mut T, count) }
}

/// # Safety
/// As [`update_at`].
#[allow(clippy::too_many_arguments)]
unsafe fn update_with_params<G: Elem>(
    state: Arrays<'_>,
    grad: &[G],
    params: Option<(usize, Kind)>,
    keep_params: bool,
    keep_state: Option<KeptArrays<'_>>,
    master_in_params: bool,
    kinds: StateKinds,
    count: usize,
    grad_scale: f32,
    k: &AdamConstants,
    arith: &DeepSpeedArith,
    simd: Simd,
    threads: usize,
    cuts: Cuts<'_>,
) -> Result<ChunkSums> {
    // Longer than 80 lines for a reason: one call per parameter element type (and none), each written
    // out in full by rustfmt, after the parameters' own checks.
    // SAFETY: the caller's promise for `params`.
    unsafe {
        match params {
            None => update::<G, f32>(
                Chunk {
                    state,
                    grad,
                    params: None,
                    keep_params,
                    keep_state,
                    kinds,
                    master_in_params,
                },
                grad_scale,
                k,
                arith,
                simd,
                threads,
                cuts,
            ),
            Some((a, Kind::F32)) => update(
                Chunk {
                    state,
                    grad,
                    params: Some(slice_mut::<f32>(a, count)),
                    keep_params,
                    keep_state,
                    kinds,
                    master_in_params,
                },
                grad_scale,
                k,
                arith,
                simd,
                threads,
                cuts,
            ),
            Some((a, Kind::Bf16)) => update(
                Chunk {
                    state,
                    grad,
                    params: Some(slice_mut::<Bf16>(a, count)),
                    keep_params,
                    keep_state,
                    kinds,
                    master_in_params,
                },
                grad_scale,
                k,
                arith,
                simd,
                threads,
                cuts,
            ),
            Some((a, Kind::F16)) => update(
                Chunk {
                    state,
                    grad,
                    params: Some(slice_mut::<F16>(a, count)),
                    keep_params,
                    keep_state,
                    kinds,
                    master_in_params,
                },
                grad_scale,
                k,
                arith,
                simd,
                threads,
                cuts,
            ),
        }
    }
}

/// A thread's checksum pieces, `(start, len, crc)`, of the state as read and as written.
pub(super) type Hashed = [Option<Vec<(u64, u64, u32)>>; 2];

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
    /// Where the parameters before the pass are kept ([`Chunk::keep_params`]).
    pub(super) kept: Option<Vec<KeptParams>>,
    /// Where the state before the pass is copied ([`Chunk::keep_state`]): this range's params,
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

/// One thread's range, block by block: the block's state hashed as read, updated (its elements below
/// `vector` with DeepSpeed's vector arithmetic, in SIMD where `simd` says, the rest with `tail`'s), and
/// hashed as written. Returns the pieces' `(start, len, crc)`, as read and as written.
fn run_part<G: Elem, P: Elem>(
    mut part: Part<'_, G, P>,
    grad_scale: f32,
    k: &AdamConstants,
    tail: TailFma,
    simd: Simd,
) -> (Hashed, Option<Vec<KeptParams>>) {
    #[cfg(target_arch = "x86_64")]
    if part.kinds.is_fp32() && matches!(simd, Simd::Avx512Clmul | Simd::Avx2Clmul) {
        if let Some(splits) = fold_splits(&part, simd.lanes()) {
            return run_part_folding(part, splits, grad_scale, k, tail, simd);
        }
    }
    let len = part.g.len();
    for b0 in (0..len).step_by(BLOCK) {
        let b1 = (b0 + BLOCK).min(len);
        keep_block(&mut part, b0, b1, simd);
        hash_block(&mut part, 0, b0, b1);
        run_block(&mut part, b0, b1, grad_scale, k, tail, simd);
        hash_block(&mut part, 1, b0, b1);
    }
    (finish_pieces(part.sums), part.kept)
}

/// Keeps elements `b0..b1` as they are before the block is updated (in the core's cache for it): their
/// state where [`Chunk::keep_state`] asked, and their parameters where [`Chunk::keep_params`] asked and
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

/// Elements `b0..b1` of a thread's range (see [`run_part`]).
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

/// Elements `b0..b1` of a range whose state is in half precision ([`Chunk::kinds`]), as DeepSpeed's CPU
/// Adam computes them (see [`update`]): each run of one arithmetic 8 lanes at a time where `lanes` says
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
