//! What the root integration tests share: running the `cellmesh` binary and waiting on processes.
#![allow(dead_code)] // each test file uses a part

use std::time::Duration;

use tokio::process::Child;

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until the admin server on `admin` answers `/ready` with 200; fails if `child` exits.
pub async fn wait_ready(admin: u16, child: &mut Child) {
    let addr = format!("127.0.0.1:{admin}").parse().unwrap();
    for _ in 0..400 {
        if let Ok((200, _)) = cellmesh_admin::http_get(addr, "/ready").await {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("process exited early with {status}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("admin 127.0.0.1:{admin} never became ready");
}

/// Runs `cellmesh up ARGS --summary-json F` as a user does; asserts it exits 0 and that the summary
/// has every key in `keys`. Returns the summary and what it printed.
pub fn run_up_binary(args: &[&str], keys: &[&str]) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cellmesh"))
        .arg("up")
        .args(args)
        .arg("--summary-json")
        .arg(&path)
        .output()
        .expect("cellmesh runs");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for key in keys {
        assert!(v.get(key).is_some(), "summary lacks {key}: {v}");
    }
    (v, String::from_utf8_lossy(&out.stdout).into_owned())
}
