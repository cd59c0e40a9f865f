//! The element types of the state, the gradients and the parameters, and their conversions: widening
//! and narrowing exactly as torch's copies do (nearest-even to bf16 and fp16, NaN, inf and subnormals
//! included), and as DeepSpeed's CPU Adam stores its results ([`Elem::narrow_as_cpu_adam`]); the dtypes
//! DeepSpeed keeps the optimizer state in ([`StateKinds`]).

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
    /// Narrowed as DeepSpeed's CPU Adam stores a result in this type (c10's conversions, which its
    /// SIMD stores match): as [`Elem::narrow`] but where a type says otherwise.
    fn narrow_as_cpu_adam(x: f32) -> Self {
        Self::narrow(x)
    }
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
    /// c10's `round_to_nearest_even`: every NaN becomes 0x7fc0 (DeepSpeed's AVX-512 and NEON stores
    /// write the same).
    fn narrow_as_cpu_adam(x: f32) -> Self {
        if x.is_nan() {
            return Bf16(0x7fc0);
        }
        Self::narrow(x)
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

/// The dtypes DeepSpeed keeps a subgroup's optimizer state in: its master weights (with their
/// gradients) and its Adam moments. fp32 and fp32 but for DeepSpeed's `bf16_master_weights_and_grads`
/// (bf16 weights), `bf16_optimizer_states` (and bf16 moments) and `fp16_master_weights_and_grads` (fp16
/// weights). The pass holds every value in an fp32 element of the state, each rounded to its dtype as
/// DeepSpeed's CPU Adam stores it, so a value is exactly the one DeepSpeed's state holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateKinds {
    pub master: Kind,
    pub moments: Kind,
}

impl StateKinds {
    /// fp32 weights and moments.
    pub const FP32: StateKinds = StateKinds {
        master: Kind::F32,
        moments: Kind::F32,
    };

    pub fn is_fp32(self) -> bool {
        self == Self::FP32
    }

    /// From torch's names of the master weights' and the moments' dtypes, each an error naming its key
    /// (`master_dtype`, `moments_dtype`) where it is none ([`Kind::parse`]).
    pub fn parse(master: &str, moments: &str) -> Result<StateKinds> {
        Ok(StateKinds {
            master: Kind::parse("master_dtype", master)?,
            moments: Kind::parse("moments_dtype", moments)?,
        })
    }

    /// As DeepSpeed takes them: the moments in fp32 or in the master weights' dtype; the gradient, and
    /// the parameters written (if any), in the master weights' dtype where that is half precision; an
    /// error naming the argument otherwise.
    pub fn check(self, grad: Kind, params: Option<Kind>) -> Result<()> {
        if self.moments != Kind::F32 && self.moments != self.master {
            return Err(Error::config(
                "moments_dtype",
                format!(
                    "{:?} moments with {:?} master weights: DeepSpeed's CPU Adam keeps them in fp32 \
                     or in the master weights' dtype",
                    self.moments, self.master
                ),
            ));
        }
        if self.master == Kind::F32 {
            return Ok(());
        }
        for (name, kind) in [("grad", Some(grad)), ("params", params)] {
            if let Some(kind) = kind.filter(|&k| k != self.master) {
                return Err(Error::config(
                    name,
                    format!(
                        "{kind:?} elements, where the master weights are {:?}: DeepSpeed keeps the \
                         gradients and the parameters in the master weights' dtype",
                        self.master
                    ),
                ));
            }
        }
        Ok(())
    }
}
