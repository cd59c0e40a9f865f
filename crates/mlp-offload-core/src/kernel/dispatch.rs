//! The SIMD instructions a pass may use, found on this CPU or named by the caller.

use crate::error::{Error, Result};

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

    pub(super) fn lanes(self) -> usize {
        match self {
            Simd::Avx512Clmul | Simd::Avx512 => 16,
            Simd::Avx2Clmul | Simd::Avx2 => 8,
            Simd::Scalar => 1,
        }
    }
}
