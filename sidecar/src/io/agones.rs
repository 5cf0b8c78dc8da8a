//! The Agones SDK client: a task that makes the calls [`AgonesSdk`] decides, over the SDK
//! server's local REST API (`http://localhost:PORT`), one at a time, each bounded by
//! [`CALL_TIMEOUT`]. It follows the node through a [`NodeStatus`] the driver publishes. A call
//! that fails is counted (`agones_calls`) and logged once per streak; it is never fatal, the
//! game is served all the same.
//!
//! The task is not stopped by the sidecar's shutdown token: it ends once `Shutdown` went through
//! (or was given up) after the node stopped cleanly, or at once after a failure, so the process
//! exits only after its last call.

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::model::agones::{AgonesSdk, Call, NodeStatus, Stopped};

/// The longest one call may take, connecting included.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of an answer read before its head ends.
const MAX_HEAD: usize = 16 * 1024;

/// Where the SDK server is, and what this node tells it.
pub(crate) struct Target {
    pub port: u16,
    pub node_id: u32,
    pub geo: String,
    pub health_every_ms: u64,
}

/// Calls the SDK server at `target` as [`AgonesSdk`] decides, following `node`, until nothing is
/// left to call.
pub(crate) async fn run(target: Target, mut node: watch::Receiver<NodeStatus>, metrics: Metrics) {
    let start = Instant::now();
    let now = || start.elapsed().as_millis() as u64;
    let mut sdk = AgonesSdk::new(target.node_id, &target.geo, target.health_every_ms, now());
    tracing::info!(
        port = target.port,
        "under Agones: calling its SDK server on the game's behalf"
    );
    let mut open = true;
    // Failures in a row, by call.
    let mut failing: HashMap<&'static str, u32> = HashMap::new();
    sdk.status(now(), latest(&mut node, false));
    while !sdk.finished() {
        if open {
            match node.has_changed() {
                Ok(false) => {}
                Ok(true) => sdk.status(now(), latest(&mut node, false)),
                Err(_) => {
                    open = false;
                    sdk.status(now(), latest(&mut node, true));
                }
            }
        }
        if let Some(call) = sdk.poll_call(now()) {
            let outcome = send(target.port, &call).await;
            let name = call.name();
            match &outcome {
                Ok(()) => {
                    metrics.agones_call(name, "ok");
                    if let Some(n) = failing.remove(name) {
                        tracing::info!(call = name, failures = n, "Agones SDK answering again");
                    }
                    match call {
                        Call::Ready => tracing::info!("Agones told the game server is ready"),
                        Call::Shutdown => {
                            tracing::info!("Agones told to shut the game server down")
                        }
                        Call::Label { key, value } => {
                            tracing::debug!(key, value, "Agones label set")
                        }
                        Call::Health => {}
                    }
                }
                Err(e) => {
                    metrics.agones_call(name, e.result());
                    let n = failing.entry(name).or_default();
                    *n += 1;
                    if *n == 1 {
                        tracing::warn!(call = name, error = %e, "Agones SDK call failed; trying again");
                    } else {
                        tracing::debug!(call = name, failures = *n, error = %e, "Agones SDK call failed");
                    }
                }
            }
            sdk.done(now(), outcome.is_ok());
            continue;
        }
        if sdk.finished() {
            break;
        }
        let wake = sdk
            .poll_timeout()
            .map(|ms| start + Duration::from_millis(ms));
        tokio::select! {
            changed = node.changed(), if open => {
                open = changed.is_ok();
                sdk.status(now(), latest(&mut node, !open));
            }
            _ = sleep_until(wake) => {}
        }
    }
    if failing.contains_key("shutdown") {
        tracing::warn!("Agones never took the Shutdown: giving up");
    }
}

/// The node's latest status; if it ended (`closed`) without saying how, it failed.
fn latest(node: &mut watch::Receiver<NodeStatus>, closed: bool) -> NodeStatus {
    let mut status = *node.borrow_and_update();
    if closed && status.stopped.is_none() {
        status.stopped = Some(Stopped::Failed);
    }
    status
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error("answered {0}")]
    Status(u16),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("no answer within {CALL_TIMEOUT:?}")]
    Timeout,
    #[error("not an HTTP answer: {0:?}")]
    Garbled(String),
}

impl CallError {
    /// Its `result` in the `agones_calls` metric.
    fn result(&self) -> &'static str {
        match self {
            CallError::Status(_) => "rejected",
            _ => "unreachable",
        }
    }
}

/// One call: a fresh connection, the request, the head of the answer; its status must be 2xx.
async fn send(port: u16, call: &Call) -> Result<(), CallError> {
    tokio::time::timeout(CALL_TIMEOUT, exchange(port, call))
        .await
        .map_err(|_| CallError::Timeout)?
}

async fn exchange(port: u16, call: &Call) -> Result<(), CallError> {
    let mut stream = TcpStream::connect(("localhost", port)).await?;
    stream.write_all(request(port, call).as_bytes()).await?;
    // Only the status matters: the head is read, the rest is left (the connection closes).
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        head.extend_from_slice(&buf[..n]);
        if n == 0 || head.windows(4).any(|w| w == b"\r\n\r\n") || head.len() > MAX_HEAD {
            break;
        }
    }
    match status_of(&head) {
        Some(s) if (200..300).contains(&s) => Ok(()),
        Some(s) => Err(CallError::Status(s)),
        None => Err(CallError::Garbled(
            String::from_utf8_lossy(&head[..head.len().min(80)]).into_owned(),
        )),
    }
}

/// The HTTP/1.1 request for `call`, its body JSON.
fn request(port: u16, call: &Call) -> String {
    let body = call.body();
    format!(
        "{} {} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
         Accept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        call.method(),
        call.path(),
        body.len()
    )
}

/// The status code of an HTTP/1.x answer's head.
fn status_of(head: &[u8]) -> Option<u16> {
    let line = head.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/1."))?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_is_read_from_the_head() {
        assert_eq!(status_of(b"HTTP/1.1 200 OK\r\n\r\n"), Some(200));
        assert_eq!(
            status_of(b"HTTP/1.0 500 Internal Server Error\r\nX: y\r\n"),
            Some(500)
        );
        assert_eq!(status_of(b""), None);
        assert_eq!(status_of(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(status_of(b"HTTP/1.1 abc\r\n"), None);
    }

    #[test]
    fn a_request_carries_its_json_body() {
        let r = request(
            9358,
            &Call::Label {
                key: "cellmesh-geo",
                value: "paris".into(),
            },
        );
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("PUT /metadata/label HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("Content-Type: application/json"), "{head}");
        assert!(
            head.contains(&format!("Content-Length: {}", body.len())),
            "{head}"
        );
        assert_eq!(body, r#"{"key":"cellmesh-geo","value":"paris"}"#);
        let r = request(9358, &Call::Health);
        assert!(r.starts_with("POST /health HTTP/1.1\r\n"), "{r}");
        assert!(
            r.ends_with("Content-Length: 2\r\nConnection: close\r\n\r\n{}"),
            "{r}"
        );
    }

    /// A server that answers every request with `status` and records what it got.
    async fn answering(status: u16) -> (u16, tokio::task::JoinHandle<Vec<String>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut got = Vec::new();
            for _ in 0..2 {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                while !buf[..n].ends_with(b"{}") {
                    match s.read(&mut buf[n..]).await.unwrap() {
                        0 => break,
                        k => n += k,
                    }
                }
                got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                let answer = format!("HTTP/1.1 {status} X\r\nContent-Length: 2\r\n\r\n{{}}");
                s.write_all(answer.as_bytes()).await.unwrap();
            }
            got
        });
        (port, task)
    }

    #[tokio::test]
    async fn a_call_succeeds_on_2xx_and_is_rejected_otherwise() {
        let (port, server) = answering(200).await;
        send(port, &Call::Ready).await.unwrap();
        send(port, &Call::Shutdown).await.unwrap();
        let got = server.await.unwrap();
        assert!(got[0].starts_with("POST /ready "), "{got:?}");
        assert!(got[1].starts_with("POST /shutdown "), "{got:?}");

        let (port, _server) = answering(500).await;
        let e = send(port, &Call::Health).await.unwrap_err();
        assert_eq!(e.result(), "rejected", "{e}");

        // Nobody listening.
        let free = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = free.local_addr().unwrap().port();
        drop(free);
        let e = send(port, &Call::Health).await.unwrap_err();
        assert_eq!(e.result(), "unreachable", "{e}");
    }
}
