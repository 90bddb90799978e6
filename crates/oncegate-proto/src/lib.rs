//! The oncegate wire contract (`oncegate.v1`), generated from `proto/oncegate/v1/gate.proto`
//! at build time, with the encoded file descriptor set for gRPC reflection.

/// Package `oncegate.v1`: the `Gate` service, its messages, client and server.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("oncegate.v1");
}

/// The encoded `FileDescriptorSet` of the proto, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/oncegate_descriptor.bin"));
