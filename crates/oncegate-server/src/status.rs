//! The one mapping from engine errors to gRPC status.

use oncegate_core::Code;
use tonic::metadata::MetadataValue;

pub use oncegate_proto::{CODE_METADATA, FIELD_METADATA};

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

pub(crate) fn with_code(grpc: tonic::Code, code: Code, message: String) -> tonic::Status {
    let mut status = tonic::Status::new(grpc, message);
    status.metadata_mut().insert(CODE_METADATA, MetadataValue::from_static(code.as_str()));
    status
}

/// Maps an engine error to its status, with the stable code (and the field, when there
/// is one) in the trailers and the error's own message.
pub fn status(error: &oncegate_engine::Error) -> tonic::Status {
    let code = error.code();
    let mut status = with_code(grpc_code(code), code, error.to_string());
    if let oncegate_engine::Error::Refused(oncegate_core::Error::Invalid(invalid)) = error {
        status.metadata_mut().insert(FIELD_METADATA, MetadataValue::from_static(invalid.field()));
    }
    status
}

/// A field-level refusal raised by the front itself (wire enums and the like).
pub fn invalid(invalid: oncegate_core::Invalid) -> tonic::Status {
    status(&oncegate_engine::Error::from(invalid))
}
