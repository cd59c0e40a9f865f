//! Inputs that tell two arithmetics apart. Where the state is in half precision, most elements round
//! to the same bf16 or fp16 value whichever products the compiler fused, so random inputs rarely show
//! a wrong choice: [`witness`] searches for one element whose outputs differ, for the start-up check to
//! give DeepSpeed's kernel.

use super::adam::{AdamConstants, TailFma};
use super::elem::{Bf16, Elem, Kind, StateKinds, F16};
use super::part::rounded_element;

/// One element's inputs: the parameter, `exp_avg`, `exp_avg_sq` (exact in the state's dtypes) and the
/// gradient's bits (in the master weights' dtype where that is half precision, else fp32's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Witness {
    pub param: f32,
    pub exp_avg: f32,
    pub exp_avg_sq: f32,
    pub grad_bits: u32,
}

/// How many random elements [`witness`] tries before it gives up.
pub const TRIES: u32 = 1 << 22;

/// The first of [`TRIES`] random elements (of the magnitudes a training run has, from `seed`) whose
/// outputs with arithmetic `a` differ from those with `b`, for a state in `kinds`' dtypes; None if
/// none does, or for dtypes DeepSpeed does not keep a state in ([`StateKinds::check`]).
pub fn witness(
    a: TailFma,
    b: TailFma,
    k: &AdamConstants,
    grad_scale: f32,
    kinds: StateKinds,
    seed: u64,
) -> Option<Witness> {
    let random = XorShift(seed | 1);
    match (kinds.master, kinds.moments) {
        (Kind::F32, Kind::F32) => search::<f32, f32>(a, b, k, grad_scale, random),
        (Kind::Bf16, Kind::F32) => search::<Bf16, f32>(a, b, k, grad_scale, random),
        (Kind::Bf16, Kind::Bf16) => search::<Bf16, Bf16>(a, b, k, grad_scale, random),
        (Kind::F16, Kind::F32) => search::<F16, f32>(a, b, k, grad_scale, random),
        (Kind::F16, Kind::F16) => search::<F16, F16>(a, b, k, grad_scale, random),
        _ => None,
    }
}

/// [`witness`] with the master weights (and the gradient) in `W`, the moments in `S`.
fn search<W: Elem, S: Elem>(
    a: TailFma,
    b: TailFma,
    k: &AdamConstants,
    grad_scale: f32,
    mut random: XorShift,
) -> Option<Witness> {
    (0..TRIES).find_map(|_| {
        let (w, grad) = random_element::<W, S>(&mut random);
        let run = |how| {
            rounded_element::<W, W, S>(w.param, w.exp_avg, w.exp_avg_sq, grad, grad_scale, k, how)
        };
        let (x, y) = (run(a), run(b));
        let same = x.0.bits() == y.0.bits() && x.1.bits() == y.1.bits() && x.2.bits() == y.2.bits();
        (!same).then_some(w)
    })
}

/// Magnitudes as the start-up check's random chunks have them, each value exact in its dtype: the
/// parameter spread from 0.05 down to 5e-6, `exp_avg` about 1e-3, `exp_avg_sq` up to 1e-6, the gradient
/// about 1e-2. Returns the element and its gradient.
fn random_element<W: Elem, S: Elem>(random: &mut XorShift) -> (Witness, W) {
    let param = random.signed() * 0.05 * 10f32.powf(-4.0 * random.unit());
    let exp_avg = random.signed() * 1e-3;
    let exp_avg_sq = random.unit() * 1e-6;
    let grad = W::narrow(random.signed() * 1e-2);
    let w = Witness {
        param: W::narrow_as_cpu_adam(param).widen(),
        exp_avg: S::narrow_as_cpu_adam(exp_avg).widen(),
        exp_avg_sq: S::narrow_as_cpu_adam(exp_avg_sq).widen(),
        grad_bits: grad.bits(),
    };
    (w, grad)
}

/// Marsaglia's xorshift64: the search needs only a fast, fixed sequence.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-1, 1).
    fn signed(&mut self) -> f32 {
        2.0 * self.unit() - 1.0
    }
}
