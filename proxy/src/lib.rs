//! The cellmesh geo-edge proxy (DESIGN §12): accepts player clients, checks their signed token,
//! rate-limits their input per account and per address, times its own pings, and attaches each
//! session to a gateway sidecar over one multiplexed mesh link per gateway.
//!
//! ```text
//! client ──edge──▶ listener ─▶ client task (one per connection) ──▶ link outbox ─▶ gateway
//!                                   ▲ bounded session outbox ◀── link reader ◀────┘
//! ```
//!
//! [`start`] binds the client listener and the admin server (`/live`, `/ready`, `/metrics`,
//! `/state`), dials the gateways, and runs until its shutdown token is cancelled: readiness flips
//! first, then every client gets `Kick{SHUTDOWN}`, then the links and the admin server stop.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use anyhow::Context;
use cellmesh_admin::Admin;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod auth;
mod client;
pub mod config;
mod gateway;
mod link;
mod listener;
mod metrics;
mod ping;
mod ratelimit;
mod session;

pub use config::{ProxyConfig, RateConfig};
pub use link::LINK_SILENCE;
pub use metrics::INPUT_LOSS_REASONS;

use crate::gateway::Gateways;
use crate::metrics::Metrics;
use crate::ratelimit::InputLimits;
use crate::session::SessionInfo;

/// How often rate-limit buckets of departed clients are forgotten.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(10);

/// A snapshot of the proxy's counters (for `cellmesh up` and tests).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyStats {
    pub sessions: u64,
    pub sessions_peak: u64,
    /// Sessions moved to another gateway after their gateway's link broke.
    pub sessions_moved: u64,
    pub inputs_accepted: u64,
    /// Inputs dropped by a rate limit.
    pub inputs_dropped: u64,
    /// Inputs read from clients.
    pub inputs_received: u64,
    /// Inputs read and not relayed, by reason ([`INPUT_LOSS_REASONS`]); reasons with none left out.
    pub inputs_lost: std::collections::BTreeMap<&'static str, u64>,
    /// Inputs written to gateway links.
    pub inputs_written: u64,
    /// Inputs written to link connections that ended since (at most what they lost in flight).
    pub inputs_on_ended_links: u64,
    pub kicks: u64,
    pub rtt_ms_p50: f64,
    pub rtt_ms_p99: f64,
    pub rtt_samples: u64,
    /// Frames received from clients.
    pub frames_in: u64,
    /// Frames sent to clients.
    pub frames_out: u64,
}

/// A running proxy.
pub struct ProxyHandle {
    pub client_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub admin: Arc<Admin>,
    shared: Arc<Shared>,
    join: JoinHandle<()>,
}

impl ProxyHandle {
    pub fn stats(&self) -> ProxyStats {
        self.shared.metrics.stats()
    }

    /// Waits until the proxy has shut down and all its tasks have ended.
    pub async fn wait(self) {
        if let Err(e) = self.join.await {
            tracing::error!(error = %e, "proxy supervisor failed");
        }
    }
}

/// State shared by the listener, the client tasks and the link tasks.
pub(crate) struct Shared {
    pub(crate) cfg: ProxyConfig,
    pub(crate) metrics: Metrics,
    pub(crate) limits: InputLimits,
    pub(crate) gateways: Gateways,
    /// Stops the listener and every client task (each through its own child token).
    pub(crate) clients_stop: CancellationToken,
    client_addr: SocketAddr,
    admin: Arc<Admin>,
    sessions: Mutex<HashMap<u64, Arc<SessionInfo>>>,
    next_connection: AtomicU64,
    draining: AtomicBool,
    /// Serialises readiness updates, so a link coming up cannot undo the drain's not-ready.
    readiness: Mutex<()>,
}

impl Shared {
    pub(crate) fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn register_session(&self, connection: u64, info: Arc<SessionInfo>) {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(connection, info);
        self.metrics.session_opened();
    }

    pub(crate) fn unregister_session(&self, connection: u64) {
        let removed = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&connection);
        if removed.is_some() {
            self.metrics.session_closed();
        }
    }

    /// Ready while not draining and at least one gateway link is up.
    pub(crate) fn refresh_ready(&self) {
        let _serial = self.readiness.lock().unwrap_or_else(|p| p.into_inner());
        let ready = !self.draining.load(Ordering::SeqCst) && self.gateways.any_up();
        self.admin.set_ready(ready);
    }

    fn state_json(&self) -> serde_json::Value {
        let cfg = &self.cfg;
        let mut sessions: Vec<Arc<SessionInfo>> = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        sessions.sort_by(|a, b| (&a.account, a.session_id).cmp(&(&b.account, b.session_id)));
        serde_json::json!({
            "proxy": {
                "name": cfg.name,
                "geo": cfg.geo,
                "client_addr": self.client_addr.to_string(),
                "gateways": cfg.gateways,
                "hello_timeout_ms": cfg.hello_timeout_ms,
                "idle_timeout_ms": cfg.idle_timeout_ms,
                "ping_interval_ms": cfg.ping_interval_ms,
                "max_frame_bytes": cfg.max_frame_bytes,
                "client_outbox_frames": cfg.client_outbox_frames,
                "link_outbox_frames": cfg.link_outbox_frames,
                "rate": cfg.rate,
            },
            "ready": self.admin.is_ready(),
            "draining": self.draining.load(Ordering::SeqCst),
            "links": self.gateways.links().iter().map(|l| l.to_json()).collect::<Vec<_>>(),
            "sessions": sessions.iter().map(|s| s.to_json()).collect::<Vec<_>>(),
            "stats": self.metrics.stats(),
        })
    }
}

/// Starts the proxy; it runs until `shutdown` is cancelled (then see [`ProxyHandle::wait`]).
pub async fn start(cfg: ProxyConfig, shutdown: CancellationToken) -> anyhow::Result<ProxyHandle> {
    cfg.validate()?;
    if cfg.token_secret == config::DEFAULT_TOKEN_SECRET {
        tracing::warn!(
            "token_secret is the built-in default: anyone can sign a login; set token_secret (or CELLMESH_TOKEN_SECRET)"
        );
    }
    let listener = TcpListener::bind(&cfg.client_listen)
        .await
        .with_context(|| format!("binding client_listen {}", cfg.client_listen))?;
    let client_addr = listener.local_addr()?;

    let (metrics, registry) = Metrics::new();
    let shared = Arc::new_cyclic(|me: &Weak<Shared>| {
        // The admin's state view holds the proxy weakly: the proxy owns the admin, not back.
        let me = me.clone();
        let admin = Admin::new(registry, move || {
            me.upgrade()
                .map_or(serde_json::Value::Null, |s| s.state_json())
        });
        Shared {
            limits: InputLimits::new(&cfg.rate),
            gateways: Gateways::new(&cfg.gateways),
            clients_stop: CancellationToken::new(),
            client_addr,
            admin,
            sessions: Mutex::default(),
            next_connection: AtomicU64::new(1),
            draining: AtomicBool::new(false),
            readiness: Mutex::new(()),
            metrics,
            cfg,
        }
    });
    let admin_stop = CancellationToken::new();
    let admin_addr = cellmesh_admin::spawn(
        &shared.cfg.admin_listen,
        shared.admin.clone(),
        admin_stop.clone(),
    )
    .await
    .with_context(|| format!("binding admin_listen {}", shared.cfg.admin_listen))?;

    let background = TaskTracker::new();
    let background_stop = CancellationToken::new();
    for link in shared.gateways.links() {
        background.spawn(link::run(
            link.clone(),
            shared.clone(),
            background_stop.clone(),
        ));
    }
    background.spawn(housekeeping(shared.clone(), background_stop.clone()));
    let clients = TaskTracker::new();
    clients.spawn(listener::run(listener, shared.clone(), clients.clone()));
    tracing::info!(name = %shared.cfg.name, %client_addr, %admin_addr, gateways = ?shared.cfg.gateways, "proxy started");

    let join = tokio::spawn({
        let shared = shared.clone();
        async move {
            shutdown.cancelled().await;
            tracing::info!("proxy draining");
            shared.draining.store(true, Ordering::SeqCst);
            shared.refresh_ready();
            shared.clients_stop.cancel();
            clients.close();
            clients.wait().await;
            background_stop.cancel();
            background.close();
            background.wait().await;
            admin_stop.cancel();
            tracing::info!("proxy stopped");
        }
    });
    Ok(ProxyHandle {
        client_addr,
        admin_addr,
        admin: shared.admin.clone(),
        shared,
        join,
    })
}

async fn housekeeping(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(HOUSEKEEPING_EVERY);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => shared.limits.forget_idle(),
        }
    }
}
