//! The update's per-chunk work in one pass over memory: the half-precision gradient widened to fp32 and
//! unscaled (DeepSpeed's `unscale_and_clip_grads`), Adam or AdamW exactly as DeepSpeed's CPU Adam
//! computes it, and the new half-precision parameters (DeepSpeed's copy into its bf16/fp16 partition).
//! Where those run as four passes (a cast, a multiply, CPU Adam, a copy) each element here is read once
//! and written once: 14 bytes read and 14 written per element (bf16) against about 54.
//!
//! Bit-equality with DeepSpeed is the contract. It holds because every element goes through the same
//! IEEE operations in the same order: [`adam_element`] is the specification, written from DeepSpeed
//! 0.19's `cpu_adam.h` (`Step_AVX`, with a fused multiply-add wherever it uses `SIMD_FMA`), and the SIMD
//! paths are tested against it. Two things are DeepSpeed's build's, not its source's, so they are
//! parameters ([`DeepSpeedArith`]) found at start-up by comparing with DeepSpeed's own kernel on this CPU:
//! the vector width of its build (the last `n % width` elements of a call take its scalar loop), and how
//! the compiler fused that scalar loop's multiply-adds. The bias corrections follow DeepSpeed's
//! per-optimizer state machine ([`AdamBias`]), whose history (not only the step) decides them.
//!
//! The same pass can checksum the chunk's state as read and as written, for the store ([`Cuts`]): each
//! thread takes its range in blocks small enough to stay in the CPU's cache, hashes a block's state
//! before and after updating it, and the pieces are combined into one CRC32C per stripe, so the store
//! neither hashes the bytes again nor verifies the read on its own threads. Where the CPU has AVX-512
//! (or AVX2) and VPCLMULQDQ ([`Simd::Avx512Clmul`], [`Simd::Avx2Clmul`]) not even the cache is read
//! again: each vector of the state is folded into its stream's running CRC in the register it was
//! loaded into or stored from, two carry-less multiplications that run beside the update's divisions
//! and square roots.

use std::sync::{Arc, Mutex};

use crc_fast::CrcAlgorithm::Crc32Iscsi;

use crate::checksum::crc32c_combine;
use crate::error::{Error, Result};

/// bf16 bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

/// IEEE half bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct F16(pub u16);

/// The element types of a gradient or of parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    F32,
    Bf16,
    F16,
}

impl Kind {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Kind::F32 => 4,
            Kind::Bf16 | Kind::F16 => 2,
        }
    }

    /// `"float32"`, `"bfloat16"` or `"float16"` (torch's names); anything else is an error naming `key`.
    pub fn parse(key: &str, value: &str) -> Result<Kind> {
        match value {
            "float32" => Ok(Kind::F32),
            "bfloat16" => Ok(Kind::Bf16),
            "float16" => Ok(Kind::F16),
            other => Err(Error::config(
                key,
                format!("{other:?} is not \"float32\", \"bfloat16\" or \"float16\""),
            )),
        }
    }
}

/// An element type of the gradient or the parameters, converted to and from fp32 as torch converts it
/// on x86-64 (the specification the SIMD paths are held to).
pub trait Elem: Copy + Send + Sync + 'static {
    const KIND: Kind;
    fn widen(self) -> f32;
    fn narrow(x: f32) -> Self;
    /// The element's bits (in the low `KIND.size()` bytes).
    fn bits(self) -> u32;
}

impl Elem for f32 {
    const KIND: Kind = Kind::F32;
    fn widen(self) -> f32 {
        self
    }
    fn narrow(x: f32) -> Self {
        x
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl Elem for Bf16 {
    const KIND: Kind = Kind::Bf16;
    /// Exact: the bf16 bits are the high half of the fp32 ones (NaN payloads kept, as torch's shift).
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
    /// Round to nearest even; every NaN becomes 0xffff, as torch's vectorised copy writes it.
    fn narrow(x: f32) -> Self {
        if x.is_nan() {
            return Bf16(0xffff);
        }
        let bits = x.to_bits();
        let rounding = ((bits >> 16) & 1) + 0x7fff;
        Bf16((bits.wrapping_add(rounding) >> 16) as u16)
    }
    fn bits(self) -> u32 {
        u32::from(self.0)
    }
}

impl Elem for F16 {
    const KIND: Kind = Kind::F16;
    /// Exact (subnormal halves become normal floats); a NaN keeps its payload and becomes quiet, as
    /// F16C's `vcvtph2ps` does.
    fn widen(self) -> f32 {
        let h = u32::from(self.0);
        let sign = (h & 0x8000) << 16;
        let exp = (h >> 10) & 0x1f;
        let man = h & 0x3ff;
        let bits = match (exp, man) {
            (0, 0) => sign,
            (0, _) => {
                // Subnormal: normalise the significand.
                let shift = man.leading_zeros() - 21;
                let man = (man << shift) & 0x3ff;
                sign | ((127 - 15 + 1 - shift) << 23) | (man << 13)
            }
            (0x1f, 0) => sign | 0x7f80_0000,
            (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
            _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
        };
        f32::from_bits(bits)
    }
    /// Round to nearest even, overflow to infinity, NaN quiet with the payload's top bits, as F16C's
    /// `vcvtps2ph` (which torch uses) does.
    fn narrow(x: f32) -> Self {
        let bits = x.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let exp = ((bits >> 23) & 0xff) as i32;
        let man = bits & 0x7f_ffff;
        if exp == 0xff {
            let nan = if man != 0 {
                0x0200 | (man >> 13) as u16
            } else {
                0
            };
            return F16(sign | 0x7c00 | nan);
        }
        // The value as a 24-bit significand (implicit bit included) times 2^(e - 23).
        let e = exp - 127;
        if e > 15 {
            return F16(sign | 0x7c00);
        }
        let (significand, e) = if exp == 0 {
            (man, -126)
        } else {
            (man | 0x80_0000, e)
        };
        // Bits of the 24-bit significand to drop: 13 for a normal half, more below its range.
        let drop = if e >= -14 { 13 } else { 13 + (-14 - e) as u32 };
        if drop > 24 {
            return F16(sign);
        }
        let kept = significand >> drop;
        let rest = significand & ((1 << drop) - 1);
        let half = 1 << (drop - 1);
        let rounded = kept + u32::from(rest > half || (rest == half && kept & 1 == 1));
        // Normal halves: the exponent field, to which a rounding carry adds naturally.
        let value = if e >= -14 {
            (((e + 15) as u32) << 10) + rounded - 0x400
        } else {
            rounded
        };
        F16(sign | value.min(0x7c00) as u16)
    }
    fn bits(self) -> u32 {
        u32::from(self.0)
    }
}

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
    beta1_t: f32,
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

/// The SIMD instructions a pass uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    /// 16 lanes (AVX-512F), and the checksums folded into the same loop with VPCLMULQDQ: each
    /// 64-byte vector of the state hashed in the register it was loaded into or stored from.
    Avx512Clmul,
    /// 16 lanes (AVX-512F); the checksums hashed block by block after and before it.
    Avx512,
    /// 8 lanes (AVX2, FMA, F16C), the checksums folded in the loop with VPCLMULQDQ (as `Avx512Clmul`).
    Avx2Clmul,
    /// 8 lanes (AVX2, FMA, F16C).
    Avx2,
    /// The specification itself, element by element (aarch64, older x86-64).
    Scalar,
}

impl Simd {
    /// The widest this CPU runs.
    pub fn detect() -> Simd {
        [Simd::Avx512Clmul, Simd::Avx512, Simd::Avx2Clmul, Simd::Avx2]
            .into_iter()
            .find(|simd| simd.available())
            .unwrap_or(Simd::Scalar)
    }

    /// Whether this CPU has the instructions.
    fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = || {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            };
            let clmul = || is_x86_feature_detected!("vpclmulqdq");
            match self {
                Simd::Avx512Clmul => is_x86_feature_detected!("avx512f") && clmul(),
                Simd::Avx512 => is_x86_feature_detected!("avx512f"),
                Simd::Avx2Clmul => avx2() && clmul(),
                Simd::Avx2 => avx2(),
                Simd::Scalar => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Simd::Scalar
        }
    }

    /// `"auto"` (the widest here), `"avx512-clmul"`, `"avx512"`, `"avx2-clmul"`, `"avx2"` or `"scalar"`;
    /// one this CPU cannot run is an error naming `key`.
    pub fn parse(key: &str, value: &str) -> Result<Simd> {
        let simd = match value {
            "auto" => return Ok(Simd::detect()),
            "avx512-clmul" => Simd::Avx512Clmul,
            "avx512" => Simd::Avx512,
            "avx2-clmul" => Simd::Avx2Clmul,
            "avx2" => Simd::Avx2,
            "scalar" => Simd::Scalar,
            other => {
                return Err(Error::config(
                    key,
                    format!(
                        "{other:?} is not \"auto\", \"avx512-clmul\", \"avx512\", \"avx2-clmul\", \"avx2\" or \"scalar\""
                    ),
                ))
            }
        };
        if !simd.available() {
            return Err(Error::config(
                key,
                format!("{value:?}: this CPU lacks the instructions"),
            ));
        }
        Ok(simd)
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Avx512Clmul => "avx512-clmul",
            Simd::Avx512 => "avx512",
            Simd::Avx2Clmul => "avx2-clmul",
            Simd::Avx2 => "avx2",
            Simd::Scalar => "scalar",
        }
    }

    fn lanes(self) -> usize {
        match self {
            Simd::Avx512Clmul | Simd::Avx512 => 16,
            Simd::Avx2Clmul | Simd::Avx2 => 8,
            Simd::Scalar => 1,
        }
    }
}

/// One chunk's memory for a fused update: `state` is `[params | exp_avg | exp_avg_sq]` (fp32, `3 n`),
/// `grad` the chunk's gradient (`n`), `params` where the new half-precision parameters go (`n`), if
/// anywhere.
pub struct Chunk<'a, G: Elem, P: Elem> {
    pub state: &'a mut [f32],
    pub grad: &'a [G],
    pub params: Option<&'a mut [P]>,
    /// Keep the parameters as they were before the pass wherever they are not the old weights
    /// narrowed ([`ChunkSums::kept_params`]), so that an update that is undone can give them back
    /// (the old weights alone give back the rest). Needs `params`.
    pub keep_params: bool,
    /// Where the state as it was before the pass goes (`3 n` fp32, laid out as `state`), copied a block
    /// at a time in the pass itself, while the block is in the core's cache for its update: an update
    /// of state kept nowhere else (a chunk cached in host memory) that may be undone gives it back from
    /// here, at the cost of this write alone (no second read of the state).
    pub keep_state: Option<&'a mut [f32]>,
}

/// Elements per thread's share are a multiple of this: whole cache lines of every array, so no two
/// threads write one line.
const SHARE_ALIGN: usize = 64;

/// Elements per block of a thread's range: its state, gradient and parameters (128 KiB in bf16) stay in
/// the core's own cache between the read's checksum, the update and the write's checksum. A multiple of
/// every SIMD width.
const BLOCK: usize = 8192;

/// Where to cut the checksums of a chunk's state (`[params | exp_avg | exp_avg_sq]`, `12 n` bytes), as
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
fn elem_bytes<P: Elem>(x: &[P]) -> Vec<u8> {
    let size = P::KIND.size();
    x.iter()
        .flat_map(|e| e.bits().to_le_bytes().into_iter().take(size))
        .collect()
}

/// One contiguous byte range of the state, within one stripe, one array and one thread's range: hashed
/// as the blocks pass by.
struct Piece {
    start: u64,
    end: u64,
    /// The CRC32C of its first bytes where they were folded in the SIMD loop (`Simd::Avx512Clmul`).
    folded: Option<u32>,
    /// Of the bytes after those, how many `digest` hashed.
    digested: u64,
    digest: crc_fast::Digest,
}

/// The pieces of one thread's range of the state, per array, cut at `cuts`.
fn pieces(cuts: &[u64], n: usize, first: usize, len: usize) -> [Vec<Piece>; 3] {
    std::array::from_fn(|a| {
        let (lo, hi) = (
            (a * 4 * n + 4 * first) as u64,
            (a * 4 * n + 4 * (first + len)) as u64,
        );
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

fn as_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: any f32 is four initialised bytes; the view lives no longer than `x`.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}

/// Each stripe's CRC32C from the pieces (together covering every byte once): combined in order.
fn stripe_sums(cuts: &[u64], mut pieces: Vec<(u64, u64, u32)>) -> Vec<u32> {
    pieces.sort_unstable_by_key(|p| p.0);
    let mut sums = vec![0u32; cuts.len()];
    for (start, len, crc) in pieces {
        // The stripe holding this piece: the last start at or before it.
        let s = cuts.partition_point(|&c| c <= start).saturating_sub(1);
        sums[s] = crc32c_combine(sums[s], crc, len);
    }
    sums
}

fn check_cuts(name: &str, cuts: &[u64], total: u64) -> Result<()> {
    let ascending = cuts.windows(2).all(|w| w[0] < w[1]);
    if cuts.first() != Some(&0) || !ascending || cuts.last().is_some_and(|&c| c >= total.max(1)) {
        return Err(Error::config(
            name,
            format!("{cuts:?} must ascend from 0 within the {total} bytes of the state"),
        ));
    }
    Ok(())
}

/// Updates `chunk` in one pass: each gradient element widened and multiplied by `grad_scale`, Adam with
/// `k` as DeepSpeed computes it (its last `n % arith.vector_width` elements with `arith.tail`'s
/// arithmetic), the new parameters narrowed into `chunk.params`, and the state's checksums where `cuts`
/// asks for them. Runs on `threads` threads (the caller's among them), each over its own range.
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
    let n = chunk.grad.len();
    if chunk.state.len() != 3 * n {
        return Err(Error::config(
            "state",
            format!(
                "{} fp32 elements for a gradient of {n}: [params | exp_avg | exp_avg_sq] needs {}",
                chunk.state.len(),
                3 * n
            ),
        ));
    }
    if let Some(params) = &chunk.params {
        if params.len() != n {
            return Err(Error::config(
                "params",
                format!("{} elements for a gradient of {n}", params.len()),
            ));
        }
    }
    if chunk.keep_params && chunk.params.is_none() {
        return Err(Error::config(
            "keep_params",
            "keeps the parameters before the pass, and no params were given",
        ));
    }
    if let Some(kept) = &chunk.keep_state {
        if kept.len() != 3 * n {
            return Err(Error::config(
                "keep_state",
                format!("{} fp32 elements to keep a state of {}", kept.len(), 3 * n),
            ));
        }
    }
    if arith.vector_width == 0 {
        return Err(Error::config("vector_width", "must be at least 1"));
    }
    let total = 12 * n as u64;
    for (name, c) in [("read_cuts", cuts.read), ("write_cuts", cuts.write)] {
        if let Some(c) = c {
            check_cuts(name, c, total)?;
        }
    }
    let (p, rest) = chunk.state.split_at_mut(n);
    let (m, v) = rest.split_at_mut(n);
    // Elements below `body` get DeepSpeed's vector arithmetic, the rest its scalar loop's.
    let body = n - n % arith.vector_width;
    let threads = threads.clamp(1, n.div_ceil(SHARE_ALIGN).max(1));
    let share = (n / threads).next_multiple_of(SHARE_ALIGN);
    let mut parts = Vec::with_capacity(threads);
    let (mut p, mut m, mut v, mut g) = (p, m, v, chunk.grad);
    let mut out = chunk.params;
    let mut keep = chunk.keep_state.map(|kept| {
        let (kp, rest) = kept.split_at_mut(n);
        let (km, kv) = rest.split_at_mut(n);
        [kp, km, kv]
    });
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
        let ks = keep.take().map(|[kp, km, kv]| {
            let (kp0, kp1) = kp.split_at_mut(len);
            let (km0, km1) = km.split_at_mut(len);
            let (kv0, kv1) = kv.split_at_mut(len);
            keep = Some([kp1, km1, kv1]);
            [kp0, km0, kv0]
        });
        // Of this part, how much lies below `body` (vector arithmetic).
        let vector = body.saturating_sub(first).min(len);
        let sums = [cuts.read, cuts.write].map(|c| c.map(|c| pieces(c, n, first, len)));
        parts.push(Part {
            p: p0,
            m: m0,
            v: v0,
            g: g0,
            o: o0,
            vector,
            offsets: [4 * first, 4 * (n + first), 4 * (2 * n + first)],
            sums,
            kept: chunk.keep_params.then(Vec::new),
            kept_state: ks,
        });
        (p, m, v, g) = (p1, m1, v1, g1);
        first += len;
    }
    let run = |part: Part<'_, G, P>| run_part(part, grad_scale, k, arith.tail, simd);
    let done: Vec<(Hashed, Option<Vec<KeptParams>>)> = run_on_workers(parts, run)?;
    let [read, write] = [0, 1].map(|d| {
        [cuts.read, cuts.write][d].map(|c| {
            let pieces = done
                .iter()
                .flat_map(|(h, _)| h[d].iter().flatten().copied())
                .collect();
            stripe_sums(c, pieces)
        })
    });
    // The parts in order, each's blocks in order.
    let kept_params = chunk.keep_params.then(|| {
        done.into_iter()
            .flat_map(|(_, k)| k.unwrap_or_default())
            .collect()
    });
    Ok(ChunkSums {
        read,
        write,
        kept_params,
    })
}

/// The update's worker threads: one pool per number of threads beside the caller's, started the first
/// time a pass asks for that many and kept for the process's life. A pass wakes them instead of starting
/// threads: a start costs the caller tens of microseconds each (15 of them about a third of a millisecond
/// on a VM, against a chunk's 2-3 ms), and the last one started decides when the chunk ends. Passes that
/// run at once on the same count (two engines in one process) share its workers.
fn workers(others: usize) -> Result<Arc<rayon::ThreadPool>> {
    struct Pools {
        /// The process that started them: a child forked after a pass has none of their threads, and
        /// starts its own.
        pid: u32,
        by_count: Vec<(usize, Arc<rayon::ThreadPool>)>,
    }
    static POOLS: Mutex<Pools> = Mutex::new(Pools {
        pid: 0,
        by_count: Vec::new(),
    });
    let mut pools = POOLS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let pid = std::process::id();
    if pools.pid != pid {
        // Forgotten, not dropped: dropping a pool signals threads that exist only in the parent.
        std::mem::forget(std::mem::take(&mut pools.by_count));
        pools.pid = pid;
    }
    if let Some((_, pool)) = pools.by_count.iter().find(|(n, _)| *n == others) {
        return Ok(pool.clone());
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(others)
        .thread_name(|i| format!("mlp-update-{i}"))
        .build()
        .map_err(|e| {
            Error::config(
                "update_threads",
                format!("could not start {} threads for the update: {e}", others + 1),
            )
        })?;
    let pool = Arc::new(pool);
    pools.by_count.push((others, pool.clone()));
    Ok(pool)
}

/// Runs `run` over `parts`, the first on the caller's thread and each other on a worker of
/// [`workers`]; the results in the parts' order.
fn run_on_workers<T: Send, R: Send>(parts: Vec<T>, run: impl Fn(T) -> R + Sync) -> Result<Vec<R>> {
    let mut parts = parts.into_iter();
    let Some(mine) = parts.next() else {
        return Ok(Vec::new());
    };
    if parts.len() == 0 {
        return Ok(vec![run(mine)]);
    }
    let pool = workers(parts.len())?;
    let mut done: Vec<Option<R>> = Vec::new();
    done.resize_with(parts.len() + 1, || None);
    let run = &run;
    let (first, rest) = done.split_first_mut().expect("one part at least");
    // A panic in a worker's part comes back here, once every part has ended.
    pool.in_place_scope(|scope| {
        for (part, slot) in parts.zip(rest) {
            scope.spawn(move |_| *slot = Some(run(part)));
        }
        *first = Some(run(mine));
    });
    Ok(done
        .into_iter()
        .map(|r| r.expect("every part ran"))
        .collect())
}

/// [`update`] over raw memory: `state` holds `3 count` fp32 elements, `grad` `count` of its kind,
/// `params` (if given) `count` of its kind, kept where they are not the weights narrowed with
/// `keep_params` ([`Chunk::keep_params`]). Misaligned addresses are an error naming the array.
///
/// # Safety
/// Every address must point to live memory of that many elements, which nothing else reads or writes
/// until this returns, and no two ranges may overlap.
#[allow(clippy::too_many_arguments)]
pub unsafe fn update_at(
    state: usize,
    grad: (usize, Kind),
    params: Option<(usize, Kind)>,
    keep_params: bool,
    keep_state: Option<usize>,
    count: usize,
    grad_scale: f32,
    k: &AdamConstants,
    arith: &DeepSpeedArith,
    simd: Simd,
    threads: usize,
    cuts: Cuts<'_>,
) -> Result<ChunkSums> {
    for (name, address, kind) in [("state", state, Kind::F32), ("grad", grad.0, grad.1)]
        .into_iter()
        .chain(params.map(|(a, kind)| ("params", a, kind)))
        .chain(keep_state.map(|a| ("keep_state", a, Kind::F32)))
    {
        if address == 0 || address % kind.size() != 0 {
            return Err(Error::config(
                name,
                format!("address {address:#x} is not aligned for {kind:?} elements"),
            ));
        }
    }
    // SAFETY: the caller's promise, and the alignment checked above.
    let state = unsafe { std::slice::from_raw_parts_mut(state as *mut f32, 3 * count) };
    // SAFETY: as above.
    let keep_state = keep_state.map(|a| unsafe { slice_mut::<f32>(a, 3 * count) });
    // SAFETY: as above.
    unsafe {
        match grad.1 {
            Kind::F32 => update_with_params(
                state,
                slice::<f32>(grad.0, count),
                params,
                keep_params,
                keep_state,
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
    state: &mut [f32],
    grad: &[G],
    params: Option<(usize, Kind)>,
    keep_params: bool,
    keep_state: Option<&mut [f32]>,
    count: usize,
    grad_scale: f32,
    k: &AdamConstants,
    arith: &DeepSpeedArith,
    simd: Simd,
    threads: usize,
    cuts: Cuts<'_>,
) -> Result<ChunkSums> {
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
type Hashed = [Option<Vec<(u64, u64, u32)>>; 2];

/// One thread's range of a chunk: its arrays, how many of its first elements take the vector
/// arithmetic, each array's first byte in the state, and its checksum pieces (as read, as written).
struct Part<'a, G, P> {
    p: &'a mut [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    g: &'a [G],
    o: Option<&'a mut [P]>,
    vector: usize,
    offsets: [usize; 3],
    sums: [Option<[Vec<Piece>; 3]>; 2],
    /// Where the parameters before the pass are kept ([`Chunk::keep_params`]).
    kept: Option<Vec<KeptParams>>,
    /// Where the state before the pass is copied ([`Chunk::keep_state`]): this range's params,
    /// exp_avg and exp_avg_sq.
    kept_state: Option<[&'a mut [f32]; 3]>,
}

impl<G: Elem, P: Elem> Part<'_, G, P> {
    /// Elements `b0..b1` of every array, for a SIMD pass.
    #[cfg(target_arch = "x86_64")]
    fn lanes(&mut self, b0: usize, b1: usize) -> x86::Lanes {
        x86::Lanes {
            p: self.p[b0..b1].as_mut_ptr(),
            m: self.m[b0..b1].as_mut_ptr(),
            v: self.v[b0..b1].as_mut_ptr(),
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
    if matches!(simd, Simd::Avx512Clmul | Simd::Avx2Clmul) {
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
fn keep_block<G: Elem, P: Elem>(part: &mut Part<'_, G, P>, b0: usize, b1: usize, simd: Simd) {
    if let Some(to) = part.kept_state.as_mut() {
        for (to, from) in to.iter_mut().zip([&*part.p, &*part.m, &*part.v]) {
            let (to, from) = (&mut to[b0..b1], &from[b0..b1]);
            #[cfg(target_arch = "x86_64")]
            if simd != Simd::Scalar {
                // SAFETY: every SIMD but the scalar one needs AVX (`Simd::available`).
                unsafe { x86::copy_streaming(to, from) };
                continue;
            }
            to.copy_from_slice(from);
        }
    }
    let (Some(kept), Some(o)) = (part.kept.as_mut(), part.o.as_deref()) else {
        return;
    };
    if !narrows_to(&part.p[b0..b1], &o[b0..b1], simd) {
        kept.push(KeptParams {
            first: part.offsets[0] / 4 + b0,
            bytes: elem_bytes(&o[b0..b1]),
        });
    }
}

/// Each piece's `(start, len, crc)`: its folded first bytes and its hashed rest, combined.
fn finish_pieces(sums: [Option<[Vec<Piece>; 3]>; 2]) -> Hashed {
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
fn fold_splits<G: Elem, P: Elem>(part: &Part<'_, G, P>, lanes: usize) -> Option<Vec<usize>> {
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
fn run_part_folding<G: Elem, P: Elem>(
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
fn hash_block<G: Elem, P: Elem>(part: &mut Part<'_, G, P>, d: usize, b0: usize, b1: usize) {
    if let Some(pieces) = &mut part.sums[d] {
        for (a, x) in [&*part.p, &*part.m, &*part.v].into_iter().enumerate() {
            hash(
                &mut pieces[a],
                (part.offsets[a] + 4 * b0) as u64,
                as_bytes(&x[b0..b1]),
            );
        }
    }
}

/// Elements `b0..b1` of a thread's range (see [`run_part`]).
fn run_block<G: Elem, P: Elem>(
    part: &mut Part<'_, G, P>,
    b0: usize,
    b1: usize,
    grad_scale: f32,
    k: &AdamConstants,
    tail: TailFma,
    simd: Simd,
) {
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
    let (p, m, v, g) = (&mut *part.p, &mut *part.m, &mut *part.v, part.g);
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The vector arithmetic of [`super::adam_element`] (`TailFma::VECTOR`) with x86 intrinsics, lane
    //! for lane the same operations: DeepSpeed's `Step_AVX` with the conversions around it.

    use std::arch::x86_64::*;

    use super::{AdamConstants, Decay, Kind};

    /// `to` becomes `from`, its aligned 32-byte stretches written with stores that bypass the cache
    /// (the kept state is read again only by an undo, long after): no read of the lines first, and
    /// the cache stays the pass's. Fenced, so the stores are visible once it returns.
    ///
    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub unsafe fn copy_streaming(to: &mut [f32], from: &[f32]) {
        assert_eq!(to.len(), from.len(), "a copy between slices of one length");
        // Elements before the first 32-byte boundary of `to`, then whole vectors, then the rest.
        let head = to.as_ptr().align_offset(32).min(to.len());
        let body = (to.len() - head) / 8 * 8;
        to[..head].copy_from_slice(&from[..head]);
        for i in (head..head + body).step_by(8) {
            // SAFETY: `i + 8 <= to.len()` and `from` is as long; `to[i..]` is 32-byte aligned
            // (`head`, then steps of 8 fp32); AVX is the caller's promise.
            unsafe {
                _mm256_stream_ps(
                    to.as_mut_ptr().add(i),
                    _mm256_loadu_ps(from.as_ptr().add(i)),
                )
            };
        }
        to[head + body..].copy_from_slice(&from[head + body..]);
        _mm_sfence();
    }

    /// 16 elements of `kind` at `src`, widened to fp32 as `Elem::widen` does.
    ///
    /// # Safety
    /// `src` must hold 16 readable elements of `kind`; AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(kind: Kind, src: *const u8) -> __m512 {
        // SAFETY: the caller's promise.
        unsafe {
            match kind {
                Kind::F32 => _mm512_loadu_ps(src.cast()),
                Kind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(src.cast()),
                ))),
                Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(src.cast())),
            }
        }
    }

    /// 16 lanes of `x` narrowed to `kind` at `dst`, as `Elem::narrow` does (bf16: torch's
    /// `cvtfp32_bf16`, round to nearest even and NaN lanes 0xffff; fp16: F16C, as torch). With
    /// `stream`, by stores that bypass the cache: weakly ordered, the caller fences.
    ///
    /// # Safety
    /// `dst` must hold 16 writable elements of `kind`, with `stream` aligned to their bytes (32 in
    /// two-byte kinds, 64 in fp32); AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store16(kind: Kind, dst: *mut u8, x: __m512, stream: bool) {
        // SAFETY: the caller's promise.
        unsafe {
            match (kind, stream) {
                (Kind::F32, false) => _mm512_storeu_ps(dst.cast(), x),
                (Kind::F32, true) => _mm512_stream_ps(dst.cast(), x),
                (Kind::Bf16 | Kind::F16, false) => {
                    _mm256_storeu_si256(dst.cast(), narrow16(kind, x))
                }
                (Kind::Bf16 | Kind::F16, true) => {
                    _mm256_stream_si256(dst.cast(), narrow16(kind, x))
                }
            }
        }
    }

    /// 16 lanes of `x` narrowed to `kind`, a two-byte kind, as `store16` stores them.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn narrow16(kind: Kind, x: __m512) -> __m256i {
        if kind == Kind::F16 {
            return _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        }
        let bits = _mm512_castps_si512(x);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
            bits,
            _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)),
        ));
        let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(x, x);
        let out = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), rounded);
        _mm512_cvtusepi32_epi16(out)
    }

    /// 8 elements of `kind` at `src`, widened as `Elem::widen` does.
    ///
    /// # Safety
    /// `src` must hold 8 readable elements of `kind`; AVX2 and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8(kind: Kind, src: *const u8) -> __m256 {
        // SAFETY: the caller's promise.
        unsafe {
            match kind {
                Kind::F32 => _mm256_loadu_ps(src.cast()),
                Kind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(src.cast()),
                ))),
                Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(src.cast())),
            }
        }
    }

    /// 8 lanes of `x` narrowed to `kind` at `dst`, as `store16` (with `stream`, `dst` aligned to 16
    /// bytes in two-byte kinds, 32 in fp32).
    ///
    /// # Safety
    /// `dst` must hold 8 writable elements of `kind`, with `stream` so aligned; AVX2 and F16C must be
    /// available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store8(kind: Kind, dst: *mut u8, x: __m256, stream: bool) {
        // SAFETY: the caller's promise.
        unsafe {
            match (kind, stream) {
                (Kind::F32, false) => _mm256_storeu_ps(dst.cast(), x),
                (Kind::F32, true) => _mm256_stream_ps(dst.cast(), x),
                (Kind::Bf16 | Kind::F16, false) => _mm_storeu_si128(dst.cast(), narrow8(kind, x)),
                (Kind::Bf16 | Kind::F16, true) => _mm_stream_si128(dst.cast(), narrow8(kind, x)),
            }
        }
    }

    /// 8 lanes of `x` narrowed to `kind`, a two-byte kind, as `store8` stores them.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn narrow8(kind: Kind, x: __m256) -> __m128i {
        if kind == Kind::F16 {
            return _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
        }
        let bits = _mm256_castps_si256(x);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
            bits,
            _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)),
        ));
        let unordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
        let out = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0xffff), unordered);
        // The eight 32-bit lanes (each at most 0xffff) packed to 16 bits, in order.
        let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(out, out));
        _mm256_castsi256_si128(packed)
    }

    /// Whether the `len` fp32 values at `p`, narrowed to `kind` as the stores narrow them, are the `len`
    /// elements of `kind` at `o`, bit for bit, for one vector width: written once for every width.
    macro_rules! narrows_to_lanes {
        (
            $(#[$doc:meta])*
            $name:ident, $features:literal, $lanes:literal, loadu: $loadu:ident, narrow: $narrow:ident,
            zero: $zero:ident, or: $or:ident, test: $test:ident == $clear:literal,
            fp32: ($cast:ident, $xor:ident, $load:ident),
            half: ($widen:ident, $hxor:ident, $hload:ident)
        ) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub unsafe fn $name(kind: Kind, p: *const f32, o: *const u8, len: usize) -> bool {
                // Every difference ORed together, tested once: no branch per vector.
                let mut differs = $zero();
                for i in (0..len).step_by($lanes) {
                    // SAFETY: `i + lanes <= len` for both arrays, as the caller promised; unaligned
                    // loads.
                    unsafe {
                        let x = $loadu(p.add(i));
                        let theirs = o.add(i * kind.size());
                        let diff = if kind == Kind::F32 {
                            $xor($cast(x), $load(theirs.cast()))
                        } else {
                            $widen($hxor($narrow(kind, x), $hload(theirs.cast())))
                        };
                        differs = $or(differs, diff);
                    }
                }
                $test(differs, differs) == $clear
            }
        };
    }

    narrows_to_lanes!(
        /// 16 lanes at a time (`store16`'s narrowing); `len` a multiple of 16.
        ///
        /// # Safety
        /// `p` and `o` must hold `len` readable elements; AVX-512F must be available.
        avx512_narrows_to, "avx512f", 16, loadu: _mm512_loadu_ps, narrow: narrow16,
        zero: _mm512_setzero_si512, or: _mm512_or_si512, test: _mm512_test_epi64_mask == 0,
        fp32: (_mm512_castps_si512, _mm512_xor_si512, _mm512_loadu_si512),
        half: (_mm512_castsi256_si512, _mm256_xor_si256, _mm256_loadu_si256)
    );

    narrows_to_lanes!(
        /// 8 lanes at a time (`store8`'s narrowing); `len` a multiple of 8.
        ///
        /// # Safety
        /// `p` and `o` must hold `len` readable elements; AVX2 and F16C must be available.
        avx2_narrows_to, "avx2,fma,f16c", 8, loadu: _mm256_loadu_ps, narrow: narrow8,
        zero: _mm256_setzero_si256, or: _mm256_or_si256, test: _mm256_testz_si256 == 1,
        fp32: (_mm256_castps_si256, _mm256_xor_si256, _mm256_loadu_si256),
        half: (_mm256_castsi128_si256, _mm_xor_si128, _mm_loadu_si128)
    );

    /// Where one SIMD pass reads and writes: `len` elements of each array.
    pub struct Lanes {
        pub p: *mut f32,
        pub m: *mut f32,
        pub v: *mut f32,
        pub g: (Kind, *const u8),
        pub o: Option<(Kind, *mut u8)>,
        pub len: usize,
    }

    /// DeepSpeed's `Step_AVX` over `at`'s elements with one vector width's intrinsics, followed by the
    /// conversions around it: lane for lane the operations of [`super::adam_element`] with
    /// `TailFma::VECTOR`, in the same order, written once for every width.
    macro_rules! adam_lanes {
        (
            $(#[$doc:meta])*
            $name:ident, $features:literal, $lanes:literal,
            set1: $set1:ident, loadu: $loadu:ident, storeu: $storeu:ident, mul: $mul:ident,
            fmadd: $fmadd:ident, sqrt: $sqrt:ident, div: $div:ident, load: $load:ident, store: $store:ident
            $(, fold: $folds:ident, $fload:ident, $fold3:ident, $fstore:ident)?
        ) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub unsafe fn $name(
                at: &Lanes,
                grad_scale: f32,
                k: &AdamConstants,
                $($folds: &mut Folds,)?
            ) {
                let (beta1, beta2) = ($set1(k.beta1), $set1(k.beta2));
                let (c1, c2) = ($set1(k.one_minus_beta1), $set1(k.one_minus_beta2));
                let bias2 = $set1(k.bias_correction2);
                let (eps, step) = ($set1(k.eps), $set1(k.step_size));
                let scale = $set1(grad_scale);
                // The parameters are read again only by the next forward or a copy to the device, long
                // after: where every vector's place is aligned for them (`o` is), stores that bypass the
                // cache, with no read of the line first (2 of the pass's 30 bytes per element in bf16).
                let stream_o = at.o.is_some_and(|(kind, o)| (o as usize) % ($lanes * kind.size()) == 0);
                let (g_kind, g) = at.g;
                let g_size = g_kind.size();
                // SAFETY: `Folds` is 6 times 64 bytes; unaligned loads.
                $(let mut acc = unsafe { $folds.$fload() };)?
                for i in (0..at.len).step_by($lanes) {
                    // SAFETY: `i + lanes <= len` for every array, as the caller promised.
                    unsafe {
                        let mut grad = $mul($load(g_kind, g.add(i * g_size)), scale);
                        let mut param = $loadu(at.p.add(i));
                        let (m_in, v_in) = ($loadu(at.m.add(i)), $loadu(at.v.add(i)));
                        $(
                            let _: &Folds = $folds;
                            $fold3(&mut acc, 0, [param, m_in, v_in]);
                        )?
                        if let Decay::L2(decay) = k.decay {
                            grad = $fmadd(param, $set1(decay), grad);
                        }
                        let old_m = $mul(m_in, beta1);
                        let mom = $fmadd(grad, c1, old_m);
                        let old_v = $mul(v_in, beta2);
                        let var = $fmadd($mul(grad, grad), c2, old_v);
                        let denominator = $fmadd($sqrt(var), bias2, eps);
                        let update = $div(mom, denominator);
                        if let Decay::AdamW(w_decay) = k.decay {
                            param = $fmadd(param, $set1(w_decay), param);
                        }
                        param = $fmadd(update, step, param);
                        $storeu(at.p.add(i), param);
                        $storeu(at.m.add(i), mom);
                        $storeu(at.v.add(i), var);
                        $(
                            let _: &Folds = $folds;
                            $fold3(&mut acc, 3, [param, mom, var]);
                        )?
                        if let Some((kind, o)) = at.o {
                            $store(kind, o.add(i * kind.size()), param, stream_o);
                        }
                    }
                }
                if stream_o {
                    // The streamed stores are visible once the pass returns.
                    _mm_sfence();
                }
                // SAFETY: as the load above.
                $(unsafe { $folds.$fstore(acc) };)?
            }
        };
    }

    /// Six running CRC32C folds, one per stream of vectors: the state's three arrays as read (0-2) and
    /// as written (3-5). Each is a 512-bit (AVX-512) or 256-bit (AVX2, the row's first half)
    /// remainder-to-be: the stream so far, shortened by carry-less multiplication so that it keeps the
    /// stream's CRC ([`super::finish_fold`]).
    #[derive(Clone, Copy, Default)]
    pub struct Folds(pub [[u64; 8]; 6]);

    impl Folds {
        /// # Safety
        /// AVX-512F must be available.
        #[target_feature(enable = "avx512f")]
        unsafe fn load512(&self) -> [__m512i; 6] {
            // SAFETY: each row is 64 readable bytes; unaligned loads.
            std::array::from_fn(|s| unsafe { _mm512_loadu_si512(self.0[s].as_ptr().cast()) })
        }

        /// # Safety
        /// AVX-512F must be available.
        #[target_feature(enable = "avx512f")]
        unsafe fn store512(&mut self, acc: [__m512i; 6]) {
            for (row, x) in self.0.iter_mut().zip(acc) {
                // SAFETY: each row is 64 writable bytes; unaligned stores.
                unsafe { _mm512_storeu_si512(row.as_mut_ptr().cast(), x) };
            }
        }

        /// # Safety
        /// AVX2 must be available.
        #[target_feature(enable = "avx2")]
        unsafe fn load256(&self) -> [__m256i; 6] {
            // SAFETY: each row's first 32 bytes are readable; unaligned loads.
            std::array::from_fn(|s| unsafe { _mm256_loadu_si256(self.0[s].as_ptr().cast()) })
        }

        /// # Safety
        /// AVX2 must be available.
        #[target_feature(enable = "avx2")]
        unsafe fn store256(&mut self, acc: [__m256i; 6]) {
            for (row, x) in self.0.iter_mut().zip(acc) {
                // SAFETY: each row's first 32 bytes are writable; unaligned stores.
                unsafe { _mm256_storeu_si256(row.as_mut_ptr().cast(), x) };
            }
        }
    }

    /// x^544 and x^480 modulo CRC32C's polynomial, bit-reflected: they move a 128-bit lane's low and high
    /// halves 512 bits on, onto the same lane of the next 64 bytes (Intel's "Fast CRC Computation Using
    /// PCLMULQDQ", folding by four 128-bit lanes; ISA-L's `rk3`, `rk4` for iSCSI).
    const FOLD_512: (i64, i64) = (0x740e_ef02, 0x9e4a_ddf8);

    /// x^288 and x^224 modulo CRC32C's polynomial, bit-reflected: as [`FOLD_512`], 256 bits on (two
    /// 128-bit lanes).
    const FOLD_256: (i64, i64) = (0x1_384a_a63a, 0xba4f_c28e);

    /// Folds three 256-bit vectors into the streams `first..first + 3`.
    ///
    /// # Safety
    /// AVX2 and VPCLMULQDQ must be available.
    #[target_feature(enable = "avx2,vpclmulqdq")]
    #[inline]
    unsafe fn fold3_256(acc: &mut [__m256i; 6], first: usize, data: [__m256; 3]) {
        let key = _mm256_set_epi64x(FOLD_256.1, FOLD_256.0, FOLD_256.1, FOLD_256.0);
        for (a, x) in acc[first..first + 3].iter_mut().zip(data) {
            let low = _mm256_clmulepi64_epi128::<0x00>(*a, key);
            let high = _mm256_clmulepi64_epi128::<0x11>(*a, key);
            *a = _mm256_xor_si256(_mm256_xor_si256(low, high), _mm256_castps_si256(x));
        }
    }

    /// Folds three 512-bit vectors into the streams `first..first + 3`.
    ///
    /// # Safety
    /// AVX-512F and VPCLMULQDQ must be available.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    #[inline]
    unsafe fn fold3_512(acc: &mut [__m512i; 6], first: usize, data: [__m512; 3]) {
        let key = _mm512_set_epi64(
            FOLD_512.1, FOLD_512.0, FOLD_512.1, FOLD_512.0, FOLD_512.1, FOLD_512.0, FOLD_512.1,
            FOLD_512.0,
        );
        for (a, x) in acc[first..first + 3].iter_mut().zip(data) {
            let low = _mm512_clmulepi64_epi128::<0x00>(*a, key);
            let high = _mm512_clmulepi64_epi128::<0x11>(*a, key);
            // low ^ high ^ x
            *a = _mm512_ternarylogic_epi64::<0x96>(low, high, _mm512_castps_si512(x));
        }
    }

    adam_lanes!(
        /// # Safety
        /// AVX-512F must be available; every pointer of `at` must hold `at.len` elements (a multiple of
        /// 16), `p`, `m`, `v` and `o` writable and none overlapping another.
        avx512, "avx512f", 16,
        set1: _mm512_set1_ps, loadu: _mm512_loadu_ps, storeu: _mm512_storeu_ps, mul: _mm512_mul_ps,
        fmadd: _mm512_fmadd_ps, sqrt: _mm512_sqrt_ps, div: _mm512_div_ps, load: load16, store: store16
    );

    adam_lanes!(
        /// `avx512`, each vector of the state as read and as written also folded into `folds`.
        ///
        /// # Safety
        /// As `avx512`; VPCLMULQDQ must be available too.
        avx512_folding, "avx512f,vpclmulqdq", 16,
        set1: _mm512_set1_ps, loadu: _mm512_loadu_ps, storeu: _mm512_storeu_ps, mul: _mm512_mul_ps,
        fmadd: _mm512_fmadd_ps, sqrt: _mm512_sqrt_ps, div: _mm512_div_ps, load: load16, store: store16,
        fold: folds, load512, fold3_512, store512
    );

    adam_lanes!(
        /// # Safety
        /// AVX2, FMA and F16C must be available; as `avx512` otherwise, `at.len` a multiple of 8.
        avx2, "avx2,fma,f16c", 8,
        set1: _mm256_set1_ps, loadu: _mm256_loadu_ps, storeu: _mm256_storeu_ps, mul: _mm256_mul_ps,
        fmadd: _mm256_fmadd_ps, sqrt: _mm256_sqrt_ps, div: _mm256_div_ps, load: load8, store: store8
    );

    adam_lanes!(
        /// `avx2`, each vector of the state as read and as written also folded into `folds`.
        ///
        /// # Safety
        /// As `avx2`; VPCLMULQDQ must be available too.
        avx2_folding, "avx2,fma,f16c,vpclmulqdq", 8,
        set1: _mm256_set1_ps, loadu: _mm256_loadu_ps, storeu: _mm256_storeu_ps, mul: _mm256_mul_ps,
        fmadd: _mm256_fmadd_ps, sqrt: _mm256_sqrt_ps, div: _mm256_div_ps, load: load8, store: store8,
        fold: folds, load256, fold3_256, store256
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The same bits, or both NaN (x86 picks a NaN operand's payload by instruction form, which a
    /// compiler chooses; torch's bf16 copy makes every NaN 0xffff anyway).
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn bf16_conversions_are_torchs() {
        // value, the bits torch 2.15's copy_ writes on x86-64 (read off it)
        let cases: &[(f32, u16)] = &[
            (f32::NAN, 0xffff),
            (-f32::NAN, 0xffff),
            (f32::from_bits(0x7f80_0001), 0xffff),
            (f32::INFINITY, 0x7f80),
            (f32::NEG_INFINITY, 0xff80),
            (1e-40, 0x0001),
            (-1e-40, 0x8001),
            (1.17e-38, 0x007f),
            (3.0e-39, 0x0021),
            (65504.0, 0x4780),
            (65520.0, 0x4780),
            (1e-8, 0x322c),
            (6e-8, 0x3381),
            (2.98e-8, 0x3300),
            (1.0000001, 0x3f80),
            // Ties go to even.
            (f32::from_bits(0x3f80_8000), 0x3f80),
            (f32::from_bits(0x3f81_8000), 0x3f82),
            // Rounding into the next exponent, and up to infinity.
            (f32::from_bits(0x3fff_ffff), 0x4000),
            (f32::MAX, 0x7f80),
        ];
        for &(x, bits) in cases {
            assert_eq!(Bf16::narrow(x).0, bits, "{x:e}");
            if !x.is_nan() {
                assert_eq!(Bf16(bits).widen().to_bits(), u32::from(bits) << 16);
            }
        }
    }

    /// f32 bit patterns that reach every rounding case of a conversion to half: per exponent, mantissas
    /// at and around each halfway point, plus random ones.
    #[cfg(target_arch = "x86_64")]
    fn f32_patterns() -> Vec<u32> {
        let mut rng = StdRng::seed_from_u64(5);
        let mut out = Vec::new();
        for sign in [0u32, 1 << 31] {
            for exp in 0u32..256 {
                let mut mantissas = vec![0, 1, 0x7f_ffff, 0x7f_fffe, 0x40_0000];
                for drop in 13..=24u32 {
                    let half = 1u32 << (drop - 1);
                    for base in [0, 1 << drop, 3 << drop] {
                        for delta in [-1i64, 0, 1] {
                            let m = i64::from(base | half) + delta;
                            if (0..0x80_0000).contains(&m) {
                                mantissas.push(m as u32);
                            }
                        }
                    }
                }
                mantissas.extend((0..64).map(|_| rng.random_range(0..0x80_0000)));
                out.extend(mantissas.into_iter().map(|m| sign | (exp << 23) | m));
            }
        }
        out
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn f16_conversions_are_f16cs() {
        use std::arch::x86_64::*;
        if !is_x86_feature_detected!("f16c") {
            return;
        }
        for bits in f32_patterns() {
            let x = f32::from_bits(bits);
            // SAFETY: F16C is available (checked above).
            let hw = unsafe {
                #[target_feature(enable = "f16c")]
                unsafe fn narrow(x: f32) -> u16 {
                    _mm_extract_epi16::<0>(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(
                        _mm_set1_ps(x),
                    )) as u16
                }
                narrow(x)
            };
            assert_eq!(F16::narrow(x).0, hw, "{bits:#010x} ({x:e})");
        }
        for h in 0..=u16::MAX {
            // SAFETY: as above.
            let hw = unsafe {
                #[target_feature(enable = "f16c")]
                unsafe fn widen(h: u16) -> u32 {
                    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(h as i16))).to_bits()
                }
                widen(h)
            };
            assert_eq!(F16(h).widen().to_bits(), hw, "{h:#06x}");
        }
    }

    fn hyper(lr: f32, weight_decay: f32, adamw: bool, bias_correction: bool) -> AdamHyper {
        AdamHyper {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            bias_correction,
            adamw,
        }
    }

    /// A buffer of at least `n` elements of `P` and where in it `n` start: on a 64-byte boundary
    /// shifted by `shift` elements. Aligned, the SIMD passes write the parameters with stores that bypass
    /// the cache; shifted by one, with plain ones.
    fn placed_params<P: Elem>(n: usize, shift: usize) -> (Vec<P>, usize) {
        let size = std::mem::size_of::<P>();
        let buf = vec![P::narrow(0.0); n + 64 / size + shift];
        let start = buf.as_ptr().align_offset(64).min(64 / size) + shift;
        assert_eq!((buf.as_ptr() as usize + start * size) % 64, shift * size);
        (buf, start)
    }

    /// Random state and gradient with the values that trip arithmetic up sprinkled in: infinities, NaN,
    /// subnormals, zeros of both signs, huge and tiny magnitudes.
    fn inputs(n: usize, rng: &mut StdRng) -> (Vec<f32>, Vec<f32>) {
        let specials = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
            -3e-42,
            0.0,
            -0.0,
            3e38,
            1e-30,
        ];
        let mut pick = |scale: f32, positive: bool| {
            if rng.random_range(0..17) == 0 {
                specials[rng.random_range(0..specials.len())]
            } else {
                let x = (rng.random::<f32>() - 0.5) * 2.0 * scale;
                if positive {
                    x.abs()
                } else {
                    x
                }
            }
        };
        let mut state = Vec::with_capacity(3 * n);
        state.extend((0..n).map(|_| pick(0.1, false)));
        state.extend((0..n).map(|_| pick(1e-3, false)));
        state.extend((0..n).map(|_| pick(1e-6, true)));
        let grad = (0..n).map(|_| pick(1e-2, false)).collect();
        (state, grad)
    }

    /// The specification run element by element, as `update` must produce it.
    fn reference<G: Elem, P: Elem>(
        state: &mut [f32],
        grad: &[G],
        params: &mut [P],
        scale: f32,
        k: &AdamConstants,
        arith: &DeepSpeedArith,
    ) {
        let n = grad.len();
        let body = n - n % arith.vector_width;
        for i in 0..n {
            let how = if i < body {
                TailFma::VECTOR
            } else {
                arith.tail
            };
            let (p, m, v) = adam_element(
                state[i],
                grad[i].widen() * scale,
                state[n + i],
                state[2 * n + i],
                k,
                how,
            );
            (state[i], state[n + i], state[2 * n + i]) = (p, m, v);
            params[i] = P::narrow(p);
        }
    }

    /// A 16-wide build whose scalar tail fuses as its vectors do.
    fn vector_arith() -> DeepSpeedArith {
        DeepSpeedArith {
            vector_width: 16,
            tail: TailFma::VECTOR,
            bias_sqrt: BiasSqrt::Float,
        }
    }

    fn simds() -> Vec<Simd> {
        [
            Simd::Avx512Clmul,
            Simd::Avx512,
            Simd::Avx2Clmul,
            Simd::Avx2,
            Simd::Scalar,
        ]
        .into_iter()
        .filter(|s| Simd::parse("simd", s.name()).is_ok())
        .collect()
    }

    /// Every SIMD path this CPU runs, each without checksums and with one stripe's as read and as written
    /// (`Avx512Clmul` and `Avx2Clmul` then run their folding loops).
    fn simds_with_and_without_sums() -> Vec<(Simd, Cuts<'static>)> {
        const ONE_STRIPE: &[u64] = &[0];
        let summed = Cuts {
            read: Some(ONE_STRIPE),
            write: Some(ONE_STRIPE),
        };
        simds()
            .into_iter()
            .flat_map(|simd| [(simd, Cuts::default()), (simd, summed)])
            .collect()
    }

    fn check_paths<G: Elem, P: Elem>(to_grad: impl Fn(f32) -> G, rng: &mut StdRng) {
        let arith = DeepSpeedArith {
            vector_width: 16,
            tail: TailFma {
                momentum: MomentFma::Old,
                variance: MomentFma::Separate,
                others: false,
            },
            bias_sqrt: BiasSqrt::Float,
        };
        // Sizes: empty, within one vector, every tail length, several vectors, a thread split's edges.
        let sizes = [
            0,
            1,
            7,
            8,
            15,
            16,
            17,
            31,
            33,
            63,
            64,
            65,
            100,
            129,
            1000,
            1024 + 15,
            4099,
        ];
        // weight decay, AdamW, bias correction
        let modes = [
            (0.0, true, true),
            (0.01, true, true),
            (0.01, false, true),
            (-0.5, true, true),
            (0.0, true, false),
        ];
        for &n in &sizes {
            for &(decay, adamw, bias) in &modes {
                let mut bias_state = AdamBias::new(0.9, 0.999, BiasSqrt::Float);
                let k = bias_state.constants(3, &hyper(1e-3, decay, adamw, bias));
                let (state, grad32) = inputs(n, rng);
                let grad: Vec<G> = grad32.iter().map(|&g| to_grad(g)).collect();
                let mut want_state = state.clone();
                let mut want_params = vec![P::narrow(0.0); n];
                reference(&mut want_state, &grad, &mut want_params, 0.75, &k, &arith);
                let placements = [(1, 0), (3, 0), (1, 1), (3, 1)];
                for (simd, cuts) in simds_with_and_without_sums() {
                    for (threads, shift) in placements {
                        let mut got_state = state.clone();
                        let (mut buf, start) = placed_params::<P>(n, shift);
                        let got_params = &mut buf[start..start + n];
                        let sums = update(
                            Chunk {
                                state: &mut got_state,
                                grad: &grad,
                                params: Some(&mut *got_params),
                                keep_params: false,
                                keep_state: None,
                            },
                            0.75,
                            &k,
                            &arith,
                            simd,
                            threads,
                            cuts,
                        )
                        .unwrap();
                        if cuts.read.is_some() && n > 0 {
                            let crc = |x: &[f32]| vec![crate::checksum::crc32c(as_bytes(x))];
                            assert_eq!(
                                sums,
                                ChunkSums {
                                    read: Some(crc(&state)),
                                    write: Some(crc(&got_state)),
                                    kept_params: None,
                                },
                                "{simd:?} n {n}: checksums"
                            );
                        }
                        for i in 0..3 * n {
                            assert!(
                                same(got_state[i], want_state[i]),
                                "{simd:?} n {n} {:?} decay {decay} adamw {adamw} threads {threads}: state[{i}] {} vs {}",
                                G::KIND,
                                got_state[i],
                                want_state[i]
                            );
                        }
                        for i in 0..n {
                            assert!(
                                same(got_params[i].widen(), want_params[i].widen()),
                                "{simd:?} n {n} threads {threads} shift {shift}: params[{i}] as {:?}",
                                P::KIND
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn simd_paths_are_the_specification_for_every_type_size_and_mode() {
        let mut rng = StdRng::seed_from_u64(11);
        check_paths::<Bf16, Bf16>(Bf16::narrow, &mut rng);
        check_paths::<F16, F16>(F16::narrow, &mut rng);
        check_paths::<f32, f32>(|x| x, &mut rng);
        check_paths::<Bf16, f32>(Bf16::narrow, &mut rng);
        check_paths::<f32, Bf16>(|x| x, &mut rng);
    }

    /// Passes that run at once on the same count of threads share that count's workers, and passes on
    /// another count have their own: each is still the specification's, round after round.
    #[test]
    fn passes_at_once_share_the_workers_and_each_is_exact() {
        let arith = vector_arith();
        let k =
            AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(2, &hyper(1e-3, 0.01, true, true));
        let n = 3 * BLOCK + 100;
        let mut rng = StdRng::seed_from_u64(5);
        let callers: Vec<_> = [3, 3, 3, 5]
            .into_iter()
            .map(|threads| {
                let (state, grad32) = inputs(n, &mut rng);
                let grad: Vec<Bf16> = grad32.iter().map(|&g| Bf16::narrow(g)).collect();
                let mut want_state = state.clone();
                let mut want_params = vec![Bf16::default(); n];
                reference(&mut want_state, &grad, &mut want_params, 0.5, &k, &arith);
                (threads, state, grad, want_state, want_params)
            })
            .collect();
        std::thread::scope(|scope| {
            for (caller, (threads, state, grad, want_state, want_params)) in
                callers.iter().enumerate()
            {
                let (arith, k) = (&arith, &k);
                scope.spawn(move || {
                    for round in 0..20 {
                        let mut got_state = state.clone();
                        let mut got_params = vec![Bf16::default(); n];
                        let chunk = Chunk {
                            state: &mut got_state,
                            grad,
                            params: Some(&mut got_params),
                            keep_params: false,
                            keep_state: None,
                        };
                        update(chunk, 0.5, k, arith, Simd::detect(), *threads, Cuts::default()).unwrap();
                        assert!(
                            got_state.iter().zip(want_state).all(|(&a, &b)| same(a, b))
                                && got_params == *want_params,
                            "caller {caller} ({threads} threads), round {round}: not the specification's"
                        );
                    }
                });
            }
        });
    }

    /// Weights of every kind the narrowing treats apart (zeros of both signs, subnormals, infinities,
    /// NaN, halfway cases of bf16, fp16's overflow and subnormal range) among ordinary ones.
    fn awkward_weights(n: usize, rng: &mut StdRng) -> Vec<f32> {
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            1e-40,
            -1e-45,
            3e-6,
            65520.0,
            3e38,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
        ];
        (0..n)
            .map(|i| match i % 5 {
                3 => specials[rng.random_range(0..specials.len())],
                _ => rng.random_range(-2.0f32..2.0),
            })
            .collect()
    }

    /// A value whose bits differ from `x`'s in `P` (another value, or the other zero or NaN).
    fn other<P: Elem>(x: P) -> P {
        let bits = x.bits();
        P::narrow(match bits {
            0 => -0.0,
            _ => 1.5 + x.widen().abs().min(1.0),
        })
    }

    fn check_narrows_to<P: Elem>(rng: &mut StdRng) {
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 33, 100, 8192 + 5] {
            let weights = awkward_weights(n, rng);
            let params: Vec<P> = weights.iter().map(|&w| P::narrow(w)).collect();
            for simd in simds() {
                assert!(
                    narrows_to(&weights, &params, simd),
                    "{simd:?} n {n} {:?}",
                    P::KIND
                );
                // One element different, anywhere: in a vector, in the tail, first, last.
                for at in [0, n / 2, n.saturating_sub(1), n.saturating_sub(9)] {
                    if at >= n {
                        continue;
                    }
                    let mut changed = params.clone();
                    changed[at] = other(changed[at]);
                    assert_ne!(changed[at].bits(), params[at].bits());
                    assert!(
                        !narrows_to(&weights, &changed, simd),
                        "{simd:?} n {n} {:?}: element {at} ({:#x} for weight {:?}) not seen",
                        P::KIND,
                        changed[at].bits(),
                        weights[at]
                    );
                }
            }
        }
    }

    #[test]
    fn narrows_to_is_bit_equality_with_the_weights_narrowed_on_every_simd() {
        let mut rng = StdRng::seed_from_u64(17);
        check_narrows_to::<Bf16>(&mut rng);
        check_narrows_to::<F16>(&mut rng);
        check_narrows_to::<f32>(&mut rng);
        // -0.0 is not 0.0, and a NaN is the narrowing's NaN only (bf16: 0xffff).
        let simd = Simd::detect();
        assert!(!narrows_to(&[0.0; 16], &[Bf16(0x8000); 16], simd));
        assert!(narrows_to(&[f32::NAN; 16], &[Bf16(0xffff); 16], simd));
        assert!(!narrows_to(&[f32::NAN; 16], &[Bf16(0x7fc0); 16], simd));
    }

    fn check_kept_params<P: Elem>(rng: &mut StdRng) {
        let k =
            AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(2, &hyper(1e-3, 0.01, true, true));
        let arith = vector_arith();
        // One block, several blocks with a short last one, a thread split inside a block.
        for n in [33, 3 * BLOCK + 100, BLOCK + 64 * 3 + 5] {
            let (mut state, grad32) = inputs(n, rng);
            state[..n].copy_from_slice(&awkward_weights(n, rng));
            let grad: Vec<Bf16> = grad32.iter().map(|&g| Bf16::narrow(g)).collect();
            let mut before: Vec<P> = state[..n].iter().map(|&w| P::narrow(w)).collect();
            // Parameters set apart from their weights: a few, and a block of them.
            let apart: Vec<usize> = [1, n / 2, n - 1]
                .into_iter()
                .chain(n.min(BLOCK + 40)..n.min(BLOCK + 60))
                .collect();
            for &i in &apart {
                before[i] = other(before[i]);
            }
            for (simd, cuts) in simds_with_and_without_sums() {
                for threads in [1, 3] {
                    // Keeping the parameters, and the state too (`keep`).
                    let run = |keep: bool| {
                        let (mut s, mut params) = (state.clone(), before.clone());
                        // NaN-filled: a block the pass did not copy shows.
                        let mut kept_state = vec![f32::NAN; 3 * n];
                        let out = update(
                            Chunk {
                                state: &mut s,
                                grad: &grad,
                                params: Some(&mut params),
                                keep_params: keep,
                                keep_state: keep.then_some(&mut kept_state[..]),
                            },
                            0.5,
                            &k,
                            &arith,
                            simd,
                            threads,
                            cuts,
                        )
                        .unwrap();
                        (s, params, out, kept_state)
                    };
                    let (s0, p0, plain, _) = run(false);
                    let (s1, p1, kept, kept_state) = run(true);
                    let what = format!("{simd:?} n {n} threads {threads} {:?}", P::KIND);
                    // Keeping changes nothing else the pass does, and keeps the state as it was.
                    assert!(s0.iter().zip(&s1).all(|(a, b)| same(*a, *b)), "{what}");
                    assert!(
                        kept_state
                            .iter()
                            .zip(&state)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: the kept state is not the state before the pass"
                    );
                    assert!(
                        p0.iter().zip(&p1).all(|(a, b)| a.bits() == b.bits()),
                        "{what}"
                    );
                    assert_eq!((plain.read, plain.write), (kept.read, kept.write), "{what}");
                    assert_eq!(plain.kept_params, None);
                    // Each kept stretch is the parameters as they were, holds one set apart, and
                    // every one set apart is in one; in order, apart from each other.
                    let kept = kept.kept_params.expect("asked for");
                    let size = P::KIND.size();
                    let mut end = 0;
                    for KeptParams { first, bytes } in &kept {
                        let len = bytes.len() / size;
                        assert!(*first >= end && len > 0, "{what}: {first} after {end}");
                        end = first + len;
                        assert_eq!(
                            *bytes,
                            elem_bytes(&before[*first..end]),
                            "{what} at {first}"
                        );
                        assert!(
                            apart.iter().any(|&i| (*first..end).contains(&i)),
                            "{what} at {first}"
                        );
                    }
                    for &i in &apart {
                        assert!(
                            kept.iter()
                                .any(|k| (k.first..k.first + k.bytes.len() / size).contains(&i)),
                            "{what}: element {i} set apart, not kept"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn kept_params_and_state_are_what_the_pass_found_and_nothing_else_changes() {
        let mut rng = StdRng::seed_from_u64(19);
        check_kept_params::<Bf16>(&mut rng);
        check_kept_params::<F16>(&mut rng);
        check_kept_params::<f32>(&mut rng);
    }

    #[test]
    fn without_params_only_the_state_is_written() {
        let mut rng = StdRng::seed_from_u64(3);
        let (state, grad) = inputs(100, &mut rng);
        let k =
            AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.0, true, true));
        let arith = vector_arith();
        let (mut with, mut without) = (state.clone(), state);
        let mut params = vec![0.0f32; 100];
        update(
            Chunk {
                state: &mut with,
                grad: &grad,
                params: Some(&mut params),
                keep_params: false,
                keep_state: None,
            },
            1.0,
            &k,
            &arith,
            Simd::detect(),
            2,
            Cuts::default(),
        )
        .unwrap();
        update::<f32, f32>(
            Chunk {
                state: &mut without,
                grad: &grad,
                params: None,
                keep_params: false,
                keep_state: None,
            },
            1.0,
            &k,
            &arith,
            Simd::detect(),
            2,
            Cuts::default(),
        )
        .unwrap();
        assert!(with.iter().zip(&without).all(|(a, b)| same(*a, *b)));
    }

    #[test]
    fn the_bias_state_follows_deepspeeds_history() {
        let h = hyper(1e-3, 0.0, true, true);
        let other = AdamHyper {
            beta1: 0.8,
            beta2: 0.99,
            ..h
        };
        let pow = |b: f32, s: u64| (f64::from(b).powf(s as f64)) as f32;
        let mut bias = AdamBias::new(0.9, 0.999, BiasSqrt::Float);
        // call: (step, hyper); expected beta1^t after it
        let calls: Vec<(u64, AdamHyper, f32)> = vec![
            (1, h, 0.9),
            // The same step again (the next chunk of a subgroup): nothing moves.
            (1, h, 0.9),
            // The next step multiplies on, in float.
            (2, h, 0.9f32 * 0.9f32),
            (3, h, 0.9f32 * 0.9f32 * 0.9f32),
            // A jump: pow.
            (10, h, pow(0.9, 10)),
            // Other betas: pow with them, from that step.
            (10, other, pow(0.8, 10)),
            (11, other, pow(0.8, 10) * 0.8),
            // Back: pow again.
            (11, h, pow(0.9, 11)),
        ];
        for (i, (step, hyper, beta1_t)) in calls.into_iter().enumerate() {
            let k = bias.constants(step, &hyper);
            assert_eq!(bias.beta1_t.to_bits(), beta1_t.to_bits(), "call {i}");
            assert_eq!(k.step_size, -hyper.lr / (1.0 - beta1_t), "call {i}");
        }
        // Without bias correction both corrections are 1.
        let k = bias.constants(
            12,
            &AdamHyper {
                bias_correction: false,
                ..h
            },
        );
        assert_eq!((k.step_size, k.bias_correction2), (-1e-3, 1.0));
        // The double square root rounds once, from double.
        let mut float = AdamBias::new(0.9, 0.999, BiasSqrt::Float);
        let mut double = AdamBias::new(0.9, 0.999, BiasSqrt::Double);
        let differ = (1..5000).any(|s| {
            float.constants(s, &h).bias_correction2 != double.constants(s, &h).bias_correction2
        });
        assert!(
            differ,
            "the two square roots must be told apart at some step"
        );
        let witness = AdamBias::sqrt_witness(0.999).expect("a step that tells them apart");
        let at = |sqrt| {
            AdamBias::new(0.9, 0.999, sqrt)
                .constants(witness, &h)
                .bias_correction2
        };
        assert_ne!(at(BiasSqrt::Float), at(BiasSqrt::Double));
    }

    #[test]
    fn checksums_are_each_stripes_crc32c_as_read_and_as_written() {
        let mut rng = StdRng::seed_from_u64(17);
        let arith = vector_arith();
        let k =
            AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.01, true, true));
        let bytes = |x: &[f32]| as_bytes(x).to_vec();
        let run = |state: &mut [f32], grad: &[f32], simd: Simd, threads: usize, cuts: Cuts<'_>| {
            let params = None;
            update::<f32, f32>(
                Chunk {
                    state,
                    grad,
                    params,
                    keep_params: false,
                    keep_state: None,
                },
                1.0,
                &k,
                &arith,
                simd,
                threads,
                cuts,
            )
        };
        // Sizes: within one vector, a tail after whole vectors, whole vectors in one and several blocks
        // (so every array's edge is a vector's, as folding in the SIMD loop needs), a tail after blocks.
        for n in [1, 100, 4096, 2 * BLOCK + 1024, 3 * BLOCK + 77] {
            let total = 12 * n as u64;
            let n4 = 4 * n as u64;
            // name, stripe starts
            let cases: Vec<(&str, Vec<u64>)> = vec![
                ("one stripe", vec![0]),
                ("two, cut inside params", vec![0, 4 * (n as u64 / 2).max(1)]),
                ("on the arrays' edges", vec![0, n4, 2 * n4]),
                (
                    "many small ones",
                    (0..total).step_by((total as usize / 7).max(4)).collect(),
                ),
                (
                    "4 KiB apart, from the last array's edge",
                    std::iter::once(0)
                        .chain((2 * n4..total).step_by(4096).filter(|&c| c > 0))
                        .collect(),
                ),
                ("one unaligned", vec![0, n4 + 6]),
            ];
            for ((name, cuts), simd) in cases
                .iter()
                .flat_map(|case| simds().into_iter().map(move |simd| (case, simd)))
            {
                for threads in [1, 3] {
                    let (state, grad) = inputs(n, &mut rng);
                    let before = bytes(&state);
                    let mut after = state.clone();
                    let sums = run(
                        &mut after,
                        &grad,
                        simd,
                        threads,
                        Cuts {
                            read: Some(cuts),
                            write: Some(cuts),
                        },
                    )
                    .unwrap();
                    let after = bytes(&after);
                    let expected = |all: &[u8]| -> Vec<u32> {
                        let mut ends = cuts[1..].to_vec();
                        ends.push(total);
                        cuts.iter()
                            .zip(&ends)
                            .map(|(&a, &b)| crate::checksum::crc32c(&all[a as usize..b as usize]))
                            .collect()
                    };
                    assert_eq!(
                        sums.read,
                        Some(expected(&before)),
                        "{name}, n {n}, {simd:?}, {threads} threads: read"
                    );
                    assert_eq!(
                        sums.write,
                        Some(expected(&after)),
                        "{name}, n {n}, {simd:?}, {threads} threads: write"
                    );
                }
            }
        }
        // Only what was asked for, and that right.
        for simd in simds() {
            let (mut state, grad) = inputs(4096, &mut rng);
            let sums = run(
                &mut state,
                &grad,
                simd,
                1,
                Cuts {
                    read: None,
                    write: Some(&[0]),
                },
            )
            .unwrap();
            let written = crate::checksum::crc32c(&bytes(&state));
            assert_eq!(
                sums,
                ChunkSums {
                    read: None,
                    write: Some(vec![written]),
                    kept_params: None,
                },
                "{simd:?}"
            );
        }
        let (mut state, grad) = inputs(10, &mut rng);
        // Cuts that do not ascend from 0 inside the state are named.
        for cuts in [vec![4u64], vec![0, 8, 8], vec![0, 120]] {
            let err = run(
                &mut state,
                &grad,
                Simd::detect(),
                1,
                Cuts {
                    read: Some(&cuts),
                    write: None,
                },
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("read_cuts"), "{cuts:?}: {err}");
        }
    }

    #[test]
    fn bad_lengths_and_addresses_are_named() {
        let arith = vector_arith();
        let k =
            AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.0, true, true));
        let grad = vec![0.0f32; 10];
        // Each wrong input (a gradient of 10 elements) is an error naming the key, and the length given.
        let cases: [(&str, &[&str]); 4] = [
            ("a state of 29", &["state", "29"]),
            ("keep_params without params", &["keep_params"]),
            ("a kept state of 29", &["keep_state", "29"]),
            ("params of 9", &["params", "9"]),
        ];
        for (case, words) in cases {
            let mut state = vec![0.0f32; if case == "a state of 29" { 29 } else { 30 }];
            let (mut kept_state, mut params) = (vec![0.0f32; 29], vec![0.0f32; 9]);
            let chunk = Chunk {
                state: &mut state,
                grad: &grad,
                params: (case == "params of 9").then_some(&mut params[..]),
                keep_params: case == "keep_params without params",
                keep_state: (case == "a kept state of 29").then_some(&mut kept_state[..]),
            };
            let err = update(chunk, 1.0, &k, &arith, Simd::Scalar, 1, Cuts::default())
                .unwrap_err()
                .to_string();
            assert!(words.iter().all(|w| err.contains(w)), "{case}: {err}");
        }
        let bytes = [0u8; 64];
        // SAFETY: the call fails on the misaligned address before touching memory.
        let err = unsafe {
            update_at(
                bytes.as_ptr() as usize + 1,
                (bytes.as_ptr() as usize, Kind::Bf16),
                None,
                false,
                None,
                1,
                1.0,
                &k,
                &arith,
                Simd::Scalar,
                1,
                Cuts::default(),
            )
        }
        .unwrap_err()
        .to_string();
        assert!(err.contains("state") && err.contains("aligned"), "{err}");
        assert!(Simd::parse("simd", "sse9")
            .unwrap_err()
            .to_string()
            .contains("sse9"));
        assert!(Kind::parse("grad_dtype", "int8")
            .unwrap_err()
            .to_string()
            .contains("grad_dtype"));
    }
}
