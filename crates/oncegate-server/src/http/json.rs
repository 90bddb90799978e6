//! The JSON bodies of the HTTP API and their one translation to and from the proto
//! messages, which then take the gRPC front's own call path.
//!
//! The mapping is protobuf's JSON mapping with the proto's own field names: 64-bit
//! integers are decimal strings (a fencing token can pass 2^53, where JavaScript numbers
//! stop being exact; numbers are accepted on the way in), bytes are base64 (read in
//! either alphabet, padded or not), enums are their proto names, a oneof is the one
//! member it holds, and `null` reads as the field's default. Unknown fields are refused,
//! so a misspelt `lease_ms` is an error rather than a default.

use oncegate_core::gate::Reserved;
use oncegate_core::{Invalid, Outcome, Previous, ReserveReply};
use oncegate_proto::v1 as pb;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_with::base64::{Base64, UrlSafe};
use serde_with::{DefaultOnNull, DisplayFromStr, PickFirst, Same, serde_as};
use utoipa::ToSchema;

use crate::gate::Call;
use crate::status::Refusal;

/// A `uint64` as protobuf's JSON mapping writes it (a decimal string) and reads it (a
/// string or a number; `null` is 0, as for every field).
#[serde_as]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(transparent)]
#[schema(value_type = String, format = "uint64", example = "30000")]
pub(crate) struct Uint64(#[serde_as(as = "DefaultOnNull<PickFirst<(DisplayFromStr, Same)>>")] pub u64);

/// Bytes as protobuf's JSON mapping reads them: base64 of the standard or the URL-safe
/// alphabet, padded or not; `null` is empty.
type BytesIn = DefaultOnNull<PickFirst<(Base64, Base64<UrlSafe>)>>;

/// `POST /v1/reserve`: may this attempt proceed?
#[serde_as]
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReserveBody {
    /// 1 to 64 bytes of `[A-Za-z0-9._-]`, such as `live` or `test`.
    #[serde_as(as = "DefaultOnNull")]
    namespace: String,
    /// The idempotency key; leave it out to derive one from `key_parts`.
    #[serde(default)]
    #[serde_as(as = "DefaultOnNull")]
    key: String,
    /// Parts of a derived key: `parts.join(":") + "::" + floor(now_ms / bucket_ms)` (a
    /// single `:` before the bucket in stores made before bucket routing); the answer
    /// names the key.
    #[serde(default)]
    #[serde_as(as = "DefaultOnNull")]
    key_parts: Vec<String>,
    /// The bucket width of a derived key, in ms; only with `key_parts`.
    #[serde(default)]
    bucket_ms: Uint64,
    /// Within this long after a bucket boundary, answer from the previous bucket's key
    /// while it holds a live record; only with `key_parts`, below `bucket_ms`.
    #[serde(default)]
    bucket_grace_ms: Uint64,
    /// How long the record is remembered, in ms; 0 or absent selects the default.
    #[serde(default)]
    ttl_ms: Uint64,
    /// How long the holder may work before it must heartbeat, in ms; 0 selects the default.
    #[serde(default)]
    lease_ms: Uint64,
    /// A hash of the request payload (at most 64 bytes), base64.
    #[serde_as(as = "BytesIn")]
    #[serde(default)]
    #[schema(value_type = String, format = Byte)]
    fingerprint: Vec<u8>,
    /// How long to wait when the key is in progress, in ms; 0 answers at once.
    #[serde(default)]
    wait_ms: Uint64,
}

/// `POST /v1/commit`: the holder finished; store its outcome and response.
#[serde_as]
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CommitBody {
    #[serde_as(as = "DefaultOnNull")]
    namespace: String,
    /// The key the reserve answered with.
    #[serde_as(as = "DefaultOnNull")]
    key: String,
    /// The fencing token of the grant.
    token: Uint64,
    /// `OUTCOME_SUCCEEDED` or `OUTCOME_FAILED`.
    #[serde_as(as = "DefaultOnNull")]
    outcome: String,
    /// What later reserves of the key replay, base64.
    #[serde_as(as = "BytesIn")]
    #[serde(default)]
    #[schema(value_type = String, format = Byte)]
    response: Vec<u8>,
}

/// `POST /v1/release`: give the key up so that a retry may proceed.
#[serde_as]
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReleaseBody {
    #[serde_as(as = "DefaultOnNull")]
    namespace: String,
    #[serde_as(as = "DefaultOnNull")]
    key: String,
    token: Uint64,
}

/// `POST /v1/heartbeat`: the holder is still working; renew its lease.
#[serde_as]
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeartbeatBody {
    #[serde_as(as = "DefaultOnNull")]
    namespace: String,
    #[serde_as(as = "DefaultOnNull")]
    key: String,
    token: Uint64,
    /// The new lease, from now, in ms; 0 or absent selects the default.
    #[serde(default)]
    lease_ms: Uint64,
}

/// The answer to a reserve: the key the record lives under and one of four outcomes.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ReserveAnswer {
    /// The key the record lives under (the derived one, or within a bucket grace the
    /// previous bucket's, when key parts were sent).
    key: String,
    #[serde(flatten)]
    outcome: ReserveOutcome,
}

/// Exactly one of these members is present.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
enum ReserveOutcome {
    /// Proceed: the caller holds the key with this token until the lease ends.
    Granted(Granted),
    /// Another attempt holds the key.
    InProgress(InProgress),
    /// An attempt completed the key: replay its response.
    Completed(Completed),
    /// The key is taken by a request with another fingerprint.
    Mismatch(Mismatch),
}

#[serde_as]
#[derive(Debug, Serialize, ToSchema)]
struct Granted {
    token: Uint64,
    attempt: u32,
    lease_until_ms: Uint64,
    /// The lease's length: the request's, or the server's default when it sent none.
    lease_ms: Uint64,
    expires_at_ms: Uint64,
    /// `PREVIOUS_ABANDONED` when an earlier holder's lease ran out.
    previous: PreviousName,
}

#[serde_as]
#[derive(Debug, Serialize, ToSchema)]
struct InProgress {
    attempt: u32,
    lease_until_ms: Uint64,
    retry_after_ms: Uint64,
}

#[serde_as]
#[derive(Debug, Serialize, ToSchema)]
struct Completed {
    token: Uint64,
    outcome: OutcomeName,
    /// The stored response, base64.
    #[serde_as(as = "Base64")]
    #[schema(value_type = String, format = Byte)]
    response: Vec<u8>,
    completed_at_ms: Uint64,
    expires_at_ms: Uint64,
}

#[serde_as]
#[derive(Debug, Serialize, ToSchema)]
struct Mismatch {
    expires_at_ms: Uint64,
}

/// The answer to a commit.
#[serde_as]
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct CommitAnswer {
    /// When the completed record expires.
    expires_at_ms: Uint64,
}

/// The answer to a release: empty.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ReleaseAnswer {}

/// The answer to a heartbeat.
#[serde_as]
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct HeartbeatAnswer {
    /// The new lease deadline.
    lease_until_ms: Uint64,
    expires_at_ms: Uint64,
}

/// What a key holds now (`GET /v1/namespaces/{namespace}/keys/{key}`).
#[serde_as]
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct GetAnswer {
    state: StateName,
    token: Uint64,
    attempt: u32,
    lease_until_ms: Uint64,
    expires_at_ms: Uint64,
    /// `OUTCOME_UNSPECIFIED` unless completed.
    outcome: OutcomeName,
    #[serde_as(as = "Base64")]
    #[schema(value_type = String, format = Byte)]
    response: Vec<u8>,
}

/// The proto's enums by their names, so that the OpenAPI document lists each one's values.
#[derive(Debug, Serialize, ToSchema)]
enum PreviousName {
    #[serde(rename = "PREVIOUS_NONE")]
    None,
    #[serde(rename = "PREVIOUS_ABANDONED")]
    Abandoned,
}

#[derive(Debug, Serialize, ToSchema)]
enum OutcomeName {
    #[serde(rename = "OUTCOME_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "OUTCOME_SUCCEEDED")]
    Succeeded,
    #[serde(rename = "OUTCOME_FAILED")]
    Failed,
}

impl OutcomeName {
    fn of(outcome: pb::Outcome) -> OutcomeName {
        match outcome {
            pb::Outcome::Unspecified => OutcomeName::Unspecified,
            pb::Outcome::Succeeded => OutcomeName::Succeeded,
            pb::Outcome::Failed => OutcomeName::Failed,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
enum StateName {
    #[serde(rename = "STATE_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "STATE_FREE")]
    Free,
    #[serde(rename = "STATE_PENDING")]
    Pending,
    #[serde(rename = "STATE_ABANDONED")]
    Abandoned,
    #[serde(rename = "STATE_COMPLETED")]
    Completed,
}

/// A request body of the HTTP API: the proto message it becomes (and so its call on the
/// gRPC front's path), and the JSON that the message's reply becomes.
pub(crate) trait Body: DeserializeOwned + Send + 'static {
    type Message: Call;
    type Answer: Serialize;
    fn into_wire(self) -> Result<Self::Message, Refusal>;
    fn answer(reply: <Self::Message as Call>::Reply) -> Self::Answer;
}

impl Body for ReserveBody {
    type Message = pb::ReserveRequest;
    type Answer = ReserveAnswer;
    fn into_wire(self) -> Result<pb::ReserveRequest, Refusal> {
        Ok(pb::ReserveRequest {
            namespace: self.namespace,
            key: self.key,
            key_parts: self.key_parts,
            bucket_ms: self.bucket_ms.0,
            bucket_grace_ms: self.bucket_grace_ms.0,
            ttl_ms: self.ttl_ms.0,
            lease_ms: self.lease_ms.0,
            fingerprint: self.fingerprint,
            wait_ms: self.wait_ms.0,
        })
    }
    fn answer(reserved: Reserved) -> ReserveAnswer {
        let outcome = match reserved.reply {
            ReserveReply::Granted { token, attempt, lease_until_ms, lease_ms, expires_at_ms, previous } => {
                ReserveOutcome::Granted(Granted {
                    token: Uint64(token),
                    attempt,
                    lease_until_ms: Uint64(lease_until_ms),
                    lease_ms: Uint64(lease_ms),
                    expires_at_ms: Uint64(expires_at_ms),
                    previous: match previous {
                        Previous::None => PreviousName::None,
                        Previous::Abandoned => PreviousName::Abandoned,
                    },
                })
            }
            ReserveReply::InProgress { attempt, lease_until_ms, retry_after_ms } => {
                ReserveOutcome::InProgress(InProgress {
                    attempt,
                    lease_until_ms: Uint64(lease_until_ms),
                    retry_after_ms: Uint64(retry_after_ms),
                })
            }
            ReserveReply::Completed { token, outcome, response, completed_at_ms, expires_at_ms } => {
                ReserveOutcome::Completed(Completed {
                    token: Uint64(token),
                    outcome: match outcome {
                        Outcome::Succeeded => OutcomeName::Succeeded,
                        Outcome::Failed => OutcomeName::Failed,
                    },
                    response,
                    completed_at_ms: Uint64(completed_at_ms),
                    expires_at_ms: Uint64(expires_at_ms),
                })
            }
            ReserveReply::Mismatch { expires_at_ms } => {
                ReserveOutcome::Mismatch(Mismatch { expires_at_ms: Uint64(expires_at_ms) })
            }
        };
        ReserveAnswer { key: reserved.key.as_str().to_owned(), outcome }
    }
}

impl Body for CommitBody {
    type Message = pb::CommitRequest;
    type Answer = CommitAnswer;
    fn into_wire(self) -> Result<pb::CommitRequest, Refusal> {
        let outcome = match pb::Outcome::from_str_name(&self.outcome) {
            Some(outcome @ (pb::Outcome::Succeeded | pb::Outcome::Failed)) => outcome as i32,
            _ => {
                let rule = "must be OUTCOME_SUCCEEDED or OUTCOME_FAILED";
                return Err(Invalid::Rule { field: "outcome", rule }.into());
            }
        };
        Ok(pb::CommitRequest {
            namespace: self.namespace,
            key: self.key,
            token: self.token.0,
            outcome,
            response: self.response,
        })
    }
    fn answer(reply: pb::CommitResponse) -> CommitAnswer {
        CommitAnswer { expires_at_ms: Uint64(reply.expires_at_ms) }
    }
}

impl Body for ReleaseBody {
    type Message = pb::ReleaseRequest;
    type Answer = ReleaseAnswer;
    fn into_wire(self) -> Result<pb::ReleaseRequest, Refusal> {
        Ok(pb::ReleaseRequest { namespace: self.namespace, key: self.key, token: self.token.0 })
    }
    fn answer(_: pb::ReleaseResponse) -> ReleaseAnswer {
        ReleaseAnswer {}
    }
}

impl Body for HeartbeatBody {
    type Message = pb::HeartbeatRequest;
    type Answer = HeartbeatAnswer;
    fn into_wire(self) -> Result<pb::HeartbeatRequest, Refusal> {
        Ok(pb::HeartbeatRequest {
            namespace: self.namespace,
            key: self.key,
            token: self.token.0,
            lease_ms: self.lease_ms.0,
        })
    }
    fn answer(reply: pb::HeartbeatResponse) -> HeartbeatAnswer {
        HeartbeatAnswer {
            lease_until_ms: Uint64(reply.lease_until_ms),
            expires_at_ms: Uint64(reply.expires_at_ms),
        }
    }
}

impl GetAnswer {
    pub(crate) fn from_wire(reply: pb::GetResponse) -> GetAnswer {
        GetAnswer {
            state: match reply.state() {
                pb::State::Unspecified => StateName::Unspecified,
                pb::State::Free => StateName::Free,
                pb::State::Pending => StateName::Pending,
                pb::State::Abandoned => StateName::Abandoned,
                pb::State::Completed => StateName::Completed,
            },
            token: Uint64(reply.token),
            attempt: reply.attempt,
            lease_until_ms: Uint64(reply.lease_until_ms),
            expires_at_ms: Uint64(reply.expires_at_ms),
            outcome: OutcomeName::of(reply.outcome()),
            response: reply.response,
        }
    }
}
