//! The Python sample client (examples/python-client) logs in to a real proxy over TLS with a
//! proof of its token, plays, and gets its batches back; without TLS, the same proxy gives it
//! nothing. Needs `CELLMESH_TEST_PYTHON` (a Python with `protobuf` and `grpcio-tools`), which
//! `./scripts/test.sh` creates and exports.

mod support;

use std::path::PathBuf;

use cellmesh_proxy::ProxyConfig;
use cellmesh_test_support::required;
use support::*;

fn client_py() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/python-client/client.py")
}

async fn run_client(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(required("CELLMESH_TEST_PYTHON"))
        .arg(client_py())
        .args(args)
        .output()
        .await
        .expect("the Python client runs")
}

#[tokio::test]
async fn the_python_client_plays_over_tls_with_a_proof() {
    let dir = tempfile::tempdir().unwrap();
    let (tls_cfg, ca) = edge_certs(dir.path(), &["127.0.0.1"]);
    let gw = Gateway::start(1).await;
    let proxy = TestProxy::start(ProxyConfig {
        client_tls: tls_cfg,
        hello_timeout_ms: 1000,
        ..config(&[&gw])
    })
    .await;
    let addr = proxy.addr();
    let ca = ca.display().to_string();
    let alice = token("alice");

    let out = run_client(&[
        "--proxy", &addr, "--tls-ca", &ca, "--token", &alice, "--inputs", "5",
    ])
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("welcome alice"), "{stdout}");
    assert!(stdout.contains("batches 5"), "{stdout}");
    // The game got the inputs, in order.
    let seqs: Vec<u64> = gw.game.inputs().into_iter().map(|i| i.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);

    // In plaintext, the TLS proxy answers nothing it can read.
    let out = run_client(&["--proxy", &addr, "--token", &alice, "--timeout", "3"]).await;
    assert!(!out.status.success(), "a plaintext client logged in");
}
