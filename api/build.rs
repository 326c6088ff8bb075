//! Compiles the API protos in pure Rust (protox), so no system `protoc` is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not when it is compiled: cargo reuses a compiled build
    // script for an identical crate in another checkout sharing the target directory.
    let proto_dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let file = proto_dir.join("reviewlane/v1/review.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&proto_dir])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let bytes = prost::Message::encode_to_vec(&fds);
    std::fs::write(out.join("reviewlane_descriptor.bin"), bytes)?;
    // Requests that do not decode are the caller's error (see `codec.rs`).
    tonic_prost_build::configure().codec_path("crate::codec::ApiCodec").compile_fds(fds)?;
    Ok(())
}
