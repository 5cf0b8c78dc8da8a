//! Spans over OTLP: `cellmesh sidecar` and `cellmesh proxy` processes given a collector's endpoint
//! post the spans of a login, a handoff and a cross-node entity command to it (OTLP/HTTP,
//! protobuf), each under its service name; without an endpoint they post nothing.
//!
//! The collector is a small HTTP server in the test that decodes each `ExportTraceServiceRequest`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use cellmesh_arena::ArenaConfig;
use cellmesh_proto::client::{ClientReceiver, ClientSender};
use cellmesh_proto::edge::{client_message, server_message, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_test_support::{
    commit_plan, proxy_command, required, run_id, sidecar_command, unix_now, wait_ready,
    ProxyProcess, SidecarProcess,
};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, KeyValue};
use prost::Message;
use support::CELLMESH;
use tokio::net::TcpListener;
use tokio::process::Command;
use tokio::time::Instant;

mod support;

/// The OpenTelemetry variables a process may inherit from whoever runs the tests: each test
/// says what it wants instead.
const OTEL_VARS: &[&str] = &[
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_BSP_SCHEDULE_DELAY",
];

/// The border of the default world's 2×1 grid: node 1 west of it, node 2 east.
const BORDER_X: f64 = 65_536.0;
const SECRET: &str = "otlp-test";

/// A span as the collector got it.
#[derive(Debug, Clone)]
struct Exported {
    service: String,
    name: String,
    attributes: BTreeMap<String, String>,
}

impl Exported {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// An OTLP/HTTP collector on a loopback port: keeps every span posted to `/v1/traces`.
struct Collector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Exported>>>,
    connections: Arc<AtomicUsize>,
    /// Requests to anything but `POST /v1/traces` with a protobuf body.
    strays: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    async fn start() -> Self {
        Self::on(TcpListener::bind("127.0.0.1:0").await.expect("a free port"))
    }

    fn on(listener: TcpListener) -> Self {
        let addr = listener.local_addr().expect("bound");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let strays = Arc::new(AtomicUsize::new(0));
        let (kept, count, stray) = (spans.clone(), connections.clone(), strays.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let (kept, stray) = (kept.clone(), stray.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        receive(req, kept.clone(), stray.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            spans,
            connections,
            strays,
            task,
        }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn spans(&self) -> Vec<Exported> {
        self.spans.lock().expect("spans lock").clone()
    }

    /// The first span named `name` from `service` that `pred` accepts.
    fn find(
        &self,
        service: &str,
        name: &str,
        pred: impl Fn(&Exported) -> bool,
    ) -> Option<Exported> {
        self.spans()
            .into_iter()
            .find(|s| s.service == service && s.name == name && pred(s))
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn receive(
    req: Request<Incoming>,
    spans: Arc<Mutex<Vec<Exported>>>,
    strays: Arc<AtomicUsize>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let protobuf = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .is_some_and(|v| v == "application/x-protobuf");
    if req.method() != hyper::Method::POST || req.uri().path() != "/v1/traces" || !protobuf {
        strays.fetch_add(1, Ordering::SeqCst);
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = StatusCode::NOT_FOUND;
        return Ok(r);
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(Response::new(Full::new(Bytes::new()))),
    };
    let request = ExportTraceServiceRequest::decode(body).expect("an ExportTraceServiceRequest");
    let mut got = Vec::new();
    for rs in request.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| {
                r.attributes
                    .iter()
                    .find(|kv| kv.key == "service.name")
                    .map(text)
            })
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for span in ss.spans {
                got.push(Exported {
                    service: service.clone(),
                    name: span.name,
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(kv)))
                        .collect(),
                });
            }
        }
    }
    spans.lock().expect("spans lock").extend(got);
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    let mut r = Response::new(Full::new(Bytes::from(answer)));
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/x-protobuf"),
    );
    Ok(r)
}

/// An attribute's value as text (integers in decimal, booleans as `true`/`false`).
fn text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// `cmd` with the OpenTelemetry variables cleared, then the collector's endpoint (if any) and a
/// batch delay of `delay_ms`.
fn otel<'a>(cmd: &'a mut Command, endpoint: Option<&str>, delay_ms: u64) -> &'a mut Command {
    for var in OTEL_VARS {
        cmd.env_remove(var);
    }
    if let Some(endpoint) = endpoint {
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    }
    cmd.env("OTEL_BSP_SCHEDULE_DELAY", delay_ms.to_string())
}

/// Answers the proxy's pings and drops everything else the client is sent, for `wait`.
async fn pump(tx: &mut ClientSender, rx: &mut ClientReceiver, wait: Duration) {
    let deadline = Instant::now() + wait;
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, rx.next()).await {
        let msg = msg.expect("the connection stays up");
        if let Some(server_message::Body::Ping(p)) = msg.body {
            tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                .await
                .expect("pong sent");
        }
    }
}

/// Two sidecars and a proxy, each told the collector's endpoint. Node 1's arena holds only the
/// player, a few metres west of the border; node 2's NPCs stand a few metres east of it, within
/// the player's reach: the player's attacks are entity commands node 1 sends to node 2. Then the
/// player walks east over the border, and node 1 hands its avatar to node 2. The sidecars batch
/// for 200 ms; the proxy for a minute, so its login span arrives only because SIGTERM sends
/// what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_handoff_and_command_spans_reach_an_otlp_collector() {
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let collector = Collector::start().await;
    let endpoint = collector.endpoint();
    let run = run_id();
    let topology = format!("{}/cm_otlp_{run}", mongo.trim_end_matches('/'));
    let geo = format!("otlp-{run}");
    commit_plan(CELLMESH, &topology, "2x1", "1,2");

    let mut nodes = Vec::new();
    for node in [1u32, 2] {
        let mut cmd = sidecar_command(CELLMESH);
        cmd.env("CELLMESH_NODE_ID", node.to_string())
            .env("CELLMESH_GEO", &geo)
            .env("CELLMESH_TOPOLOGY_URL", &topology)
            .env("CELLMESH_DIRECTORY_URL", &redis);
        otel(&mut cmd, Some(&endpoint), 200);
        nodes.push(SidecarProcess::start(format!("sidecar {node}"), &mut cmd).await);
    }
    let mut arenas = Vec::new();
    for (node, npcs, center, spread) in [
        (&nodes[0], 0, (BORDER_X - 8.0, 1000.0), 4.0),
        (&nodes[1], 3, (BORDER_X + 12.0, 1000.0), 8.0),
    ] {
        let cfg = ArenaConfig {
            sidecar: SidecarAddr::Tcp(node.local.to_string()),
            npcs,
            center,
            spread,
            trade: false,
            ..ArenaConfig::default()
        };
        arenas.push(tokio::spawn(cellmesh_arena::run(
            cfg,
            tokio::time::sleep(Duration::from_secs(90)),
        )));
    }
    for node in &mut nodes {
        wait_ready(node.admin, &mut node.process).await;
    }
    let mut proxy_cmd = proxy_command(CELLMESH);
    proxy_cmd
        .env("CELLMESH_GEO", &geo)
        .env("CELLMESH_GATEWAYS", format!("[\"{}\"]", nodes[0].mesh))
        .env("CELLMESH_TOKEN_SECRET", SECRET)
        .env("CELLMESH_DRAIN_GRACE_MS", "0");
    otel(&mut proxy_cmd, Some(&endpoint), 60_000);
    let mut proxy = ProxyProcess::start("proxy", &mut proxy_cmd).await;
    wait_ready(proxy.admin, &mut proxy.process).await;

    let token = cellmesh_proto::token::sign(SECRET.as_bytes(), "ada", unix_now() + 120);
    let (mut tx, mut rx, welcome) =
        cellmesh_proto::client::login(&proxy.clients.to_string(), &token)
            .await
            .expect("login");
    assert_eq!(welcome.gateway_node, 1);

    let deadline = Instant::now() + Duration::from_secs(45);
    let logs = |nodes: &[SidecarProcess]| {
        let tails: Vec<String> = nodes.iter().map(|n| n.process.tail()).collect();
        format!("spans: {:#?}\n{}", collector.spans(), tails.join("\n"))
    };
    let command = loop {
        if let Some(s) = collector.find("cellmesh-sidecar", "entity_command", |s| {
            s.attr("node") == Some("1") && s.attr("result").is_some()
        }) {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "no entity_command span from node 1: {}",
            logs(&nodes)
        );
        pump(&mut tx, &mut rx, Duration::from_millis(200)).await;
    };
    assert_eq!(command.attr("to_node"), Some("2"), "{command:?}");
    assert_eq!(command.attr("from_account"), Some("ada"), "{command:?}");
    assert_eq!(command.attr("type"), Some("1"), "{command:?}");
    assert!(command.attr("entity").is_some(), "{command:?}");

    // East, over the border.
    let mut seq = 0;
    let handoff = loop {
        if let Some(s) = collector.find("cellmesh-sidecar", "handoff", |s| {
            s.attr("account") == Some("ada") && s.attr("outcome").is_some()
        }) {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "no handoff span of ada's avatar: {}",
            logs(&nodes)
        );
        seq += 1;
        tx.input(seq, cellmesh_arena::schema::input(1.0, 0.0))
            .await
            .expect("input sent");
        pump(&mut tx, &mut rx, Duration::from_millis(200)).await;
    };
    assert_eq!(handoff.attr("node"), Some("1"), "{handoff:?}");
    assert_eq!(handoff.attr("to_node"), Some("2"), "{handoff:?}");
    assert_eq!(handoff.attr("master"), Some("true"), "{handoff:?}");
    assert_eq!(handoff.attr("outcome"), Some("adopted"), "{handoff:?}");
    assert!(handoff.attr("entity").is_some() && handoff.attr("epoch").is_some());

    // The proxy batches for a minute: its login span comes with the exit.
    assert!(
        collector
            .find("cellmesh-proxy", "login", |_| true)
            .is_none(),
        "the login span came before the proxy's batch was due"
    );
    drop((tx, rx));
    let log = proxy.process.terminate().await;
    let login = collector
        .find("cellmesh-proxy", "login", |_| true)
        .unwrap_or_else(|| {
            panic!(
                "no login span after the proxy exited: {:#?}\n{log}",
                collector.spans()
            )
        });
    assert_eq!(login.attr("account"), Some("ada"), "{login:?}");
    assert_eq!(login.attr("geo"), Some(geo.as_str()), "{login:?}");
    assert_eq!(login.attr("node"), Some("1"), "{login:?}");
    assert_eq!(login.attr("outcome"), Some("attached"), "{login:?}");
    assert!(login.attr("gateway").is_some() && login.attr("session_epoch").is_some());
    assert!(log.contains("exporting spans over OTLP"), "{log}");

    // Only the spans of the span target are exported, nothing of the log.
    let names: std::collections::BTreeSet<String> =
        collector.spans().into_iter().map(|s| s.name).collect();
    assert!(
        names
            .iter()
            .all(|n| ["login", "handoff", "entity_command"].contains(&n.as_str())),
        "{names:?}"
    );
    assert_eq!(collector.strays.load(Ordering::SeqCst), 0);
    for a in arenas {
        a.abort();
    }
}

/// Without an endpoint nothing is exported: a sidecar and a proxy serving a login, with every
/// other OpenTelemetry variable set, never connect to a collector listening on the default
/// OTLP/HTTP port, and do not say they export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_exported_without_an_endpoint() {
    // Where an exporter built by mistake would post: the default endpoint. Another process of
    // this machine may hold the port; then the logs alone tell.
    let default_port = match TcpListener::bind("127.0.0.1:4318").await {
        Ok(l) => Some(Collector::on(l)),
        Err(e) => {
            eprintln!("127.0.0.1:4318 is taken ({e}): checking the logs only");
            None
        }
    };
    let mut sidecar_cmd = sidecar_command(CELLMESH);
    sidecar_cmd.env("CELLMESH_NODE_ID", "3");
    otel(&mut sidecar_cmd, None, 50).env("OTEL_SERVICE_NAME", "unused");
    let mut sidecar = SidecarProcess::start("sidecar", &mut sidecar_cmd).await;
    let mut proxy_cmd = proxy_command(CELLMESH);
    proxy_cmd
        .env("CELLMESH_GATEWAYS", sidecar.mesh.to_string())
        .env("CELLMESH_TOKEN_SECRET", SECRET)
        .env("CELLMESH_DRAIN_GRACE_MS", "0");
    otel(&mut proxy_cmd, None, 50);
    let mut proxy = ProxyProcess::start("proxy", &mut proxy_cmd).await;
    let arena = tokio::spawn(cellmesh_arena::run(
        ArenaConfig {
            sidecar: SidecarAddr::Tcp(sidecar.local.to_string()),
            npcs: 2,
            ..ArenaConfig::default()
        },
        tokio::time::sleep(Duration::from_secs(60)),
    ));
    wait_ready(sidecar.admin, &mut sidecar.process).await;
    wait_ready(proxy.admin, &mut proxy.process).await;

    let token = cellmesh_proto::token::sign(SECRET.as_bytes(), "ada", unix_now() + 60);
    let refused = cellmesh_proto::token::sign(b"another secret", "eve", unix_now() + 60);
    let addr = proxy.clients.to_string();
    let (tx, rx, _) = cellmesh_proto::client::login(&addr, &token)
        .await
        .expect("login");
    assert!(cellmesh_proto::client::login(&addr, &refused)
        .await
        .is_err());
    // Several batch delays.
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop((tx, rx));
    let proxy_log = proxy.process.terminate().await;
    let sidecar_log = sidecar.process.terminate().await;
    for log in [&proxy_log, &sidecar_log] {
        assert!(!log.contains("exporting spans"), "{log}");
        assert!(!log.contains("not exporting spans"), "{log}");
    }
    if let Some(c) = default_port {
        assert_eq!(c.connections.load(Ordering::SeqCst), 0, "{:?}", c.spans());
    }
    arena.abort();
}
