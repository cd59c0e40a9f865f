//! Adam as DeepSpeed's CPU Adam computes it: the per-call constants, the bias corrections' state
//! machine, the two things DeepSpeed's build decides (vector width, fused multiply-adds), and the
//! specification every SIMD path is tested against ([`adam_element`]).

use super::elem::{Kind, StateKinds};

/// How weight decay enters, as DeepSpeed's CPU Adam applies it (only for a decay above 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decay {
    None,
    /// Adam's L2: the gradient gains `decay x param`.
    L2(f32),
    /// AdamW: the parameter gains `w_decay x param`, with `w_decay = -lr x decay`.
    AdamW(f32),
}

/// The per-element constants of one DeepSpeed CPU Adam call (`Step_AVX`'s broadcasts).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConstants {
    pub beta1: f32,
    pub beta2: f32,
    pub one_minus_beta1: f32,
    pub one_minus_beta2: f32,
    pub bias_correction2: f32,
    pub eps: f32,
    pub step_size: f32,
    pub decay: Decay,
}

/// One param group's Adam settings for a call, as DeepSpeed's Python passes them (as floats).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub bias_correction: bool,
    pub adamw: bool,
}

/// How `1 / sqrt(1 - beta2^t)` is computed: DeepSpeed's `update_state` calls an unqualified `sqrt` on
/// a float, which C++ may resolve to the float or the double overload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BiasSqrt {
    Float,
    Double,
}

/// DeepSpeed's bias-correction state, kept per optimizer object (`Adam_Optimizer::IncrementStep` and
/// `update_state`): `beta^t` is multiplied on by one beta when a call's step is the last plus one, and
/// recomputed with `pow` when the betas change or the step jumps. So the history of calls, not only the
/// step, decides the bits; a new process (a resumed job) starts it afresh, as DeepSpeed's does.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamBias {
    step: u64,
    beta1: f32,
    beta2: f32,
    /// beta1 to the step's power (read by the state machine's test).
    pub(super) beta1_t: f32,
    beta2_t: f32,
    sqrt: BiasSqrt,
}

impl AdamBias {
    /// As DeepSpeed's `create_adam` makes it, with the optimizer's initial betas.
    pub fn new(beta1: f32, beta2: f32, sqrt: BiasSqrt) -> Self {
        AdamBias {
            step: 0,
            beta1,
            beta2,
            beta1_t: 1.0,
            beta2_t: 1.0,
            sqrt,
        }
    }

    /// The first Adam step, from 3 on, at which a call that jumps there (the `pow` path) gives another
    /// bias correction with a float square root than with a double one: a call there tells a build's
    /// `sqrt` apart. None if they agree for the first 100 000 steps.
    pub fn sqrt_witness(beta2: f32) -> Option<u64> {
        let hyper = |beta2| AdamHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2,
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: true,
            adamw: true,
        };
        (3..100_000).find(|&step| {
            let mut float = AdamBias::new(0.9, beta2, BiasSqrt::Float);
            let mut double = AdamBias::new(0.9, beta2, BiasSqrt::Double);
            float.constants(step, &hyper(beta2)).bias_correction2
                != double.constants(step, &hyper(beta2)).bias_correction2
        })
    }

    /// `std::pow(float, size_t)`: both promoted to double, the result rounded to float.
    fn pow(beta: f32, step: u64) -> f32 {
        f64::from(beta).powf(step as f64) as f32
    }

    /// The constants of one call at Adam step `step` (the step after this update, as DeepSpeed's
    /// Python passes it), advancing the state as DeepSpeed's `IncrementStep` does.
    pub fn constants(&mut self, step: u64, h: &AdamHyper) -> AdamConstants {
        if h.beta1 != self.beta1 || h.beta2 != self.beta2 {
            self.step = step;
            self.beta1 = h.beta1;
            self.beta2 = h.beta2;
            self.beta1_t = Self::pow(self.beta1, step);
            self.beta2_t = Self::pow(self.beta2, step);
        } else if step == self.step + 1 {
            self.step += 1;
            self.beta1_t *= self.beta1;
            self.beta2_t *= self.beta2;
        } else if step != self.step {
            self.beta1_t = Self::pow(self.beta1, step);
            self.beta2_t = Self::pow(self.beta2, step);
            self.step = step;
        }
        let (bias_correction1, bias_correction2) = if h.bias_correction {
            let second = match self.sqrt {
                BiasSqrt::Float => 1.0 / (1.0 - self.beta2_t).sqrt(),
                BiasSqrt::Double => (1.0 / f64::from(1.0 - self.beta2_t).sqrt()) as f32,
            };
            (1.0 - self.beta1_t, second)
        } else {
            (1.0, 1.0)
        };
        let decay = if h.weight_decay > 0.0 {
            if h.adamw {
                Decay::AdamW(-h.lr * h.weight_decay)
            } else {
                Decay::L2(h.weight_decay)
            }
        } else {
            Decay::None
        };
        AdamConstants {
            beta1: self.beta1,
            beta2: self.beta2,
            one_minus_beta1: 1.0 - self.beta1,
            one_minus_beta2: 1.0 - self.beta2,
            bias_correction2,
            eps: h.eps,
            step_size: -h.lr / bias_correction1,
            decay,
        }
    }
}

/// Which product of a `old * beta` plus `grad * (1 - beta)` moment update the compiler fused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MomentFma {
    /// `fma(grad, 1 - beta, old * beta)`, as DeepSpeed's SIMD code writes it.
    Gradient,
    /// `fma(old, beta, grad * (1 - beta))`.
    Old,
    /// No fused multiply-add: two products and a sum, each rounded.
    Separate,
}

/// How a DeepSpeed build computes the last `n % width` elements of a call in its scalar loop: the
/// compiler's fusing of its multiply-adds (C++ allows it, GCC does it by default, and which product of a
/// sum it fuses depends on its passes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailFma {
    pub momentum: MomentFma,
    pub variance: MomentFma,
    /// The decay, denominator and parameter updates (one product each) fused or not.
    pub others: bool,
}

impl TailFma {
    /// The arithmetic of DeepSpeed's SIMD code, which every element below a call's last `n % width`
    /// gets.
    pub const VECTOR: TailFma = TailFma {
        momentum: MomentFma::Gradient,
        variance: MomentFma::Gradient,
        others: true,
    };
}

/// What a fused pass must know of the DeepSpeed build it matches (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeepSpeedArith {
    /// Elements per SIMD vector of DeepSpeed's build (16 with AVX-512, 8 with AVX2, 4 with NEON; 1 for a
    /// build without SIMD, whose every element takes the scalar loop).
    pub vector_width: usize,
    pub tail: TailFma,
    pub bias_sqrt: BiasSqrt,
}

impl DeepSpeedArith {
    /// The vector width of DeepSpeed's build for a state in `kinds`' dtypes: its `Step_AVX` takes bf16
    /// weights or moments only with AVX-512 or NEON (16 or 4 lanes); an AVX2 build's runs every element
    /// of them through its scalar loop.
    pub fn vector_width_for(&self, kinds: StateKinds) -> usize {
        let bf16 = kinds.master == Kind::Bf16 || kinds.moments == Kind::Bf16;
        if bf16 && self.vector_width == 8 {
            1
        } else {
            self.vector_width
        }
    }

    /// Every combination a start-up check may try, the likeliest first.
    pub fn candidates() -> Vec<DeepSpeedArith> {
        let moments = [MomentFma::Gradient, MomentFma::Old, MomentFma::Separate];
        let mut out = Vec::new();
        for bias_sqrt in [BiasSqrt::Float, BiasSqrt::Double] {
            for vector_width in [16, 8, 4, 1] {
                for others in [true, false] {
                    for momentum in moments {
                        for variance in moments {
                            out.push(DeepSpeedArith {
                                vector_width,
                                tail: TailFma {
                                    momentum,
                                    variance,
                                    others,
                                },
                                bias_sqrt,
                            });
                        }
                    }
                }
            }
        }
        out
    }
}

#[inline(always)]
fn product_sum(a: f32, b: f32, c: f32, fused: bool) -> f32 {
    if fused {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
fn moment(old: f32, beta: f32, grad: f32, one_minus: f32, how: MomentFma) -> f32 {
    match how {
        MomentFma::Gradient => grad.mul_add(one_minus, old * beta),
        MomentFma::Old => old.mul_add(beta, grad * one_minus),
        MomentFma::Separate => grad * one_minus + old * beta,
    }
}

/// The specification: one element's Adam step from its (already unscaled) fp32 gradient, in DeepSpeed's
/// order of operations, with `how`'s fusing. Returns the new parameter, `exp_avg` and `exp_avg_sq`.
#[inline(always)]
pub fn adam_element(
    param: f32,
    grad: f32,
    exp_avg: f32,
    exp_avg_sq: f32,
    k: &AdamConstants,
    how: TailFma,
) -> (f32, f32, f32) {
    let mut grad = grad;
    let mut param = param;
    if let Decay::L2(decay) = k.decay {
        grad = product_sum(param, decay, grad, how.others);
    }
    let m = moment(exp_avg, k.beta1, grad, k.one_minus_beta1, how.momentum);
    let v = moment(
        exp_avg_sq,
        k.beta2,
        grad * grad,
        k.one_minus_beta2,
        how.variance,
    );
    let denominator = product_sum(v.sqrt(), k.bias_correction2, k.eps, how.others);
    let update = m / denominator;
    if let Decay::AdamW(w_decay) = k.decay {
        param = product_sum(param, w_decay, param, how.others);
    }
    (product_sum(update, k.step_size, param, how.others), m, v)
}
