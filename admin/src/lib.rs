//! The admin HTTP surface of every long-running cellmesh process (Quilkin-style):
//!
//! - `GET /live`: 200 while the process runs;
//! - `GET /ready`: 200 when it should get traffic, 503 while starting or draining;
//! - `GET /metrics`: Prometheus text from the process's registry;
//! - `GET /state`: a JSON view of the process's state.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod config;

pub use prometheus_client;

type StateFn = dyn Fn() -> serde_json::Value + Send + Sync;

/// What the admin server shows: readiness, a metrics registry, and a state view.
pub struct Admin {
    ready: AtomicBool,
    registry: Registry,
    state: Box<StateFn>,
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
        })
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The Prometheus text exposition of the registry.
    pub fn metrics_text(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
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
            (&Method::GET, "/metrics") => (
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                self.metrics_text(),
            ),
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
        Response::builder()
            .status(status)
            .header("content-type", ctype)
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
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    continue;
                }
            },
        };
        let admin = admin.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let resp = admin.respond(&req);
                async move { Ok::<_, Infallible>(resp) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => if let Err(e) = r { tracing::debug!(%peer, error = %e, "admin connection ended") },
                _ = shutdown.cancelled() => {}
            }
        });
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
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
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
        let (_, body) = http_get(addr, "/state").await.unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&body).unwrap()["node"],
            3
        );
        assert_eq!(http_get(addr, "/nope").await.unwrap().0, 404);
        stop.cancel();
    }
}
