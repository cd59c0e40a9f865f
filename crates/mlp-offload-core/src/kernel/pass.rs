//! The chunk's pass: its arguments checked, the chunk cut into one range per thread (whole cache
//! lines apart), each range updated block by block while the block is in the core's cache (`part`;
//! `folded` where the checksums are folded into the SIMD loop); and the same pass over raw memory
//! ([`update_at`]).

use super::adam::{AdamConstants, DeepSpeedArith, TailFma};
use super::crc::{check_cuts, finish_pieces, pieces, stripe_sums, Hashed};
use super::dispatch::Simd;
use super::elem::{Bf16, Elem, Kind, StateKinds, F16};
#[cfg(target_arch = "x86_64")]
use super::folded::{fold_splits, run_part_folding};
use super::part::{hash_block, keep_block, run_block, KeptParams, Part, BLOCK};
use super::pool::run_on_workers;
use super::state::{Array, Arrays, KeptArrays, StateLayout};
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

/// `$body` with `$T` the element type of `$kind` (a [`Kind`]): one copy of it per element type.
macro_rules! with_elem {
    ($kind:expr, $T:ident => $body:expr) => {
        match $kind {
            Kind::F32 => {
                type $T = f32;
                $body
            }
            Kind::Bf16 => {
                type $T = Bf16;
                $body
            }
            Kind::F16 => {
                type $T = F16;
                $body
            }
        }
    };
}

/// One chunk's memory by address, for [`update_at`]: `state` the chunk's bytes, laid out as its
/// [`StateLayout`] says; `grad` `count` elements of its kind; `params` `count` of its kind where the new
/// parameters go (with [`StateLayout::master_in_params`], the master weights themselves), if anywhere;
/// `keep_state` room for as many bytes as the state's ([`Chunk::keep_state`]); `keep_params` as
/// [`Chunk::keep_params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkAt {
    pub state: usize,
    pub grad: (usize, Kind),
    pub params: Option<(usize, Kind)>,
    pub keep_state: Option<usize>,
    pub keep_params: bool,
    pub count: usize,
}

/// [`update`] over raw memory: `chunk`'s state holds `chunk.count` elements laid out as `layout` says
/// ([`StateLayout::offsets`]; its values in `layout.kinds`' dtypes, [`Chunk::kinds`]), `keep_state` (if
/// given) room for as many bytes, the gradient and the parameters (if given) `count` elements of their
/// kinds. With `layout.master_in_params` ([`Chunk::master_in_params`]) the state holds the moments
/// alone ([`StateKinds::moments_layout`]), `keep_state` room for them, and the parameters are the
/// master weights. Misaligned addresses are an error naming the array.
///
/// # Safety
/// Every address must point to live memory of that many elements, which nothing else reads or writes
/// until this returns, and no two ranges may overlap.
#[allow(clippy::too_many_arguments)]
pub unsafe fn update_at(
    chunk: ChunkAt,
    layout: StateLayout,
    grad_scale: f32,
    k: &AdamConstants,
    arith: &DeepSpeedArith,
    simd: Simd,
    threads: usize,
    cuts: Cuts<'_>,
) -> Result<ChunkSums> {
    // Every address checked, naming its array, before any memory is touched.
    let master = check_addresses(chunk, layout)?;
    let ChunkAt {
        state,
        grad,
        params,
        keep_state,
        keep_params,
        count,
    } = chunk;
    let StateLayout {
        stored,
        master_in_params,
        ..
    } = layout;
    let params = if master_in_params { None } else { params };
    // SAFETY: the caller's promise, and the alignment checked above.
    let state = unsafe { arrays_at(state, stored, count, master) };
    // SAFETY: as above.
    let keep_state = keep_state.map(|a| unsafe { kept_at(a, stored, count, master_in_params) });
    let pass = Untyped {
        state,
        keep_state,
        keep_params,
        layout,
        grad_scale,
        k,
        arith,
        simd,
        threads,
        cuts,
    };
    // SAFETY: as above, for the gradient and the parameters.
    unsafe {
        with_elem!(grad.1, G => {
            let grad = slice::<G>(grad.0, count);
            match params {
                None => pass.run::<G, f32>(grad, None),
                Some((at, kind)) => with_elem!(kind, P => pass.run(grad, Some(slice_mut::<P>(at, count)))),
            }
        })
    }
}

/// Every address of `chunk` aligned for its elements (an error naming the array otherwise); with the
/// master weights in the parameters, the parameters given, in the master weights' dtype: their address.
fn check_addresses(chunk: ChunkAt, layout: StateLayout) -> Result<Option<usize>> {
    let ChunkAt {
        state,
        grad,
        params,
        keep_state,
        ..
    } = chunk;
    let StateLayout {
        stored,
        master_in_params,
        ..
    } = layout;
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
    if !master_in_params {
        return Ok(None);
    }
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
    Ok(Some(at))
}

/// What [`update_at`] hands on to [`update`] whatever the element types of the gradient and the
/// parameters.
struct Untyped<'a> {
    state: Arrays<'a>,
    keep_state: Option<KeptArrays<'a>>,
    keep_params: bool,
    layout: StateLayout,
    grad_scale: f32,
    k: &'a AdamConstants,
    arith: &'a DeepSpeedArith,
    simd: Simd,
    threads: usize,
    cuts: Cuts<'a>,
}

impl<'a> Untyped<'a> {
    /// The pass with this gradient and these parameters.
    fn run<G: Elem, P: Elem>(
        self,
        grad: &'a [G],
        params: Option<&'a mut [P]>,
    ) -> Result<ChunkSums> {
        let chunk = Chunk {
            state: self.state,
            grad,
            params,
            keep_params: self.keep_params,
            keep_state: self.keep_state,
            kinds: self.layout.kinds,
            master_in_params: self.layout.master_in_params,
        };
        update(
            chunk,
            self.grad_scale,
            self.k,
            self.arith,
            self.simd,
            self.threads,
            self.cuts,
        )
    }
}

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
