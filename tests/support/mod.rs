//! What the root integration tests share beyond `cellmesh-test-support`: the `cellmesh` binary and
//! a cluster node run from it.
#![allow(dead_code)] // each test file uses a part

use cellmesh_test_support::{sidecar_command, SidecarProcess};

/// The binary under test (only this package's tests can name it).
pub const CELLMESH: &str = env!("CARGO_BIN_EXE_cellmesh");

/// Runs `cellmesh up ARGS --summary-json F`; see [`cellmesh_test_support::run_up_binary`].
pub fn run_up_binary(args: &[&str], keys: &[&str]) -> (serde_json::Value, String) {
    cellmesh_test_support::run_up_binary(CELLMESH, args, keys)
}

/// Starts node `node` of the cluster in `topology`, sharing the directory in `redis` with `geo`.
pub async fn start_sidecar(node: u32, topology: &str, redis: &str, geo: &str) -> SidecarProcess {
    SidecarProcess::start(
        format!("sidecar {node}"),
        sidecar_command(CELLMESH)
            .env("CELLMESH_NODE_ID", node.to_string())
            .env("CELLMESH_GEO", geo)
            .env("CELLMESH_TOPOLOGY_URL", topology)
            .env("CELLMESH_DIRECTORY_URL", redis),
    )
    .await
}
