//! The admin HTTP surface of every long-running cellmesh process (Quilkin-style):
//!
//! - `GET /live`: 200 while the process runs;
//! - `GET /ready`: 200 when it should get traffic, 503 while starting or draining;
//! - `GET /metrics`: the process's registry, in OpenMetrics when the scraper's `Accept` asks for
//!   `application/openmetrics-text`, else in the classic Prometheus text format 0.0.4 (see
//!   [`exposition`]);
//! - `GET /state`: a JSON view of the process's state;
//! - whatever a process adds with [`Admin::route`] (the live map's `/map` and `/api/world`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod config;
pub mod exposition;

pub use exposition::Format;

pub use prometheus_client;

/// The `tracing` target of the spans a process exports over OTLP when an endpoint is configured
/// (`login` in the proxy, `handoff` and `entity_command` in the sidecar): the exporter takes
/// these spans only, and the log none of them, so with no endpoint they are disabled spans.
pub const SPANS_TARGET: &str = "cellmesh::spans";

type StateFn = dyn Fn() -> serde_json::Value + Send + Sync;

/// The answer of a route a process added: status, content type and body.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Bytes,
}

impl Reply {
    pub fn ok(content_type: &'static str, body: impl Into<Bytes>) -> Self {
        Self {
            status: 200,
            content_type,
            body: body.into(),
        }
    }

    /// A JSON body, or a 500 naming why it could not be written.
    pub fn json(value: &impl serde::Serialize) -> Self {
        match serde_json::to_vec(value) {
            Ok(body) => Self::ok("application/json", body),
            Err(e) => Self {
                status: 500,
                content_type: "text/plain",
                body: format!("cannot encode: {e}\n").into(),
            },
        }
    }
}

/// A route's handler: called for every `GET` of its path.
pub type Route = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Reply> + Send>> + Send + Sync>;

/// What the admin server shows: readiness, a metrics registry, a state view, and the routes a
/// process added.
pub struct Admin {
    ready: AtomicBool,
    registry: Registry,
    state: Box<StateFn>,
    routes: RwLock<HashMap<String, Route>>,
}

impl Admin {
    pub fn new(
        registry: Registry,
        state: impl Fn() -> serde_json::Value + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            ready: AtomicBool::new(false),
            registry,
            state: Box::new(state),
            routes: RwLock::default(),
        })
    }

    /// Serves `GET path` with `handler` from now on (a later route of the same path replaces
    /// it). The built-in paths (`/live`, `/ready`, `/metrics`, `/state`) cannot be taken.
    pub fn route<F, Fut>(&self, path: &str, handler: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        let route: Route = Arc::new(move || Box::pin(handler()));
        self.routes
            .write()
            .expect("admin routes poisoned")
            .insert(path.to_string(), route);
    }

    /// Answers one request: an added route, else the built-in ones.
    async fn handle(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        const BUILT_IN: [&str; 6] = [
            "/live", "/healthz", "/ready", "/readyz", "/metrics", "/state",
        ];
        let path = req.uri().path();
        if req.method() == Method::GET && !BUILT_IN.contains(&path) {
            let route = self
                .routes
                .read()
                .expect("admin routes poisoned")
                .get(path)
                .cloned();
            if let Some(route) = route {
                let reply = route().await;
                return Response::builder()
                    .status(reply.status)
                    .header("content-type", reply.content_type)
                    .header("cache-control", "no-store")
                    .body(Full::new(reply.body))
                    .expect("route response parts are valid");
            }
        }
        self.respond(req)
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The OpenMetrics exposition of the registry.
    pub fn metrics_text(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// The registry's exposition in `format`.
    pub fn metrics_in(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.metrics_text(),
            Format::Classic => exposition::to_classic(&self.metrics_text()),
        }
    }

    fn respond(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        let (status, ctype, body) = match (req.method(), req.uri().path()) {
            (&Method::GET, "/live") | (&Method::GET, "/healthz") => {
                (StatusCode::OK, "text/plain", "live\n".to_string())
            }
            (&Method::GET, "/ready") | (&Method::GET, "/readyz") => {
                if self.is_ready() {
                    (StatusCode::OK, "text/plain", "ready\n".to_string())
                } else {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        "not ready\n".to_string(),
                    )
                }
            }
            (&Method::GET, "/metrics") => {
                let accept = req
                    .headers()
                    .get(hyper::header::ACCEPT)
                    .and_then(|v| v.to_str().ok());
                let format = Format::negotiate(accept);
                (
                    StatusCode::OK,
                    format.content_type(),
                    self.metrics_in(format),
                )
            }
            (&Method::GET, "/state") => {
                let v = (self.state)();
                (StatusCode::OK, "application/json", format!("{v:#}\n"))
            }
            (&Method::GET, _) => (
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found\n".to_string(),
            ),
            _ => (
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "method not allowed\n".to_string(),
            ),
        };
        let mut response = Response::builder()
            .status(status)
            .header("content-type", ctype);
        if req.uri().path() == "/metrics" {
            // The page's format follows the scraper's Accept header.
            response = response.header("vary", "Accept");
        }
        response
            .body(Full::new(Bytes::from(body)))
            .expect("static response parts are valid")
    }
}

/// Serves the admin endpoints on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    admin: Arc<Admin>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let conns = shutdown.clone();
    accept_loop(|| listener.accept(), &shutdown, |stream, peer| {
        let admin = admin.clone();
        let shutdown = conns.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let admin = admin.clone();
                async move { Ok::<_, Infallible>(admin.handle(&req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => if let Err(e) = r { tracing::debug!(%peer, error = %e, "admin connection ended") },
                _ = shutdown.cancelled() => {}
            }
        });
    })
    .await;
    Ok(())
}

/// The pause after a failed accept; each failure in a row doubles it, up to the longest.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest pause between tries of a failing accept.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Hands what `accept` accepts to `handle` until `shutdown` is cancelled. An accept that fails
/// (out of file descriptors or buffers: it fails again at once) pauses the loop, longer each time
/// in a row, instead of spinning; the streak is logged once, when it starts and when it ends.
async fn accept_loop<S, A, F>(
    mut accept: A,
    shutdown: &CancellationToken,
    mut handle: impl FnMut(S, SocketAddr),
) where
    A: FnMut() -> F,
    F: Future<Output = std::io::Result<(S, SocketAddr)>>,
{
    let mut backoff = Backoff::default();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                if let Some(failures) = backoff.reset() {
                    tracing::info!(failures, "admin accepting again");
                }
                handle(stream, peer);
            }
            Err(e) => {
                let (pause, first) = backoff.fail();
                if first {
                    tracing::warn!(error = %e, "admin accept failing; retrying with backoff");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}

/// The pause after each failure of a streak.
#[derive(Debug, Default)]
struct Backoff {
    failures: u32,
    next: Duration,
}

impl Backoff {
    /// Counts a failure; returns the pause before the next try and whether it starts a streak.
    fn fail(&mut self) -> (Duration, bool) {
        self.failures = self.failures.saturating_add(1);
        let pause = if self.failures == 1 {
            ACCEPT_BACKOFF_MIN
        } else {
            (self.next * 2).min(ACCEPT_BACKOFF_MAX)
        };
        self.next = pause;
        (pause, self.failures == 1)
    }

    /// Ends the streak, if any; returns how many failures it had.
    fn reset(&mut self) -> Option<u32> {
        let failures = std::mem::take(&mut self.failures);
        self.next = Duration::ZERO;
        (failures > 0).then_some(failures)
    }
}

/// Binds `addr` and serves in the background; returns the bound address.
pub async fn spawn(
    addr: &str,
    admin: Arc<Admin>,
    shutdown: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = serve(listener, admin, shutdown).await {
            tracing::error!(error = %e, "admin server failed");
        }
    });
    Ok(local)
}

/// A tiny HTTP GET for tests and the CLI: returns (status, body).
pub async fn http_get(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
) -> anyhow::Result<(u16, String)> {
    let r = http_get_with(addr, path, &[]).await?;
    Ok((r.status, r.body))
}

/// What [`http_get_with`] got back.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A tiny HTTP GET sending `headers` (e.g. `("accept", "text/plain")`).
pub async fn http_get_with(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<HttpResponse> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    s.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status line in {text:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(HttpResponse {
        status,
        headers,
        body: body.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[tokio::test]
    async fn endpoints() {
        let mut reg = Registry::default();
        let c: Counter = Counter::default();
        reg.register("frames_in", "frames received", c.clone());
        c.inc_by(7);
        let admin = Admin::new(reg, || serde_json::json!({"node": 3}));
        let stop = CancellationToken::new();
        let addr = spawn("127.0.0.1:0", admin.clone(), stop.clone())
            .await
            .unwrap();
        assert_eq!(http_get(addr, "/live").await.unwrap().0, 200);
        assert_eq!(http_get(addr, "/ready").await.unwrap().0, 503);
        admin.set_ready(true);
        assert_eq!(http_get(addr, "/ready").await.unwrap().0, 200);
        let (s, body) = http_get(addr, "/metrics").await.unwrap();
        assert_eq!(s, 200);
        assert!(body.contains("frames_in_total 7"), "{body}");

        // Without an Accept header, or asking for text/plain: the classic format.
        for accept in [None, Some("text/plain"), Some("*/*")] {
            let headers: Vec<_> = accept.map(|a| ("accept", a)).into_iter().collect();
            let r = http_get_with(addr, "/metrics", &headers).await.unwrap();
            assert_eq!(r.status, 200);
            assert_eq!(
                r.header("content-type"),
                Some("text/plain; version=0.0.4; charset=utf-8"),
                "{accept:?}"
            );
            assert_eq!(r.header("vary"), Some("Accept"));
            assert_eq!(
                r.body,
                "# HELP frames_in_total frames received.\n\
                 # TYPE frames_in_total counter\n\
                 frames_in_total 7\n"
            );
        }
        // Asking for OpenMetrics: OpenMetrics, as before.
        let r = http_get_with(
            addr,
            "/metrics",
            &[("Accept", "application/openmetrics-text; version=1.0.0")],
        )
        .await
        .unwrap();
        assert_eq!(
            r.header("content-type"),
            Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
        );
        assert_eq!(
            r.body,
            "# HELP frames_in frames received.\n\
             # TYPE frames_in counter\n\
             frames_in_total 7\n\
             # EOF\n"
        );
        assert_eq!(r.body, admin.metrics_text());
        let (_, body) = http_get(addr, "/state").await.unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["node"],
            3
        );
        assert_eq!(http_get(addr, "/nope").await.unwrap().0, 404);

        // An added route answers its path; a built-in path stays the built-in.
        admin.route("/api/world", || async {
            Reply::json(&serde_json::json!({"cells": 4}))
        });
        admin.route("/live", || async { Reply::ok("text/plain", "taken") });
        let (s, body) = http_get(addr, "/api/world").await.unwrap();
        assert_eq!(s, 200);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["cells"],
            4
        );
        assert_eq!(http_get(addr, "/live").await.unwrap().1, "live\n");
        assert_eq!(http_get(addr, "/nope").await.unwrap().0, 404);
        stop.cancel();
    }

    /// An accept that fails as it does out of file descriptors, and how many times it was tried;
    /// past `cap` tries it stops the loop, so that a spinning loop fails the test instead of
    /// hanging it.
    fn failing_accept<'a>(
        tries: &'a std::cell::Cell<u32>,
        cap: u32,
        stop: &CancellationToken,
    ) -> impl FnMut() -> std::future::Ready<std::io::Result<((), SocketAddr)>> + 'a {
        let stop = stop.clone();
        move || {
            tries.set(tries.get() + 1);
            if tries.get() >= cap {
                stop.cancel();
            }
            std::future::ready(Err(std::io::Error::from_raw_os_error(24)))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_accept_is_retried_with_backoff_not_in_a_spin() {
        let stop = CancellationToken::new();
        let tries = std::cell::Cell::new(0);
        let timer = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            timer.cancel();
        });
        accept_loop(failing_accept(&tries, 10_000, &stop), &stop, |(), _| {}).await;
        // 10, 20, … 640 ms, then 1 s each: 11 tries in 5 s.
        assert!(
            (5..=20).contains(&tries.get()),
            "{} accepts in 5 s",
            tries.get()
        );
    }

    #[test]
    fn the_backoff_doubles_to_its_cap_and_restarts_after_a_success() {
        let mut b = Backoff::default();
        let ms = |(d, first): (Duration, bool)| (d.as_millis(), first);
        assert_eq!(ms(b.fail()), (10, true));
        assert_eq!(ms(b.fail()), (20, false));
        for _ in 0..10 {
            b.fail();
        }
        assert_eq!(ms(b.fail()), (1000, false));
        assert_eq!(b.reset(), Some(13));
        assert_eq!(b.reset(), None);
        assert_eq!(ms(b.fail()), (10, true));
    }
}
