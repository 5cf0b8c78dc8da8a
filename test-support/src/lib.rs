//! What the workspace's tests share: one bound on waiting, the clock, the test servers named by
//! `./scripts/test.sh`, a collector of what processes write, and `cellmesh sidecar` /
//! `cellmesh proxy` and `cellmesh director` run as processes that report the addresses they bound.
//!
//! A dev-dependency only. A library cannot name another package's binary, so whatever runs
//! `cellmesh` takes the binary's path: the root package's tests pass
//! `env!("CARGO_BIN_EXE_cellmesh")`.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod echo_game;
mod process;

pub use echo_game::{EchoGame, GameInput, ECHO};

pub use process::{
    director_command, proxy_command, sidecar_command, DirectorProcess, Exited, Process,
    ProxyProcess, SidecarProcess, DIRECTOR_LISTENING, PROXY_LISTENING, SIDECAR_LISTENING,
};

/// Upper bound for anything a test waits for that should happen promptly. Only a failing test
/// waits this long, so it is generous: a loaded machine must not turn a slow start into a failure.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// `fut`'s output; panics naming `what` if it takes longer than [`PATIENCE`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    within_limit(what, PATIENCE, fut).await
}

/// `fut`'s output; panics naming `what` if it takes longer than `limit`.
pub async fn within_limit<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what} ({limit:?})"))
}

/// Seconds since the Unix epoch (token expiries).
pub fn unix_now() -> u64 {
    since_epoch().as_secs()
}

/// Milliseconds since the Unix epoch (lease clocks).
pub fn unix_ms() -> u64 {
    since_epoch().as_millis() as u64
}

fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is past 1970")
}

/// The value of a test server's env var, set by `./scripts/test.sh`. A missing one fails the
/// test and says how to get it: tests that need a server never skip.
pub fn required(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set: run ./scripts/test.sh, which installs and starts Redis and the \
             MongoDB-compatible server, creates the Python venv, and exports their addresses"
        )
    })
}

/// A name unique to this run, for the databases, geos and accounts a test creates in a server
/// that outlives it.
pub fn run_id() -> String {
    format!("{}_{}", std::process::id(), since_epoch().subsec_nanos())
}

/// A name for `test` that no other test, nor an earlier run, uses: process, time and a counter
/// first (a name cut short stays unique), the test's name last.
pub fn unique_name(test: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(
        "t{}_{:x}_{n}_{test}",
        std::process::id(),
        since_epoch().as_nanos()
    )
}

/// Everything a process wrote so far, collected while it runs (a full pipe would stall it).
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<String>>);

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
                sink.push(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    }

    pub fn text(&self) -> String {
        self.0.lock().expect("log lock poisoned").clone()
    }

    /// The last few kilobytes, for a failure message.
    pub fn tail(&self) -> String {
        let text = self.text();
        let start = text.len().saturating_sub(3000);
        let start = (start..text.len())
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        text[start..].to_string()
    }

    fn push(&self, text: &str) {
        self.0.lock().expect("log lock poisoned").push_str(text);
    }
}

/// Waits until the admin server at `admin` answers `/ready` with 200; fails with what `process`
/// wrote if it exits first or is not ready within [`PATIENCE`].
pub async fn wait_ready(admin: SocketAddr, process: &mut Process) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Ok((200, _)) = cellmesh_admin::http_get(admin, "/ready").await {
            return;
        }
        if let Ok(Some(status)) = process.child.try_wait() {
            let log = process.last_words().await;
            panic!("{} exited early with {status}:\n{log}", process.name);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} (admin {admin}) never became ready:\n{}",
            process.name,
            process.log.tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A process's `/state`, if its admin server answers.
pub async fn admin_state(admin: SocketAddr) -> Option<serde_json::Value> {
    match cellmesh_admin::http_get(admin, "/state").await {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// Commits a grid partition with `cellmesh partition plan --grid G --nodes N --commit`, as an
/// operator does.
pub fn commit_plan(bin: impl AsRef<Path>, topology: &str, grid: &str, nodes: &str) {
    let out = std::process::Command::new(bin.as_ref())
        .args(["partition", "plan", "--grid", grid, "--nodes", nodes])
        .args(["--commit", "--store", topology])
        .output()
        .expect("cellmesh runs");
    assert!(
        out.status.success(),
        "plan {grid} {nodes} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `cellmesh up ARGS --summary-json F` as a user does (with its admin port on a free port
/// unless ARGS name one, so runs side by side do not collide); asserts it exits 0 and that the
/// summary has every key in `keys`. Returns the summary and what it printed.
pub fn run_up_binary(
    bin: impl AsRef<Path>,
    args: &[&str],
    keys: &[&str],
) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("s.json");
    let mut cmd = std::process::Command::new(bin.as_ref());
    cmd.arg("up").args(args);
    if !args.iter().any(|a| a.starts_with("--admin")) {
        cmd.args(["--admin", "127.0.0.1:0"]);
    }
    let out = cmd
        .arg("--summary-json")
        .arg(&path)
        .output()
        .expect("cellmesh runs");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = std::fs::read_to_string(&path).expect("the summary is written");
    let v: serde_json::Value = serde_json::from_str(&summary).expect("the summary is JSON");
    for key in keys {
        assert!(v.get(key).is_some(), "summary lacks {key}: {v}");
    }
    (v, String::from_utf8_lossy(&out.stdout).into_owned())
}
