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
//!
//! Directories made since bucket routing ([`Routing::BucketBase`]) take one step more: a
//! key that ends in `::` and a bucket number (a derived key, see [`Routing::bucket_key`])
//! takes its slot from the hash of the scope with the text before `::`, so that every
//! bucket of one derived key lives on one shard and a reserve can decide two buckets in
//! one batch. The other 50 bits of its hash stay the whole key's, so records keep
//! distinct hashes. Every other key routes as before.

use crate::Scope;

/// How a data directory maps keys to slots; recorded in its manifest, never changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// The whole key's hash picks the slot, and derived keys end `:bucket`: directories
    /// made before bucket routing.
    WholeKey,
    /// Derived keys end `::bucket` and route by the text before it: new directories.
    BucketBase,
}

/// What sets a bucket number off from the rest of a derived key under
/// [`Routing::BucketBase`]; key parts may hold neither `:` nor nothing, so no part list
/// can produce it anywhere else.
pub const BUCKET_SEPARATOR: &str = "::";

impl Routing {
    /// The routing hash of a scope: what stores keep beside each record and what
    /// [`slot_of_hash`] reads the slot from.
    pub fn hash(self, scope: &Scope) -> u64 {
        let whole = scope_hash(scope);
        let Some(base) = self.bucket_base(scope.key.as_str()) else { return whole };
        let base = hash_parts([scope.tenant.as_str(), scope.namespace.as_str(), base]);
        let slot_bits = u64::from(SLOT_COUNT - 1);
        (whole & !slot_bits) | (base & slot_bits)
    }

    /// The slot of a scope, in `0..SLOT_COUNT`.
    pub fn slot_of(self, scope: &Scope) -> u32 {
        slot_of_hash(self.hash(scope))
    }

    /// The text a derived key routes by: before a final `::` and 1 to 20 ASCII digits.
    /// `None` for every other key, and always under [`Routing::WholeKey`].
    pub fn bucket_base(self, key: &str) -> Option<&str> {
        if self == Routing::WholeKey {
            return None;
        }
        // A byte scan for the last separator: `rsplit_once` builds a substring searcher
        // on every call, and every command hashes its key (a shard profile showed it).
        let separator = BUCKET_SEPARATOR.as_bytes();
        let at = key.as_bytes().windows(separator.len()).rposition(|w| w == separator)?;
        let (base, bucket) = (&key[..at], &key[at + separator.len()..]);
        let digits = (1..=20).contains(&bucket.len()) && bucket.bytes().all(|b| b.is_ascii_digit());
        (digits && !base.is_empty()).then_some(base)
    }

    /// A derived key: its base (the parts joined by `:`) and a bucket number, set off by
    /// `:` under [`Routing::WholeKey`] and by [`BUCKET_SEPARATOR`] under
    /// [`Routing::BucketBase`].
    pub fn bucket_key(self, base: &str, bucket: u64) -> String {
        let separator = match self {
            Routing::WholeKey => ":",
            Routing::BucketBase => BUCKET_SEPARATOR,
        };
        format!("{base}{separator}{bucket}")
    }
}

/// The number of slots that keys hash onto.
pub const SLOT_COUNT: u32 = 16_384;

/// The unambiguous byte encoding of a scope that routing hashes.
pub fn scope_bytes(scope: &Scope) -> Vec<u8> {
    encode([scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()])
}

/// Each part's length (a little-endian `u32`) and bytes, in order.
fn encode(parts: [&str; 3]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + parts.iter().map(|p| p.len()).sum::<usize>());
    for part in parts {
        let len = u32::try_from(part.len()).expect("validated fields are far below 4 GiB");
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(part.as_bytes());
    }
    out
}

/// Encoded parts up to this size are hashed from the stack.
const ENCODED_ON_STACK_BYTES: usize = 256;

/// The hash of the parts' encoding. Every command hashes its scope more than once (to
/// route it, then in the store), and a shard profile showed the encoding's allocation:
/// a usual scope is encoded on the stack instead; a longer one takes the same bytes on
/// the heap.
fn hash_parts(parts: [&str; 3]) -> u64 {
    let len = 12 + parts.iter().map(|p| p.len()).sum::<usize>();
    if len > ENCODED_ON_STACK_BYTES {
        return xxhash_rust::xxh3::xxh3_64(&encode(parts));
    }
    let mut buf = [0u8; ENCODED_ON_STACK_BYTES];
    let mut at = 0;
    for part in parts {
        let part_len = u32::try_from(part.len()).expect("shorter than the buffer");
        buf[at..at + 4].copy_from_slice(&part_len.to_le_bytes());
        buf[at + 4..at + 4 + part.len()].copy_from_slice(part.as_bytes());
        at += 4 + part.len();
    }
    xxhash_rust::xxh3::xxh3_64(&buf[..len])
}

/// The 64-bit routing hash of a scope.
pub fn scope_hash(scope: &Scope) -> u64 {
    hash_parts([scope.tenant.as_str(), scope.namespace.as_str(), scope.key.as_str()])
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

    #[test]
    fn bucket_routing_puts_every_bucket_of_a_derived_key_on_one_slot() {
        let routing = Routing::BucketBase;
        let a = scope("acme", "live", "trade:x:buy::29401224");
        let b = scope("acme", "live", "trade:x:buy::29401225");
        assert_eq!(routing.slot_of(&a), routing.slot_of(&b));
        assert_eq!(routing.slot_of(&a), slot_of(&scope("acme", "live", "trade:x:buy")));
        assert_ne!(routing.hash(&a), routing.hash(&b), "records keep distinct hashes");
        assert_eq!(routing.hash(&a) >> 14, scope_hash(&a) >> 14);
    }

    #[test]
    fn only_a_final_double_colon_and_digits_is_a_bucket() {
        let base = |key| Routing::BucketBase.bucket_base(key);
        assert_eq!(base("a:b::12"), Some("a:b"));
        assert_eq!(base("a::b::7"), Some("a::b"));
        for plain in ["order:123", "a::", "::5", "a::1x", "a::123456789012345678901", "a:::"] {
            assert_eq!(base(plain), None, "{plain}");
        }
        assert_eq!(Routing::WholeKey.bucket_base("a:b::12"), None);
        let plain = scope("acme", "live", "order:123");
        assert_eq!(Routing::BucketBase.hash(&plain), scope_hash(&plain));
    }

    #[test]
    fn a_scope_encoded_in_exactly_the_stack_buffer_and_one_byte_more_hash_as_their_encoding() {
        for len in [ENCODED_ON_STACK_BYTES - 1, ENCODED_ON_STACK_BYTES, ENCODED_ON_STACK_BYTES + 1] {
            let s = scope("t", "n", &"k".repeat(len - 14));
            assert_eq!(scope_bytes(&s).len(), len);
            assert_eq!(scope_hash(&s), xxhash_rust::xxh3::xxh3_64(&scope_bytes(&s)), "{len}");
        }
    }

    proptest::proptest! {
        /// Hashed from the stack or from the heap, a scope hashes as its encoding does
        /// (every stored record's hash and every key's slot depend on it).
        #[test]
        fn the_hash_is_the_hash_of_the_encoding(
            tenant in "[a-z]{1,40}", namespace in "[a-z]{1,40}", key in "[a-zé:0-9]{1,300}",
        ) {
            let s = scope(&tenant, &namespace, &key);
            proptest::prop_assert_eq!(scope_hash(&s), xxhash_rust::xxh3::xxh3_64(&scope_bytes(&s)));
        }

        /// The byte scan finds the same base as splitting at the last separator (the
        /// routing of every stored record depends on it), runs of colons included.
        #[test]
        fn the_bucket_base_is_what_the_last_separator_splits_off(key in "[a:1-3é]{0,12}") {
            let reference = key.rsplit_once(BUCKET_SEPARATOR).and_then(|(base, bucket)| {
                let digits = (1..=20).contains(&bucket.len()) && bucket.bytes().all(|b| b.is_ascii_digit());
                (digits && !base.is_empty()).then_some(base)
            });
            proptest::prop_assert_eq!(Routing::BucketBase.bucket_base(&key), reference);
        }
    }

    #[test]
    fn bucket_keys_are_set_off_by_the_routing_separator() {
        assert_eq!(Routing::WholeKey.bucket_key("trade:x", 5), "trade:x:5");
        assert_eq!(Routing::BucketBase.bucket_key("trade:x", 5), "trade:x::5");
    }

    /// Computed independently with Python's `xxhash.xxh3_64_intdigest` over the same
    /// bytes; the slot is 14267.
    const PINNED_HASH: u64 = 14_732_654_656_653_735_867;
}
