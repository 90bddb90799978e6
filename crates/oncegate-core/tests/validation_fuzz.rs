//! Request validation under random input: it never panics, what it accepts is within
//! every limit, what it refuses names a real field in its message, and derived keys are
//! injective (different parts never derive the same key).
//!
//! 1,000 cases per run by default; `PROPTEST_CASES` raises it (see docs/reliability.md
//! for an hour-long run).

use oncegate_core::{Invalid, Limits, Namespace, Tenant};
use proptest::prelude::*;

const FIELDS: &[&str] = &[
    "key",
    "key_parts",
    "bucket_ms",
    "namespace",
    "tenant",
    "fingerprint",
    "response",
    "ttl_ms",
    "lease_ms",
    "wait_ms",
    "token",
];

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000).max(1_000)
}

fn names_a_field(error: &Invalid) -> Result<(), TestCaseError> {
    prop_assert!(FIELDS.contains(&error.field()), "unknown field {}", error.field());
    let message = error.to_string();
    prop_assert!(message.contains(error.field()), "'{message}' does not name {}", error.field());
    prop_assert!(!message.ends_with('.'));
    Ok(())
}

/// Strings that stress the validators: separators, multi-byte characters, control bytes.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9:._-]{0,12}",
        "\\PC{0,40}",
        proptest::collection::vec(any::<char>(), 0..700).prop_map(|v| v.into_iter().collect()),
    ]
}

/// Durations around every bound, and anywhere.
fn duration() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(99),
        Just(100),
        Just(999),
        Just(1_000),
        Just(3_600_000),
        Just(3_600_001),
        Just(604_800_000),
        Just(604_800_001),
        any::<u64>()
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn validation_accepts_only_what_fits(
        key in text(),
        raw_key in proptest::collection::vec(any::<u8>(), 0..600),
        namespace in text(),
        fingerprint in proptest::collection::vec(any::<u8>(), 0..100),
        response_len in 0usize..70_000,
        ttl in duration(),
        lease in duration(),
        wait in duration(),
        token in prop_oneof![Just(0u64), any::<u64>()],
    ) {
        let limits = Limits::default();
        match limits.key(&key) {
            Ok(k) => prop_assert!(!k.as_str().is_empty() && k.as_str().len() <= limits.key_bytes_max),
            Err(e) => names_a_field(&e)?,
        }
        match limits.key_from_bytes(&raw_key) {
            Ok(k) => prop_assert!(std::str::from_utf8(&raw_key).is_ok() && k.as_str().as_bytes() == raw_key.as_slice()),
            Err(e) => names_a_field(&e)?,
        }
        match Namespace::new(&namespace) {
            Ok(n) => prop_assert!(n.as_str().len() <= 64 && n.as_str().bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))),
            Err(e) => names_a_field(&e)?,
        }
        match Tenant::new(&namespace) {
            Ok(_) => prop_assert!(Namespace::new(&namespace).is_ok(), "tenants and namespaces share one alphabet"),
            Err(e) => names_a_field(&e)?,
        }
        match limits.fingerprint(&fingerprint) {
            Ok(f) => prop_assert!(f.as_bytes().len() <= limits.fingerprint_bytes_max),
            Err(e) => names_a_field(&e)?,
        }
        match limits.response(&vec![0; response_len]) {
            Ok(()) => prop_assert!(response_len <= limits.response_bytes_max),
            Err(e) => names_a_field(&e)?,
        }
        match limits.ttl_ms(ttl) {
            Ok(v) => prop_assert!((limits.ttl_ms_min..=limits.ttl_ms_max).contains(&v)),
            Err(e) => names_a_field(&e)?,
        }
        match limits.lease_ms(lease) {
            Ok(v) => prop_assert!((limits.lease_ms_min..=limits.lease_ms_max).contains(&v)),
            Err(e) => names_a_field(&e)?,
        }
        match limits.wait_ms(wait) {
            Ok(v) => prop_assert!(v <= limits.wait_ms_max),
            Err(e) => names_a_field(&e)?,
        }
        match limits.token(token) {
            Ok(v) => prop_assert!(v > 0),
            Err(e) => names_a_field(&e)?,
        }
    }

    #[test]
    fn derived_keys_are_valid_and_injective(
        a in proptest::collection::vec(text(), 0..20),
        b in proptest::collection::vec(text(), 0..20),
        bucket in prop_oneof![Just(0u64), Just(1u64), Just(60_000u64), any::<u64>()],
        now in any::<u64>(),
    ) {
        let limits = Limits::default();
        let ka = limits.derive_key(&a, bucket, now);
        let kb = limits.derive_key(&b, bucket, now);
        for result in [&ka, &kb] {
            match result {
                Ok(k) => prop_assert!(k.as_str().len() <= limits.key_bytes_max),
                Err(e) => names_a_field(e)?,
            }
        }
        if let (Ok(ka), Ok(kb)) = (&ka, &kb) {
            prop_assert_eq!(ka == kb, a == b, "parts {:?} and {:?} derive {} and {}", a, b, ka, kb);
        }
    }
}
