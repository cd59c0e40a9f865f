use super::part::{elem_bytes, BLOCK};
use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn as_bytes(x: &[f32]) -> &[u8] {
    Array::F32(&mut x.to_vec())
        .bytes(0, x.len())
        .to_vec()
        .leak()
}

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
                _mm_extract_epi16::<0>(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm_set1_ps(
                    x,
                ))) as u16
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
                            state: fp32_arrays(&mut got_state),
                            grad: &grad,
                            params: Some(&mut *got_params),
                            keep_params: false,
                            keep_state: None,
                            kinds: StateKinds::FP32,
                            master_in_params: false,
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
                                params: [None, None],
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
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(2, &hyper(1e-3, 0.01, true, true));
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
        for (caller, (threads, state, grad, want_state, want_params)) in callers.iter().enumerate()
        {
            let (arith, k) = (&arith, &k);
            scope.spawn(move || {
                for round in 0..20 {
                    let mut got_state = state.clone();
                    let mut got_params = vec![Bf16::default(); n];
                    let chunk = Chunk {
                        state: fp32_arrays(&mut got_state),
                        grad,
                        params: Some(&mut got_params),
                        keep_params: false,
                        keep_state: None,
                        kinds: StateKinds::FP32,
                        master_in_params: false,
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
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(2, &hyper(1e-3, 0.01, true, true));
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
                            state: fp32_arrays(&mut s),
                            grad: &grad,
                            params: Some(&mut params),
                            keep_params: keep,
                            keep_state: keep.then(|| fp32_arrays(&mut kept_state).map(Some)),
                            kinds: StateKinds::FP32,
                            master_in_params: false,
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
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.0, true, true));
    let arith = vector_arith();
    let (mut with, mut without) = (state.clone(), state);
    let mut params = vec![0.0f32; 100];
    update(
        Chunk {
            state: fp32_arrays(&mut with),
            grad: &grad,
            params: Some(&mut params),
            keep_params: false,
            keep_state: None,
            kinds: StateKinds::FP32,
            master_in_params: false,
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
            state: fp32_arrays(&mut without),
            grad: &grad,
            params: None,
            keep_params: false,
            keep_state: None,
            kinds: StateKinds::FP32,
            master_in_params: false,
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
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.01, true, true));
    let bytes = as_bytes;
    let run = |state: &mut [f32], grad: &[f32], simd: Simd, threads: usize, cuts: Cuts<'_>| {
        let params = None;
        update::<f32, f32>(
            Chunk {
                state: fp32_arrays(state),
                grad,
                params,
                keep_params: false,
                keep_state: None,
                kinds: StateKinds::FP32,
                master_in_params: false,
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
                    Some(expected(before)),
                    "{name}, n {n}, {simd:?}, {threads} threads: read"
                );
                assert_eq!(
                    sums.write,
                    Some(expected(after)),
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
        let written = crate::checksum::crc32c(bytes(&state));
        assert_eq!(
            sums,
            ChunkSums {
                read: None,
                write: Some(vec![written]),
                kept_params: None,
                params: [None, None],
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
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.0, true, true));
    let grad = vec![0.0f32; 10];
    // Each wrong input (a gradient of 10 elements) is an error naming the key, and the length given.
    let cases: [(&str, &[&str]); 4] = [
        ("a state of 29", &["state", "[9, 9, 11]"]),
        ("keep_params without params", &["keep_params"]),
        (
            "a kept state of 29",
            &["keep_state", "[9 F32, 9 F32, 11 F32]"],
        ),
        ("params of 9", &["params", "9"]),
    ];
    for (case, words) in cases {
        let mut state = vec![0.0f32; if case == "a state of 29" { 29 } else { 30 }];
        let (mut kept_state, mut params) = (vec![0.0f32; 29], vec![0.0f32; 9]);
        let chunk = Chunk {
            state: fp32_arrays(&mut state),
            grad: &grad,
            params: (case == "params of 9").then_some(&mut params[..]),
            keep_params: case == "keep_params without params",
            keep_state: (case == "a kept state of 29")
                .then(|| fp32_arrays(&mut kept_state).map(Some)),
            kinds: StateKinds::FP32,
            master_in_params: false,
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
            ChunkAt {
                state: bytes.as_ptr() as usize + 1,
                grad: (bytes.as_ptr() as usize, Kind::Bf16),
                params: None,
                keep_state: None,
                keep_params: false,
                count: 1,
            },
            StateLayout::new(StateKinds::FP32, StateKinds::FP32, false).unwrap(),
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

/// `x` as DeepSpeed's CPU Adam stores it in `kind` (c10's conversions), written out apart from the
/// kernel's: bf16 nearest-even with every NaN 0x7fc0, fp16 as F16C's `vcvtps2ph`.
fn stored(kind: Kind, x: f32) -> f32 {
    match kind {
        Kind::F32 => x,
        Kind::Bf16 if x.is_nan() => f32::from_bits(0x7fc0_0000),
        Kind::Bf16 => Bf16::narrow(x).widen(),
        Kind::F16 => F16::narrow(x).widen(),
    }
}

/// One array of a state, owned, in the dtype it is kept in.
enum Owned {
    F32(Vec<f32>),
    Bf16(Vec<Bf16>),
    F16(Vec<F16>),
}

impl Owned {
    /// `xs` (values of `kind`, NaNs as CPU Adam stores them) kept in `kind`: their own bits.
    fn new(kind: Kind, xs: &[f32]) -> Owned {
        match kind {
            Kind::F32 => Owned::F32(xs.to_vec()),
            Kind::Bf16 => Owned::Bf16(
                xs.iter()
                    .map(|x| Bf16((x.to_bits() >> 16) as u16))
                    .collect(),
            ),
            Kind::F16 => Owned::F16(xs.iter().map(|&x| F16::narrow(x)).collect()),
        }
    }

    fn array(&mut self) -> Array<'_> {
        match self {
            Owned::F32(a) => Array::F32(a),
            Owned::Bf16(a) => Array::Bf16(a),
            Owned::F16(a) => Array::F16(a),
        }
    }

    fn widened(&self) -> Vec<f32> {
        match self {
            Owned::F32(a) => a.clone(),
            Owned::Bf16(a) => a.iter().map(|x| x.widen()).collect(),
            Owned::F16(a) => a.iter().map(|x| x.widen()).collect(),
        }
    }
}

/// `update` of a state in `kinds`' half precision (`state`: `[params | exp_avg | exp_avg_sq]` in fp32)
/// with its arrays kept in `stored`'s dtypes, writing parameters, keeping nothing and summing nothing:
/// the state after it (in fp32) and the parameters.
#[allow(clippy::too_many_arguments)]
fn half_state_update<G: Elem>(
    state: &[f32],
    stored: StateKinds,
    grad: &[G],
    kinds: StateKinds,
    grad_scale: f32,
    k: &AdamConstants,
    arith: &DeepSpeedArith,
    simd: Simd,
    threads: usize,
) -> (Vec<f32>, Vec<G>) {
    let n = grad.len();
    let dtypes = [stored.master, stored.moments, stored.moments];
    let mut owned: [Owned; 3] =
        std::array::from_fn(|a| Owned::new(dtypes[a], &state[a * n..][..n]));
    let mut params = vec![G::narrow(0.0); n];
    let chunk = Chunk {
        state: owned.each_mut().map(|o| o.array()),
        grad,
        params: Some(&mut params),
        keep_params: false,
        keep_state: None,
        kinds,
        master_in_params: false,
    };
    update(chunk, grad_scale, k, arith, simd, threads, Cuts::default()).unwrap();
    (owned.iter().flat_map(Owned::widened).collect(), params)
}

/// Where a state in `kinds` may be kept: in fp32, in its own dtypes, and with half-precision moments
/// in fp32 (as after a checkpoint's load moved them to the weights' dtype).
fn storages(kinds: StateKinds) -> Vec<StateKinds> {
    let mut all = vec![StateKinds::FP32, kinds];
    if kinds.moments != Kind::F32 {
        all.push(StateKinds {
            master: kinds.master,
            moments: Kind::F32,
        });
    }
    all
}

/// A state in half precision through `update`, against the element-by-element specification of
/// DeepSpeed's CPU Adam in those dtypes.
fn check_half_state<G: Elem>(
    kinds: StateKinds,
    width: usize,
    threads: usize,
    n: usize,
    rng: &mut StdRng,
) {
    let (mut state, grad32) = inputs(n, rng);
    for (k, value) in state.iter_mut().enumerate() {
        *value = stored(if k < n { kinds.master } else { kinds.moments }, *value);
    }
    let grad: Vec<G> = grad32.iter().map(|&g| G::narrow(g)).collect();
    let arith = DeepSpeedArith {
        vector_width: width,
        tail: TailFma {
            momentum: MomentFma::Old,
            variance: MomentFma::Separate,
            others: false,
        },
        bias_sqrt: BiasSqrt::Float,
    };
    let k =
        AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(3, &hyper(1e-3, 0.01, false, true));
    // Where DeepSpeed's build takes these dtypes in its vector code: not at all with bf16 on AVX2, nor
    // in a build without SIMD (width 1).
    let bf16 = kinds.master == Kind::Bf16 || kinds.moments == Kind::Bf16;
    let body = if (bf16 && width == 8) || width == 1 {
        0
    } else {
        n - n % width
    };
    let mut expected = state.clone();
    let mut expected_params = vec![G::narrow(0.0); n];
    for i in 0..n {
        let how = if i < body {
            TailFma::VECTOR
        } else {
            arith.tail
        };
        let g = G::narrow(grad[i].widen() * 0.25).widen();
        let (p, m, v) = adam_element(state[i], g, state[n + i], state[2 * n + i], &k, how);
        expected[i] = stored(kinds.master, p);
        expected[n + i] = stored(kinds.moments, m);
        expected[2 * n + i] = stored(kinds.moments, v);
        expected_params[i] = G::narrow_as_cpu_adam(p);
    }
    for stored in storages(kinds) {
        let (state, params) = half_state_update(
            &state,
            stored,
            &grad,
            kinds,
            0.25,
            &k,
            &arith,
            Simd::detect(),
            threads,
        );
        let case =
            format!("{kinds:?} kept in {stored:?}, width {width}, {threads} threads, {n} elements");
        check_half_results(&case, &state, &params, &expected, &expected_params);
    }
}

/// A half-precision state's pass (`state`, `params`) against what DeepSpeed's CPU Adam gives.
fn check_half_results<G: Elem>(
    case: &str,
    state: &[f32],
    params: &[G],
    expected: &[f32],
    expected_params: &[G],
) {
    for (i, (a, b)) in state.iter().zip(expected).enumerate() {
        assert!(
            same(*a, *b),
            "{case}: state element {i}: {a:e} against {b:e}"
        );
    }
    for (i, (a, b)) in params.iter().zip(expected_params).enumerate() {
        assert_eq!(a.bits(), b.bits(), "{case}: params element {i}");
        assert_eq!(
            a.widen().to_bits(),
            state[i].to_bits(),
            "{case}: params {i} are not the master weights"
        );
    }
}

#[test]
fn a_state_in_half_precision_is_rounded_as_cpu_adam_stores_it() {
    let mut rng = StdRng::seed_from_u64(61);
    // master, moments
    let kinds = [
        (Kind::Bf16, Kind::F32),
        (Kind::Bf16, Kind::Bf16),
        (Kind::F16, Kind::F32),
        (Kind::F16, Kind::F16),
    ];
    for (master, moments) in kinds {
        let kinds = StateKinds { master, moments };
        for width in [16, 8, 1] {
            for threads in [1, 3] {
                for n in [1, 15, BLOCK + 37] {
                    match master {
                        Kind::Bf16 => check_half_state::<Bf16>(kinds, width, threads, n, &mut rng),
                        _ => check_half_state::<F16>(kinds, width, threads, n, &mut rng),
                    }
                }
            }
        }
    }
}

#[test]
fn cpu_adams_bf16_nan_is_c10s() {
    for x in [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001)] {
        assert_eq!(Bf16::narrow_as_cpu_adam(x).0, 0x7fc0);
    }
    assert_eq!(Bf16::narrow_as_cpu_adam(1.0).0, Bf16::narrow(1.0).0);
    assert_eq!(F16::narrow_as_cpu_adam(f32::NAN).0, F16::narrow(f32::NAN).0);
}

#[test]
fn state_dtypes_deepspeed_does_not_take_are_named() {
    // master, moments, grad, params, the argument named
    let cases = [
        (Kind::Bf16, Kind::F32, Kind::F32, None, "grad"),
        (
            Kind::Bf16,
            Kind::Bf16,
            Kind::Bf16,
            Some(Kind::F16),
            "params",
        ),
        (Kind::F16, Kind::Bf16, Kind::F16, None, "moments_dtype"),
        (Kind::F32, Kind::Bf16, Kind::Bf16, None, "moments_dtype"),
    ];
    for (master, moments, grad, params, named) in cases {
        let err = StateKinds { master, moments }
            .check(grad, params)
            .unwrap_err()
            .to_string();
        assert!(err.contains(named), "{master:?}/{moments:?}: {err}");
    }
    assert!(StateKinds::FP32.check(Kind::Bf16, Some(Kind::Bf16)).is_ok());
}

#[test]
fn a_witness_tells_two_scalar_loops_apart_and_only_those() {
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.0, true, true));
    let kinds = StateKinds {
        master: Kind::Bf16,
        moments: Kind::Bf16,
    };
    let tail = |momentum, variance| TailFma {
        momentum,
        variance,
        others: true,
    };
    let (a, b) = (
        tail(MomentFma::Old, MomentFma::Old),
        tail(MomentFma::Old, MomentFma::Gradient),
    );
    let w = witness(a, b, &k, 0.5, kinds, 1).expect("the variance's fusing shows somewhere");
    let run = |how| {
        part::rounded_element::<Bf16, Bf16, Bf16>(
            w.param,
            w.exp_avg,
            w.exp_avg_sq,
            Bf16(w.grad_bits as u16),
            0.5,
            &k,
            how,
        )
    };
    assert_ne!(run(a), run(b));
    assert_eq!(witness(a, a, &k, 0.5, kinds, 1), None);
}

/// The rounded pass of every state in half precision, with every arithmetic and decay, in SIMD where
/// this CPU has it against the specification element by element (`Simd::Scalar`), on awkward values:
/// NaN, infinities, subnormals and halfway cases in the state and the gradient.
fn check_rounded_simd<G: Elem>(kinds: StateKinds, rng: &mut StdRng) {
    // One vector's leftover past a block, and runs that start off a vector's boundary.
    let n = BLOCK + 8 * 5 + 3;
    let weights = awkward_weights(n, rng);
    let m = awkward_weights(n, rng);
    // exp_avg_sq is never negative in DeepSpeed's state.
    let v: Vec<f32> = awkward_weights(n, rng).iter().map(|x| x.abs()).collect();
    let state: Vec<f32> = [weights, m, v]
        .iter()
        .enumerate()
        .flat_map(|(a, xs)| {
            let kind = if a == 0 { kinds.master } else { kinds.moments };
            xs.iter().map(move |&x| stored(kind, x))
        })
        .collect();
    let grad: Vec<G> = awkward_weights(n, rng)
        .iter()
        .map(|&g| G::narrow(g * 1e-2))
        .collect();
    let moments = [MomentFma::Gradient, MomentFma::Old, MomentFma::Separate];
    let decays = [(0.0, true), (0.01, true), (0.01, false)];
    for (momentum, variance, others) in moments.iter().flat_map(|&a| {
        moments
            .iter()
            .flat_map(move |&b| [(a, b, true), (a, b, false)])
    }) {
        for &(decay, adamw) in &decays {
            for width in [16, 1] {
                let arith = DeepSpeedArith {
                    vector_width: width,
                    tail: TailFma {
                        momentum,
                        variance,
                        others,
                    },
                    bias_sqrt: BiasSqrt::Float,
                };
                let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float)
                    .constants(2, &hyper(1e-3, decay, adamw, true));
                let run = |simd: Simd, stored: StateKinds| {
                    half_state_update(&state, stored, &grad, kinds, 1.0 / 3.0, &k, &arith, simd, 2)
                };
                // The specification on an fp32 state, against SIMD on every storage.
                let (spec, spec_params) = run(Simd::Scalar, StateKinds::FP32);
                for stored in storages(kinds) {
                    let (ours, our_params) = run(Simd::detect(), stored);
                    let case = format!(
                        "{kinds:?} kept in {stored:?}, {:?}, decay {decay} adamw {adamw}",
                        arith.tail
                    );
                    // A value rounded to half precision is one bit pattern, NaN included (bf16's 0x7fc0;
                    // fp16 keeps a payload, as fp32 does: `same`).
                    let exact = |kind: Kind, a: f32, b: f32| {
                        if kind == Kind::Bf16 {
                            a.to_bits() == b.to_bits()
                        } else {
                            same(a, b)
                        }
                    };
                    for (i, (a, b)) in ours.iter().zip(&spec).enumerate() {
                        let kind = if i < n { kinds.master } else { kinds.moments };
                        assert!(
                            exact(kind, *a, *b),
                            "{case}: state {i}: {a:e} against {b:e}"
                        );
                    }
                    for (i, (a, b)) in our_params.iter().zip(&spec_params).enumerate() {
                        assert!(
                            exact(kinds.master, a.widen(), b.widen()),
                            "{case}: params {i}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_rounded_pass_in_simd_is_the_specification() {
    let mut rng = StdRng::seed_from_u64(68);
    for (master, moments) in [
        (Kind::Bf16, Kind::F32),
        (Kind::Bf16, Kind::Bf16),
        (Kind::F16, Kind::F32),
        (Kind::F16, Kind::F16),
    ] {
        let kinds = StateKinds { master, moments };
        match master {
            Kind::Bf16 => check_rounded_simd::<Bf16>(kinds, &mut rng),
            _ => check_rounded_simd::<F16>(kinds, &mut rng),
        }
    }
}

/// `xs` (values of `kind`) in `kind`'s bytes.
fn kind_bytes(kind: Kind, xs: &[f32]) -> Vec<u8> {
    let mut owned = Owned::new(kind, xs);
    owned.array().bytes(0, xs.len()).to_vec()
}

/// `bytes` of `kind`'s elements, widened.
fn widened(kind: Kind, bytes: &[u8]) -> Vec<f32> {
    let size = kind.size();
    bytes
        .chunks_exact(size)
        .map(|b| match kind {
            Kind::F32 => f32::from_le_bytes(b.try_into().unwrap()),
            Kind::Bf16 => Bf16(u16::from_le_bytes(b.try_into().unwrap())).widen(),
            Kind::F16 => F16(u16::from_le_bytes(b.try_into().unwrap())).widen(),
        })
        .collect()
}

/// The half-precision states of the tables: master, moments, elements (odd: the arrays' alignment must
/// not depend on it).
const HALF_STATES: [(Kind, Kind, usize); 4] = [
    (Kind::Bf16, Kind::Bf16, 2 * BLOCK + 13),
    (Kind::Bf16, Kind::F32, 2 * BLOCK + 13),
    (Kind::F16, Kind::F32, 77),
    (Kind::F16, Kind::F16, 4096),
];

/// Random `[params | exp_avg | exp_avg_sq]` of `n` elements, each a value of its dtype in `kinds`, and a
/// gradient's bytes in the master weights' dtype.
fn rounded_inputs(kinds: StateKinds, n: usize, rng: &mut StdRng) -> (Vec<f32>, Vec<u8>) {
    let (mut state, grad32) = inputs(n, rng);
    for (i, value) in state.iter_mut().enumerate() {
        *value = stored(if i < n { kinds.master } else { kinds.moments }, *value);
    }
    let m = kinds.master;
    (state, kind_bytes(m, &widened(m, &kind_bytes(m, &grad32))))
}

/// The CRC32C of each stripe of `bytes`, cut at `cuts`.
fn stripe_crcs(cuts: &[u64], bytes: &[u8]) -> Vec<u32> {
    cuts.iter()
        .zip(cuts.iter().skip(1).copied().chain([bytes.len() as u64]))
        .map(|(&s, e)| crate::checksum::crc32c(&bytes[s as usize..e as usize]))
        .collect()
}

/// Cuts within `total` bytes of a state, as the store's stripes cut it.
fn some_cuts(total: usize) -> Vec<u64> {
    [0, 4096, total as u64 / 2 + 6, total as u64 - 2]
        .into_iter()
        .filter(|&c| c < total as u64)
        .collect()
}

/// One pass at raw addresses, on 3 threads of the widest SIMD here: the state in `words`, laid out for
/// `kinds` (the moments alone with `master_in_params`), the gradient's `grad` bytes, `n` parameters at
/// `params`; keeping the parameters and the state into `kept` where given, summed at `cuts`.
#[allow(clippy::too_many_arguments)]
fn pass_at(
    words: &mut [u32],
    grad: &[u8],
    params: usize,
    kept: Option<&mut [u32]>,
    master_in_params: bool,
    kinds: StateKinds,
    n: usize,
    k: &AdamConstants,
    cuts: Option<&[u64]>,
) -> ChunkSums {
    let keep = kept.is_some();
    // SAFETY: every array lives for the call, of the lengths given, none overlapping another.
    unsafe {
        update_at(
            ChunkAt {
                state: words.as_mut_ptr() as usize,
                grad: (grad.as_ptr() as usize, kinds.master),
                params: Some((params, kinds.master)),
                keep_state: kept.map(|kept| kept.as_mut_ptr() as usize),
                keep_params: keep,
                count: n,
            },
            StateLayout::new(kinds, kinds, master_in_params).unwrap(),
            1.0,
            k,
            &vector_arith(),
            Simd::detect(),
            3,
            Cuts {
                read: cuts,
                write: cuts,
            },
        )
    }
    .unwrap()
}

#[test]
fn a_state_kept_in_its_own_dtypes_is_laid_out_summed_and_kept() {
    let mut rng = StdRng::seed_from_u64(69);
    let arith = vector_arith();
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(2, &hyper(1e-3, 0.01, true, true));
    for (master, moments, n) in HALF_STATES {
        let kinds = StateKinds { master, moments };
        let (offsets, total) = kinds.layout(n);
        let sizes = [master.size(), moments.size(), moments.size()];
        assert_eq!(total, sizes.iter().sum::<usize>() * n, "{kinds:?}");
        // Each array aligned for its elements, and the three tiling the chunk's bytes.
        let mut spans: Vec<(usize, usize)> = (0..3)
            .map(|a| (offsets[a], offsets[a] + sizes[a] * n))
            .collect();
        spans.sort_unstable();
        assert!(
            spans.windows(2).all(|w| w[0].1 == w[1].0) && spans[2].1 == total,
            "{kinds:?}"
        );
        assert!(
            (0..3).all(|a| offsets[a] % sizes[a] == 0),
            "{kinds:?}: {offsets:?}"
        );
        let (state, grad_bytes) = rounded_inputs(kinds, n, &mut rng);
        // The state in its layout, in words of 4 bytes (aligned for every array).
        let bytes = |w: &[u32]| bytes_of(w, total);
        let mut raw = vec![0u8; total];
        let dtypes = [master, moments, moments];
        for a in 0..3 {
            let b = kind_bytes(dtypes[a], &state[a * n..][..n]);
            raw[offsets[a]..][..b.len()].copy_from_slice(&b);
        }
        let mut words = words_of(&raw);
        let before = bytes(&words);
        let mut kept = vec![0u32; words.len()];
        // The parameters, the weights' bits (as the last pass left them).
        let mut params: Vec<u16> = kind_bytes(master, &state[..n])
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let cuts = some_cuts(total);
        let sums = |b: &[u8]| stripe_crcs(&cuts, b);
        let (address, kept_at) = (params.as_mut_ptr() as usize, Some(&mut kept[..]));
        let got = pass_at(
            &mut words,
            &grad_bytes,
            address,
            kept_at,
            false,
            kinds,
            n,
            &k,
            Some(&cuts),
        );
        let after = bytes(&words);
        assert_eq!(bytes(&kept), before, "{kinds:?}: the kept state");
        assert_eq!(got.read, Some(sums(&before)), "{kinds:?}: sums as read");
        assert_eq!(got.write, Some(sums(&after)), "{kinds:?}: sums as written");
        // The same pass on the state in fp32.
        let g: Vec<f32> = widened(master, &grad_bytes);
        let fp32 = StateKinds::FP32;
        let simd = Simd::detect();
        let (wide, expected_params): (Vec<f32>, Vec<u32>) = match master {
            Kind::Bf16 => {
                let g: Vec<Bf16> = g.iter().map(|&x| Bf16::narrow(x)).collect();
                let (w, p) = half_state_update(&state, fp32, &g, kinds, 1.0, &k, &arith, simd, 3);
                (w, p.iter().map(|p| p.bits()).collect())
            }
            _ => {
                let g: Vec<F16> = g.iter().map(|&x| F16::narrow(x)).collect();
                let (w, p) = half_state_update(&state, fp32, &g, kinds, 1.0, &k, &arith, simd, 3);
                (w, p.iter().map(|p| p.bits()).collect())
            }
        };
        for a in 0..3 {
            let kind = if a == 0 { master } else { moments };
            let ours = widened(kind, &after[offsets[a]..][..kind.size() * n]);
            for (i, (x, y)) in ours.iter().zip(&wide[a * n..][..n]).enumerate() {
                assert_eq!(x.to_bits(), y.to_bits(), "{kinds:?}: array {a} element {i}");
            }
        }
        let ours: Vec<u32> = params.iter().map(|&p| u32::from(p)).collect();
        assert_eq!(ours, expected_params, "{kinds:?}: params");
        // The parameters were the weights' bits before the pass: none kept.
        assert_eq!(got.kept_params, Some(vec![]), "{kinds:?}: kept params");
    }
}

/// `bytes` in words of 4 bytes (zero-padded): aligned for every array of a state.
fn words_of(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|b| {
            let mut four = [0u8; 4];
            four[..b.len()].copy_from_slice(b);
            u32::from_le_bytes(four)
        })
        .collect()
}

/// The first `len` bytes of `words`.
fn bytes_of(words: &[u32], len: usize) -> Vec<u8> {
    words
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .take(len)
        .collect()
}

/// The pass over a state laid out whole (`StateKinds::layout`), the parameters written apart, without
/// sums: the moments' bytes and the parameters' after it.
fn pass_with_master_stored(
    kinds: StateKinds,
    state: &[f32],
    grad_bytes: &[u8],
    k: &AdamConstants,
) -> (Vec<u8>, Vec<u8>) {
    let n = state.len() / 3;
    let (offsets, total) = kinds.layout(n);
    let mut raw = vec![0u8; total];
    for (a, kind) in [kinds.master, kinds.moments, kinds.moments]
        .into_iter()
        .enumerate()
    {
        let b = kind_bytes(kind, &state[a * n..][..n]);
        raw[offsets[a]..][..b.len()].copy_from_slice(&b);
    }
    let mut words = words_of(&raw);
    let mut params = vec![0u16; n];
    let address = params.as_mut_ptr() as usize;
    pass_at(
        &mut words, grad_bytes, address, None, false, kinds, n, k, None,
    );
    let after = bytes_of(&words, total);
    let s = kinds.moments.size() * n;
    let moments = [&after[offsets[1]..][..s], &after[offsets[2]..][..s]].concat();
    (
        moments,
        params.iter().flat_map(|p| p.to_le_bytes()).collect(),
    )
}

#[test]
fn master_weights_in_the_parameters_give_the_pass_with_them_stored() {
    let mut rng = StdRng::seed_from_u64(71);
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(3, &hyper(1e-3, 0.01, true, true));
    for (master, moments, n) in HALF_STATES {
        let kinds = StateKinds { master, moments };
        let (offsets, total) = kinds.moments_layout(n);
        assert_eq!(
            (offsets, total),
            (
                [2 * moments.size() * n, 0, moments.size() * n],
                2 * moments.size() * n
            )
        );
        let (state, grad_bytes) = rounded_inputs(kinds, n, &mut rng);
        let (want_moments, want_params) = pass_with_master_stored(kinds, &state, &grad_bytes, &k);
        // The moments alone, and the parameters holding the master weights.
        let before = [
            kind_bytes(moments, &state[n..2 * n]),
            kind_bytes(moments, &state[2 * n..]),
        ]
        .concat();
        let mut words = words_of(&before);
        let mut kept = vec![0u32; words.len()];
        let params_before = kind_bytes(master, &state[..n]);
        let mut params = words_of(&params_before);
        let cuts = some_cuts(total);
        let sums = |b: &[u8]| stripe_crcs(&cuts, b);
        let (address, kept_at) = (params.as_mut_ptr() as usize, Some(&mut kept[..]));
        let got = pass_at(
            &mut words,
            &grad_bytes,
            address,
            kept_at,
            true,
            kinds,
            n,
            &k,
            Some(&cuts),
        );
        let (after, params_after) = (bytes_of(&words, total), bytes_of(&params, 2 * n));
        assert_eq!(after, want_moments, "{kinds:?}: the moments");
        assert_eq!(params_after, want_params, "{kinds:?}: the parameters");
        assert_eq!(got.read, Some(sums(&before)), "{kinds:?}: sums as read");
        assert_eq!(got.write, Some(sums(&after)), "{kinds:?}: sums as written");
        let crc = crate::checksum::crc32c;
        assert_eq!(
            got.params,
            [Some(crc(&params_before)), Some(crc(&params_after))],
            "{kinds:?}"
        );
        // The moments and every parameter as they were: what an undo gives back.
        assert_eq!(
            bytes_of(&kept, total),
            before,
            "{kinds:?}: the kept moments"
        );
        let kept_params: Vec<u8> = got
            .kept_params
            .unwrap()
            .into_iter()
            .flat_map(|k| k.bytes)
            .collect();
        assert_eq!(kept_params, params_before, "{kinds:?}: the kept parameters");
    }
}

#[test]
fn master_weights_in_the_parameters_need_half_precision_parameters() {
    let k = AdamBias::new(0.9, 0.999, BiasSqrt::Float).constants(1, &hyper(1e-3, 0.0, true, true));
    let (mut moments, grad, mut params) = ([0u32; 16], [0u16; 8], [0u32; 8]);
    // kept in, the parameters' dtype, the parameters' address given: the argument the error names
    let cases = [
        (StateKinds::FP32, Kind::F32, true, "master_in_params"),
        (
            StateKinds {
                master: Kind::Bf16,
                moments: Kind::Bf16,
            },
            Kind::F16,
            true,
            "params",
        ),
        (
            StateKinds {
                master: Kind::Bf16,
                moments: Kind::Bf16,
            },
            Kind::Bf16,
            false,
            "params",
        ),
    ];
    for (kinds, params_kind, given, name) in cases {
        // SAFETY: every array lives for the call and holds 8 elements of any of these dtypes.
        let err = unsafe {
            update_at(
                ChunkAt {
                    state: moments.as_mut_ptr() as usize,
                    grad: (grad.as_ptr() as usize, Kind::Bf16),
                    params: given.then_some((params.as_mut_ptr() as usize, params_kind)),
                    keep_state: None,
                    keep_params: false,
                    count: 8,
                },
                // Not `StateLayout::new`, which refuses the first: the pass's own checks.
                StateLayout {
                    kinds,
                    stored: kinds,
                    master_in_params: true,
                },
                1.0,
                &k,
                &vector_arith(),
                Simd::Scalar,
                1,
                Cuts::default(),
            )
        }
        .unwrap_err()
        .to_string();
        assert!(err.contains(name), "{kinds:?} {params_kind:?}: {err}");
    }
}

#[test]
fn a_state_layout_that_deepspeed_cannot_keep_is_refused_by_name() {
    let (f32_, bf16, f16) = (Kind::F32, Kind::Bf16, Kind::F16);
    let of = |master, moments| StateKinds { master, moments };
    // DeepSpeed's dtypes, the chunk's, master weights in the parameters: the argument the error names.
    let cases = [
        (of(f16, bf16), of(f16, bf16), false, "moments"),
        (of(bf16, bf16), of(f16, bf16), false, "stored_master"),
        (of(bf16, f32_), of(bf16, bf16), false, "stored_moments"),
        (StateKinds::FP32, StateKinds::FP32, true, "master_in_params"),
        (of(bf16, bf16), of(f32_, bf16), true, "master_in_params"),
    ];
    for (kinds, stored, in_params, name) in cases {
        let err = StateLayout::new(kinds, stored, in_params)
            .unwrap_err()
            .to_string();
        assert!(err.contains(name), "{kinds:?} in {stored:?}: {err}");
    }
    let fine = StateLayout::new(of(bf16, f32_), StateKinds::FP32, false).unwrap();
    assert_eq!(fine.offsets(10), StateKinds::FP32.layout(10));
}
