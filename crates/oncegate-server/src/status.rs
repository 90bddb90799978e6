//! The server's one mapping from engine errors to gRPC status: each error becomes its
//! stable code (and field), and `oncegate_proto::status` turns that into the status.

pub use oncegate_proto::status::grpc_code;
pub use oncegate_proto::{CODE_METADATA, FIELD_METADATA};

/// A refusal the front makes itself (authentication, load shedding), by stable code.
pub(crate) fn with_code(code: oncegate_core::Code, message: String) -> tonic::Status {
    oncegate_proto::status::with_code(code, message)
}

/// Maps an engine error to its status, with the stable code (and the field, when there
/// is one) in the trailers and the error's own message.
pub fn status(error: &oncegate_engine::Error) -> tonic::Status {
    match error {
        oncegate_engine::Error::Refused(oncegate_core::Error::Invalid(invalid)) => {
            oncegate_proto::status::invalid_field(Some(invalid.field()), error.to_string())
        }
        other => with_code(other.code(), other.to_string()),
    }
}

/// A field-level refusal raised by the front itself (wire enums and the like).
pub fn invalid(invalid: oncegate_core::Invalid) -> tonic::Status {
    status(&oncegate_engine::Error::from(invalid))
}
