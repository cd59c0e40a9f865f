use super::*;

#[test]
fn stripes_follow_weights_and_alignment() {
    struct Case {
        size: u64,
        weights: &'static [f64],
        want: &'static [(usize, u64)],
    }
    let cases = [
        Case {
            size: 1 << 20,
            weights: &[1.0],
            want: &[(0, 1 << 20)],
        },
        Case {
            size: 1 << 20,
            weights: &[1.0, 1.0],
            want: &[(0, 1 << 19), (1, 1 << 19)],
        },
        Case {
            size: 1 << 20,
            weights: &[3.0, 1.0],
            want: &[(0, 786_432), (1, 262_144)],
        },
        Case {
            size: 1000,
            weights: &[1.0, 1.0],
            want: &[(1, 1000)],
        },
        Case {
            size: 10_000,
            weights: &[1.0, 1.0],
            want: &[(0, 4096), (1, 5904)],
        },
        Case {
            size: 8192,
            weights: &[0.0, 2.0, 1.0],
            want: &[(1, 4096), (2, 4096)],
        },
        Case {
            size: 0,
            weights: &[1.0, 1.0],
            want: &[],
        },
    ];
    for c in cases {
        let aligns = vec![4096; c.weights.len()];
        let stripes = plan_stripes(c.size, c.weights, &aligns).unwrap();
        let got: Vec<(usize, u64)> = stripes.iter().map(|s| (s.path, s.len)).collect();
        assert_eq!(got, c.want, "size {} weights {:?}", c.size, c.weights);
        assert_eq!(stripes.iter().map(|s| s.len).sum::<u64>(), c.size);
        assert!(
            stripes.iter().all(|s| s.object_offset % 4096 == 0),
            "{stripes:?}"
        );
    }
}

#[test]
fn bad_weights_name_the_key() {
    for weights in [
        &[][..],
        &[1.0][..],
        &[0.0, 0.0][..],
        &[-1.0, 2.0][..],
        &[f64::NAN, 1.0][..],
    ] {
        let err = plan_stripes(10, weights, &[4096, 4096]).unwrap_err();
        assert!(
            err.to_string().starts_with("weights:"),
            "{weights:?}: {err}"
        );
    }
}

#[test]
fn keys_cannot_escape_the_store() {
    for bad in [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "/etc/passwd",
        ".hidden",
        "a\0b",
        "é",
        &"x".repeat(201),
    ] {
        assert!(validate_key(bad).is_err(), "{bad:?} accepted");
    }
    for good in [
        "a",
        "sg17.exp_avg",
        "sub-group_0.fp32",
        "a..b",
        &"x".repeat(200),
    ] {
        validate_key(good).unwrap();
    }
}
