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

/// The value of a test server's env var (set by `./scripts/test.sh`); a missing one fails the test
/// and says how to get it.
pub fn required(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: run ./scripts/test.sh, which installs and starts Redis and the MongoDB-compatible server")
    })
}

/// A name unique to this run, for the databases and geos a test creates in a shared server.
pub fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{}_{nanos}", std::process::id())
}

/// Commits a grid partition with `cellmesh partition plan --grid G --nodes N --commit`, as an
/// operator does.
pub fn commit_plan(topology: &str, grid: &str, nodes: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cellmesh"))
        .args(["partition", "plan", "--grid", grid, "--nodes", nodes])
        .args(["--commit", "--store", topology])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "plan {grid} {nodes} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `cellmesh sidecar` process joined to a cluster, with the ports it listens on.
pub struct SidecarProcess {
    pub local: u16,
    pub mesh: u16,
    pub admin: u16,
    pub child: Child,
}

/// Starts node `node` of the cluster in `topology`, sharing the directory in `redis` with `geo`.
pub fn spawn_sidecar(node: u32, topology: &str, redis: &str, geo: &str) -> SidecarProcess {
    let (local, mesh, admin) = (free_port(), free_port(), free_port());
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_cellmesh"))
        .arg("sidecar")
        .env("CELLMESH_NODE_ID", node.to_string())
        .env("CELLMESH_GEO", geo)
        .env("CELLMESH_LOCAL_LISTEN", format!("127.0.0.1:{local}"))
        .env("CELLMESH_MESH_LISTEN", format!("127.0.0.1:{mesh}"))
        .env("CELLMESH_ADMIN_LISTEN", format!("127.0.0.1:{admin}"))
        .env("CELLMESH_TOPOLOGY_URL", topology)
        .env("CELLMESH_DIRECTORY_URL", redis)
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    SidecarProcess {
        local,
        mesh,
        admin,
        child,
    }
}

/// A process's `/state`, if its admin server answers.
pub async fn admin_state(admin: u16) -> Option<serde_json::Value> {
    let addr = format!("127.0.0.1:{admin}").parse().unwrap();
    match cellmesh_admin::http_get(addr, "/state").await {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// Everything a process wrote so far, collected while it runs (a full pipe would stall it).
#[derive(Clone, Default)]
pub struct Log(std::sync::Arc<std::sync::Mutex<String>>);

impl Log {
    /// Appends what `from` yields until it closes.
    pub fn collect(
        &self,
        mut from: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        use tokio::io::AsyncReadExt;
        let sink = self.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = from.read(&mut buf).await {
                sink.0
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    }

    pub fn text(&self) -> String {
        self.0.lock().unwrap().clone()
    }
}
