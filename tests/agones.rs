//! Under Agones (`AGONES_SDK_HTTP_PORT` set), the `cellmesh sidecar` process calls the Agones SDK
//! server's REST API itself, so that its game needs no Agones SDK: labels with its node id and
//! geo, `Ready` once the game said `Hello`, `Health` on a period, `Shutdown` after the drain and
//! before it exits. Agones' own local SDK server is not available here: a local HTTP server
//! stands in for it and records every call.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::sdk::{connect, SdkConfig};
use cellmesh_test_support::{sidecar_command, wait_ready, within, SidecarProcess, PATIENCE};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use support::CELLMESH;
use tokio::net::TcpListener;
use tokio::time::Instant;

mod support;

/// How often the sidecars of these tests send `Health`.
const HEALTH_EVERY_MS: &str = "150";

/// One request the stand-in got.
#[derive(Debug, Clone)]
struct Recorded {
    at: Instant,
    method: String,
    path: String,
    content_type: String,
    /// The body as JSON (`null` if it was not).
    body: Value,
}

/// A stand-in for the Agones SDK server: it answers every request with one status and records it.
struct SdkServer {
    port: u16,
    calls: Arc<Mutex<Vec<Recorded>>>,
    server: tokio::task::JoinHandle<()>,
}

impl SdkServer {
    async fn start(status: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let calls = Arc::new(Mutex::new(Vec::new()));
        let log = calls.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let log = log.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let log = log.clone();
                        async move {
                            let at = Instant::now();
                            let method = req.method().to_string();
                            let path = req.uri().path().to_string();
                            let content_type = req
                                .headers()
                                .get(hyper::header::CONTENT_TYPE)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or_default()
                                .to_string();
                            let body = req.into_body().collect().await?.to_bytes();
                            let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
                            log.lock().unwrap().push(Recorded {
                                at,
                                method,
                                path,
                                content_type,
                                body,
                            });
                            Ok::<_, hyper::Error>(
                                Response::builder()
                                    .status(status)
                                    .header(hyper::header::CONTENT_TYPE, "application/json")
                                    .body(Full::new(Bytes::from_static(b"{}")))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self {
            port,
            calls,
            server,
        }
    }

    fn calls(&self) -> Vec<Recorded> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits until what was recorded satisfies `done`.
    async fn wait_for(&self, what: &str, done: impl Fn(&[Recorded]) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        while !done(&self.calls()) {
            assert!(
                Instant::now() < deadline,
                "no {what} within {PATIENCE:?}; got {:#?}",
                self.calls()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for SdkServer {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn count(calls: &[Recorded], path: &str) -> usize {
    calls.iter().filter(|c| c.path == path).count()
}

/// A port nobody listens on (bound, then let go).
async fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().port()
}

/// A sidecar under Agones whose SDK server is on `port`.
async fn sidecar_under_agones(port: u16) -> SidecarProcess {
    SidecarProcess::start(
        "sidecar",
        sidecar_command(CELLMESH)
            .env("AGONES_SDK_HTTP_PORT", port.to_string())
            .env("CELLMESH_AGONES__HEALTH_EVERY_MS", HEALTH_EVERY_MS)
            .env("CELLMESH_NODE_ID", "9")
            .env("CELLMESH_GEO", "paris"),
    )
    .await
}

/// A game that says `Hello` to the sidecar at `local` and reads whatever it is sent.
async fn connect_game(local: SocketAddr) -> cellmesh_proto::sdk::GameSender {
    let (tx, mut rx, welcome) = within(
        "the game's Welcome",
        connect(SdkConfig::tcp(local.to_string(), "agones-test")),
    )
    .await
    .expect("the sidecar welcomes the game");
    assert_eq!(welcome.node_id, 9);
    tokio::spawn(async move { while let Some(Ok(_)) = rx.next().await {} });
    tx
}

/// The value of the counter `agones_calls{call, result}` on the sidecar's `/metrics`.
async fn agones_calls(admin: SocketAddr, call: &str, result: &str) -> u64 {
    let (status, text) = cellmesh_admin::http_get(admin, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    let series =
        format!("cellmesh_sidecar_agones_calls_total{{call=\"{call}\",result=\"{result}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_calls_agones_for_its_game_from_start_to_shutdown() {
    let sdk = SdkServer::start(200).await;
    let mut sidecar = sidecar_under_agones(sdk.port).await;

    // Before any game: the labels and Health (a game may take a while to start), never Ready.
    sdk.wait_for("Health three times", |c| count(c, "/health") >= 3)
        .await;
    let before = sdk.calls();
    assert_eq!(
        count(&before, "/ready"),
        0,
        "Ready without a game: {before:#?}"
    );
    let labels: Vec<&Value> = before
        .iter()
        .filter(|c| c.method == "PUT" && c.path == "/metadata/label")
        .map(|c| &c.body)
        .collect();
    assert_eq!(
        labels,
        vec![
            &json!({"key": "cellmesh-node", "value": "9"}),
            &json!({"key": "cellmesh-geo", "value": "paris"})
        ],
        "{before:#?}"
    );
    assert!(
        before[..2].iter().all(|c| c.path == "/metadata/label"),
        "the labels first: {before:#?}"
    );

    // A game says Hello: Ready, once.
    let hello_at = Instant::now();
    let _game = connect_game(sidecar.local).await;
    wait_ready(sidecar.admin, &mut sidecar.process).await;
    sdk.wait_for("Ready", |c| count(c, "/ready") == 1).await;
    let ready_at = sdk.calls().iter().find(|c| c.path == "/ready").unwrap().at;
    assert!(ready_at >= hello_at, "Ready before the game said Hello");
    sdk.wait_for("Health on after Ready", |c| {
        c.iter()
            .filter(|c| c.path == "/health" && c.at > ready_at)
            .count()
            >= 3
    })
    .await;
    assert_eq!(agones_calls(sidecar.admin, "ready", "ok").await, 1);
    assert!(agones_calls(sidecar.admin, "health", "ok").await >= 6);

    // SIGTERM: the sidecar drains, tells Agones to shut down, then exits cleanly.
    let term_at = Instant::now();
    sidecar.process.signal("TERM");
    let status = within("the sidecar to exit", sidecar.process.child.wait())
        .await
        .unwrap();
    let exited_at = Instant::now();
    let log = sidecar.process.last_words().await;
    assert!(status.success(), "exited with {status}:\n{log}");
    let calls = sdk.calls();
    assert_eq!(count(&calls, "/shutdown"), 1, "{calls:#?}");
    let last = calls.last().unwrap();
    assert_eq!(
        last.path, "/shutdown",
        "Shutdown is the last call: {calls:#?}"
    );
    assert!(
        term_at < last.at && last.at < exited_at,
        "Shutdown after the signal and before the exit"
    );
    assert_eq!(count(&calls, "/ready"), 1, "Ready once: {calls:#?}");
    let drained = log.find("drained: shutting down").expect(&log);
    let shutdown = log
        .find("Agones told to shut the game server down")
        .expect(&log);
    assert!(
        drained < shutdown,
        "Shutdown before the drain ended:\n{log}"
    );

    // Every call as the SDK server's REST API takes it: JSON bodies, POST but for the labels.
    for c in &calls {
        assert_eq!(c.content_type, "application/json", "{c:?}");
        assert!(c.body.is_object(), "{c:?}");
        let want = if c.path == "/metadata/label" {
            "PUT"
        } else {
            "POST"
        };
        assert_eq!(c.method, want, "{c:?}");
        if c.method == "POST" {
            assert_eq!(c.body, json!({}), "{c:?}");
        }
    }
}

/// The game is served whatever the SDK server does: its failures are counted and tried again,
/// and the sidecar still exits cleanly on SIGTERM (giving `Shutdown` up after a while).
async fn the_game_is_served_despite(sdk: Option<&SdkServer>, port: u16, result: &str) {
    let mut sidecar = sidecar_under_agones(port).await;
    let _game = connect_game(sidecar.local).await;
    wait_ready(sidecar.admin, &mut sidecar.process).await;
    let deadline = Instant::now() + PATIENCE;
    while agones_calls(sidecar.admin, "ready", result).await < 2
        || agones_calls(sidecar.admin, "health", result).await < 2
        || agones_calls(sidecar.admin, "label", result).await < 2
    {
        assert!(
            Instant::now() < deadline,
            "failed Agones calls are not counted as {result} or not tried again:\n{}",
            sidecar.process.tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(agones_calls(sidecar.admin, "ready", "ok").await, 0);
    // Still serving its game.
    let (status, _) = cellmesh_admin::http_get(sidecar.admin, "/ready")
        .await
        .unwrap();
    assert_eq!(status, 200);
    let state = cellmesh_test_support::admin_state(sidecar.admin)
        .await
        .unwrap();
    assert_eq!(state["game_connected"], true, "{state}");
    sidecar.process.terminate().await;
    if let Some(sdk) = sdk {
        assert!(count(&sdk.calls(), "/shutdown") >= 1, "Shutdown was tried");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_server_answering_errors_does_not_disturb_the_game() {
    let sdk = SdkServer::start(500).await;
    the_game_is_served_despite(Some(&sdk), sdk.port, "rejected").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_sdk_server_does_not_disturb_the_game() {
    the_game_is_served_despite(None, free_port().await, "unreachable").await;
}
