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
//!
//! Its modules, by concern:
//! - [`elem`]: the element types (fp32, bf16, fp16) and their conversions, as torch's;
//! - [`adam`]: Adam's constants, DeepSpeed's bias corrections and arithmetic, and the specification
//!   ([`adam_element`]);
//! - [`dispatch`]: the SIMD instructions a pass may use on this CPU ([`Simd`]);
//! - [`pass`]: the chunk's pass ([`update`], [`update_at`] with its [`ChunkAt`] and [`StateLayout`]):
//!   its arguments and the threads' ranges; `part`: a thread's range, block by block; `folded`: a range
//!   with the checksums folded into the SIMD loop;
//! - [`pool`]: the pass's worker threads;
//! - [`witness`]: inputs that tell two arithmetics apart, for the start-up check;
//! - [`crc`]: the state's checksums, cut as the store cuts its stripes, hashed or folded in the pass;
//! - `x86`: the vector arithmetic, the rounded pass of a state in half precision and the folded
//!   checksums with x86-64's intrinsics.

pub mod adam;
pub mod crc;
pub mod dispatch;
pub mod elem;
#[cfg(target_arch = "x86_64")]
mod folded;
mod part;
pub mod pass;
pub mod pool;
pub mod state;
pub mod witness;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use adam::{
    adam_element, AdamBias, AdamConstants, AdamHyper, BiasSqrt, Decay, DeepSpeedArith, MomentFma,
    TailFma,
};
pub use dispatch::Simd;
pub use elem::{Bf16, Elem, Kind, StateKinds, F16};
pub use part::{narrows_to, KeptParams};
pub use pass::{update, update_at, Chunk, ChunkAt, ChunkSums, Cuts};
pub use state::{fp32_arrays, Array, Arrays, StateLayout};
pub use witness::{witness, Witness};

#[cfg(test)]
mod tests;
