//! Every request limit at, just under and just over its bound, and the configuration
//! checks of the limits themselves.

use oncegate_core::{
    FINGERPRINT_BYTES_CEILING, Invalid, KEY_BYTES_CEILING, Key, LEASE_MS_FLOOR, Limits, Namespace,
    RESPONSE_BYTES_CEILING, TTL_MS_CEILING, Tenant, Unit, derive_key, route::Routing,
};

/// A named check: does a value of this size pass?
struct Bound {
    name: &'static str,
    /// Runs the check with a value of size `n`.
    check: fn(&Limits, u64) -> Result<(), Invalid>,
    /// The smallest accepted size.
    min: u64,
    /// The largest accepted size.
    max: u64,
    /// The field every refusal must name.
    field: &'static str,
}

/// Every request limit's bound: the lengths, then the numbers.
fn bounds(l: &Limits) -> Vec<Bound> {
    length_bounds(l).into_iter().chain(number_bounds(l)).collect()
}

/// The bounds on lengths in bytes: keys, names, fingerprints and responses.
fn length_bounds(l: &Limits) -> Vec<Bound> {
    vec![
        Bound {
            name: "key",
            check: |l, n| l.key(&"k".repeat(n as usize)).map(drop),
            min: 1,
            max: l.key_bytes_max as u64,
            field: "key",
        },
        Bound {
            name: "key of multi-byte chars",
            check: |l, n| l.key(&("é".repeat(n as usize / 2) + &"a".repeat(n as usize % 2))).map(drop),
            min: 1,
            max: l.key_bytes_max as u64,
            field: "key",
        },
        Bound {
            name: "namespace",
            check: |_, n| Namespace::new(&"n".repeat(n as usize)).map(drop),
            min: 1,
            max: 64,
            field: "namespace",
        },
        Bound {
            name: "tenant",
            check: |_, n| Tenant::new(&"t".repeat(n as usize)).map(drop),
            min: 1,
            max: 64,
            field: "tenant",
        },
        Bound {
            name: "fingerprint",
            check: |l, n| l.fingerprint(&vec![7; n as usize]).map(drop),
            min: 0,
            max: l.fingerprint_bytes_max as u64,
            field: "fingerprint",
        },
        Bound {
            name: "response",
            check: |l, n| l.response(&vec![7; n as usize]),
            min: 0,
            max: l.response_bytes_max as u64,
            field: "response",
        },
    ]
}

/// The bounds on numbers: durations, the count of key parts and the token.
fn number_bounds(l: &Limits) -> Vec<Bound> {
    vec![
        Bound {
            name: "ttl",
            check: |l, n| l.ttl_ms(n).map(drop),
            min: l.ttl_ms_min,
            max: l.ttl_ms_max,
            field: "ttl_ms",
        },
        Bound {
            name: "lease",
            check: |l, n| l.lease_ms(n).map(drop),
            min: l.lease_ms_min,
            max: l.lease_ms_max,
            field: "lease_ms",
        },
        Bound {
            name: "wait",
            check: |l, n| l.wait_ms(n).map(drop),
            min: 0,
            max: l.wait_ms_max,
            field: "wait_ms",
        },
        Bound {
            name: "bucket",
            check: |l, n| l.derive_key(&["a"], n, 0).map(drop),
            min: 1,
            max: l.bucket_ms_max,
            field: "bucket_ms",
        },
        Bound {
            name: "key parts count",
            check: |l, n| l.derive_key(&vec!["p"; n as usize], 60_000, 0).map(drop),
            min: 1,
            max: l.key_parts_len_max as u64,
            field: "key_parts",
        },
        Bound { name: "token", check: |l, n| l.token(n).map(drop), min: 1, max: u64::MAX, field: "token" },
    ]
}

#[test]
fn every_limit_at_under_and_over_its_bounds() {
    let limits = Limits::default();
    for bound in bounds(&limits) {
        let accepted = |n: u64| (bound.check)(&limits, n);
        assert!(accepted(bound.max).is_ok(), "{}: the maximum {} must pass", bound.name, bound.max);
        assert!(accepted(bound.min).is_ok(), "{}: the minimum {} must pass", bound.name, bound.min);
        if bound.max > bound.min {
            assert!(accepted(bound.max - 1).is_ok(), "{}: just under the maximum must pass", bound.name);
        }
        if bound.max < u64::MAX {
            let err = accepted(bound.max + 1).expect_err(bound.name);
            assert_eq!(err.field(), bound.field, "{}: {err}", bound.name);
            assert!(
                err.to_string().contains(&bound.max.to_string()),
                "{}: '{err}' must name the limit",
                bound.name
            );
        }
        // Zero is the "use the default" value for ttl and lease, so their floor is
        // checked one below the minimum only where that is not zero.
        if bound.min > 1 || (bound.min == 1 && !matches!(bound.field, "ttl_ms" | "lease_ms")) {
            let err = accepted(bound.min - 1).expect_err(bound.name);
            assert_eq!(err.field(), bound.field, "{}: {err}", bound.name);
        }
    }
}

#[test]
fn zero_ttl_and_lease_select_defaults() {
    let limits = Limits::default();
    assert_eq!(limits.ttl_ms(0), Ok(24 * 3_600_000));
    assert_eq!(limits.lease_ms(0), Ok(30_000));
    assert_eq!(
        limits.ttl_ms(999),
        Err(Invalid::OutOfRange {
            field: "ttl_ms",
            value: 999,
            min: 1_000,
            max: 7 * 86_400_000,
            unit: Unit::Ms
        })
    );
    assert_eq!(
        limits.lease_ms(99),
        Err(Invalid::OutOfRange { field: "lease_ms", value: 99, min: 100, max: 3_600_000, unit: Unit::Ms })
    );
}

#[test]
fn messages_name_field_value_and_limit() {
    let limits = Limits::default();
    assert_eq!(limits.key(&"k".repeat(700)).unwrap_err().to_string(), "key is 700 bytes; the limit is 512");
    assert_eq!(limits.key("").unwrap_err().to_string(), "key is empty; it must be at least 1 byte");
    assert_eq!(
        Namespace::new("live mode").unwrap_err().to_string(),
        "namespace has ' ' at byte 4; only ASCII letters, digits, '.', '_' and '-' are allowed"
    );
    assert_eq!(limits.key_from_bytes(b"\xff\xfe").unwrap_err().to_string(), "key is not valid utf-8");
    assert_eq!(limits.token(0).unwrap_err().to_string(), "token must not be zero");
}

#[test]
fn a_key_holding_nul_is_refused_naming_the_field() {
    let limits = Limits::default();
    let err = limits.key("order\u{0}42").unwrap_err();
    assert_eq!(err.field(), "key");
    assert_eq!(err.to_string(), "key has '\\0' at byte 5; only characters other than NUL are allowed");
    assert_eq!(limits.key_from_bytes(b"\0").unwrap_err().field(), "key");
    // Every other character, control characters and non-ASCII included, is a key.
    assert!(limits.key("tab\there \u{1}ключ").is_ok());
}

#[test]
fn namespace_alphabet() {
    for ok in ["live", "test", "a.b_c-D9"] {
        assert!(Namespace::new(ok).is_ok(), "{ok}");
    }
    for bad in ["live/test", "ключ", "a:b", "a b", "tab\t"] {
        assert_eq!(Namespace::new(bad).unwrap_err().field(), "namespace", "{bad}");
    }
}

#[test]
fn derived_key_format_is_the_documented_one() {
    let limits = Limits::default();
    let parts = ["trade", "binance", "BTCUSDT", "buy", "0.5", "live"];
    let now_ms = 1_764_073_440_000 + 59_999;
    let key = limits.derive_key(&parts, 60_000, now_ms).unwrap();
    assert_eq!(key.as_str(), "trade:binance:BTCUSDT:buy:0.5:live:29401224");
    assert_eq!(derive_key(&parts, 60_000, now_ms), key.as_str());
    // The same parts one bucket later give another key; inside the bucket, the same.
    assert_eq!(limits.derive_key(&parts, 60_000, now_ms - 59_999).unwrap(), key);
    assert_ne!(limits.derive_key(&parts, 60_000, now_ms + 1).unwrap(), key);
}

#[test]
fn bucket_routing_sets_the_bucket_off_and_names_the_earlier_one_within_the_grace() {
    let limits = Limits::default();
    let parts = ["trade", "binance", "BTCUSDT", "buy", "0.5", "live"];
    let derived = limits.derived(&parts, 60_000, 2_000, Routing::BucketBase).unwrap();
    let boundary = 29_401_225 * 60_000;
    assert_eq!(derived.key(derived.bucket_of(boundary)), "trade:binance:BTCUSDT:buy:0.5:live::29401225");
    assert_eq!(derived.earlier_bucket(boundary), Some(29_401_224));
    assert_eq!(derived.earlier_bucket(boundary + 1_999), Some(29_401_224));
    assert_eq!(derived.earlier_bucket(boundary + 2_000), None, "the grace has passed");
    assert_eq!(derived.earlier_bucket(boundary - 1), None, "before the boundary there is no earlier bucket");
    let no_grace = limits.derived(&parts, 60_000, 0, Routing::BucketBase).unwrap();
    assert_eq!(no_grace.earlier_bucket(boundary), None);
    let first = limits.derived(&parts, 60_000, 2_000, Routing::BucketBase).unwrap();
    assert_eq!(first.earlier_bucket(5), None, "bucket zero has none before it");
}

#[test]
fn derived_key_refusals() {
    let limits = Limits::default();
    let refused = [
        (limits.derive_key::<&str>(&[], 60_000, 0), "key_parts is empty; it must be at least 1 byte"),
        (limits.derive_key(&["a", ""], 60_000, 0), "key_parts[1] is empty"),
        (limits.derive_key(&["a:b"], 60_000, 0), "key_parts[0] contains ':', the separator of derived keys"),
        (limits.derive_key(&["a"], 0, 0), "bucket_ms must not be zero"),
        (
            limits.derived(&["a"], 60_000, 60_000, Routing::BucketBase).map(|d| Key::from_stored(d.key(0))),
            "bucket_grace_ms is 60000 ms; it must be between 0 ms and 59999 ms",
        ),
        (limits.derive_key(&["a", "b\0c"], 60_000, 0), "key_parts[1] contains NUL"),
    ];
    for (result, message) in refused {
        assert_eq!(result.unwrap_err().to_string(), message);
    }
    let long = "p".repeat(510);
    let err = limits.derive_key(&[long.as_str()], 1, 1_000).unwrap_err();
    assert_eq!(err.to_string(), "key is 515 bytes; the limit is 512");
}

#[test]
fn default_limits_pass_their_own_check() {
    assert_eq!(Limits::default().check(), Ok(()));
}

#[test]
fn limits_check_reports_every_problem_at_once() {
    let limits = Limits {
        key_bytes_max: KEY_BYTES_CEILING + 1,
        fingerprint_bytes_max: FINGERPRINT_BYTES_CEILING + 1,
        response_bytes_max: RESPONSE_BYTES_CEILING + 1,
        ttl_ms_max: TTL_MS_CEILING + 1,
        lease_ms_min: LEASE_MS_FLOOR - 1,
        ..Limits::default()
    };
    let problems = limits.check().unwrap_err();
    let fields: Vec<_> = problems.iter().map(|p| p.field.clone()).collect();
    assert_eq!(
        fields,
        [
            "limits.key_bytes_max",
            "limits.fingerprint_bytes_max",
            "limits.response_bytes_max",
            "limits.ttl_ms_max",
            "limits.lease_ms_min"
        ]
    );
    assert_eq!(
        problems[0].to_string(),
        "limits.key_bytes_max is 1025 bytes; it must be between 1 bytes and 1024 bytes"
    );
}

#[test]
fn limits_check_enforces_relations() {
    let limits = Limits { ttl_ms_default: 8 * 86_400_000, lease_ms_max: 50, ..Limits::default() };
    let fields: Vec<_> = limits.check().unwrap_err().iter().map(|p| p.field.clone()).collect();
    assert_eq!(fields, ["limits.ttl_ms_default", "limits.lease_ms_max", "limits.lease_ms_default"]);
}

#[test]
fn ceilings_are_accepted_by_the_check() {
    let limits = Limits {
        key_bytes_max: KEY_BYTES_CEILING,
        fingerprint_bytes_max: FINGERPRINT_BYTES_CEILING,
        response_bytes_max: RESPONSE_BYTES_CEILING,
        ttl_ms_max: TTL_MS_CEILING,
        ..Limits::default()
    };
    assert_eq!(limits.check(), Ok(()));
}
