//! The oncegate wire contract (`oncegate.v1`), generated from `proto/oncegate/v1/gate.proto`
//! at build time, with the encoded file descriptor set for gRPC reflection.

pub mod codec;
pub mod convert;
pub mod status;

/// Package `oncegate.v1`: the `Gate` and `Admin` services, their messages, clients and
/// servers.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("oncegate.v1");
}

/// The encoded `FileDescriptorSet` of the proto, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/oncegate_descriptor.bin"));

/// The trailer that carries the stable error code of a refusal (`lease_lost`, ...).
pub const CODE_METADATA: &str = "oncegate-code";
/// The trailer that names the field at fault when the code is `invalid_argument`.
pub const FIELD_METADATA: &str = "oncegate-field";
/// The trailer that names the limit reached when the code is `resource_exhausted`
/// (`waiters_per_key_max`, `tenants[].requests_per_s`, ...), so a client can tell its own
/// quota from the server's load.
pub const LIMIT_METADATA: &str = "oncegate-limit";
/// The header of a `Session` stream's response that gives the most calls the server keeps
/// in flight on it (`server.session_calls_in_flight_max`). Past that it holds one call
/// unstarted and reads nothing more, so a cancel sent behind that call would wait for a
/// call to end: a client that never has more in flight has every cancel read at once.
pub const SESSION_CALLS_IN_FLIGHT_MAX_METADATA: &str = "oncegate-session-calls-in-flight-max";
