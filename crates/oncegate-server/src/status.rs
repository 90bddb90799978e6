//! The server's one mapping to gRPC status: every refusal, the engine's and the front's
//! own, is a [`Refusal`]; its stable code (and field, or limit) goes through
//! `oncegate_proto::status`, and its code is also the metric label, taken from the
//! refusal itself rather than read back from the status it became.

use oncegate_core::Code;
use oncegate_engine::{BackupError, ResizeError};

pub use oncegate_proto::status::grpc_code;
pub use oncegate_proto::{CODE_METADATA, FIELD_METADATA, LIMIT_METADATA};

/// Why the gRPC front did not answer a call about its key.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The engine's answer (a contract refusal, an unavailable shard, a full queue).
    #[error(transparent)]
    Engine(#[from] oncegate_engine::Error),
    /// Missing or wrong credentials.
    #[error("{0}")]
    Unauthenticated(&'static str),
    /// A limit of the front: the server's, or the calling tenant's.
    #[error("{what}; {limit} is {value}")]
    Exhausted {
        /// What is used up, in words.
        what: &'static str,
        /// The configuration key of the limit, as the `oncegate-limit` trailer names it.
        limit: &'static str,
        /// Its value.
        value: u64,
    },
    /// No answer within the call's deadline (a `Session` call's `timeout_ms`, or the
    /// HTTP front's share of `server.request_timeout_ms`). The call was dropped: one not
    /// yet decided is never granted, one already written keeps its effect, as with any
    /// lost answer.
    #[error(
        "no answer within {within_ms} ms ({limit}); the call may still take effect, and a retried reserve is answered from its record"
    )]
    Unanswered {
        /// The deadline, from when the call was read.
        within_ms: u64,
        /// Where the deadline came from, in words.
        limit: &'static str,
    },
    /// A call whose deadline passed before it could start (a `Session` call held at the
    /// stream's limit, an HTTP request whose body took its time): it never reached its
    /// shard, so it had no effect.
    #[error("not started within {within_ms} ms ({limit}); the call had no effect")]
    Unstarted {
        /// The deadline, from when the call was read.
        within_ms: u64,
        /// Where the deadline came from, in words.
        limit: &'static str,
    },
    /// An online add-shards could not start or stopped (`Admin.AddShards`).
    #[error("adding shards: {0}")]
    AddShards(#[source] oncegate_engine::ResizeError),
    /// An online backup could not start or stopped (`Admin.Backup`).
    #[error("backing up: {0}")]
    Backup(#[source] oncegate_engine::BackupError),
    /// A long operator task ended without an answer (its thread panicked).
    #[error("{what} ended without an answer; see the server's log")]
    Ended {
        /// The task: "the add", "the backup".
        what: &'static str,
    },
    /// The tenant sent more requests (or finishing calls) than its rate allows.
    #[error(
        "tenant {tenant} is over its rate; {limit} is {per_s} (burst {burst}); retry in {retry_after_ms} ms"
    )]
    RateLimited {
        /// The tenant.
        tenant: oncegate_core::Tenant,
        /// The rate it is over: `tenants[].requests_per_s` or `tenants[].finishes_per_s`.
        limit: &'static str,
        /// Its configured rate.
        per_s: u32,
        /// Its configured burst.
        burst: u32,
        /// When the next request would be admitted.
        retry_after_ms: u64,
    },
}

/// The limit name of a refusal for a full disk.
pub const DISK_LIMIT: &str = "disk";

impl Refusal {
    /// The stable code of this refusal.
    pub fn code(&self) -> Code {
        match self {
            Refusal::Engine(error) => error.code(),
            Refusal::Unauthenticated(_) => Code::Unauthenticated,
            Refusal::Unanswered { .. } | Refusal::Unstarted { .. } => Code::Unavailable,
            Refusal::Exhausted { .. } | Refusal::RateLimited { .. } => Code::ResourceExhausted,
            Refusal::AddShards(ResizeError::Target { .. }) => Code::InvalidArgument,
            Refusal::AddShards(ResizeError::Busy { .. } | ResizeError::SlotStuck { .. }) => Code::Conflict,
            Refusal::AddShards(_) => Code::Unavailable,
            Refusal::Backup(BackupError::NotEmpty { .. }) => Code::InvalidArgument,
            Refusal::Backup(BackupError::Busy { .. } | BackupError::Unsupported { .. }) => Code::Conflict,
            Refusal::Backup(_) | Refusal::Ended { .. } => Code::Unavailable,
        }
    }

    /// When the caller may try again, where the refusal knows.
    pub(crate) fn retry_after_ms(&self) -> Option<u64> {
        match self {
            Refusal::RateLimited { retry_after_ms, .. } => Some(*retry_after_ms),
            _ => None,
        }
    }

    /// The request field at fault and the limit reached, where the refusal names one.
    pub(crate) fn detail(&self) -> (Option<&'static str>, Option<&'static str>) {
        use oncegate_engine::Error as E;
        match self {
            Refusal::Engine(E::Refused(oncegate_core::Error::Invalid(invalid))) => {
                (Some(invalid.field()), None)
            }
            Refusal::Engine(E::ResourceExhausted { limit_name, .. }) => (None, Some(limit_name)),
            Refusal::Engine(E::DiskFull { .. }) => (None, Some(DISK_LIMIT)),
            Refusal::Exhausted { limit, .. } => (None, Some(limit)),
            Refusal::RateLimited { limit, .. } => (None, Some(limit)),
            Refusal::AddShards(ResizeError::Target { .. }) => (Some("shards_total"), None),
            Refusal::Backup(BackupError::NotEmpty { .. }) => (Some("to"), None),
            Refusal::Engine(_)
            | Refusal::Unauthenticated(_)
            | Refusal::Unanswered { .. }
            | Refusal::Unstarted { .. }
            | Refusal::AddShards(_)
            | Refusal::Backup(_)
            | Refusal::Ended { .. } => (None, None),
        }
    }

    /// The gRPC status: the code, and the field or limit, in trailers.
    pub fn to_status(&self) -> tonic::Status {
        let message = self.to_string();
        match self.detail() {
            (Some(field), _) => oncegate_proto::status::invalid_field(Some(field), message),
            (None, Some(limit)) => oncegate_proto::status::exhausted(limit, message),
            (None, None) => oncegate_proto::status::with_code(self.code(), message),
        }
    }

    /// The same refusal as one call of a `Session` stream answers it: what
    /// [`Refusal::to_status`] puts in the status and its trailers, as a message.
    pub fn to_wire(&self) -> oncegate_proto::v1::Refusal {
        let (field, limit) = self.detail();
        let code = self.code();
        oncegate_proto::v1::Refusal {
            grpc_code: grpc_code(code) as i32,
            code: code.as_str().to_owned(),
            message: self.to_string(),
            field: field.unwrap_or_default().to_owned(),
            limit: limit.unwrap_or_default().to_owned(),
        }
    }
}

impl From<oncegate_core::Invalid> for Refusal {
    fn from(invalid: oncegate_core::Invalid) -> Self {
        Refusal::Engine(invalid.into())
    }
}

impl From<Refusal> for tonic::Status {
    fn from(refusal: Refusal) -> Self {
        refusal.to_status()
    }
}

/// Maps an engine error to its status (the admin service's calls).
pub fn status(error: oncegate_engine::Error) -> tonic::Status {
    Refusal::Engine(error).to_status()
}

/// A field-level refusal raised by a service itself (wire enums, admin reasons).
pub fn invalid(invalid: oncegate_core::Invalid) -> tonic::Status {
    Refusal::from(invalid).to_status()
}
