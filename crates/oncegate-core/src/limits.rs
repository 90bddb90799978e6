//! Named limits with their defaults and hard ceilings, and the validation of every
//! request field against them.
//!
//! Each limit has a default that suits a gateway and a hard ceiling (or floor) that
//! configuration cannot pass. Configuration is checked as a whole so that an operator
//! sees every problem at once.

use serde::{Deserialize, Serialize};

use crate::route::Routing;
use crate::{Invalid, Problem, Problems, Unit};

const SECOND_MS: u64 = 1_000;
const MINUTE_MS: u64 = 60 * SECOND_MS;
const HOUR_MS: u64 = 60 * MINUTE_MS;
const DAY_MS: u64 = 24 * HOUR_MS;

/// Namespaces are short labels such as `live` or `test`; the contract fixes 64 bytes.
pub const NAMESPACE_BYTES_MAX: usize = 64;
/// Tenants are names from configuration, held to the namespace alphabet and size.
pub const TENANT_BYTES_MAX: usize = 64;
/// The largest `key_bytes_max` configuration may set.
pub const KEY_BYTES_CEILING: usize = 1024;
/// The largest `key_parts_len_max` configuration may set.
pub const KEY_PARTS_LEN_CEILING: usize = 64;
/// The largest `fingerprint_bytes_max`: a fingerprint is a hash, and 64 bytes hold a
/// SHA-512 or a BLAKE3-512.
pub const FINGERPRINT_BYTES_CEILING: usize = 64;
/// The largest `response_bytes_max`: stored responses travel in one message and one
/// SQLite row, so they stay well below gRPC's and SQLite's own limits.
pub const RESPONSE_BYTES_CEILING: usize = 1024 * 1024;
/// The smallest `ttl_ms_min`: below a second, retries would routinely outlive the record.
pub const TTL_MS_FLOOR: u64 = SECOND_MS;
/// The largest `ttl_ms_max`.
pub const TTL_MS_CEILING: u64 = 30 * DAY_MS;
/// The smallest `lease_ms_min`: below this, a heartbeat cannot keep up with the network.
pub const LEASE_MS_FLOOR: u64 = 100;
/// The largest `lease_ms_max`.
pub const LEASE_MS_CEILING: u64 = DAY_MS;
/// The largest `wait_ms_max`: a parked reserve holds a request open this long at most.
pub const WAIT_MS_CEILING: u64 = 10 * MINUTE_MS;
/// The largest `bucket_ms_max`.
pub const BUCKET_MS_CEILING: u64 = 30 * DAY_MS;

// Relations between the hard bounds, checked when the crate compiles.
const _: () = assert!(TTL_MS_FLOOR <= TTL_MS_CEILING);
const _: () = assert!(LEASE_MS_FLOOR <= LEASE_MS_CEILING);
const _: () = assert!(KEY_BYTES_CEILING >= 512);
const _: () = assert!(RESPONSE_BYTES_CEILING >= 64 * 1024);

/// Every configurable limit on a request, with units last in each name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Longest key, in bytes of UTF-8 (derived keys included).
    pub key_bytes_max: usize,
    /// Most `key_parts` items in one reserve.
    pub key_parts_len_max: usize,
    /// Longest request fingerprint, in bytes.
    pub fingerprint_bytes_max: usize,
    /// Longest stored response, in bytes.
    pub response_bytes_max: usize,
    /// Shortest ttl a reserve may ask for.
    pub ttl_ms_min: u64,
    /// Longest ttl a reserve may ask for.
    pub ttl_ms_max: u64,
    /// The ttl used when a reserve sends zero.
    pub ttl_ms_default: u64,
    /// Shortest lease a reserve or heartbeat may ask for.
    pub lease_ms_min: u64,
    /// Longest lease a reserve or heartbeat may ask for.
    pub lease_ms_max: u64,
    /// The lease used when a reserve or heartbeat sends zero.
    pub lease_ms_default: u64,
    /// Longest a reserve may wait for a key in progress.
    pub wait_ms_max: u64,
    /// Widest bucket for derived keys.
    pub bucket_ms_max: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            key_bytes_max: 512,
            key_parts_len_max: 16,
            fingerprint_bytes_max: 64,
            response_bytes_max: 64 * 1024,
            ttl_ms_min: SECOND_MS,
            ttl_ms_max: 7 * DAY_MS,
            ttl_ms_default: DAY_MS,
            lease_ms_min: 100,
            lease_ms_max: HOUR_MS,
            lease_ms_default: 30 * SECOND_MS,
            wait_ms_max: 30 * SECOND_MS,
            bucket_ms_max: 7 * DAY_MS,
        }
    }
}

impl Limits {
    /// Checks the configuration against the hard bounds and the relations between its
    /// own fields, returning every problem rather than the first.
    pub fn check(&self) -> Result<(), Vec<Problem>> {
        let mut problems = Problems::default();
        problems.within("key_bytes_max", self.key_bytes_max as u64, 1, KEY_BYTES_CEILING as u64, Unit::Bytes);
        problems.within(
            "key_parts_len_max",
            self.key_parts_len_max as u64,
            1,
            KEY_PARTS_LEN_CEILING as u64,
            Unit::Count,
        );
        let fingerprint = self.fingerprint_bytes_max as u64;
        problems.within(
            "fingerprint_bytes_max",
            fingerprint,
            0,
            FINGERPRINT_BYTES_CEILING as u64,
            Unit::Bytes,
        );
        problems.within(
            "response_bytes_max",
            self.response_bytes_max as u64,
            0,
            RESPONSE_BYTES_CEILING as u64,
            Unit::Bytes,
        );
        problems.within("ttl_ms_min", self.ttl_ms_min, TTL_MS_FLOOR, TTL_MS_CEILING, Unit::Ms);
        problems.within(
            "ttl_ms_max",
            self.ttl_ms_max,
            self.ttl_ms_min.max(TTL_MS_FLOOR),
            TTL_MS_CEILING,
            Unit::Ms,
        );
        problems.within("ttl_ms_default", self.ttl_ms_default, self.ttl_ms_min, self.ttl_ms_max, Unit::Ms);
        problems.within("lease_ms_min", self.lease_ms_min, LEASE_MS_FLOOR, LEASE_MS_CEILING, Unit::Ms);
        problems.within(
            "lease_ms_max",
            self.lease_ms_max,
            self.lease_ms_min.max(LEASE_MS_FLOOR),
            LEASE_MS_CEILING,
            Unit::Ms,
        );
        problems.within(
            "lease_ms_default",
            self.lease_ms_default,
            self.lease_ms_min,
            self.lease_ms_max,
            Unit::Ms,
        );
        problems.within("wait_ms_max", self.wait_ms_max, 0, WAIT_MS_CEILING, Unit::Ms);
        problems.within("bucket_ms_max", self.bucket_ms_max, 1, BUCKET_MS_CEILING, Unit::Ms);
        problems.into_result().map_err(|all| all.into_iter().map(|p| p.under("limits")).collect())
    }

    /// The ttl for a reserve: zero selects the default, anything else must be in range.
    pub fn ttl_ms(&self, requested_ms: u64) -> Result<u64, Invalid> {
        duration("ttl_ms", requested_ms, self.ttl_ms_default, self.ttl_ms_min, self.ttl_ms_max)
    }

    /// The lease for a reserve or heartbeat: zero selects the default.
    pub fn lease_ms(&self, requested_ms: u64) -> Result<u64, Invalid> {
        duration("lease_ms", requested_ms, self.lease_ms_default, self.lease_ms_min, self.lease_ms_max)
    }

    /// The wait of a reserve: zero means "answer at once".
    pub fn wait_ms(&self, requested_ms: u64) -> Result<u64, Invalid> {
        if requested_ms > self.wait_ms_max {
            return Err(Invalid::OutOfRange {
                field: "wait_ms",
                value: requested_ms,
                min: 0,
                max: self.wait_ms_max,
                unit: Unit::Ms,
            });
        }
        Ok(requested_ms)
    }

    /// Validates a client's key.
    pub fn key(&self, key: &str) -> Result<Key, Invalid> {
        check_len("key", key.len(), self.key_bytes_max)?;
        if let Some(at) = key.find('\0') {
            return Err(Invalid::BadChar { field: "key", found: '\0', at, allowed: NUL_FREE });
        }
        Ok(Key(key.to_owned()))
    }

    /// Validates a key that arrived as raw bytes (fronts whose wire type is bytes).
    pub fn key_from_bytes(&self, key: &[u8]) -> Result<Key, Invalid> {
        let key = std::str::from_utf8(key).map_err(|_| Invalid::NotUtf8 { field: "key" })?;
        self.key(key)
    }

    /// Validates a request fingerprint; empty means "no fingerprint".
    pub fn fingerprint(&self, bytes: &[u8]) -> Result<Fingerprint, Invalid> {
        if bytes.len() > self.fingerprint_bytes_max {
            return Err(Invalid::TooLong {
                field: "fingerprint",
                len: bytes.len(),
                max: self.fingerprint_bytes_max,
            });
        }
        Ok(Fingerprint(bytes.to_vec()))
    }

    /// Validates a response to store with a commit.
    pub fn response(&self, bytes: &[u8]) -> Result<(), Invalid> {
        if bytes.len() > self.response_bytes_max {
            return Err(Invalid::TooLong {
                field: "response",
                len: bytes.len(),
                max: self.response_bytes_max,
            });
        }
        Ok(())
    }

    /// Validates a fencing token named by commit, release or heartbeat. Tokens start at
    /// 1, so 0 is always a client bug (often an unset field).
    pub fn token(&self, token: u64) -> Result<u64, Invalid> {
        if token == 0 {
            return Err(Invalid::Zero { field: "token" });
        }
        Ok(token)
    }

    /// Derives a key from parts and a time bucket, as a directory routed by whole keys
    /// does; see [`derive_key`] for that format.
    pub fn derive_key<S: AsRef<str>>(
        &self,
        parts: &[S],
        bucket_ms: u64,
        now_ms: u64,
    ) -> Result<Key, Invalid> {
        let derived = self.derived(parts, bucket_ms, 0, Routing::WholeKey)?;
        self.key(&derived.key(derived.bucket_of(now_ms)))
    }

    /// Validates a derived key's parts, bucket width and grace (`bucket_grace_ms`, zero
    /// for none; it must be shorter than the bucket). The keys it then makes still need
    /// [`Limits::key`] for their length.
    pub fn derived<S: AsRef<str>>(
        &self,
        parts: &[S],
        bucket_ms: u64,
        bucket_grace_ms: u64,
        routing: Routing,
    ) -> Result<DerivedKey, Invalid> {
        if parts.is_empty() {
            return Err(Invalid::Empty { field: "key_parts" });
        }
        if parts.len() > self.key_parts_len_max {
            return Err(Invalid::TooMany {
                field: "key_parts",
                len: parts.len(),
                max: self.key_parts_len_max,
            });
        }
        if bucket_ms == 0 {
            return Err(Invalid::Zero { field: "bucket_ms" });
        }
        if bucket_ms > self.bucket_ms_max {
            return Err(Invalid::OutOfRange {
                field: "bucket_ms",
                value: bucket_ms,
                min: 1,
                max: self.bucket_ms_max,
                unit: Unit::Ms,
            });
        }
        if bucket_grace_ms >= bucket_ms {
            return Err(Invalid::OutOfRange {
                field: "bucket_grace_ms",
                value: bucket_grace_ms,
                min: 0,
                max: bucket_ms - 1,
                unit: Unit::Ms,
            });
        }
        for (index, part) in parts.iter().enumerate() {
            let part = part.as_ref();
            if part.is_empty() {
                return Err(Invalid::KeyPart { index, problem: "is empty" });
            }
            if part.contains('\0') {
                return Err(Invalid::KeyPart { index, problem: "contains NUL" });
            }
            if part.contains(KEY_PART_SEPARATOR) {
                return Err(Invalid::KeyPart {
                    index,
                    problem: "contains ':', the separator of derived keys",
                });
            }
        }
        let base = parts.iter().map(AsRef::as_ref).collect::<Vec<_>>().join(":");
        Ok(DerivedKey { base, bucket_ms, bucket_grace_ms, routing })
    }
}

/// A derived key before its bucket is known: validated parts, width and grace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DerivedKey {
    base: String,
    bucket_ms: u64,
    bucket_grace_ms: u64,
    routing: Routing,
}

impl DerivedKey {
    /// The parts joined: what every bucket's key starts with, and, routed by bucket base,
    /// what they route by.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Whether a reserve may be answered from the bucket before its own.
    pub fn has_grace(&self) -> bool {
        self.bucket_grace_ms > 0
    }

    /// The bucket that `now_ms` falls in.
    pub fn bucket_of(&self, now_ms: u64) -> u64 {
        now_ms / self.bucket_ms
    }

    /// The key of one bucket.
    pub fn key(&self, bucket: u64) -> String {
        self.routing.bucket_key(&self.base, bucket)
    }

    /// The bucket before `now_ms`'s, when `now_ms` is within the grace after their
    /// boundary: a retry of a call sent just before the boundary may belong there.
    pub fn earlier_bucket(&self, now_ms: u64) -> Option<u64> {
        let bucket = self.bucket_of(now_ms);
        let into_ms = now_ms - bucket * self.bucket_ms;
        (bucket > 0 && into_ms < self.bucket_grace_ms).then(|| bucket - 1)
    }
}

/// Keys may hold any UTF-8 but NUL: SQLite's text functions and C clients stop at the
/// first NUL, so a key holding one could be stored under one name and shown under another.
const NUL_FREE: &str = "characters other than NUL";

fn duration(field: &'static str, requested: u64, default: u64, min: u64, max: u64) -> Result<u64, Invalid> {
    if requested == 0 {
        return Ok(default);
    }
    if requested < min || requested > max {
        return Err(Invalid::OutOfRange { field, value: requested, min, max, unit: Unit::Ms });
    }
    Ok(requested)
}

fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), Invalid> {
    if len == 0 {
        return Err(Invalid::Empty { field });
    }
    if len > max {
        return Err(Invalid::TooLong { field, len, max });
    }
    Ok(())
}

/// The separator between the parts of a derived key, and before its bucket number.
pub const KEY_PART_SEPARATOR: char = ':';

/// The derived key of a directory routed by whole keys ([`Routing::WholeKey`]):
/// `parts.join(":") + ":" + floor(now_ms / bucket_ms)`. Directories made since bucket
/// routing set the bucket off with `::` instead ([`Routing::bucket_key`]).
///
/// Each format is part of the wire contract and never changes for a directory that
/// uses it (a retry must find the key its first attempt stored). It does no validation:
/// use [`Limits::derived`], which refuses empty parts, parts containing `:` and a zero
/// bucket, so that distinct part lists can never produce the same key.
pub fn derive_key<S: AsRef<str>>(parts: &[S], bucket_ms: u64, now_ms: u64) -> String {
    let mut key = String::new();
    for part in parts {
        key.push_str(part.as_ref());
        key.push(KEY_PART_SEPARATOR);
    }
    key.push_str(&(now_ms / bucket_ms).to_string());
    key
}

/// Checks a name in the `[A-Za-z0-9._-]` alphabet shared by tenants and namespaces.
fn check_label(field: &'static str, value: &str, max: usize) -> Result<(), Invalid> {
    check_len(field, value.len(), max)?;
    if let Some((at, found)) =
        value.char_indices().find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(Invalid::BadChar {
            field,
            found,
            at,
            allowed: "ASCII letters, digits, '.', '_' and '-'",
        });
    }
    Ok(())
}

macro_rules! string_newtype {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        /// `clone_from` reuses the string's buffer.
        impl Clone for $name {
            fn clone(&self) -> Self {
                $name(self.0.clone())
            }

            fn clone_from(&mut self, source: &Self) {
                self.0.clone_from(&source.0);
            }
        }

        impl $name {
            /// The validated text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

string_newtype!(
    /// The owner of a key, taken from authentication and never from a request body.
    Tenant
);
string_newtype!(
    /// A mode that must never share keys with another, such as `live` and `test`.
    Namespace
);
string_newtype!(
    /// A client's idempotency key, or one derived from parts and a bucket.
    Key
);

/// The tenant of a server with no tenants configured, and of embedded single-tenant use.
pub const DEFAULT_TENANT: &str = "default";

impl Tenant {
    /// The `default` tenant.
    pub fn default_tenant() -> Tenant {
        Tenant(DEFAULT_TENANT.to_owned())
    }

    /// Validates a tenant name: 1 to 64 bytes of `[A-Za-z0-9._-]`.
    pub fn new(name: &str) -> Result<Tenant, Invalid> {
        check_label("tenant", name, TENANT_BYTES_MAX)?;
        Ok(Tenant(name.to_owned()))
    }
}

impl Namespace {
    /// Validates a namespace: 1 to 64 bytes of `[A-Za-z0-9._-]`.
    pub fn new(name: &str) -> Result<Namespace, Invalid> {
        check_label("namespace", name, NAMESPACE_BYTES_MAX)?;
        Ok(Namespace(name.to_owned()))
    }
}

/// A hash of a request's payload, compared on every reserve of the same key; empty means
/// the caller sent none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Fingerprint(Vec<u8>);

impl Fingerprint {
    /// No fingerprint.
    pub const NONE: Fingerprint = Fingerprint(Vec::new());

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Whether the caller sent no fingerprint.
    pub fn is_none(&self) -> bool {
        self.0.is_empty()
    }

    /// Rebuilds a fingerprint read back from the store, which only holds validated ones.
    pub fn from_stored(bytes: Vec<u8>) -> Fingerprint {
        Fingerprint(bytes)
    }
}

/// The bytes a request's `fingerprint` field carries.
impl From<Fingerprint> for Vec<u8> {
    fn from(fingerprint: Fingerprint) -> Vec<u8> {
        fingerprint.0
    }
}

impl Key {
    /// Rebuilds a key read back from the store, which only holds validated ones.
    pub fn from_stored(key: String) -> Key {
        Key(key)
    }
}

/// The full address of a record: `(tenant, namespace, key)`.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Scope {
    /// From authentication.
    pub tenant: Tenant,
    /// From the request.
    pub namespace: Namespace,
    /// From the request, or derived.
    pub key: Key,
}

/// `clone_from` reuses the strings' buffers.
impl Clone for Scope {
    fn clone(&self) -> Self {
        Scope { tenant: self.tenant.clone(), namespace: self.namespace.clone(), key: self.key.clone() }
    }

    fn clone_from(&mut self, source: &Self) {
        // Destructured, so that a new field cannot be left out.
        let Scope { tenant, namespace, key } = self;
        tenant.clone_from(&source.tenant);
        namespace.clone_from(&source.namespace);
        key.clone_from(&source.key);
    }
}
