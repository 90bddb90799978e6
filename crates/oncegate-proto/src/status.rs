//! The one mapping from oncegate's stable codes to gRPC statuses. Every status a front
//! sends is built here: with the code in the `oncegate-code` trailer and, for a bad
//! field, the field in `oncegate-field`. The server maps its engine errors to codes and
//! comes here; the codec comes here for requests that do not decode.

use oncegate_core::Code;
use tonic::metadata::MetadataValue;

use crate::{CODE_METADATA, FIELD_METADATA, LIMIT_METADATA};

/// The gRPC code for each stable code, as the contract's table gives it.
pub fn grpc_code(code: Code) -> tonic::Code {
    match code {
        Code::InvalidArgument => tonic::Code::InvalidArgument,
        Code::NotFound => tonic::Code::NotFound,
        Code::LeaseLost | Code::Conflict | Code::AlreadyCompleted => tonic::Code::FailedPrecondition,
        Code::Unavailable => tonic::Code::Unavailable,
        Code::ResourceExhausted => tonic::Code::ResourceExhausted,
        Code::Unauthenticated => tonic::Code::Unauthenticated,
        // `Code` is non-exhaustive; a code added later without a mapping is a bug that
        // must not turn into a success.
        _ => tonic::Code::Internal,
    }
}

/// The status of a refusal with this stable code.
pub fn with_code(code: Code, message: String) -> tonic::Status {
    let mut status = tonic::Status::new(grpc_code(code), message);
    status.metadata_mut().insert(CODE_METADATA, MetadataValue::from_static(code.as_str()));
    status
}

/// The status of a `resource_exhausted` refusal, naming the limit reached in the trailer.
pub fn exhausted(limit: &'static str, message: String) -> tonic::Status {
    let mut status = with_code(Code::ResourceExhausted, message);
    status.metadata_mut().insert(LIMIT_METADATA, MetadataValue::from_static(limit));
    status
}

/// The status of a request field that is invalid; `field` is named in the trailer when
/// it is known and a valid header value.
pub fn invalid_field(field: Option<&str>, message: String) -> tonic::Status {
    let mut status = with_code(Code::InvalidArgument, message);
    if let Some(value) = field.and_then(|f| MetadataValue::try_from(f).ok()) {
        status.metadata_mut().insert(FIELD_METADATA, value);
    }
    status
}

/// The stable code of a status, read back by clients: the `oncegate-code` trailer when
/// the server sent one, otherwise what the gRPC code means (a status made by the
/// client's own transport, a proxy's, or an older server's).
pub fn code_of(status: &tonic::Status) -> Code {
    let trailer = status.metadata().get(CODE_METADATA).and_then(|v| v.to_str().ok());
    if let Some(code) = trailer.and_then(|name| Code::ALL.into_iter().find(|c| c.as_str() == name)) {
        return code;
    }
    match status.code() {
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange => Code::InvalidArgument,
        tonic::Code::NotFound => Code::NotFound,
        tonic::Code::FailedPrecondition | tonic::Code::AlreadyExists | tonic::Code::Aborted => Code::Conflict,
        tonic::Code::ResourceExhausted => Code::ResourceExhausted,
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => Code::Unauthenticated,
        // Unavailable, a deadline, a cancelled or reset stream, an unknown or internal
        // error: the call may not have reached the server, or its answer did not come back.
        _ => Code::Unavailable,
    }
}
