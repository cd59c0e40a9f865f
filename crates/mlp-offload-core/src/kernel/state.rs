//! A chunk's state as the pass sees it: its three arrays (the master weights, `exp_avg`,
//! `exp_avg_sq`), each in the dtype it is kept in, and where they lie in the chunk's bytes.

use super::elem::{Bf16, Elem, Kind, StateKinds, F16};

/// One array of a chunk's state, in the dtype it is kept in.
pub enum Array<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
    F16(&'a mut [F16]),
}

/// The master weights, `exp_avg` and `exp_avg_sq`, in that order.
pub type Arrays<'a> = [Array<'a>; 3];

/// Where the state before a pass is copied: the master weights, `exp_avg` and `exp_avg_sq`, each where
/// it is kept (`None`: not kept here; the master weights kept in the parameters are kept with them).
pub type KeptArrays<'a> = [Option<Array<'a>>; 3];

/// `[params | exp_avg | exp_avg_sq]` in fp32 (`3 n` elements) as the pass's arrays.
pub fn fp32_arrays(state: &mut [f32]) -> Arrays<'_> {
    let n = state.len() / 3;
    let (p, rest) = state.split_at_mut(n);
    let (m, v) = rest.split_at_mut(n);
    [Array::F32(p), Array::F32(m), Array::F32(v)]
}

impl<'a> Array<'a> {
    pub fn kind(&self) -> Kind {
        match self {
            Array::F32(_) => Kind::F32,
            Array::Bf16(_) => Kind::Bf16,
            Array::F16(_) => Kind::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::F32(a) => a.len(),
            Array::Bf16(a) => a.len(),
            Array::F16(a) => a.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its first `at` elements and the rest.
    pub fn split_at_mut(self, at: usize) -> (Array<'a>, Array<'a>) {
        match self {
            Array::F32(a) => {
                let (x, y) = a.split_at_mut(at);
                (Array::F32(x), Array::F32(y))
            }
            Array::Bf16(a) => {
                let (x, y) = a.split_at_mut(at);
                (Array::Bf16(x), Array::Bf16(y))
            }
            Array::F16(a) => {
                let (x, y) = a.split_at_mut(at);
                (Array::F16(x), Array::F16(y))
            }
        }
    }

    /// The bytes of elements `b0..b1`.
    pub fn bytes(&self, b0: usize, b1: usize) -> &[u8] {
        match self {
            Array::F32(a) => elem_bytes_of(&a[b0..b1]),
            Array::Bf16(a) => elem_bytes_of(&a[b0..b1]),
            Array::F16(a) => elem_bytes_of(&a[b0..b1]),
        }
    }

    /// The bytes of elements `b0..b1`, to write.
    pub fn bytes_mut(&mut self, b0: usize, b1: usize) -> &mut [u8] {
        match self {
            Array::F32(a) => elem_bytes_of_mut(&mut a[b0..b1]),
            Array::Bf16(a) => elem_bytes_of_mut(&mut a[b0..b1]),
            Array::F16(a) => elem_bytes_of_mut(&mut a[b0..b1]),
        }
    }

    /// Its fp32 elements: the fp32 pass runs on an fp32 state alone (`StateKinds::check_stored`).
    pub fn f32s(&mut self) -> &mut [f32] {
        match self {
            Array::F32(a) => a,
            other => unreachable!("the fp32 pass on a {:?} array", other.kind()),
        }
    }

    /// Element `i`, widened to fp32 (exactly).
    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Array::F32(a) => a[i],
            Array::Bf16(a) => a[i].widen(),
            Array::F16(a) => a[i].widen(),
        }
    }

    /// Stores `x`, a value of this array's dtype or of a narrower one, at `i`: its own bits, or in
    /// fp32 widened (exactly), NaNs as they are.
    #[inline(always)]
    pub fn set<T: Elem>(&mut self, i: usize, x: T) {
        match self {
            Array::F32(a) => a[i] = x.widen(),
            Array::Bf16(a) => {
                debug_assert_eq!(T::KIND, Kind::Bf16);
                a[i] = Bf16(x.bits() as u16);
            }
            Array::F16(a) => {
                debug_assert_eq!(T::KIND, Kind::F16);
                a[i] = F16(x.bits() as u16);
            }
        }
    }

    /// Where its element `i` lies, for the SIMD loops.
    pub fn ptr_at(&mut self, i: usize) -> *mut u8 {
        self.bytes_mut(i, i).as_mut_ptr()
    }
}

/// The elements' bytes as they lie in memory, without a copy.
pub(super) fn elem_bytes_of<T: Elem>(x: &[T]) -> &[u8] {
    // SAFETY: every `Elem` is `f32` or a `repr(transparent)` `u16` (elem.rs): initialised bytes and no
    // padding; the view lives no longer than `x`.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}

fn elem_bytes_of_mut<T: Elem>(x: &mut [T]) -> &mut [u8] {
    // SAFETY: as `elem_bytes_of`; every bit pattern is a valid `f32` or `u16`, so any bytes written
    // through the view leave valid elements; the view borrows `x` mutably for as long as it lives.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), std::mem::size_of_val(x)) }
}

impl StateKinds {
    /// Where a state kept in these dtypes lies in a chunk of `n` elements: each array's first byte
    /// (master weights, `exp_avg`, `exp_avg_sq`), and the chunk's bytes. Wider arrays first, so that
    /// every array starts aligned for its elements whatever `n` is: `[params | exp_avg | exp_avg_sq]`
    /// where the three are of one size (an fp32 state's layout of old), `[exp_avg | exp_avg_sq |
    /// params]` for half-precision weights beside fp32 moments.
    pub fn layout(self, n: usize) -> ([usize; 3], usize) {
        let (w, s) = (self.master.size() * n, self.moments.size() * n);
        let offsets = if self.master.size() >= self.moments.size() {
            [0, w, w + s]
        } else {
            [2 * s, 0, s]
        };
        (offsets, w + 2 * s)
    }

    /// Where a state lies whose master weights are the parameters themselves ([`Chunk::master_in_params`](
    /// super::pass::Chunk::master_in_params)): the moments alone, `[exp_avg | exp_avg_sq]`, each array's
    /// first byte (the master weights' as if they followed the moments: where their checksum's stripe
    /// begins), and the stored bytes, the moments'.
    pub fn moments_layout(self, n: usize) -> ([usize; 3], usize) {
        let s = self.moments.size() * n;
        ([2 * s, 0, s], 2 * s)
    }

    /// [`Self::layout`], or with the master weights in the parameters [`Self::moments_layout`].
    pub fn layout_for(self, n: usize, master_in_params: bool) -> ([usize; 3], usize) {
        if master_in_params {
            self.moments_layout(n)
        } else {
            self.layout(n)
        }
    }

    /// Whether a state rounded to `self` may be kept in `stored`: each array in its own dtype or in
    /// fp32 (widened, exactly); an error naming `state` otherwise.
    pub fn check_stored(self, stored: StateKinds) -> crate::error::Result<()> {
        let fits = |kind: Kind, within: Kind| within == kind || within == Kind::F32;
        if fits(self.master, stored.master) && fits(self.moments, stored.moments) {
            return Ok(());
        }
        Err(crate::error::Error::config(
            "state",
            format!(
                "a state in {stored:?} cannot hold one rounded to {self:?}: each array is kept in \
                 its dtype or in fp32"
            ),
        ))
    }
}

/// How a chunk keeps a state: `kinds` the dtypes DeepSpeed keeps it in (each value rounded to them as
/// its CPU Adam stores it), `stored` the dtypes the chunk keeps each array in (`kinds`' own, or fp32
/// holding their values), and whether the master weights are the half-precision parameters themselves
/// (`master_in_params`: the chunk keeps the moments alone, [`StateKinds::moments_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateLayout {
    pub kinds: StateKinds,
    pub stored: StateKinds,
    pub master_in_params: bool,
}

impl StateLayout {
    /// The state as DeepSpeed keeps it: the moments in fp32 or in the master weights' dtype (an error
    /// naming `moments` otherwise), each array kept in its own dtype or in fp32 (naming `stored_master`
    /// or `stored_moments`), and master weights in the parameters only where they are in half
    /// precision and kept in it (naming `master_in_params`).
    pub fn new(
        kinds: StateKinds,
        stored: StateKinds,
        master_in_params: bool,
    ) -> crate::error::Result<StateLayout> {
        use crate::error::Error;
        // The gradient in the master weights' dtype is always one DeepSpeed takes: the moments' check.
        kinds.check(kinds.master, None).map_err(|e| match e {
            Error::Config { message, .. } => Error::config("moments", message),
            other => other,
        })?;
        for (key, kind, within) in [
            ("stored_master", kinds.master, stored.master),
            ("stored_moments", kinds.moments, stored.moments),
        ] {
            if within != kind && within != Kind::F32 {
                return Err(Error::config(
                    key,
                    format!(
                        "{within:?} cannot hold values of {kind:?}: each array is kept in its dtype \
                         or in fp32"
                    ),
                ));
            }
        }
        if master_in_params && (kinds.master == Kind::F32 || stored.master != kinds.master) {
            return Err(Error::config(
                "master_in_params",
                format!(
                    "master weights in {:?} kept in {:?}: only master weights in the parameters' half \
                     precision are the parameters",
                    kinds.master, stored.master
                ),
            ));
        }
        Ok(StateLayout {
            kinds,
            stored,
            master_in_params,
        })
    }

    /// Where a chunk of `n` elements keeps its state: each array's first byte (master weights,
    /// `exp_avg`, `exp_avg_sq`) and the chunk's bytes ([`StateKinds::layout_for`] of `stored`).
    pub fn offsets(self, n: usize) -> ([usize; 3], usize) {
        self.stored.layout_for(n, self.master_in_params)
    }
}
