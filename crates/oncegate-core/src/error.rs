//! Errors of the core and the stable codes every layer maps them to.
//!
//! Fronts never match on message text: they map a [`Code`] to their own status (gRPC,
//! HTTP). The code strings are part of the wire contract and never change.

use std::fmt;

/// The stable, machine-readable code of every refusal oncegate can give.
///
/// Each layer has its own error enum; each enum maps every variant onto one of these
/// codes, and each front maps codes to its protocol in one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Code {
    /// A field is outside its limit or malformed.
    InvalidArgument,
    /// No live record exists for the key (never reserved, released or expired).
    NotFound,
    /// The token is not the current holder's: another attempt took over.
    LeaseLost,
    /// A commit that disagrees with the completion already stored.
    Conflict,
    /// Release or heartbeat of a completed key, which would let a duplicate through.
    AlreadyCompleted,
    /// The store or the key's shard cannot serve; nothing was granted.
    Unavailable,
    /// A bounded queue or limit on concurrent work is full; retry later.
    ResourceExhausted,
    /// Missing or wrong credentials.
    Unauthenticated,
}

impl Code {
    /// Every code, in declaration order; tests and fronts iterate it to prove their
    /// mappings are total.
    pub const ALL: [Code; 8] = [
        Code::InvalidArgument,
        Code::NotFound,
        Code::LeaseLost,
        Code::Conflict,
        Code::AlreadyCompleted,
        Code::Unavailable,
        Code::ResourceExhausted,
        Code::Unauthenticated,
    ];

    /// The code's wire string, lowercase snake case.
    pub const fn as_str(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::LeaseLost => "lease_lost",
            Code::Conflict => "conflict",
            Code::AlreadyCompleted => "already_completed",
            Code::Unavailable => "unavailable",
            Code::ResourceExhausted => "resource_exhausted",
            Code::Unauthenticated => "unauthenticated",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request field that is outside its limit or malformed.
///
/// Every variant names the field and, where there is one, the value and the limit, so
/// the message alone tells the caller what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    /// A required field is empty.
    #[error("{field} is empty; it must be at least 1 byte")]
    Empty {
        /// The field's wire name.
        field: &'static str,
    },
    /// A field is longer than its limit.
    #[error("{field} is {len} bytes; the limit is {max}")]
    TooLong {
        /// The field's wire name.
        field: &'static str,
        /// The length received.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// A repeated field has more items than its limit.
    #[error("{field} has {len} items; the limit is {max}")]
    TooMany {
        /// The field's wire name.
        field: &'static str,
        /// The number of items received.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// A number is outside its allowed range.
    #[error(
        "{field} is {value}{u}; it must be between {min}{u} and {max}{u}",
        u = unit.suffix()
    )]
    OutOfRange {
        /// The field's wire name.
        field: &'static str,
        /// The value received.
        value: u64,
        /// The smallest allowed value.
        min: u64,
        /// The largest allowed value.
        max: u64,
        /// The unit of all three.
        unit: crate::Unit,
    },
    /// A character outside the field's alphabet.
    #[error("{field} has {found:?} at byte {at}; only {allowed} are allowed")]
    BadChar {
        /// The field's wire name.
        field: &'static str,
        /// The offending character.
        found: char,
        /// Its byte offset in the field.
        at: usize,
        /// The allowed alphabet, in words.
        allowed: &'static str,
    },
    /// A string field that is not valid UTF-8.
    #[error("{field} is not valid utf-8")]
    NotUtf8 {
        /// The field's wire name.
        field: &'static str,
    },
    /// A field that must not be zero.
    #[error("{field} must not be zero")]
    Zero {
        /// The field's wire name.
        field: &'static str,
    },
    /// One item of `key_parts` is unusable.
    #[error("key_parts[{index}] {problem}")]
    KeyPart {
        /// The item's position.
        index: usize,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A rule between fields, such as two that exclude each other.
    #[error("{field}: {rule}")]
    Rule {
        /// The field's wire name.
        field: &'static str,
        /// The rule that was broken.
        rule: &'static str,
    },
    /// An enum field holds a value that is not one of its members.
    #[error("{field} has unknown value {value}")]
    UnknownEnum {
        /// The field's wire name.
        field: &'static str,
        /// The raw value received.
        value: i64,
    },
}

impl Invalid {
    /// The wire name of the field at fault.
    pub fn field(&self) -> &'static str {
        match self {
            Invalid::Empty { field }
            | Invalid::TooLong { field, .. }
            | Invalid::TooMany { field, .. }
            | Invalid::OutOfRange { field, .. }
            | Invalid::BadChar { field, .. }
            | Invalid::NotUtf8 { field }
            | Invalid::Zero { field }
            | Invalid::Rule { field, .. }
            | Invalid::UnknownEnum { field, .. } => field,
            Invalid::KeyPart { .. } => "key_parts",
        }
    }
}

/// Why the core refused an operation. Every variant is a definite answer about the key,
/// never a storage problem (those belong to the engine's error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request field is outside its limit or malformed.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// No live record: never reserved, released, or expired.
    #[error("no live record for this key")]
    NotFound,
    /// The token names an attempt that is no longer the current holder.
    #[error("lease lost: token {token} is not the current holder (current token is {current})")]
    LeaseLost {
        /// The token the caller sent.
        token: u64,
        /// The token of the current holder.
        current: u64,
    },
    /// A commit that disagrees with the stored completion (another token, or another
    /// outcome).
    #[error("conflict: the key was completed by token {current} with outcome {outcome}")]
    Conflict {
        /// The token of the stored completion.
        current: u64,
        /// The stored outcome.
        outcome: crate::Outcome,
    },
    /// Release or heartbeat of a completed key.
    #[error("the key is completed; it cannot be released or renewed")]
    AlreadyCompleted,
}

impl Error {
    /// The stable code of this error.
    pub fn code(&self) -> Code {
        match self {
            Error::Invalid(_) => Code::InvalidArgument,
            Error::NotFound => Code::NotFound,
            Error::LeaseLost { .. } => Code::LeaseLost,
            Error::Conflict { .. } => Code::Conflict,
            Error::AlreadyCompleted => Code::AlreadyCompleted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_strings_are_unique_and_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for code in Code::ALL {
            let s = code.as_str();
            assert!(seen.insert(s), "duplicate code {s}");
            assert!(s.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
        }
    }

    #[test]
    fn messages_are_lowercase_without_trailing_period() {
        let samples: Vec<String> = vec![
            Invalid::TooLong { field: "key", len: 700, max: 512 }.to_string(),
            Invalid::OutOfRange { field: "ttl_ms", value: 5, min: 1000, max: 2000, unit: crate::Unit::Ms }
                .to_string(),
            Error::NotFound.to_string(),
            Error::LeaseLost { token: 3, current: 4 }.to_string(),
            Error::AlreadyCompleted.to_string(),
        ];
        for s in samples {
            assert!(!s.ends_with('.'), "{s}");
            assert_eq!(s.chars().next().map(|c| c.is_lowercase()), Some(true), "{s}");
        }
        assert_eq!(
            Invalid::TooLong { field: "key", len: 700, max: 512 }.to_string(),
            "key is 700 bytes; the limit is 512"
        );
    }
}
