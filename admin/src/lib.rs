//! The admin HTTP surface of every long-running cellmesh process (Quilkin-style):
//!
//! - `GET /live`: 200 while the process runs;
//! - `GET /ready`: 200 when it should get traffic, 503 while starting or draining;
//! - `GET /metrics`: the process's registry, in OpenMetrics when the scraper's `Accept` asks for
//!   `application/openmetrics-text`, else in the classic Prometheus text format 0.0.4 (see
//!   [`exposition`]);
//! - `GET /state`: a JSON view of the process's state;
//! - whatever a process adds with [`Admin::route`] (the live map's `/map` and `/api/world`).
//!
//! With an admin token set ([`Admin::set_token`]), every path but `/live`, `/ready` and
//! `/metrics` asks for `Authorization: Bearer <token>`; the listener bounds how long a request's
//! head and an idle connection may take and how many connections may be open (see [`guard`]).

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
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod cache;
pub mod config;
pub mod exposition;
pub mod guard;

pub use cache::SingleFlight;
pub use exposition::Format;
pub use guard::Limits;

pub use prometheus_client;

/// The `tracing` target of the spans a process exports over OTLP when an endpoint is configured
/// (`login` in the proxy, `handoff` and `entity_command` in the sidecar): the exporter takes
/// these spans only, and the log none of them, so with no endpoint they are disabled spans.
pub const SPANS_TARGET: &str = "cellmesh::spans";

type StateFn = dyn Fn() -> serde_json::Value + Send + Sync;
type AsyncStateFn =
    dyn Fn() -> Pin<Box<dyn Future<Output = serde_json::Value> + Send>> + Send + Sync;

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
    /// Composes `/state` in place of `state`, where the state lives in a task of its own.
    state_async: RwLock<Option<Arc<AsyncStateFn>>>,
    /// By path: the handler, and whether it is served without the token.
    routes: RwLock<HashMap<String, (Route, bool)>>,
    /// Empty: every path is open.
    token: RwLock<String>,
    limits: RwLock<Limits>,
    guard_metrics: GuardMetrics,
    /// The admin port's own metrics (`cellmesh_admin_*`), shown after the process's.
    guard_registry: Registry,
}

type Reason = Vec<(&'static str, &'static str)>;

/// What the guard refused, by reason.
#[derive(Clone, Default)]
struct GuardMetrics {
    requests_refused: Family<Reason, Counter>,
    connections_refused: Counter,
    connections_timed_out: Family<Reason, Counter>,
}

impl GuardMetrics {
    fn registry(&self) -> Registry {
        let mut reg = Registry::with_prefix("cellmesh_admin");
        reg.register(
            "requests_refused",
            "Admin requests refused for want of the admin token, by reason (missing_token, wrong_token)",
            self.requests_refused.clone(),
        );
        reg.register(
            "connections_refused",
            "Admin connections closed as soon as accepted because the most allowed were open",
            self.connections_refused.clone(),
        );
        reg.register(
            "connections_timed_out",
            "Admin connections closed for taking too long, by reason (header: a request's head, idle: no byte either way)",
            self.connections_timed_out.clone(),
        );
        reg
    }

    fn timed_out(&self, reason: &'static str) {
        self.connections_timed_out
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }
}

impl Admin {
    pub fn new(
        registry: Registry,
        state: impl Fn() -> serde_json::Value + Send + Sync + 'static,
    ) -> Arc<Self> {
        let guard_metrics = GuardMetrics::default();
        Arc::new(Self {
            ready: AtomicBool::new(false),
            registry,
            state: Box::new(state),
            state_async: RwLock::default(),
            routes: RwLock::default(),
            token: RwLock::default(),
            limits: RwLock::default(),
            guard_registry: guard_metrics.registry(),
            guard_metrics,
        })
    }

    /// Asks for `Authorization: Bearer <token>` on every path but `/live`, `/ready` and
    /// `/metrics` from now on (the next request already); empty: every path is open.
    pub fn set_token(&self, token: &str) {
        *self.token.write().expect("admin token poisoned") = token.to_string();
    }

    /// The listener's bounds; read when [`serve`] starts, so set them before.
    pub fn set_limits(&self, limits: Limits) {
        *self.limits.write().expect("admin limits poisoned") = limits;
    }

    pub fn limits(&self) -> Limits {
        *self.limits.read().expect("admin limits poisoned")
    }

    /// The 401 of a request the token does not allow, if it is one.
    fn refuse(&self, req: &Request<Incoming>) -> Option<Response<Full<Bytes>>> {
        let token = self.token.read().expect("admin token poisoned");
        let authorization = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        let open = self.is_open(req.uri().path());
        let refusal = guard::check(&token, open, authorization).err()?;
        self.guard_metrics
            .requests_refused
            .get_or_create(&vec![("reason", refusal.reason())])
            .inc();
        Some(
            Response::builder()
                .status(StatusCode::UNAUTHORIZED)
                .header("content-type", "text/plain")
                .header("www-authenticate", "Bearer realm=\"cellmesh-admin\"")
                .body(Full::new(Bytes::from_static(refusal.message().as_bytes())))
                .expect("static response parts are valid"),
        )
    }

    /// Serves `GET path` with `handler` from now on (a later route of the same path replaces
    /// it), to holders of the admin token when one is set. The built-in paths (`/live`,
    /// `/ready`, `/metrics`, `/state`) cannot be taken.
    pub fn route<F, Fut>(&self, path: &str, handler: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        self.add_route(path, handler, false);
    }

    /// [`Admin::route`] served without the token: for what shows nothing of the process (a
    /// static page that asks for its data with the token).
    pub fn route_open<F, Fut>(&self, path: &str, handler: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        self.add_route(path, handler, true);
    }

    fn add_route<F, Fut>(&self, path: &str, handler: F, open: bool)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        let route: Route = Arc::new(move || Box::pin(handler()));
        self.routes
            .write()
            .expect("admin routes poisoned")
            .insert(path.to_string(), (route, open));
    }

    /// Whether `path` is served without the token.
    fn is_open(&self, path: &str) -> bool {
        guard::OPEN_PATHS.contains(&path)
            || self
                .routes
                .read()
                .expect("admin routes poisoned")
                .get(path)
                .is_some_and(|(_, open)| *open)
    }

    /// Answers one request: an added route, else the built-in ones.
    async fn handle(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        const BUILT_IN: [&str; 6] = [
            "/live", "/healthz", "/ready", "/readyz", "/metrics", "/state",
        ];
        if let Some(refused) = self.refuse(req) {
            return refused;
        }
        let path = req.uri().path();
        if req.method() == Method::GET && !BUILT_IN.contains(&path) {
            let route = self
                .routes
                .read()
                .expect("admin routes poisoned")
                .get(path)
                .map(|(route, _)| route.clone());
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
        if req.method() == Method::GET && path == "/state" {
            let state = self
                .state_async
                .read()
                .expect("admin state poisoned")
                .clone();
            if let Some(state) = state {
                let v = state().await;
                return Response::builder()
                    .status(StatusCode::OK)
                    .header("content-type", "application/json")
                    .header("cache-control", "no-store")
                    .body(Full::new(Bytes::from(format!("{v:#}\n"))))
                    .expect("state response parts are valid");
            }
        }
        self.respond(req)
    }

    /// Composes `/state` with `state` from now on: for a process whose state a task of its own
    /// owns, asked for it as each request comes.
    pub fn set_state_async<F, Fut>(&self, state: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = serde_json::Value> + Send + 'static,
    {
        let f: Arc<AsyncStateFn> = Arc::new(move || Box::pin(state()));
        *self.state_async.write().expect("admin state poisoned") = Some(f);
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The OpenMetrics exposition of the registry, then of the admin port's own metrics.
    pub fn metrics_text(&self) -> String {
        use prometheus_client::encoding::text;
        let mut out = String::new();
        text::encode_registry(&mut out, &self.registry)
            .and_then(|()| text::encode_registry(&mut out, &self.guard_registry))
            .and_then(|()| text::encode_eof(&mut out))
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

/// Serves the admin endpoints on `listener` until `shutdown` is cancelled, within the admin's
/// [`Limits`]: a connection past the most allowed is closed as soon as accepted, one whose
/// request head takes too long or that moves no byte for too long is closed.
pub async fn serve(
    listener: TcpListener,
    admin: Arc<Admin>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let limits = admin.limits();
    anyhow::ensure!(
        limits.max_connections > 0,
        "admin max_connections must be greater than 0"
    );
    let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let conns = shutdown.clone();
    accept_loop(|| listener.accept(), &shutdown, |stream, peer| {
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // Dropped: closed at once, before a byte is read.
            admin.guard_metrics.connections_refused.inc();
            tracing::debug!(%peer, max = limits.max_connections, "admin connection refused: too many open");
            return;
        };
        let admin = admin.clone();
        let shutdown = conns.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let metrics = admin.guard_metrics.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let admin = admin.clone();
                async move { Ok::<_, Infallible>(admin.handle(&req).await) }
            });
            let (stream, activity) = idle::Watched::new(stream);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    if e.is_timeout() {
                        metrics.timed_out("header");
                    }
                    tracing::debug!(%peer, error = %e, "admin connection ended");
                },
                _ = activity.idle_for(limits.idle_timeout) => {
                    metrics.timed_out("idle");
                    tracing::debug!(%peer, "admin connection closed: idle");
                }
                _ = shutdown.cancelled() => {}
            }
        });
    })
    .await;
    Ok(())
}

/// A stream that notes when it last moved a byte, for closing connections that do not.
mod idle {
    use std::io;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio::time::Instant;

    /// When the stream last moved a byte, in milliseconds since it was made.
    pub(super) struct Activity {
        born: Instant,
        last_ms: Arc<AtomicU64>,
    }

    impl Activity {
        /// Resolves once no byte moved for `idle`.
        pub(super) async fn idle_for(&self, idle: Duration) {
            loop {
                let last = self.born + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
                if Instant::now().saturating_duration_since(last) >= idle {
                    return;
                }
                tokio::time::sleep_until(last + idle).await;
            }
        }
    }

    pub(super) struct Watched<S> {
        inner: S,
        born: Instant,
        last_ms: Arc<AtomicU64>,
    }

    impl<S> Watched<S> {
        pub(super) fn new(inner: S) -> (Self, Activity) {
            let born = Instant::now();
            let last_ms = Arc::new(AtomicU64::new(0));
            let activity = Activity {
                born,
                last_ms: last_ms.clone(),
            };
            (
                Self {
                    inner,
                    born,
                    last_ms,
                },
                activity,
            )
        }

        fn moved(&self) {
            let ms = Instant::now()
                .saturating_duration_since(self.born)
                .as_millis();
            self.last_ms
                .store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let before = buf.filled().len();
            let r = Pin::new(&mut self.inner).poll_read(cx, buf);
            if buf.filled().len() > before {
                self.moved();
            }
            r
        }
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let r = Pin::new(&mut self.inner).poll_write(cx, buf);
            if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
                self.moved();
            }
            r
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
            if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
                self.moved();
            }
            r
        }

        fn is_write_vectored(&self) -> bool {
            self.inner.is_write_vectored()
        }
    }
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

/// [`http_get`] with the admin token `token` (empty: none sent).
pub async fn http_get_token(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
    token: &str,
) -> anyhow::Result<(u16, String)> {
    http_get_token_bounded(addr, path, token, HTTP_GET_MAX_BYTES).await
}

/// [`http_get_token`] reading at most `max_bytes` of the answer.
pub async fn http_get_token_bounded(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
    token: &str,
    max_bytes: u64,
) -> anyhow::Result<(u16, String)> {
    let auth = guard::bearer(token);
    let headers: Vec<(&str, &str)> = auth.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let r = http_get_bounded(addr, path, &headers, max_bytes).await?;
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

/// The most [`http_get_with`] reads of an answer; a larger one is an error.
pub const HTTP_GET_MAX_BYTES: u64 = 64 << 20;

/// A tiny HTTP GET sending `headers` (e.g. `("accept", "text/plain")`).
pub async fn http_get_with(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<HttpResponse> {
    http_get_bounded(addr, path, headers, HTTP_GET_MAX_BYTES).await
}

/// [`http_get_with`] reading at most `max_bytes` of the answer (head and body): a peer that
/// sends more is refused, not buffered.
pub async fn http_get_bounded(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
    headers: &[(&str, &str)],
    max_bytes: u64,
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
    (&mut s).take(max_bytes + 1).read_to_end(&mut buf).await?;
    anyhow::ensure!(
        buf.len() as u64 <= max_bytes,
        "GET {path}: the answer is larger than {max_bytes} bytes"
    );
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
    async fn an_answer_past_the_bound_is_refused_not_buffered() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = [0u8; 1024];
                    let _ = s.read(&mut head).await;
                    let body = "x".repeat(10_000);
                    let answer = format!("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{body}");
                    let _ = s.write_all(answer.as_bytes()).await;
                });
            }
        });
        let err = http_get_bounded(addr, "/api/node-map", &[], 4096)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("larger than 4096 bytes"), "{err}");
        let ok = http_get_bounded(addr, "/api/node-map", &[], 20_000)
            .await
            .unwrap();
        assert_eq!((ok.status, ok.body.len()), (200, 10_000));
    }

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
            // The process's metrics, then the admin port's own (a family without a child
            // yet shows nothing).
            assert_eq!(
                r.body,
                "# HELP frames_in_total frames received.\n\
                 # TYPE frames_in_total counter\n\
                 frames_in_total 7\n\
                 # HELP cellmesh_admin_connections_refused_total Admin connections closed as soon as accepted because the most allowed were open.\n\
                 # TYPE cellmesh_admin_connections_refused_total counter\n\
                 cellmesh_admin_connections_refused_total 0\n"
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
             # HELP cellmesh_admin_connections_refused Admin connections closed as soon as accepted because the most allowed were open.\n\
             # TYPE cellmesh_admin_connections_refused counter\n\
             cellmesh_admin_connections_refused_total 0\n\
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

    async fn guarded(token: &str, limits: Limits) -> (Arc<Admin>, SocketAddr, CancellationToken) {
        let admin = Admin::new(
            Registry::default(),
            || serde_json::json!({"accounts": {"alice": "10.0.0.1:5000"}}),
        );
        admin.set_token(token);
        admin.set_limits(limits);
        admin.set_ready(true);
        let stop = CancellationToken::new();
        let addr = spawn("127.0.0.1:0", admin.clone(), stop.clone())
            .await
            .unwrap();
        (admin, addr, stop)
    }

    #[tokio::test]
    async fn the_token_guards_every_path_but_the_probes_and_the_metrics() {
        let (admin, addr, stop) = guarded("t0ken", Limits::default()).await;
        admin.route("/api/world", || async {
            Reply::ok("application/json", "{}")
        });
        for path in ["/state", "/api/world", "/nope"] {
            let r = http_get_with(addr, path, &[]).await.unwrap();
            assert_eq!(r.status, 401, "{path}: {}", r.body);
            assert!(
                r.header("www-authenticate")
                    .is_some_and(|v| v.starts_with("Bearer")),
                "{path}: {:?}",
                r.headers
            );
            assert!(r.body.contains("Authorization: Bearer"), "{}", r.body);
            assert_eq!(r.body.lines().count(), 1, "{}", r.body);
            assert!(!r.body.contains("alice"));
        }
        for wrong in ["Bearer t0ke", "Bearer t0ken2", "Basic t0ken", "t0ken"] {
            let r = http_get_with(addr, "/state", &[("Authorization", wrong)])
                .await
                .unwrap();
            assert_eq!(r.status, 401, "{wrong}");
            assert!(!r.body.contains("alice"));
        }
        // The probes and the scraper need no token.
        assert_eq!(http_get(addr, "/live").await.unwrap().0, 200);
        assert_eq!(http_get(addr, "/ready").await.unwrap().0, 200);
        let (status, metrics) = http_get(addr, "/metrics").await.unwrap();
        assert_eq!(status, 200);
        assert!(
            metrics.contains("cellmesh_admin_requests_refused_total{reason=\"missing_token\"} 3"),
            "{metrics}"
        );
        assert!(
            metrics.contains("cellmesh_admin_requests_refused_total{reason=\"wrong_token\"} 4"),
            "{metrics}"
        );
        // A page routed open needs none either.
        admin.route_open("/map", || async { Reply::ok("text/html", "<html>") });
        assert_eq!(http_get(addr, "/map").await.unwrap().0, 200);
        // The right one opens the rest.
        let (status, body) = http_get_token(addr, "/state", "t0ken").await.unwrap();
        assert_eq!(status, 200);
        assert!(body.contains("alice"));
        assert_eq!(
            http_get_token(addr, "/api/world", "t0ken").await.unwrap().0,
            200
        );
        // Rotated: the old token is refused from the next request.
        admin.set_token("n3w");
        assert_eq!(
            http_get_token(addr, "/state", "t0ken").await.unwrap().0,
            401
        );
        assert_eq!(http_get_token(addr, "/state", "n3w").await.unwrap().0, 200);
        stop.cancel();
    }

    /// Reads until the server closes the connection; how long that took, or `None` if it did not
    /// within `within`.
    async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> Option<Duration> {
        use tokio::io::AsyncReadExt;
        let start = tokio::time::Instant::now();
        let mut buf = [0u8; 1024];
        tokio::time::timeout(within, async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return start.elapsed(),
                    Ok(_) => {}
                }
            }
        })
        .await
        .ok()
    }

    #[tokio::test]
    async fn a_client_that_stalls_in_its_request_head_is_closed_after_the_header_timeout() {
        use tokio::io::AsyncWriteExt;
        let limits = Limits {
            header_read_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let (_admin, addr, stop) = guarded("", limits).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /sta").await.unwrap();
        let took = closed_within(&mut s, Duration::from_secs(5))
            .await
            .expect("a stalled request head was still open after 5 s");
        assert!(took >= Duration::from_millis(250), "closed after {took:?}");
        // A keep-alive connection waiting for its next request is under the same bound.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /live HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let took = closed_within(&mut s, Duration::from_secs(5))
            .await
            .expect("a keep-alive connection was still open after 5 s");
        assert!(took >= Duration::from_millis(250), "closed after {took:?}");
        let (_, metrics) = http_get(addr, "/metrics").await.unwrap();
        assert!(
            metrics.contains("cellmesh_admin_connections_timed_out_total{reason=\"header\"} 2"),
            "{metrics}"
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn a_connection_that_moves_nothing_is_closed_after_the_idle_timeout() {
        let limits = Limits {
            idle_timeout: Duration::from_millis(300),
            header_read_timeout: Duration::from_secs(60),
            ..Limits::default()
        };
        let (_admin, addr, stop) = guarded("", limits).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let took = closed_within(&mut s, Duration::from_secs(5))
            .await
            .expect("an idle connection was still open after 5 s");
        assert!(took >= Duration::from_millis(250), "closed after {took:?}");
        let (_, metrics) = http_get(addr, "/metrics").await.unwrap();
        assert!(
            metrics.contains("cellmesh_admin_connections_timed_out_total{reason=\"idle\"} 1"),
            "{metrics}"
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn a_connection_past_the_cap_is_closed_at_once_and_counted() {
        use tokio::io::AsyncWriteExt;
        let limits = Limits {
            max_connections: 2,
            ..Limits::default()
        };
        let (admin, addr, stop) = guarded("", limits).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            // A byte of a request: the connection is surely accepted before the next one.
            s.write_all(b"G").await.unwrap();
            held.push(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = third
            .write_all(b"GET /live HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await;
        let took = closed_within(&mut third, Duration::from_secs(2))
            .await
            .expect("the third connection of two allowed was served");
        assert!(took < Duration::from_secs(1), "closed after {took:?}");
        assert!(
            admin
                .metrics_text()
                .contains("cellmesh_admin_connections_refused_total 1\n"),
            "{}",
            admin.metrics_text()
        );
        // One of the two finishes its request and closes: its place is free again.
        let mut first = held.remove(0);
        first
            .write_all(b"ET /live HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        closed_within(&mut first, Duration::from_secs(2))
            .await
            .expect("the first connection was answered and closed");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(http_get(addr, "/live").await.unwrap().0, 200);
        stop.cancel();
    }

    #[tokio::test]
    async fn concurrent_calls_of_a_single_flight_route_run_it_once() {
        let (admin, addr, stop) = guarded("t", Limits::default()).await;
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let cache = Arc::new(SingleFlight::new(Duration::from_secs(1)));
        let counted = runs.clone();
        admin.route("/api/world", move || {
            let (cache, runs) = (cache.clone(), counted.clone());
            async move {
                let n = cache
                    .get(|| async {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        runs.fetch_add(1, Ordering::SeqCst) + 1
                    })
                    .await;
                Reply::ok("text/plain", n.to_string())
            }
        });
        let calls: Vec<_> = (0..8)
            .map(|_| tokio::spawn(http_get_token(addr, "/api/world", "t")))
            .collect();
        for c in calls {
            assert_eq!(c.await.unwrap().unwrap(), (200, "1".to_string()));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
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
