//! Which shard owns a key: a stable hash of its scope onto a fixed slot space.
//!
//! The algorithm is part of the on-disk format (a data directory's records live in the
//! shard this picks), so it never changes:
//!
//! 1. Encode the scope as `len(tenant) ‖ tenant ‖ len(namespace) ‖ namespace ‖ len(key)
//!    ‖ key`, each length a little-endian `u32` of the UTF-8 byte count. The lengths make
//!    the encoding unambiguous: no two scopes share an encoding.
//! 2. Hash it with XXH3-64, seed 0 (`xxhash_rust::xxh3::xxh3_64`), a hash with a frozen
//!    specification; never `std`'s `DefaultHasher`, which may change between releases.
//! 3. `slot = hash % 16384`.
//! 4. `shard = slot % shard_count`. The slot layer lets a later version record a slot map
//!    in the data directory's manifest and move slots between shards without rehashing.

use crate::Scope;

/// The number of slots that keys hash onto.
pub const SLOT_COUNT: u32 = 16_384;

/// The unambiguous byte encoding of a scope that routing hashes.
pub fn scope_bytes(scope: &Scope) -> Vec<u8> {
    let parts = [scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()];
    let mut out = Vec::with_capacity(12 + parts.iter().map(|p| p.len()).sum::<usize>());
    for part in parts {
        let len = u32::try_from(part.len()).expect("validated fields are far below 4 GiB");
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(part.as_bytes());
    }
    out
}

/// The 64-bit routing hash of a scope.
pub fn scope_hash(scope: &Scope) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&scope_bytes(scope))
}

/// The slot of a scope, in `0..SLOT_COUNT`.
pub fn slot_of(scope: &Scope) -> u32 {
    slot_of_hash(scope_hash(scope))
}

/// The slot of a scope's routing hash (stores keep the hash beside each record).
pub fn slot_of_hash(hash: u64) -> u32 {
    (hash % u64::from(SLOT_COUNT)) as u32
}

/// The owner of a slot when slots are spread evenly: how keys were routed before the
/// slot map, and how a new directory's map starts.
pub fn shard_of_slot(slot: u32, shard_count: u32) -> u32 {
    assert!(shard_count > 0, "a store has at least one shard");
    slot % shard_count
}

/// The shard that owns a scope.
pub fn shard_of(scope: &Scope, shard_count: u32) -> u32 {
    shard_of_slot(slot_of(scope), shard_count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Key, Namespace, Tenant};

    fn scope(tenant: &str, namespace: &str, key: &str) -> Scope {
        Scope {
            tenant: Tenant::new(tenant).unwrap(),
            namespace: Namespace::new(namespace).unwrap(),
            key: Key::from_stored(key.to_owned()),
        }
    }

    #[test]
    fn encoding_is_length_prefixed() {
        let bytes = scope_bytes(&scope("t", "ns", "k1"));
        assert_eq!(bytes, b"\x01\0\0\0t\x02\0\0\0ns\x02\0\0\0k1");
    }

    #[test]
    fn distinct_splits_do_not_collide() {
        // Without length prefixes these two would hash the same bytes.
        assert_ne!(scope_bytes(&scope("ab", "c", "d")), scope_bytes(&scope("a", "bc", "d")));
    }

    /// Pins the algorithm: if this test ever fails, existing data directories would
    /// route keys to the wrong shard.
    #[test]
    fn test_vector() {
        let s = scope("acme", "live", "order-42");
        assert_eq!(scope_hash(&s), PINNED_HASH);
        assert_eq!(slot_of(&s), 14_267);
        assert_eq!(shard_of(&s, 4), slot_of(&s) % 4);
    }

    /// Computed independently with Python's `xxhash.xxh3_64_intdigest` over the same
    /// bytes; the slot is 14267.
    const PINNED_HASH: u64 = 14_732_654_656_653_735_867;
}
