//! Inputs that tell two arithmetics apart. Where the state is in half precision, most elements round
//! to the same bf16 or fp16 value whichever products the compiler fused, so random inputs rarely show
//! a wrong choice: [`witness`] searches for one element whose outputs differ, for the start-up check to
//! give DeepSpeed's kernel.

use super::adam::{AdamConstants, TailFma};
use super::elem::{Bf16, Elem, Kind, StateKinds, F16};
use super::pass::rounded_element;

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
/// none does.
pub fn witness(
    a: TailFma,
    b: TailFma,
    k: &AdamConstants,
    grad_scale: f32,
    kinds: StateKinds,
    seed: u64,
) -> Option<Witness> {
    let mut random = XorShift(seed | 1);
    (0..TRIES).find_map(|_| {
        let w = random_element(&mut random, kinds);
        let run = |how| match kinds.master {
            Kind::Bf16 => element(&w, Bf16(w.grad_bits as u16), grad_scale, k, how, kinds),
            Kind::F16 => element(&w, F16(w.grad_bits as u16), grad_scale, k, how, kinds),
            Kind::F32 => element(&w, f32::from_bits(w.grad_bits), grad_scale, k, how, kinds),
        };
        let (x, y) = (run(a), run(b));
        let same = |p: f32, q: f32| p.to_bits() == q.to_bits();
        (!(same(x.0, y.0) && same(x.1, y.1) && same(x.2, y.2))).then_some(w)
    })
}

fn element<G: Elem>(
    w: &Witness,
    grad: G,
    grad_scale: f32,
    k: &AdamConstants,
    how: TailFma,
    kinds: StateKinds,
) -> (f32, f32, f32) {
    rounded_element(
        w.param,
        w.exp_avg,
        w.exp_avg_sq,
        grad,
        grad_scale,
        k,
        how,
        kinds,
    )
}

/// Magnitudes as the start-up check's random chunks have them, each value exact in its dtype: the
/// parameter spread from 0.05 down to 5e-6, `exp_avg` about 1e-3, `exp_avg_sq` up to 1e-6, the gradient
/// about 1e-2.
fn random_element(random: &mut XorShift, kinds: StateKinds) -> Witness {
    let param = random.signed() * 0.05 * 10f32.powf(-4.0 * random.unit());
    let exp_avg = random.signed() * 1e-3;
    let exp_avg_sq = random.unit() * 1e-6;
    let grad = random.signed() * 1e-2;
    let grad_bits = match kinds.master {
        Kind::Bf16 => Bf16::narrow(grad).bits(),
        Kind::F16 => F16::narrow(grad).bits(),
        Kind::F32 => grad.to_bits(),
    };
    Witness {
        param: kinds.master.round_as_cpu_adam(param),
        exp_avg: kinds.moments.round_as_cpu_adam(exp_avg),
        exp_avg_sq: kinds.moments.round_as_cpu_adam(exp_avg_sq),
        grad_bits,
    }
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
