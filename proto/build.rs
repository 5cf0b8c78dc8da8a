//! Generates the prost types from `proto/*.proto` with protox, so no system `protoc` is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/local.proto", "proto/mesh.proto", "proto/edge.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    prost_build::Config::new()
        .bytes(["."])
        // Once per connection, and the largest client message by far: boxed, so that every
        // other message of a client frame stays small (see the fuzz test's amplification bounds).
        .boxed(".cellmesh.edge.ClientMessage.body.hello")
        .compile_fds(fds)?;
    Ok(())
}
