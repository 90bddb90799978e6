//! Compiles the proto with protox (pure Rust), so a fresh machine needs no `protoc`, and
//! writes the encoded file descriptor set for gRPC reflection.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/oncegate/v1/gate.proto", "proto/oncegate/v1/admin.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("oncegate_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::codec::StrictCodec")
        .compile_fds(fds)?;
    Ok(())
}
