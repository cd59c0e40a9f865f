//! The vector arithmetic of [`super::adam_element`] (`TailFma::VECTOR`) with x86 intrinsics, lane
//! for lane the same operations: DeepSpeed's `Step_AVX` with the conversions around it.

use std::arch::x86_64::*;

use super::{AdamConstants, Decay, Kind, MomentFma, StateKinds, TailFma};

/// `to` becomes `from`, its aligned 32-byte stretches written with stores that bypass the cache
/// (the kept state is read again only by an undo, long after): no read of the lines first, and
/// the cache stays the pass's. Fenced, so the stores are visible once it returns.
///
/// # Safety
/// AVX must be available.
#[target_feature(enable = "avx")]
pub unsafe fn copy_streaming(to: &mut [u8], from: &[u8]) {
    assert_eq!(to.len(), from.len(), "a copy between slices of one length");
    // Bytes before the first 32-byte boundary of `to`, then whole vectors, then the rest.
    let head = to.as_ptr().align_offset(32).min(to.len());
    let body = (to.len() - head) / 32 * 32;
    to[..head].copy_from_slice(&from[..head]);
    for i in (head..head + body).step_by(32) {
        // SAFETY: `i + 32 <= to.len()` and `from` is as long; `to[i..]` is 32-byte aligned
        // (`head`, then steps of 32 bytes); AVX is the caller's promise.
        unsafe {
            _mm256_stream_si256(
                to.as_mut_ptr().add(i).cast(),
                _mm256_loadu_si256(from.as_ptr().add(i).cast()),
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
            (Kind::Bf16 | Kind::F16, false) => _mm256_storeu_si256(dst.cast(), narrow16(kind, x)),
            (Kind::Bf16 | Kind::F16, true) => _mm256_stream_si256(dst.cast(), narrow16(kind, x)),
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
    pack16(bf16_bits8(x, TORCH_BF16_NAN))
}

/// The bf16 NaN torch's vectorised copy (or `mul_`) writes (`Elem::narrow`).
const TORCH_BF16_NAN: i32 = 0xffff;

/// The bf16 NaN DeepSpeed's CPU Adam stores (c10's, `Elem::narrow_as_cpu_adam`).
const CPU_ADAM_BF16_NAN: i32 = 0x7fc0;

/// 8 lanes of `x` rounded to bf16, to nearest even, each lane's bits in its low 16 and every NaN lane
/// `nan` ([`TORCH_BF16_NAN`] or [`CPU_ADAM_BF16_NAN`]).
#[target_feature(enable = "avx2")]
#[inline]
fn bf16_bits8(x: __m256, nan: i32) -> __m256i {
    let bits = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        bits,
        _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)),
    ));
    let unordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    _mm256_blendv_epi8(rounded, _mm256_set1_epi32(nan), unordered)
}

/// Eight 32-bit lanes, each at most 0xffff, packed to 16 bits, in order.
#[target_feature(enable = "avx2")]
#[inline]
fn pack16(lanes: __m256i) -> __m128i {
    let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(lanes, lanes));
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

/// Where one SIMD pass reads and writes: `len` elements of each array, the state's in the dtypes
/// `stored` names (the fp32 loops take fp32 alone).
pub struct Lanes {
    pub p: *mut u8,
    pub m: *mut u8,
    pub v: *mut u8,
    pub stored: StateKinds,
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
            debug_assert!(at.stored.is_fp32(), "the fp32 loop on a state in {:?}", at.stored);
            let (p, m, v) = (at.p.cast::<f32>(), at.m.cast::<f32>(), at.v.cast::<f32>());
            // SAFETY: `Folds` is 6 times 64 bytes; unaligned loads.
            $(let mut acc = unsafe { $folds.$fload() };)?
            for i in (0..at.len).step_by($lanes) {
                // SAFETY: `i + lanes <= len` for every array, as the caller promised.
                unsafe {
                    let mut grad = $mul($load(g_kind, g.add(i * g_size)), scale);
                    let mut param = $loadu(p.add(i));
                    let (m_in, v_in) = ($loadu(m.add(i)), $loadu(v.add(i)));
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
                    $storeu(p.add(i), param);
                    $storeu(m.add(i), mom);
                    $storeu(v.add(i), var);
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

/// 8 lanes of `x` rounded to `kind` and widened back, exactly: bf16 to nearest even with every NaN
/// lane `nan` ([`bf16_bits8`]), fp16 by F16C (both ways), fp32 as it is.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn rounded8(kind: Kind, x: __m256, nan: i32) -> __m256 {
    match kind {
        Kind::F32 => x,
        Kind::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)),
        Kind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bf16_bits8(x, nan))),
    }
}

/// 8 lanes of `x`, each exactly an element of `kind` (a [`rounded8`] result), stored as `kind` at `dst`:
/// their bits, NaNs included.
///
/// # Safety
/// `dst` must hold 8 writable elements of `kind`; AVX2 and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store_exact8(kind: Kind, dst: *mut u8, x: __m256) {
    let half = match kind {
        // SAFETY: the caller's promise; an unaligned store.
        Kind::F32 => return unsafe { _mm256_storeu_ps(dst.cast(), x) },
        Kind::F16 => _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x),
        Kind::Bf16 => pack16(_mm256_srli_epi32::<16>(_mm256_castps_si256(x))),
    };
    // SAFETY: the caller's promise; an unaligned store.
    unsafe { _mm_storeu_si128(dst.cast(), half) };
}

/// `a * b + c`, fused or each step rounded (`adam::product_sum`).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn product_sum8(a: __m256, b: __m256, c: __m256, fused: bool) -> __m256 {
    if fused {
        _mm256_fmadd_ps(a, b, c)
    } else {
        _mm256_add_ps(_mm256_mul_ps(a, b), c)
    }
}

/// `old * beta + grad * one_minus` with `how`'s fusing (`adam::moment`).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn moment8(old: __m256, beta: __m256, grad: __m256, one_minus: __m256, how: MomentFma) -> __m256 {
    match how {
        MomentFma::Gradient => _mm256_fmadd_ps(grad, one_minus, _mm256_mul_ps(old, beta)),
        MomentFma::Old => _mm256_fmadd_ps(old, beta, _mm256_mul_ps(grad, one_minus)),
        MomentFma::Separate => {
            _mm256_add_ps(_mm256_mul_ps(grad, one_minus), _mm256_mul_ps(old, beta))
        }
    }
}

/// [`super::pass`]'s rounded elements (a state in half precision, `kinds`) 8 lanes at a time: lane for
/// lane the operations of `pass::rounded_element` with `how`'s arithmetic, in the same order. The
/// gradient is multiplied in its own dtype, each result rounded to its dtype as CPU Adam stores it and
/// kept in `p`, `m`, `v` in the dtypes `at.stored` names (its own, or fp32 widened); the parameters get
/// the master weights' bits.
///
/// # Safety
/// AVX2, FMA and F16C must be available; every pointer of `at` must hold `at.len` elements (a multiple
/// of 8), `p`, `m`, `v` and `o` writable and none overlapping another.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn avx2_rounded(
    at: &Lanes,
    grad_scale: f32,
    k: &AdamConstants,
    how: TailFma,
    kinds: StateKinds,
) {
    let set1 = _mm256_set1_ps;
    let (beta1, beta2) = (set1(k.beta1), set1(k.beta2));
    let (c1, c2) = (set1(k.one_minus_beta1), set1(k.one_minus_beta2));
    let (bias2, eps, step) = (set1(k.bias_correction2), set1(k.eps), set1(k.step_size));
    let scale = set1(grad_scale);
    let (g_kind, g) = at.g;
    let (w, s) = (at.stored.master, at.stored.moments);
    for i in (0..at.len).step_by(8) {
        // SAFETY: `i + 8 <= len` for every array, as the caller promised; unaligned loads and stores.
        unsafe {
            let scaled = _mm256_mul_ps(load8(g_kind, g.add(i * g_kind.size())), scale);
            let mut grad = rounded8(g_kind, scaled, TORCH_BF16_NAN);
            let (p, m, v) = (
                at.p.add(i * w.size()),
                at.m.add(i * s.size()),
                at.v.add(i * s.size()),
            );
            let mut param = load8(w, p);
            let (m_in, v_in) = (load8(s, m), load8(s, v));
            if let Decay::L2(decay) = k.decay {
                grad = product_sum8(param, set1(decay), grad, how.others);
            }
            let mom = moment8(m_in, beta1, grad, c1, how.momentum);
            let var = moment8(v_in, beta2, _mm256_mul_ps(grad, grad), c2, how.variance);
            let denominator = product_sum8(_mm256_sqrt_ps(var), bias2, eps, how.others);
            let update = _mm256_div_ps(mom, denominator);
            if let Decay::AdamW(w_decay) = k.decay {
                param = product_sum8(param, set1(w_decay), param, how.others);
            }
            param = product_sum8(update, step, param, how.others);
            let param = rounded8(kinds.master, param, CPU_ADAM_BF16_NAN);
            store_exact8(w, p, param);
            store_exact8(s, m, rounded8(kinds.moments, mom, CPU_ADAM_BF16_NAN));
            store_exact8(s, v, rounded8(kinds.moments, var, CPU_ADAM_BF16_NAN));
            if let Some((kind, o)) = at.o {
                store_exact8(kind, o.add(i * kind.size()), param);
            }
        }
    }
}
